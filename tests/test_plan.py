"""`python -m experiments.plan`: an experiment's real train step compiled for a TPU slice from
this CPU host, with its bytes per device, FLOPs, collectives and predicted step time.

The compile tests need XLA's TPU compiler (libtpu, the `tpu_runtime` fixture) and run the planner
in subprocesses: libtpu's settings must be made before jax starts. Each compile of these tiny
models (2 layers, 64 wide) takes a few seconds.
"""

import json
import os
import subprocess
import sys

import pytest

from transformer_jax.errors import ConfigError
from transformer_jax.planning import collectives, compile as planning, targets

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = {
    'lm': ('experiments/configs/shakespeare_char.py', {
        'model.emb_dim': 64, 'model.num_heads': 4, 'model.mlp_dim': 256,
        'model.num_decoder_layers': 2, 'data.block_size': 64, 'data.batch_size': 8,
        'model.attention_implementation': 'xla'
    }),
    'bert': ('experiments/configs/bert_pretrain_small.py', {
        'model.emb_dim': 64, 'model.num_heads': 4, 'model.mlp_dim': 256,
        'model.num_encoder_layers': 2, 'data.max_len': 64, 'data.batch_size': 8,
        'data.max_predictions': 8, 'tokenizer.vocab_size': 512,
        'model.attention_implementation': 'xla', 'model.attention_dropout_rate': 0.0
    }),
    'translation': ('experiments/configs/translate_quickstart.py', {
        'model.emb_dim': 64, 'model.num_heads': 4, 'model.mlp_dim': 256,
        'model.num_encoder_layers': 1, 'model.num_decoder_layers': 1, 'data.max_len': 32,
        'data.batch_tokens': 256, 'data.buckets': (32,), 'model.attention_implementation': 'xla'
    }),
}
MESHES = {'data': {'data': 4}, 'fsdp': {'fsdp': 4}, 'tensor': {'tensor': 4}}

FIELDS = ('target', 'chip', 'device_kind', 'chips', 'topology', 'family', 'mesh', 'parameters',
          'batch', 'parameter_bytes', 'optimizer_state_bytes', 'batch_bytes', 'activation_bytes',
          'peak_bytes', 'hbm_bytes', 'hbm_fraction', 'fits', 'flops_per_device',
          'bytes_accessed_per_device', 'model_flops_per_device', 'collectives', 'compute_time_s',
          'memory_time_s', 'step_time_s', 'bound', 'mfu', 'tokens_per_step', 'tokens_per_s',
          'formula', 'lower_s', 'compile_s')


def planner_env(tpu_runtime: str = '') -> dict[str, str]:
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(filter(None, [REPO_ROOT, env.get('PYTHONPATH')]))
  if tpu_runtime:
    env['TRANSFORMER_JAX_LIBTPU_DIR'] = tpu_runtime
  env['TF_CPP_MIN_LOG_LEVEL'] = '2'
  return env


def run_plan(*args: str, tpu_runtime: str = '') -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-m', 'experiments.plan', *args], cwd=REPO_ROOT,
                        env=planner_env(tpu_runtime), capture_output=True, text=True, timeout=600,
                        check=False)


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


# Plans every case in one subprocess (one jax start-up for all of them).
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


@pytest.fixture(scope='module')
def tiny_plans(tpu_runtime) -> dict[tuple[str, str], dict]:
  """{(family, mesh name): plan} for the tiny GPT, BERT and translation steps on tpu-v5e-4."""
  cases = []
  for family, (path, overrides) in TINY.items():
    for mesh_name, mesh in MESHES.items():
      values = dict(overrides, **{f'mesh.{axis}': 1 for axis in ('data', 'fsdp', 'tensor')})
      values.update({f'mesh.{axis}': size for axis, size in mesh.items()})
      cases.append(
          dict(name=f'{family}/{mesh_name}', config=path, overrides=values, target='tpu-v5e-4'))
  result = subprocess.run(
      [sys.executable, '-c', _DRIVER, json.dumps(cases)], cwd=REPO_ROOT,
      env=planner_env(tpu_runtime), capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  plans = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{')]
  return {tuple(p['case'].split('/')): p for p in plans}


# -- without compiling ----------------------------------------------------------------------------


def test_unknown_target_names_the_known_ones():
  with pytest.raises(ConfigError, match='tpu-v5e-4.*tpu-v6e-16'):
    targets.get('tpu-v9-1')


def test_every_target_has_its_chip_figures():
  for target in targets.TARGETS.values():
    chip = target.chip
    assert target.chips >= 1 and chip.peak_flops > 1e14 and chip.hbm_bytes >= 16 * targets.GIB
    assert chip.hbm_bandwidth > 5e11 and target.topology.startswith(f'{chip.name}:')


def test_prediction_is_the_roofline_of_one_device():
  target = targets.get('tpu-v5e-4')  # 197 TFLOP/s, 819 GB/s
  compute_bound = planning.predict(197e12, 819e9 / 2, 98.5e12, target)
  assert compute_bound['step_time_s'] == pytest.approx(1.0)
  assert compute_bound['bound'] == 'compute' and compute_bound['mfu'] == pytest.approx(0.5)
  memory_bound = planning.predict(1e12, 819e9 * 2, 0.0, target)
  assert memory_bound['step_time_s'] == pytest.approx(2.0) and memory_bound['bound'] == 'memory'


def test_model_flops_count_the_parameters_in_matmuls():
  """Embedding lookups are no matmuls; a token table tied to the output is one."""
  import flax.linen as nn
  import jax
  from transformer_jax.models.gpt import gpt2_config, llama_config
  from transformer_jax.tasks.lm import LanguageModelTask
  sizes = dict(vocab_size=100, emb_dim=32, num_heads=2, mlp_dim=64, num_decoder_layers=1,
               max_len=16)
  for cfg, lookup_only in ((gpt2_config(**sizes), 16 * 32), (llama_config(**sizes), 100 * 32)):
    boxed = jax.eval_shape(LanguageModelTask(cfg).init_variables, jax.random.key(0))
    params = nn.meta.unbox(boxed['params'])
    total = sum(x.size for x in jax.tree.leaves(params))
    assert planning.matmul_parameters(params, cfg.tie_output) == total - lookup_only


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
  """Each workflow's task and batch come from the config alone (no corpus, no tokenizer)."""
  from transformer_jax.cli import entrypoint
  path, overrides = TINY[family]
  config = entrypoint.load_config_file(path)
  for key, value in overrides.items():
    section, leaf = key.split('.')
    config[section][leaf] = value
  workflow = planning.workflow_for(config)
  assert workflow.__name__.endswith(family)
  task, batch = workflow.abstract_task(config, num_devices=4)
  assert task.cfg.emb_dim == 64 and batch['inputs'].dtype == 'int32'
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
  task, batch = planning.workflow_for(config).abstract_task(config)
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


# -- the three families under data, fsdp and tensor meshes ----------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize('family', list(TINY))
def test_every_family_compiles_under_each_mesh(tiny_plans, family):
  for mesh_name, mesh in MESHES.items():
    plan = tiny_plans[(family, mesh_name)]
    assert plan['family'] == family and plan['device_kind'] == 'TPU v5 lite'
    assert {k: v for k, v in plan['mesh'].items() if v > 1} == mesh
    assert plan['fits'] and plan['peak_bytes'] > 0 and plan['flops_per_device'] > 0
    assert set(FIELDS) <= set(plan)
  # data parallelism reduces gradients; fsdp gathers weights and scatters gradients
  assert tiny_plans[(family, 'data')]['collectives']['all-reduce']['count'] >= 1
  fsdp = tiny_plans[(family, 'fsdp')]['collectives']
  assert fsdp['all-gather']['count'] >= 1 and fsdp.get('reduce-scatter', {}).get('count', 0) >= 1


@pytest.mark.slow
@pytest.mark.parametrize('family', list(TINY))
def test_bytes_per_device_fall_with_fsdp(tiny_plans, family):
  data, fsdp = tiny_plans[(family, 'data')], tiny_plans[(family, 'fsdp')]
  assert fsdp['parameter_bytes'] < 0.3 * data['parameter_bytes']
  assert fsdp['optimizer_state_bytes'] < 0.3 * data['optimizer_state_bytes']
  assert fsdp['peak_bytes'] < data['peak_bytes']
