"""`python -m experiments.plan`: an experiment's real train step compiled for a TPU slice or a
GPU host from this CPU host, with its bytes per device, FLOPs, collectives and predicted step time.

The compile tests need XLA's TPU compiler (libtpu, the `tpu_runtime` fixture) or jax's CUDA
plugin (`gpu_runtime`) and run the planner in subprocesses: the compilers are found when jax
starts. Each compile of these tiny models (2 layers, 64 wide) takes a few seconds.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from transformer_jax.errors import ConfigError
from transformer_jax.models.bert import ALBERT_ARCHITECTURE, BERT_ARCHITECTURE, ROBERTA_ARCHITECTURE
from transformer_jax.models.encoder_decoder import T5_V1_1_ARCHITECTURE
from transformer_jax.models.gpt import GPT2_ARCHITECTURE, LLAMA_ARCHITECTURE
from transformer_jax.planning import collectives, compile as planning, targets
from transformer_jax.workflows import experiment_kinds

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LM = {
    'model.emb_dim': 64, 'model.num_heads': 4, 'model.mlp_dim': 256, 'model.num_decoder_layers': 2,
    'data.block_size': 64, 'data.batch_size': 8, 'model.attention_implementation': 'xla'
}
_BERT = {
    'model.emb_dim': 64, 'model.num_heads': 4, 'model.mlp_dim': 256, 'model.num_encoder_layers': 2,
    'data.max_len': 64, 'data.batch_size': 8, 'data.max_predictions': 8,
    'tokenizer.vocab_size': 512, 'model.attention_implementation': 'xla',
    'model.attention_dropout_rate': 0.0
}
_TRANSLATION = {
    'model.emb_dim': 64, 'model.num_heads': 4, 'model.mlp_dim': 256, 'model.num_encoder_layers': 1,
    'model.num_decoder_layers': 1, 'data.max_len': 32, 'data.batch_tokens': 256,
    'data.buckets': (32,), 'model.attention_implementation': 'xla'
}
# The three workflows, then the other model families they train at the same sizes: LLaMA with
# grouped-query attention (8 query heads on 4 key/value heads, which mesh.tensor=4 splits), OPT
# (GPT-2's switches with ReLU: convert/hf_opt.py), T5 v1.1 span corruption, RoBERTa (full
# sentences, byte-level vocabulary) and ALBERT (a factorised embedding, one shared layer).
TINY = {
    'lm': ('experiments/configs/shakespeare_char.py', _LM),
    'bert': ('experiments/configs/bert_pretrain_small.py', _BERT),
    'translation': ('experiments/configs/translate_quickstart.py', _TRANSLATION),
    'llama': ('experiments/configs/llama_shakespeare.py',
              {**_LM, 'model.num_heads': 8, 'model.num_kv_heads': 4}),
    'opt': ('experiments/configs/shakespeare_char.py', {**_LM, 'model.activation': 'relu'}),
    't5': ('experiments/configs/t5_span_corruption.py',
           {**_TRANSLATION, 'tokenizer.vocab_size': 400}),
    'roberta': ('experiments/configs/roberta_pretrain_small.py', _BERT),
    'albert':
        ('experiments/configs/albert_pretrain_small.py', {**_BERT, 'model.embedding_size': 32}),
}
WORKFLOWS = ('lm', 'bert', 'translation')
# The workflow planning each entry of TINY, and the switches its model must carry there.
WORKFLOW = dict({w: w for w in WORKFLOWS}, llama='lm', opt='lm', t5='translation', roberta='bert',
                albert='bert')
ARCHITECTURE = {
    'lm': GPT2_ARCHITECTURE,
    'bert': BERT_ARCHITECTURE,
    'translation': dict(norm_position='post', position='sinusoidal', activation='relu'),
    'llama': dict(LLAMA_ARCHITECTURE, num_kv_heads=4),
    'opt': dict(GPT2_ARCHITECTURE, activation='relu'),
    't5': T5_V1_1_ARCHITECTURE,
    'roberta': ROBERTA_ARCHITECTURE,
    'albert': dict(ALBERT_ARCHITECTURE, embedding_size=32),
}
MESHES = {'data': {'data': 4}, 'fsdp': {'fsdp': 4}, 'tensor': {'tensor': 4}}
GPU_MESHES = {'data': {'data': 8}, 'fsdp': {'fsdp': 8}, 'tensor': {'data': 2, 'tensor': 4}}

# XLA:GPU compiles a tiny step in 20-50 s on 2 cores (XLA:TPU in 4-15): the three workflows
# compile for a GPU under every mesh, the families beside them under data x tensor alone, which
# splits their own parameters (over heads, key/value heads, MLP and vocabulary) and the batch.
GPU_MESHES_OF = {
    family: GPU_MESHES if family in WORKFLOWS else {'tensor': GPU_MESHES['tensor']}
    for family in TINY
}
# On TPU likewise the families beside the three workflows skip the data mesh: its all-reduce of
# gradients is the workflow's, whatever the family (saves ~1 min of the suite).
MESHES_OF = {
    family: MESHES if family in WORKFLOWS else {k: MESHES[k] for k in ('fsdp', 'tensor')}
    for family in TINY
}

FIELDS = ('target', 'chip', 'device_kind', 'chips', 'topology', 'family', 'mesh', 'parameters',
          'batch', 'parameter_bytes', 'optimizer_state_bytes', 'batch_bytes', 'activation_bytes',
          'peak_bytes', 'hbm_bytes', 'hbm_fraction', 'fits', 'flops_per_device',
          'bytes_accessed_per_device', 'model_flops_per_device', 'collectives', 'compute_time_s',
          'memory_time_s', 'step_time_s', 'bound', 'mfu', 'tokens_per_step', 'tokens_per_s',
          'formula', 'lower_s', 'compile_s', 'platform', 'usable_bytes', 'memory_fraction',
          'flops_source', 'bytes_accessed_source', 'attention_compiled', 'attention_note')


def planner_env(tpu_runtime: str = '', gpu_runtime: str = '', **variables) -> dict[str, str]:
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(filter(None, [REPO_ROOT, env.get('PYTHONPATH')]))
  if tpu_runtime:
    env['TRANSFORMER_JAX_LIBTPU_DIR'] = tpu_runtime
  if gpu_runtime:
    env['TRANSFORMER_JAX_CUDA_PLUGIN_DIR'] = gpu_runtime
  env['TF_CPP_MIN_LOG_LEVEL'] = '2'
  env.update(variables)
  return env


def run_plan(*args: str, tpu_runtime: str = '', gpu_runtime: str = '',
             **variables) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-m', 'experiments.plan', *args], cwd=REPO_ROOT,
                        env=planner_env(tpu_runtime, gpu_runtime, **variables), capture_output=True,
                        text=True, timeout=600, check=False)


def flags(family: str, **overrides) -> list[str]:
  path, values = TINY[family]
  values = dict(values, **{k.replace('__', '.'): v for k, v in overrides.items()})
  return [f'--config={path}'] + [f'--config.{k}={v}' for k, v in values.items()]


def error_lines(result) -> list[str]:
  return [line for line in result.stderr.splitlines() if line.startswith('error:')]


def assert_one_error(result, *expected: str):
  assert result.returncode == 1, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  errors = error_lines(result)
  assert len(errors) == 1, result.stderr[-3000:]
  for text in expected:
    assert text in errors[0], errors[0]
  return errors[0]


def tiny_task(family: str, **overrides):
  """The abstract task of TINY[family] (with `overrides`, 'section.field': value)."""
  from transformer_jax.cli import entrypoint
  path, values = TINY[family]
  config = entrypoint.load_config_file(path)
  for key, value in dict(values, **overrides).items():
    section, leaf = key.split('.')
    config[section][leaf] = value
  return experiment_kinds.of_config(config).abstract_task(config)[0]


# Plans every case (one family's meshes) in one subprocess: one jax start-up for them all.
_DRIVER = '''
import json, sys
from transformer_jax.planning import runtime
runtime.prepare()
from transformer_jax.cli import entrypoint
from transformer_jax.planning import compile as planning, targets
for case in json.loads(sys.argv[1]):
  config = entrypoint.load_config_file(case['config'])
  for key, value in case['overrides'].items():
    *parents, leaf = key.split('.')
    node = config
    for part in parents:
      node = node[part]
    node[leaf] = tuple(value) if isinstance(value, list) else value
  result = planning.plan(config, targets.get(case['target']))
  print(json.dumps(dict(result, case=case['name'])), flush=True)
'''


def plan_family(family: str, target: str, meshes: dict, env: dict) -> dict[tuple[str, str], dict]:
  """{(family, mesh name): plan} for the tiny step of `family` on `target` under `meshes`."""
  path, overrides = TINY[family]
  cases = []
  for mesh_name, mesh in meshes.items():
    values = dict(overrides, **{f'mesh.{axis}': 1 for axis in ('data', 'fsdp', 'tensor')})
    values.update({f'mesh.{axis}': size for axis, size in mesh.items()})
    cases.append(dict(name=f'{family}/{mesh_name}', config=path, overrides=values, target=target))
  result = subprocess.run(
      [sys.executable, '-c', _DRIVER, json.dumps(cases)], cwd=REPO_ROOT, env=env,
      capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  plans = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{')]
  return {tuple(p['case'].split('/')): p for p in plans}


class FamilyPlans(dict):
  """{(family, mesh name): plan} on one target, a family's meshes (`meshes_of[family]`) planned
  in one subprocess when the first of them is read: a test of one family compiles it alone."""

  def __init__(self, target: str, meshes_of: dict, env: dict):
    super().__init__()
    self.target, self.meshes_of, self.env = target, meshes_of, env

  def __missing__(self, key):
    family = key[0]
    self.update(plan_family(family, self.target, self.meshes_of[family], self.env))
    return self[key]


@pytest.fixture(scope='module')
def tiny_plans(tpu_runtime) -> FamilyPlans:
  """The tiny steps on tpu-v5e-4 under data, fsdp and tensor meshes of 4."""
  return FamilyPlans('tpu-v5e-4', MESHES_OF, planner_env(tpu_runtime))


@pytest.fixture(scope='module')
def tiny_gpu_plans(gpu_runtime) -> FamilyPlans:
  """The tiny steps on gpu-h100-8 under data, fsdp and data x tensor meshes of 8 (the families
  beside the three workflows: data x tensor alone, `GPU_MESHES_OF`)."""
  return FamilyPlans('gpu-h100-8', GPU_MESHES_OF, planner_env(gpu_runtime=gpu_runtime))


# -- without compiling ----------------------------------------------------------------------------


def test_unknown_target_names_the_known_ones():
  with pytest.raises(ConfigError, match='tpu-v5e-4.*tpu-v6e-16'):
    targets.get('tpu-v9-1')


def test_every_target_has_its_chip_figures():
  for target in targets.TARGETS.values():
    chip = target.chip
    assert target.chips >= 1 and chip.peak_flops > 1e14 and chip.hbm_bytes >= 16 * targets.GIB
    assert chip.hbm_bandwidth > 5e11
    if target.platform == 'gpu':  # slices x hosts x GPUs per host
      assert target.name.startswith(f'gpu-{chip.name}-') and chip.gpu is not None
      assert math.prod(int(n) for n in target.topology.split('x')) == target.chips
      assert f'device_memory_size: {chip.hbm_bytes}' in chip.target_config()
    else:
      assert target.platform == 'tpu' and target.topology.startswith(f'{chip.name}:')
  assert {'gpu-h100-8', 'gpu-h200-1', 'gpu-h200-8', 'gpu-a100-80g-8'} <= set(targets.TARGETS)


def test_a_gpu_step_fits_in_jax_memory_pool(monkeypatch):
  """XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 by default, of a GPU's memory; a TPU's HBM whole."""
  h100, v5e = targets.get('gpu-h100-8'), targets.get('tpu-v5e-4')
  monkeypatch.delenv('XLA_PYTHON_CLIENT_MEM_FRACTION', raising=False)
  assert planning.memory_fraction(h100) == 0.75 and planning.memory_fraction(v5e) == 1.0
  monkeypatch.setenv('XLA_PYTHON_CLIENT_MEM_FRACTION', '.9')
  assert planning.memory_fraction(h100) == 0.9
  for bad in ('most', '1.5'):
    monkeypatch.setenv('XLA_PYTHON_CLIENT_MEM_FRACTION', bad)
    with pytest.raises(ConfigError, match='XLA_PYTHON_CLIENT_MEM_FRACTION'):
      planning.memory_fraction(h100)


def test_the_compilers_are_named_with_the_line_that_installs_them(monkeypatch, tmp_path):
  import importlib.metadata
  from transformer_jax.planning import runtime
  assert runtime.libtpu_fallback('libtpu==0.0.53.*') == 'libtpu<0.0.54'
  version = importlib.metadata.version('jax')
  if runtime._jax_version()[:2] < runtime.MIN_GPU_JAX:
    with pytest.raises(ConfigError, match='planning for a GPU needs jax >= 0.11'):
      runtime.cuda_plugin_requirements()
    return
  assert runtime.cuda_plugin_requirements() == [
      f'jax-cuda13-plugin=={version}', f'jax-cuda13-pjrt=={version}'
  ]
  monkeypatch.setenv(runtime.CUDA_PLUGIN_DIR_VARIABLE, str(tmp_path))
  with pytest.raises(ConfigError, match=f'holds no CUDA plugin.*--target {tmp_path}'):
    runtime.require('gpu')
  monkeypatch.delenv(runtime.CUDA_PLUGIN_DIR_VARIABLE)
  monkeypatch.setattr(runtime, 'cuda_plugin_installed', lambda: False)
  with pytest.raises(ConfigError, match=r'needs XLA:GPU.*pip install -e "\.\[gpu-plan\]"'):
    runtime.require('gpu')


def test_key_value_heads_the_tensor_axis_cannot_split_are_one_error_line():
  """LLaMA's 2 key/value heads over mesh.tensor=4: one line naming the array and the field, before
  anything is placed (jax's own error is an IndivisibleError traceback); 4 heads split."""
  import jax
  from transformer_jax.parallel import sharding

  def params(**overrides):
    task = tiny_task('llama', **overrides)
    return jax.eval_shape(lambda rng: task.init_variables(rng)['params'], jax.random.key(0))

  two_kv_heads = params(**{'model.num_kv_heads': 2})
  with pytest.raises(ConfigError) as error:
    sharding.check_splits(two_kv_heads, {'data': 1, 'fsdp': 1, 'tensor': 4})
  assert str(error.value).startswith(
      "mesh.tensor = 4 cannot split stack/layer_0/self_attention/key/kernel [64, 2, 8]: its "
      "'kv_heads' dimension (model.num_kv_heads) is 2, not a multiple of 4")
  sharding.check_splits(two_kv_heads, {'data': 1, 'fsdp': 1, 'tensor': 2})
  sharding.check_splits(params(), {'data': 1, 'fsdp': 4, 'tensor': 4})


def test_cudnn_attention_is_refused_in_float32():
  """cuDNN's fused attention takes bf16 or fp16 only: a float32 model asking for it is one error
  line before anything is traced (jax's own error is a ValueError deep in the trace)."""
  import ml_collections
  from transformer_jax.cli import validation
  config = ml_collections.ConfigDict(
      {'model': {'attention_implementation': 'cudnn', 'dtype': 'float32'}})
  assert 'needs model.dtype bfloat16 or float16' in validation.attention_kernel_unavailable(
      config, 'gpu')
  config.model.dtype = 'bfloat16'
  assert validation.attention_kernel_unavailable(config, 'gpu') is None
  assert 'runs on GPU only' in validation.attention_kernel_unavailable(config, 'tpu')


def test_prediction_is_the_roofline_of_one_device():
  target = targets.get('tpu-v5e-4')  # 197 TFLOP/s, 819 GB/s
  compute_bound = planning.predict(197e12, 819e9 / 2, 98.5e12, target)
  assert compute_bound['step_time_s'] == pytest.approx(1.0)
  assert compute_bound['bound'] == 'compute' and compute_bound['mfu'] == pytest.approx(0.5)
  memory_bound = planning.predict(1e12, 819e9 * 2, 0.0, target)
  assert memory_bound['step_time_s'] == pytest.approx(2.0) and memory_bound['bound'] == 'memory'


def test_without_a_cost_analysis_flops_and_bytes_come_from_the_program():
  """XLA:GPU answers no cost analysis without a device: the lowered program's FLOPs (else the
  model's) and the bytes its kernels move, each said to be so."""
  hlo = '\n'.join([
      'HloModule m', '', '%fused (p.0: f32[4,256]) -> f32[256] {',
      '  %p.0 = f32[4,256]{1,0} parameter(0)', '  %i = s32[] constant(0)',
      '  %ds = f32[1,256]{1,0} dynamic-slice(%p.0, %i, %i), dynamic_slice_sizes={1,256}',
      '  ROOT %r = f32[256]{0} bitcast(%ds)', '}', '',
      'ENTRY %main (a: f32[4,256], b: f32[256]) -> f32[256] {',
      '  %a = f32[4,256]{1,0} parameter(0)', '  %b = f32[256]{0} parameter(1)',
      '  %f = f32[256]{0} fusion(%a), kind=kLoop, calls=%fused',
      '  ROOT %add = f32[256]{0} add(%f, %b)', '}'
  ])

  class Memory:
    argument_size_in_bytes, output_size_in_bytes, alias_size_in_bytes = 100, 60, 50
    temp_size_in_bytes, generated_code_size_in_bytes = 1000, 0

  class Compiled:
    memory_analysis = lambda self: Memory()
    cost_analysis = lambda self: None
    as_text = lambda self: hlo

  class State:
    params, opt_state, step = {}, {}, None

  h100 = targets.get('gpu-h100-8')
  result = planning.analyse(Compiled(), State(), {}, h100, 4.5e12, lambda: {'flops': 5e12})
  assert result['flops_per_device'] == 5e12 and 'before optimisation' in result['flops_source']
  # the fusion reads one row of `a` (it only slices it) and writes 256 floats; the add reads two
  # vectors and writes one
  assert result['bytes_accessed_per_device'] == 4 * (256 + 256) + 4 * 3 * 256
  assert 'kernel' in result['bytes_accessed_source']
  assert result['peak_bytes'] == 100 + 60 - 50 + 1000
  result = planning.analyse(Compiled(), State(), {}, h100, 4.5e12)
  assert result['flops_per_device'] == 4.5e12 and 'model formula' in result['flops_source']


def test_collectives_are_read_from_tpu_hlo_text():
  """Bare operand names, tiled layouts, an asynchronous copy with the same channel (counted once)
  and XLA:TPU's reduce-scatter (an all-reduce inside an all-reduce-scatter computation)."""
  groups = "replica_groups=mesh['axis_0'=4] {'axis_0'}"
  hlo = '\n'.join([
      'HloModule jit_train_step',
      '',
      '%fused_computation.1 (param_0.1: bf16[64,256]) -> bf16[256,256] {',
      '  %param_0.1 = bf16[64,256]{1,0:T(8,128)(2,1)} parameter(0)',
      '  ROOT %all-gather.7 = bf16[256,256]{1,0:T(8,128)(2,1)} all-gather(%param_0.1), '
      f'channel_id=8, {groups}, dimensions={{0}}',
      '}',
      '',
      '%fused_computation.2 (param_0.2: bf16[64,256]) -> bf16[256,256] {',
      '  %param_0.2 = bf16[64,256]{1,0:T(8,128)(2,1)S(1)} parameter(0)',
      '  ROOT %all-gather.8 = bf16[256,256]{1,0:T(8,128)(2,1)} all-gather(%param_0.2), '
      f'channel_id=8, {groups}, dimensions={{0}}',
      '}',
      '',
      '%all-reduce-scatter.3 (param_0.3: f32[1024]) -> f32[256] {',
      '  %param_0.3 = f32[1024]{0:T(1024)} parameter(0)',
      f'  %all-reduce.4 = f32[1024]{{0:T(1024)}} all-reduce(%param_0.3), channel_id=9, {groups}, '
      'to_apply=%add',
      '  ROOT %slice.1 = f32[256]{0:T(256)} slice(%all-reduce.4), slice={[0:256]}',
      '}',
      '',
      'ENTRY %main.1 (p0: f32[16,16]) -> f32[16,16] {',
      '  %p0 = f32[16,16]{1,0:T(8,128)} parameter(0)',
      '  ROOT %all-reduce.9 = f32[16,16]{1,0:T(8,128)} all-reduce(%p0), channel_id=10, '
      f'{groups}, to_apply=%add',
      '}',
  ])
  assert collectives.summary(hlo) == {
      'all-gather': {'count': 1, 'bytes': 64 * 256 * 2},
      'reduce-scatter': {'count': 1, 'bytes': 1024 * 4},
      'all-reduce': {'count': 1, 'bytes': 16 * 16 * 4},
  }


@pytest.mark.parametrize('family', list(TINY))
def test_abstract_task_reads_nothing(family):
  """Each workflow's task and batch come from the config alone (no corpus, no tokenizer), with
  the family's own model."""
  from transformer_jax.cli import entrypoint
  path, overrides = TINY[family]
  config = entrypoint.load_config_file(path)
  for key, value in overrides.items():
    section, leaf = key.split('.')
    config[section][leaf] = value
  experiment = experiment_kinds.of_config(config)
  assert experiment.workflow_name == WORKFLOW[family]
  task, batch = experiment.abstract_task(config, num_devices=4)
  assert task.cfg.emb_dim == 64 and batch['inputs'].dtype == 'int32'
  switches = ARCHITECTURE[family]
  assert {k: getattr(task.cfg, k) for k in switches} == switches
  rows = batch['inputs'].shape[0]
  assert all(v.shape[0] == rows for v in batch.values()) and rows % 4 == 0


def test_fine_tuning_is_planned_from_the_checkpoint_config_alone(tmp_path):
  """A Hugging Face BERT directory with only its config.json: no weights, no vocabulary read."""
  from experiments.configs.bert_common import finetune_config
  (tmp_path / 'config.json').write_text(
      json.dumps(
          dict(model_type='bert', vocab_size=1000, hidden_size=64, num_attention_heads=4,
               intermediate_size=256, num_hidden_layers=2, max_position_embeddings=128)))
  config = finetune_config()
  config.init.hf_dir = str(tmp_path)
  task, batch = experiment_kinds.of_config(config).abstract_task(config)
  assert task.cfg.emb_dim == 64 and task.cfg.vocab_size == 1000
  assert batch['inputs'].shape == (32, 64) and batch['labels'].shape == (32,)


# -- the command line -----------------------------------------------------------------------------


@pytest.mark.slow
def test_unknown_target_is_one_error_line_listing_the_known_ones():
  result = run_plan(*flags('lm'), '--target=tpu-v9-8')
  assert_one_error(result, "unknown target 'tpu-v9-8'", 'tpu-v5e-4', 'tpu-v5p-128')


@pytest.mark.slow
def test_a_mesh_that_does_not_match_the_chips_is_one_error_line():
  result = run_plan(*flags('lm'), '--config.mesh.data=8', '--target=tpu-v5e-4')
  assert_one_error(result, 'tpu-v5e-4 has 4 chips', "mesh {'data': 8")


@pytest.mark.slow
def test_a_key_the_experiment_lacks_is_one_error_line():
  result = run_plan(*flags('lm'), '--config.model.num_layers=2', '--target=tpu-v5e-4')
  assert_one_error(result, "no key 'num_layers'")


@pytest.mark.slow
def test_targets_are_listed():
  result = run_plan('--targets')
  assert result.returncode == 0, result.stderr[-3000:]
  for name in targets.TARGETS:
    assert name in result.stdout


@pytest.mark.slow
def test_plan_prints_the_figures_and_one_json_line(tpu_runtime):
  result = run_plan(*flags('lm'), '--config.mesh.data=2', '--config.mesh.tensor=2',
                    '--target=tpu-v5e-4', tpu_runtime=tpu_runtime)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.strip().splitlines()
  plan = json.loads(lines[-1])
  assert set(FIELDS) <= set(plan), set(FIELDS) - set(plan)
  assert plan['mesh'] == {'data': 2, 'fsdp': 1, 'tensor': 2} and plan['chips'] == 4
  assert plan['device_kind'] == 'TPU v5 lite' and plan['fits']
  assert 0 < plan['parameter_bytes'] < plan['peak_bytes'] < plan['hbm_bytes']
  assert plan['optimizer_state_bytes'] >= 2 * plan['parameter_bytes']  # AdamW's two moments
  assert plan['flops_per_device'] > 0 and plan['step_time_s'] > 0 and 0 < plan['mfu'] < 1
  assert plan['collectives'].get('all-reduce', {}).get('count', 0) >= 1
  text = result.stdout
  for label in ('parameters', 'optimizer state', 'activations', 'total (XLA peak)', 'FLOPs',
                'collectives', 'predicted', 'MFU'):
    assert label in text
  # libtpu stays quiet: no host-bounds or worker warnings, no error lines
  assert 'host bounds' not in result.stderr and 'TPU_WORKER_HOSTNAMES' not in result.stderr
  assert not error_lines(result)


@pytest.mark.slow
def test_a_state_too_big_for_hbm_is_refused_before_compiling(tpu_runtime):
  """A 2.1B-parameter embedding: 8 GiB of weights and 16 GiB of AdamW moments per v5e chip."""
  result = run_plan(
      *flags('lm', model__emb_dim=1024, tokenizer__vocab_size=2_000_000,
             model__num_decoder_layers=1), '--target=tpu-v5e-4', tpu_runtime=tpu_runtime)
  assert_one_error(result, 'tpu-v5e-4', 'optimizer state alone', 'GiB', 'mesh.fsdp')


@pytest.mark.slow
def test_activations_too_big_for_hbm_are_refused(tpu_runtime):
  """Small weights, a huge batch: the compiled program needs more than 16 GiB per device."""
  result = run_plan(*flags('lm', data__batch_size=4096, data__block_size=1024),
                    '--target=tpu-v5e-4', tpu_runtime=tpu_runtime)
  assert_one_error(result, 'tpu-v5e-4', 'GiB', 'model.remat_policy', 'data.batch_size (now 4096)',
                   'mesh.fsdp')


# -- every family under data, fsdp and tensor meshes ----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize('family', list(TINY))
def test_every_family_compiles_under_each_mesh(tiny_plans, family):
  for mesh_name, mesh in MESHES_OF[family].items():
    plan = tiny_plans[(family, mesh_name)]
    assert plan['family'] == WORKFLOW[family] and plan['device_kind'] == 'TPU v5 lite'
    assert {k: v for k, v in plan['mesh'].items() if v > 1} == mesh
    assert plan['fits'] and plan['peak_bytes'] > 0 and plan['flops_per_device'] > 0
    assert set(FIELDS) <= set(plan)
  # data parallelism reduces gradients; fsdp gathers weights and scatters gradients
  if 'data' in MESHES_OF[family]:
    assert tiny_plans[(family, 'data')]['collectives']['all-reduce']['count'] >= 1
  fsdp = tiny_plans[(family, 'fsdp')]['collectives']
  assert fsdp['all-gather']['count'] >= 1 and fsdp.get('reduce-scatter', {}).get('count', 0) >= 1


@pytest.mark.slow
@pytest.mark.parametrize('family', WORKFLOWS)
def test_bytes_per_device_fall_with_fsdp(tiny_plans, family):
  data, fsdp = tiny_plans[(family, 'data')], tiny_plans[(family, 'fsdp')]
  assert fsdp['parameter_bytes'] < 0.3 * data['parameter_bytes']
  assert fsdp['optimizer_state_bytes'] < 0.3 * data['optimizer_state_bytes']
  assert fsdp['peak_bytes'] < data['peak_bytes']


# -- NVIDIA GPUs, compiled without one -----------------------------------------------------------


@pytest.mark.slow
def test_gpu_plan_prints_the_figures_and_one_json_line(gpu_runtime):
  """A bfloat16 GPT asking for cuDNN attention: planned with XLA's, and the plan says why."""
  result = run_plan(*flags('lm', model__attention_implementation='cudnn',
                           model__dtype='bfloat16'), '--config.mesh.data=2',
                    '--config.mesh.tensor=4', '--target=gpu-h100-8', gpu_runtime=gpu_runtime)
  assert result.returncode == 0, result.stderr[-3000:]
  plan = json.loads(result.stdout.strip().splitlines()[-1])
  assert set(FIELDS) <= set(plan), set(FIELDS) - set(plan)
  assert plan['platform'] == 'gpu' and plan['device_kind'] == 'NVIDIA H100 80GB HBM3'
  assert plan['mesh'] == {'data': 2, 'fsdp': 1, 'tensor': 4} and plan['chips'] == 8
  assert plan['usable_bytes'] == int(0.75 * plan['hbm_bytes']) and plan['fits']
  assert 0 < plan['parameter_bytes'] < plan['peak_bytes'] < plan['usable_bytes']
  # no cost analysis from XLA:GPU without a device: XLA's count of the lowered program (the
  # masked half of causal attention, the loss and the optimizer beyond the model's count), and
  # the kernels' traffic, each said so
  assert plan['model_flops_per_device'] <= plan['flops_per_device']
  assert plan['flops_per_device'] < 1.5 * plan['model_flops_per_device']
  assert 'before optimisation' in plan['flops_source'] and 0 < plan['mfu'] <= 1
  assert 'kernel' in plan['bytes_accessed_source'] and plan['bytes_accessed_per_device'] > 0
  assert plan['attention_implementation'] == 'cudnn' and plan['attention_compiled'] == 'xla'
  assert 'cuDNN attention cannot be compiled without a GPU' in plan['attention_note']
  assert plan['collectives'].get('all-reduce', {}).get('count', 0) >= 1
  for label in ('jax\'s pool', 'before optimisation', 'note        cuDNN', 'predicted', 'MFU'):
    assert label in result.stdout
  assert not error_lines(result)


@pytest.mark.slow
def test_a_gpu_step_too_big_for_jax_memory_pool_is_refused(gpu_runtime):
  """The pool is XLA_PYTHON_CLIENT_MEM_FRACTION of the GPU: 5% of an H100 is 4 GiB."""
  result = run_plan(*flags('lm', data__batch_size=4096,
                           data__block_size=1024), '--config.mesh.data=8', '--target=gpu-h100-8',
                    gpu_runtime=gpu_runtime, XLA_PYTHON_CLIENT_MEM_FRACTION='0.05')
  assert_one_error(result, 'gpu-h100-8', "jax's memory pool (5% of", 'model.remat_policy',
                   'data.batch_size (now 4096)', 'XLA_PYTHON_CLIENT_MEM_FRACTION=0.95')


@pytest.mark.slow
@pytest.mark.parametrize('family', list(TINY))
def test_every_family_compiles_for_a_gpu_under_each_mesh(tiny_gpu_plans, family):
  plans = {name: tiny_gpu_plans[(family, name)] for name in GPU_MESHES_OF[family]}
  for mesh_name, plan in plans.items():
    assert plan['family'] == WORKFLOW[family]
    assert plan['device_kind'] == 'NVIDIA H100 80GB HBM3'
    assert {k: v for k, v in plan['mesh'].items() if v > 1} == GPU_MESHES[mesh_name]
    assert plan['fits'] and plan['peak_bytes'] > 0 and plan['flops_per_device'] > 0
    assert set(FIELDS) <= set(plan)
    if 'data' in GPU_MESHES[mesh_name]:  # data parallelism reduces gradients
      assert plan['collectives']['all-reduce']['count'] >= 1
  if 'fsdp' in plans:
    fsdp = plans['fsdp']['collectives']
    assert fsdp['all-gather']['count'] >= 1 and fsdp.get('reduce-scatter', {}).get('count', 0) >= 1
    assert plans['fsdp']['parameter_bytes'] < 0.2 * plans['data']['parameter_bytes']


# -- the decode step of a language model (--decode_batch, --decode_length) ------------------------


def placed(cache, shardings):
  import jax
  return jax.tree.map(lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=p), cache,
                      shardings)


def test_cache_rows_are_split_over_the_batch_axes_when_they_divide():
  """Keys and values [B, ...] split over data x fsdp; a position counter, a scalar or one int per
  row, is no part of the keys and values."""
  import jax
  import jax.numpy as jnp
  from transformer_jax.planning import decode
  mesh = jax.sharding.AbstractMesh((2, 3, 2), ('data', 'fsdp', 'tensor'))
  for rows, ways in ((12, 6), (10, 1)):
    cache = {
        'position': jax.ShapeDtypeStruct((), jnp.int32), 'row_positions': jax.ShapeDtypeStruct(
            (rows,), jnp.int32), 'layer': {
                'cached_key': jax.ShapeDtypeStruct((rows, 4, 16, 32), jnp.bfloat16),
                'cached_value': jax.ShapeDtypeStruct((rows, 4, 32, 16), jnp.bfloat16)
            }
    }
    shardings, split = decode.cache_shardings(cache, mesh)
    assert split == (ways > 1)
    assert shardings['position'].spec == jax.sharding.PartitionSpec()
    cache = placed(cache, shardings)
    assert decode.kv_cache_bytes(cache) == 2 * rows // ways * 4 * 16 * 32 * 2
    assert planning.shard_bytes(cache) == decode.kv_cache_bytes(cache) + 4 + 4 * rows // ways


def test_the_lm_cache_bytes_are_the_analytic_count():
  """The tiny GPT's own cache (2 layers, 4 kv heads of 16, float32), shapes only: no compiler."""
  import jax
  from transformer_jax.planning import decode
  task = tiny_task('lm')
  cache = jax.eval_shape(lambda: task._empty_cache(8, 32))
  mesh = jax.sharding.AbstractMesh((4, 1, 2), ('data', 'fsdp', 'tensor'))
  shardings, split = decode.cache_shardings(cache, mesh)
  assert split
  assert decode.analytic_kv_cache_bytes(task.decode_model.cfg, 8, 32) == 2 * 2 * 8 * 32 * 4 * 16 * 4
  assert decode.kv_cache_bytes(placed(cache, shardings)) == 2 * 2 * 8 * 32 * 4 * 16 * 4 // 4


@pytest.mark.slow
def test_decode_plan_of_another_experiment_is_one_error_line():
  result = run_plan(*flags('translation'), '--target=tpu-v5e-4', '--decode_batch=4',
                    '--decode_length=16')
  assert_one_error(result, "config.experiment 'lm'", "experiment is 'translation'")


@pytest.mark.slow
def test_decode_plan_prints_the_cache_and_one_json_line(tpu_runtime):
  """8 rows of 32 slots split over data=2: half the keys and values of 2 layers x 4 kv heads x
  16 floats per chip."""
  result = run_plan(*flags('lm'), '--config.mesh.data=2', '--config.mesh.tensor=2',
                    '--target=tpu-v5e-4', '--decode_batch=8', '--decode_length=32',
                    tpu_runtime=tpu_runtime)
  assert result.returncode == 0, result.stderr[-3000:]
  plan = json.loads(result.stdout.strip().splitlines()[-1])
  assert plan['step'] == 'decode' and plan['mesh'] == {'data': 2, 'fsdp': 1, 'tensor': 2}
  assert plan['cache_rows_split'] and plan['cache_row_ways'] == 2
  assert plan['kv_cache_bytes'] == plan[
      'kv_cache_bytes_analytic'] == 2 * 2 * 8 * 32 * 4 * 16 * 4 // 2
  assert plan['cache_bytes'] - plan['kv_cache_bytes'] < 64  # the position counter(s)
  assert plan['fits'] and 0 < plan['parameter_bytes'] + plan['cache_bytes'] <= plan['peak_bytes']
  assert plan['xla_memory']['alias'] >= plan['cache_bytes']  # the donated cache is updated in place
  step_s = (plan['parameter_bytes'] +
            plan['cache_bytes']) / targets.get('tpu-v5e-4').chip.hbm_bandwidth
  assert plan['step_time_s'] == pytest.approx(step_s)
  assert plan['tokens_per_s'] == pytest.approx(8 / step_s)
  for label in ('KV cache', 'analytic', 'equal', 'rows split over data x fsdp, 2 ways',
                'total (XLA peak)', 'tokens/s'):
    assert label in result.stdout
  assert not error_lines(result)


@pytest.mark.slow
def test_a_decode_cache_too_big_for_hbm_is_refused_before_compiling(tpu_runtime):
  """2**20 rows of 64 slots of 2 layers x 64 floats: 64 GiB of keys and values, whole on every
  chip (mesh tensor=4 does not split rows)."""
  result = run_plan(*flags('lm'), '--config.mesh.tensor=4', '--target=tpu-v5e-4',
                    f'--decode_batch={2**20}', '--decode_length=64', tpu_runtime=tpu_runtime)
  assert_one_error(result, 'tpu-v5e-4', 'KV cache (64.00 GiB) alone',
                   '--decode_batch (now 1048576)', 'mesh.data x mesh.fsdp')


@pytest.mark.slow
def test_gpu_decode_plan_with_rows_that_do_not_divide(gpu_runtime):
  """3 rows over fsdp=8: the cache is whole on every GPU, in bfloat16."""
  result = run_plan(*flags('lm',
                           model__dtype='bfloat16'), '--config.mesh.fsdp=8', '--target=gpu-h100-8',
                    '--decode_batch=3', '--decode_length=64', gpu_runtime=gpu_runtime)
  assert result.returncode == 0, result.stderr[-3000:]
  plan = json.loads(result.stdout.strip().splitlines()[-1])
  assert plan['platform'] == 'gpu' and not plan['cache_rows_split']
  assert plan['kv_cache_bytes'] == plan['kv_cache_bytes_analytic'] == 2 * 2 * 3 * 64 * 4 * 16 * 2
  assert plan['fits'] and plan['usable_bytes'] == int(0.75 * plan['hbm_bytes'])
  assert 'replicated: the rows do not divide' in result.stdout
