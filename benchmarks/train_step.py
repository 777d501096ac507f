r"""Train-step speed of our models against plain PyTorch eager models of the same shape, on CPU.

  python benchmarks/train_step.py                 # baby and mid GPT, 3 rounds (~5-6 min, 2 cores)
  python benchmarks/train_step.py --rounds=5 --configs=mid
  python benchmarks/train_step.py --rounds=2 --configs=multi30k,bert
  python benchmarks/train_step.py --jax_pythons=.venv311/bin/python,.venv312/bin/python
      # two jax versions (one per interpreter) and PyTorch, interleaved in every round

Configs: GPT 'baby' and 'mid' (shakespeare_char sizes); 'multi30k', the translation model of
experiments/configs/multi30k.py (3+3 layers, 256 wide, vocab 8000) on 128 pairs of 32+32 tokens,
PyTorch side `torch.nn.Transformer` (benchmarks/torch_translation.py); 'bert', MiniLM-L6 size
(6 layers, 384 wide, 12 heads, vocab 30522) sequence classification at sequence 128, PyTorch
side Hugging Face `BertForSequenceClassification` (benchmarks/torch_bert.py).

What is timed: one full training update (forward, loss, backward, global-norm clip, AdamW) in
fp32 with dropout 0. For JAX it is the real trainer's step (`trainer.make_train_step` over
`tasks.lm.LanguageModelTask`, jitted with the trainer's shardings and donation); for PyTorch it
is `benchmarks/torch_gpt.py` (eager, `scaled_dot_product_attention`, multi-tensor AdamW).

Method, for a noisy machine: every measurement runs in a fresh subprocess; each round runs
JAX then PyTorch for a config (A B A B ...); the first step (compilation) and `warmup` more
steps are excluded; each timed step is synced and timed on its own and the median step reported
(a one-time burst of fresh buffers, see the note after DEFAULT_STEPS, would otherwise land in
the mean of a few steps); the JAX/PyTorch ratio is taken per round and the median reported.
Each JAX run also times a jitted 2048x2048 matmul (8192 on accelerators) in the compute dtype,
the machine's practical FLOP/s ceiling; on GPU/TPU the model FLOP utilisation (MFU) against the
chip's nominal dense bf16 peak is reported too (`--configs=gpt2 --dtype=bfloat16 --notorch`,
or `bash benchmarks/gpu_gpt2.sh`).

Model FLOPs per trained token = 6 * N + 12 * L * T * D, N = non-embedding parameters, L layers,
T block size, D width (Kaplan et al. 2020 / PaLM appendix B; the 12LTD attention term counts the
full T x T score matrix, as those formulas do, although causal kernels may skip half of it).
For the translation model and BERT the same rule is applied per stack with N = matmul weights
(encoder on source tokens; decoder and the tied output projection on target tokens; attention
12 * D * query length * key length per layer, cross-attention included). Tokens/s counts target
tokens for translation and input tokens for BERT.

Last line of output: one JSON object with every figure.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformer_jax.cli import process

if __name__ == '__main__':
  process.setup_allocator()  # before jax (or torch) allocates anything

import importlib.util
import json
import resource
import statistics
import subprocess
import time
from typing import Any, NamedTuple

import numpy as np
from absl import app, flags

from tools import machine

CONFIGS = {
    'baby':
        dict(kind='gpt', n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12,
             vocab_size=65),
    'mid':
        dict(kind='gpt', n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=16,
             vocab_size=65),
    'multi30k':
        dict(kind='translation', n_layer=3, n_head=4, n_embd=256, mlp=1024, source_length=32,
             block_size=32, batch_size=128, vocab_size=8000),
    'bert':
        dict(kind='bert', n_layer=6, n_head=12, n_embd=384, mlp=1536, block_size=128, batch_size=32,
             vocab_size=30522),
    # GPT-2 small (124M) for accelerators: `--configs=gpt2 --dtype=bfloat16 --notorch`.
    'gpt2':
        dict(kind='gpt', n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=16,
             vocab_size=50304),
}
# (warmup steps after the first, timed steps); a mid step is roughly 100x a baby one.
DEFAULT_STEPS = {
    'baby': (5, 40), 'mid': (3, 4), 'multi30k': (3, 4), 'bert': (3, 4), 'gpt2': (3, 10)
}
# Once, at a step that varies from run to run (seen from the 2nd to past the 7th), a JAX step
# touches a fresh set of buffers: BERT ~375k minor faults (~1.5 GB) in that one step, none in
# the steps after it (`perf record -e minor-faults` over time; 16 timed steps average 23.6k
# faults, 4 average 94k). Timed steps are therefore synced and timed one by one and the
# *median* step is reported (the steady state a long run sees); the worst step's faults too.
FLOPS_FORMULA = '6*N_nonembed + 12*n_layer*block_size*n_embd FLOPs per token'
MATMUL_N = {'cpu': 2048}  # accelerators: 8192 (a 2048^3 product is too small to fill a GPU)

_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Rounds; each runs JAX then PyTorch per config.')
_CONFIGS = flags.DEFINE_list('configs', ['baby', 'mid'], f'Configs to run, of {list(CONFIGS)}.')
_STEPS = flags.DEFINE_list(
    'steps', [], 'Per-config "name:warmup:timed" step counts, e.g. '
    f'mid:1:4 (defaults: {DEFAULT_STEPS}).')
_TORCH = flags.DEFINE_bool('torch', True, 'Also time the PyTorch baseline (if torch is installed).')
_JAX_PYTHONS = flags.DEFINE_list(
    'jax_pythons', [], 'Interpreters to time the JAX step under, each with its own jax (e.g. a '
    'Python 3.11 venv with jax 0.10.2 and a 3.12 one with jax 0.12), in turn in every round; '
    'default: this one. PyTorch runs under this interpreter.')
_TORCH_THREADS = flags.DEFINE_integer('torch_threads', 2, 'torch.set_num_threads for PyTorch.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed for parameters and token batches.')
_DTYPE = flags.DEFINE_enum(
    'dtype', 'float32', ['float32', 'bfloat16'],
    'bfloat16 on CPU: JAX under the CPU precision policy (model.matmul_dtype=bfloat16, '
    'transformer_jax/precision.py) against PyTorch under torch.autocast("cpu", bfloat16); on '
    'accelerators: JAX computes in bf16 (model.dtype) and PyTorch is not run. Parameters and '
    'optimizer stay float32 everywhere.')
_BATCH = flags.DEFINE_integer('batch_size', 0, 'Rows per step instead of the config\'s (0).')
_SCAN = flags.DEFINE_bool(
    'scan_layers', False, 'JAX: run the layers as one nn.scan (compiles '
    'one layer instead of all: shorter time to the first step).')
_ASYNC = flags.DEFINE_bool(
    'async_dispatch', False, 'JAX on CPU: dispatch steps asynchronously (jax\'s default) instead '
    'of synchronously as the experiments do (cli/process.synchronous_cpu_dispatch).')
# Internal: a child process runs one variant ("jax-baby", "torch-mid", ...).
_VARIANT = flags.DEFINE_string('variant', None, 'Internal: run one variant and print its JSON.')
_WARMUP = flags.DEFINE_integer('warmup', None, 'Internal: warm-up steps for --variant.')
_TIMED = flags.DEFINE_integer('timed_steps', None, 'Internal: timed steps for --variant.')


def model_flops_per_token(non_embedding_params: int, spec: dict) -> float:
  """Training FLOPs per counted token (see the module docstring)."""
  d, layers, t = spec['n_embd'], spec['n_layer'], spec['block_size']
  if spec['kind'] == 'gpt':
    return 6.0 * non_embedding_params + 12.0 * layers * t * d
  encoder_layer = 4 * d * d + 2 * d * spec['mlp']
  if spec['kind'] == 'bert':
    return 6.0 * layers * encoder_layer + 12.0 * layers * t * d
  s = spec['source_length']  # translation: per target token, source side scaled by s / t
  decoder_layer = encoder_layer + 4 * d * d
  return (6.0 * (layers * encoder_layer * s / t + layers * decoder_layer + spec['vocab_size'] * d) +
          12.0 * layers * d * (s * s / t + t + s))


def _random_batches(spec: dict, count: int, seed: int) -> list[dict[str, np.ndarray]]:
  """A few fixed batches of uniform random tokens, cycled through (the trainer's batch keys).

  Translation and BERT rows get right padding of random length (real batches have it, and it
  exercises the padding masks); token ids start at 3 so no real token is padding.
  """
  rng = np.random.default_rng(seed)
  b, t, vocab = spec['batch_size'], spec['block_size'], spec['vocab_size']
  tokens = lambda length: rng.integers(3, vocab, (b, length), dtype=np.int32)

  def pad_rows(x, min_length):
    lengths = rng.integers(min_length, x.shape[1] + 1, b)
    x[np.arange(x.shape[1])[None, :] >= lengths[:, None]] = 0
    return x

  batches = []
  for _ in range(count):
    if spec['kind'] == 'gpt':
      batches.append({'inputs': tokens(t), 'targets': tokens(t)})
    elif spec['kind'] == 'translation':
      batches.append(
          {'inputs': pad_rows(tokens(spec['source_length']), 8), 'targets': pad_rows(tokens(t), 8)})
    else:
      inputs = pad_rows(tokens(t), t // 2)
      batches.append({
          'inputs': inputs, 'segments': np.zeros_like(inputs),
          'labels': rng.integers(0, 2, b, dtype=np.int32), 'weights': np.ones(b, np.float32)
      })
  return batches


def _timed_loop(step, state, batches, warmup: int, timed: int, sync):
  """Runs first step, warm-up, timed steps; returns (state, timings dict).

  Each timed step is synced and timed on its own; the medians of their times and minor page
  faults are reported (see the note after DEFAULT_STEPS), and the worst step's faults."""
  start = time.perf_counter()
  state, loss = step(state, batches[0])
  sync(loss)
  first_step_s = time.perf_counter() - start
  first_loss = float(loss)
  for i in range(warmup):
    state, loss = step(state, batches[(i + 1) % len(batches)])
  sync((state, loss))
  seconds, faults, major_faults = [], [], []
  for i in range(timed):
    usage, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    state, loss = step(state, batches[i % len(batches)])
    sync((state, loss))
    seconds.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    faults.append(after.ru_minflt - usage.ru_minflt)
    major_faults.append(after.ru_majflt - usage.ru_majflt)
  return state, {
      'first_step_s': first_step_s,
      'seconds_per_step': float(np.median(seconds)),
      'mean_seconds_per_step': float(np.mean(seconds)),
      'minflt_per_step': float(np.median(faults)),
      'max_minflt_in_a_step': max(faults),
      'majflt_per_step': float(np.median(major_faults)),
      'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,  # KiB
      'loss_first': first_loss,
      'loss_last': float(loss)
  }


def _best_seconds(fn, repeats: int = 5) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)  # the ceiling: noise only ever slows a run down


class JaxTraining(NamedTuple):
  """The real trainer's step for a config, ready to run under `sharding.use_mesh(mesh, rules)`."""
  train_step: Any  # jitted (state, batch) -> (state, metrics), state donated
  state: Any
  batches: list[Any]  # on the device, with the batch sharding
  mesh: Any
  rules: Any
  non_embedding_params: int
  loss_impl: str
  trainer_model_flops: float | None  # the task's own count (transformer_jax/flops.py)


def build_jax_training(spec: dict, seed: int) -> JaxTraining:
  """The trainer's step, a fresh state and random batches for `spec`, jitted exactly as `Trainer`
  does: shardings from the logical axes, donated state."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import ml_collections
  from transformer_jax import onednn_lifetime
  from transformer_jax.parallel import sharding
  from transformer_jax.training.optimizer import make_optimizer
  from transformer_jax.training.train_step import step_compiler_options
  from transformer_jax.training.trainer import TrainState, make_train_step

  task, loss_impl = _jax_task(spec)
  # The trainer's optimizer (clip 1.0 + AdamW on matrices), as torch_gpt.make_optimizer.
  tx, _ = make_optimizer(
      ml_collections.ConfigDict(
          dict(learning_rate=3e-4, warmup_steps=0, schedule='constant', b1=0.9, b2=0.95, eps=1e-8,
               weight_decay=0.1, grad_clip_norm=1.0)))

  def create_state(rng):
    params = task.init_variables(rng)['params']
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  mesh, rules = sharding.make_mesh(None), sharding.LOGICAL_AXIS_RULES
  state_shardings = sharding.tree_shardings(mesh, jax.eval_shape(create_state, jax.random.key(0)),
                                            rules)
  batch_sharding = sharding.batch_sharding(mesh)
  train_step = onednn_lifetime.jit(make_train_step(task.loss_fn, tx, seed),
                                   in_shardings=(state_shardings, batch_sharding),
                                   out_shardings=(state_shardings, None), donate_argnums=(0,),
                                   compiler_options=step_compiler_options(task, mesh))
  with sharding.use_mesh(mesh, rules):
    state = jax.jit(lambda rng: nn.meta.unbox(create_state(rng)),
                    out_shardings=state_shardings)(jax.random.key(seed))
  embeddings = ('token_embed', 'position_embedding', 'target_embed', 'segment_embedding')
  non_embedding = sum(x.size
                      for path, x in jax.tree_util.tree_leaves_with_path(state.params)
                      if not any(getattr(k, 'key', None) in embeddings for k in path))
  batches = [jax.device_put(batch, batch_sharding) for batch in _random_batches(spec, 4, seed)]
  # The FLOPs the training log's MFU counts (causal attention at half, the tied output projection
  # in), so that its figure can be checked against this one.
  counted = getattr(task, 'model_flops', None)
  trainer_flops = float(counted(state.params, batches[0])) if counted else None
  return JaxTraining(train_step, state, batches, mesh, rules, int(non_embedding), loss_impl,
                     trainer_flops)


def run_jax(spec: dict, warmup: int, timed: int, seed: int) -> dict:
  import jax
  from transformer_jax import flops, onednn_lifetime, precision
  from transformer_jax.cli import process
  from transformer_jax.parallel import sharding

  if not _ASYNC.value:
    process.synchronous_cpu_dispatch()  # as the experiments' entry points do
  training = build_jax_training(spec, seed)

  def step(state, batch):
    state, metrics = training.train_step(state, batch)
    return state, metrics['loss_mean']

  with sharding.use_mesh(training.mesh, training.rules):
    _, result = _timed_loop(step, training.state, training.batches, warmup, timed,
                            jax.block_until_ready)

  n = MATMUL_N.get(jax.default_backend(), 8192)
  a = jax.random.normal(jax.random.key(1), (n, n), _DTYPE.value)
  b = jax.random.normal(jax.random.key(2), (n, n), _DTYPE.value)
  # In the dtype the model's matmuls run in, compiled as its step is (the policy's options).
  matmul = onednn_lifetime.jit(
      lambda a, b: a @ b, compiler_options=precision.compiler_options(_DTYPE.value,
                                                                      jax.default_backend()))
  matmul(a, b).block_until_ready()
  seconds = _best_seconds(lambda: matmul(a, b).block_until_ready())
  device_kind = jax.devices()[0].device_kind
  from transformer_jax import chips  # nominal chip peaks, for MFU on accelerators
  chip = chips.for_device_kind(device_kind)
  result.update(
      non_embedding_params=training.non_embedding_params, loss_impl=training.loss_impl, matmul_n=n,
      matmul_flops_per_s=2.0 * n**3 / seconds, device_kind=device_kind,
      peak_bf16_flops_per_s=chip.peak_flops if chip and jax.default_backend() != 'cpu' else None,
      jax_version=jax.__version__, backend=jax.default_backend(),
      dispatch='asynchronous' if _ASYNC.value else 'synchronous')
  if jax.default_backend() == 'cpu':
    # The training log's CPU peak: the best matmul rate this machine has shown (flops.CpuPeak).
    result['cpu_peak_flops_per_s'] = flops.CpuPeak.of(_DTYPE.value).flops
  if training.trainer_model_flops:  # the training log's MFU: its FLOPs over its peak
    peak = result['peak_bf16_flops_per_s'] or result['cpu_peak_flops_per_s']
    result['trainer_mfu'] = training.trainer_model_flops / result['seconds_per_step'] / peak
  return result


def _jax_precision() -> dict:
  """The model's dtype and matmul_dtype for --dtype: bfloat16 is the CPU precision policy on CPU
  (float32 model, bf16 matmuls) and bf16 compute on accelerators."""
  import jax
  from transformer_jax.model_config import DTYPES
  if _DTYPE.value == 'bfloat16' and jax.default_backend() == 'cpu':
    return dict(dtype=DTYPES['float32'], matmul_dtype=DTYPES['bfloat16'])
  return dict(dtype=DTYPES[_DTYPE.value], matmul_dtype=None)


def _jax_task(spec: dict):
  """(task, description) of the real training task for the config's model."""
  common = dict(vocab_size=spec['vocab_size'], emb_dim=spec['n_embd'], num_heads=spec['n_head'],
                dropout_rate=0.0, attention_dropout_rate=0.0, scan_layers=_SCAN.value,
                **_jax_precision())
  if spec['kind'] == 'translation':
    from transformer_jax.model_config import TransformerConfig
    from transformer_jax.tasks.translation import TranslationTask
    # experiments/configs/translate_common.py + multi30k.py, dropout off.
    cfg = TransformerConfig(mlp_dim=spec['mlp'], num_encoder_layers=spec['n_layer'],
                            num_decoder_layers=spec['n_layer'], max_len=256, **common)
    return TranslationTask(cfg, label_smoothing=0.1), 'tasks.translation.TranslationTask'
  if spec['kind'] == 'bert':
    from transformer_jax.models.bert import bert_config
    from transformer_jax.tasks.bert import BertClassificationTask
    cfg = bert_config(mlp_dim=spec['mlp'], num_encoder_layers=spec['n_layer'], **common)
    return BertClassificationTask(cfg, 2), 'tasks.bert.BertClassificationTask'
  from transformer_jax.models.gpt import gpt2_config
  cfg = gpt2_config(mlp_dim=4 * spec['n_embd'], num_decoder_layers=spec['n_layer'],
                    max_len=spec['block_size'], **common)
  try:
    from transformer_jax.tasks.lm import LanguageModelTask
    return LanguageModelTask(cfg), 'tasks.lm.LanguageModelTask'
  except ImportError:
    return _LocalLMTask(cfg), 'local cross_entropy_sums'


class _LocalLMTask:
  """Fallback for a tree without tasks/lm.py: GPT + mean next-token cross-entropy."""

  def __init__(self, cfg):
    from transformer_jax.models.gpt import GPT
    self.cfg, self.model = cfg, GPT(cfg)

  def init_variables(self, rng):
    import jax.numpy as jnp
    return self.model.init({'params': rng, 'dropout': rng}, jnp.ones((1, 8), jnp.int32))

  def loss_fn(self, params, batch, rng, deterministic):
    import jax.numpy as jnp
    from transformer_jax.layers.losses import cross_entropy_sums
    rngs = None if deterministic else {'dropout': rng}
    logits = self.model.apply({'params': params}, batch['inputs'], deterministic=deterministic,
                              rngs=rngs)
    _, nll, correct, weight = cross_entropy_sums(logits, batch['targets'],
                                                 jnp.ones(batch['targets'].shape, jnp.float32))
    return nll / weight, {'loss': nll, 'correct': correct, 'weight': weight}


def run_torch(spec: dict, warmup: int, timed: int, seed: int) -> dict:
  import torch
  from benchmarks import torch_gpt

  torch.set_num_threads(_TORCH_THREADS.value)
  torch.manual_seed(seed)
  batches = [{
      k: torch.from_numpy(v).long() if v.dtype != np.float32 else torch.from_numpy(v)
      for k, v in batch.items()
  }
             for batch in _random_batches(spec, 4, seed)]
  if spec['kind'] == 'gpt':
    model = torch_gpt.TorchGPT(
        torch_gpt.TorchGPTConfig(vocab_size=spec['vocab_size'], block_size=spec['block_size'],
                                 n_layer=spec['n_layer'], n_head=spec['n_head'],
                                 n_embd=spec['n_embd'], dropout=0.0))
    train_step = lambda b: torch_gpt.train_step(model, optimizer, b['inputs'], b['targets'])
    non_embedding = model.num_params(non_embedding=True)
  elif spec['kind'] == 'translation':
    from benchmarks import torch_translation
    model = torch_translation.TorchTranslation(
        torch_translation.TorchTranslationConfig(vocab_size=spec['vocab_size'],
                                                 d_model=spec['n_embd'], n_head=spec['n_head'],
                                                 d_ff=spec['mlp'], n_encoder_layers=spec['n_layer'],
                                                 n_decoder_layers=spec['n_layer']))
    train_step = lambda b: torch_translation.train_step(model, optimizer, b['inputs'], b['targets'])
    non_embedding = model.num_params() - model.embed.weight.numel()
  else:
    from benchmarks import torch_bert
    model = torch_bert.make_model(spec['vocab_size'], spec['n_embd'], spec['n_head'], spec['mlp'],
                                  spec['n_layer'])
    train_step = lambda b: torch_bert.train_step(model, optimizer, b['inputs'], b['segments'], b[
        'labels'])
    non_embedding = sum(p.numel() for n, p in model.named_parameters() if 'embeddings' not in n)
  model.train()
  optimizer = torch_gpt.make_optimizer(model)

  autocast = _DTYPE.value == 'bfloat16'  # torch.autocast("cpu", bfloat16), as a user writes it

  def step(state, batch):
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
      return state, train_step(batch)

  _, result = _timed_loop(step, None, batches, warmup, timed, lambda _: None)  # eager: synced
  n = MATMUL_N['cpu']
  dtype = torch.bfloat16 if autocast else torch.float32
  a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
  torch.mm(a, b)
  seconds = _best_seconds(lambda: torch.mm(a, b))
  result.update(non_embedding_params=non_embedding, torch_matmul_flops_per_s=2.0 * n**3 / seconds,
                torch_version=torch.__version__, torch_threads=torch.get_num_threads())
  return result


def _spec(name: str) -> dict:
  """The config, with --batch_size applied."""
  return dict(CONFIGS[name], batch_size=_BATCH.value or CONFIGS[name]['batch_size'])


def run_variant(variant: str, warmup: int, timed: int, seed: int) -> dict:
  framework, _, name = variant.partition('-')
  if name not in CONFIGS or framework not in ('jax', 'torch'):
    raise app.UsageError(f'--variant must be jax-NAME or torch-NAME with NAME in '
                         f'{list(CONFIGS)}, got {variant!r}')
  spec = _spec(name)
  run = run_jax if framework == 'jax' else run_torch
  result = run(spec, warmup, timed, seed)
  tokens = spec['batch_size'] * spec['block_size']
  # GPT: the measured parameter count, as before; others: the analytic one (same both sides).
  flops_per_step = model_flops_per_token(result['non_embedding_params'], spec) * tokens
  seconds = result['seconds_per_step']
  result.update(variant=variant, framework=framework, config=name, tokens_per_step=tokens,
                warmup_steps=warmup, timed_steps=timed, ms_per_step=1000.0 * seconds,
                tokens_per_s=tokens / seconds, model_flops_per_step=flops_per_step,
                model_flops_per_s=flops_per_step / seconds, dtype=_DTYPE.value,
                allocator=process.allocator_description())
  if result.get('peak_bf16_flops_per_s'):
    result['mfu'] = result['model_flops_per_s'] / result['peak_bf16_flops_per_s']
  return result


def _step_counts() -> dict[str, tuple[int, int]]:
  counts = dict(DEFAULT_STEPS)
  for item in _STEPS.value:
    try:
      name, warmup, timed = item.split(':')
      counts[name] = (int(warmup), int(timed))
    except ValueError:
      raise app.UsageError(f'--steps entries look like mid:1:4, got {item!r}') from None
    if name not in CONFIGS or counts[name][0] < 0 or counts[name][1] < 1:
      raise app.UsageError(f'bad --steps entry {item!r}: config in {list(CONFIGS)}, '
                           'warmup >= 0, timed >= 1')
  return counts


def _spawn(variant: str, warmup: int, timed: int, python: str | None = None) -> dict:
  """Runs one variant in a fresh interpreter (same allocator env) and parses its JSON."""
  command = [
      python or sys.executable,
      os.path.abspath(__file__), f'--variant={variant}', f'--warmup={warmup}',
      f'--timed_steps={timed}', f'--seed={_SEED.value}', f'--torch_threads={_TORCH_THREADS.value}',
      f'--dtype={_DTYPE.value}', f'--batch_size={_BATCH.value}',
      f'--{"" if _SCAN.value else "no"}scan_layers',
      f'--{"" if _ASYNC.value else "no"}async_dispatch'
  ]
  proc = subprocess.run(command, capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    sys.stderr.write(proc.stderr[-4000:])
    raise RuntimeError(f'{variant} failed with exit code {proc.returncode}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _jax_version(python: str) -> str:
  """The jax version installed for interpreter `python`."""
  proc = subprocess.run([python, '-c', 'import importlib.metadata as m; print(m.version("jax"))'],
                        capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    raise app.UsageError(f'--jax_pythons: {python} has no jax: {proc.stderr.strip()[-300:]}')
  return proc.stdout.strip()


def _median(values: list[float]) -> float | None:
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def _summarise(name: str, runs: dict[str, list[dict]]) -> dict:
  """Medians over rounds per framework, and the median of the per-round speed ratios."""
  summary = {}
  for framework, results in runs.items():
    if not results:
      continue
    keys = [
        k for k, v in results[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    ]
    summary[framework] = {k: _median([r.get(k) for r in results]) for k in keys}
    summary[framework]['rounds'] = [
        {k: r[k] for k in ('tokens_per_s', 'ms_per_step', 'first_step_s')} for r in results
    ]
  labels = [label for label in runs if label.startswith('jax') and runs[label]]
  # Each JAX over PyTorch, and each later JAX over the first (the version comparison).
  pairs = [(label, 'torch') for label in labels if runs.get('torch')]
  pairs += [(label, labels[0]) for label in labels[1:]]
  for numerator, denominator in pairs:
    ratios = [
        a['tokens_per_s'] / b['tokens_per_s'] for a, b in zip(runs[numerator], runs[denominator])
    ]
    key = f'{numerator}_over_{denominator}'.replace(' ', '_')
    summary[f'{key}_tokens_per_s'] = statistics.median(ratios)
    summary[f'{key}_per_round'] = ratios
  for label in labels:
    summary[label]['model_flops_over_matmul'] = (summary[label]['model_flops_per_s'] /
                                                 summary[label]['matmul_flops_per_s'])
  summary['spec'] = _spec(name)
  return summary


def _print_summary(name: str, s: dict, labels: list[str]):
  for framework in labels:
    if framework not in s:
      continue
    f = s[framework]
    print(f'  {name:5s} {framework:5s}: {f["tokens_per_s"]:10,.0f} tok/s  '
          f'{f["ms_per_step"]:9.1f} ms/step  {f["model_flops_per_s"] / 1e9:7.1f} GFLOP/s model'
          f'  first step {f["first_step_s"]:5.1f} s  peak RSS {f["peak_rss_mb"]:7.0f} MB  '
          f'{f["minflt_per_step"]:9.0f} minor faults/step')
  for label in labels:
    if not label.startswith('jax') or label not in s:
      continue
    j = s[label]
    print(f'  {name:5s} {label} matmul {j["matmul_n"]:.0f}^3 {_DTYPE.value}: '
          f'{j["matmul_flops_per_s"] / 1e9:.1f} GFLOP/s; model FLOP/s = '
          f'{100 * j["model_flops_over_matmul"]:.0f}% of it')
    if j.get('mfu'):
      print(f'  {name:5s} MFU {100 * j["mfu"]:.1f}% of the nominal '
            f'{j["peak_bf16_flops_per_s"] / 1e12:.0f} TFLOP/s bf16 peak')
    if j.get('trainer_mfu'):
      print(f'  {name:5s} MFU as the training log counts it (transformer_jax/flops.py): '
            f'{100 * j["trainer_mfu"]:.1f}%')
  for key in s:
    if key.endswith('_tokens_per_s') and '_over_' in key:
      per_round = ', '.join(f'{r:.2f}' for r in s[key.replace('_tokens_per_s', '_per_round')])
      print(f'  {name:5s} {key.replace("_tokens_per_s", "")} tokens/s: {s[key]:.2f} '
            f'(median of rounds: {per_round})')


def main(argv):
  del argv
  if _VARIANT.value:
    if _WARMUP.value is None or _TIMED.value is None:
      raise app.UsageError('--variant needs --warmup and --timed_steps')
    print(json.dumps(run_variant(_VARIANT.value, _WARMUP.value, _TIMED.value, _SEED.value)))
    return
  unknown = [c for c in _CONFIGS.value if c not in CONFIGS]
  if unknown or _ROUNDS.value < 1:
    raise app.UsageError(f'--configs must be among {list(CONFIGS)} (got {unknown}); '
                         '--rounds >= 1')
  counts = _step_counts()
  with_torch = (_TORCH.value and importlib.util.find_spec('torch') is not None)
  # (label, interpreter) per timed framework: 'jax', or 'jax 0.10.2', 'jax 0.12.0.1', ...
  pythons = _JAX_PYTHONS.value or [sys.executable]
  frameworks = [('jax' if len(pythons) == 1 else f'jax {_jax_version(p)}', p) for p in pythons]
  frameworks += [('torch', sys.executable)] if with_torch else []
  labels = [label for label, _ in frameworks]
  if len(set(labels)) != len(labels):
    raise app.UsageError(f'--jax_pythons name one jax version twice: {labels}')
  print(f'allocator: {process.allocator_description()}')
  described = machine.description()
  print(f'machine: {described["cpu"]} ({", ".join(described["cpu_flags"])}), '
        f'{described["cores"]} cores; commit {described["commit"]}')
  print(f'PyTorch baseline: {"yes" if with_torch else "no (torch not installed or --notorch)"}; '
        f'model FLOPs: {FLOPS_FORMULA}')
  runs = {name: {label: [] for label in labels} for name in _CONFIGS.value}
  start = time.time()
  for r in range(_ROUNDS.value):
    for name in _CONFIGS.value:
      warmup, timed = counts[name]
      for label, python in frameworks:  # A B in every round: drift hits both alike
        framework = label.split()[0]
        result = _spawn(f'{framework}-{name}', warmup, timed, python)
        runs[name][label].append(result)
        print(
            f'round {r + 1}/{_ROUNDS.value} {label:5s} {name:5s}: '
            f'{result["tokens_per_s"]:10,.0f} tok/s  {result["ms_per_step"]:9.1f} ms/step  '
            f'(first step {result["first_step_s"]:.1f} s, {time.time() - start:.0f} s elapsed)',
            flush=True)
  summaries = {name: _summarise(name, runs[name]) for name in _CONFIGS.value}
  print(f'medians over {_ROUNDS.value} round(s):')
  for name, s in summaries.items():
    _print_summary(name, s, labels)
  print(
      json.dumps({
          'benchmark': 'train_step', **machine.description(), 'rounds': _ROUNDS.value,
          'steps': counts, 'allocator': process.allocator_description(),
          'flops_formula': FLOPS_FORMULA, 'precision': _DTYPE.value, 'dropout': 0.0,
          'torch_baseline': with_torch, 'scan_layers': _SCAN.value,
          'wall_seconds': time.time() - start, 'configs': summaries
      }))


if __name__ == '__main__':
  app.run(main)
