"""Model FLOPs of a training step, and the model FLOP utilisation (MFU) of the training log.

Model FLOPs count what the model needs, not what the compiled program does (no
rematerialisation, padding kernels or optimizer update):
  - 6 per matmul parameter (a dense kernel, or the embedding table a tied output multiplies by)
    for every token it multiplies: 2 in the forward pass, 4 in the backward pass;
  - attention's two products, scores q.k and the weighted sum of values: 2 FLOPs each per
    query, key and feature forward, so 12 with the backward pass; halved for causal attention,
    whose masked half need not be computed (MaxText counts it so since its PR #1988).
The tasks apply these to their models (`Task.model_flops(params, batch)`), and the trainer's
progress line divides them by the step time and the peak.

MFU = model FLOP/s / peak FLOP/s. The peak is the chip's nominal dense bf16 rate on TPU and GPU
(`chips.py`) and, on CPU, the best rate a 2048^3 matmul has reached on this machine (`CpuPeak`):
in the dtype the model's matmuls run in, compiled as the steps are, measured at every start and
remembered per CPU model, usable cores, jaxlib and dtype in
$XDG_CACHE_HOME/transformer_jax/cpu_matmul_peak.json (`benchmarks/train_step.py` divides by the
same). A measurement taken while other work shares the CPU is low (137 against 405 GFLOP/s seen on
a 2-core EPYC), and a peak that low would show MFU above 100% for the whole run; the best figure
seen is what the machine can do. Should a window's model FLOP/s still exceed the peak (no quiet
measurement yet), the progress line says the peak is stale instead of giving a figure, and the
matmul is measured again.
"""

import dataclasses
import json
import os

import jax
import numpy as np

from transformer_jax import chips, files, precision

CPU_MATMUL_N = 2048
FORMULA = ('6 x matmul parameters x tokens + 12 x layers x queries x keys x attention width, '
           'causal halved')


def kernel_parameters(tree, parents: tuple[str, ...] = ()) -> int:
  """Parameters of the dense kernels in `tree` (every leaf named 'kernel'); with `parents`, only
  those of kernels whose path ends in parents + ('kernel',)."""
  total, suffix = 0, list(parents) + ['kernel']
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names = [str(getattr(key, 'key', key)) for key in path]
    if names[-len(suffix):] == suffix:
      total += int(np.prod(leaf.shape))
  return total


def memory_projection_parameters(stack) -> int:
  """The key and value kernels of a decoder's cross-attention: they multiply the encoder's
  positions, not the decoder's."""
  return (kernel_parameters(stack, ('cross_attention', 'key')) +
          kernel_parameters(stack, ('cross_attention', 'value')))


def stack_parameters(stack, layers: int, shared: bool) -> int:
  """Matmul parameters a layer stack applies to each token: ALBERT's one shared layer counts
  once per application."""
  return kernel_parameters(stack) * (layers if shared else 1)


def dense(parameters: int, tokens: int) -> float:
  """Forward and backward FLOPs of `parameters` matmul parameters applied to `tokens` tokens."""
  return 6.0 * parameters * tokens


def attention(layers: int, sequences: int, queries: int, keys: int, width: int,
              causal: bool) -> float:
  """Forward and backward FLOPs of `layers` attentions of `sequences` sequences, `queries` x
  `keys` positions, `width` = heads x head_dim."""
  return 12.0 * layers * sequences * queries * keys * width * (0.5 if causal else 1.0)


def attention_width(cfg) -> int:
  return cfg.num_heads * (cfg.head_dim or cfg.emb_dim // cfg.num_heads)


def tied_output_parameters(cfg, table) -> int:
  """Parameters of the output projection when it multiplies by the token table `table`."""
  return int(np.prod(table['embedding'].shape)) if cfg.tie_output else 0


def peak_flops_per_device(device, matmul_dtype) -> tuple[float | None, str]:
  """(peak FLOP/s of one device or None where unknown, where the figure comes from)."""
  if device.platform == 'cpu':
    peak = CpuPeak.of(matmul_dtype)
    return peak.flops, peak.describe()
  kind = getattr(device, 'device_kind', '')
  chip = chips.for_device_kind(kind)
  if chip is None:
    return None, f'no nominal peak known for {kind!r}'
  return chip.peak_flops, f'{kind} nominal dense bf16: {chip.peak_flops / 1e12:,.0f} TFLOP/s'


def measure_cpu_matmul(matmul_dtype, n: int = CPU_MATMUL_N, repeats: int = 3) -> float:
  """FLOP/s of the fastest of `repeats` n^3 matmuls in `matmul_dtype`, compiled with the
  options the policy's steps use (a fraction of a second)."""
  return 2.0 * n**3 / precision.matmul_seconds(matmul_dtype, n, repeats=repeats)


@dataclasses.dataclass
class CpuPeak:
  """This machine's CPU peak for one matmul dtype: the best n^3 matmul rate seen here.

  `of` measures now and merges with the cache, so a run started beside other work still divides
  by what the machine reached when it was quiet; the cache keeps the higher figure.
  """
  dtype: str
  measured: float  # FLOP/s of the latest measurement in this process
  best: float  # the highest known on this machine (the cache, and this process's measurements)
  cache_path: str
  n: int = CPU_MATMUL_N

  @property
  def flops(self) -> float:
    return max(self.best, self.measured)

  @classmethod
  def of(cls, matmul_dtype, cache_path: str | None = None, n: int = CPU_MATMUL_N) -> 'CpuPeak':
    """Measured now, merged with the cache (one process measures once per dtype)."""
    name = np.dtype(matmul_dtype).name
    cache_path = cache_path or files.cache_path('cpu_matmul_peak.json')
    key = (name, cache_path, n)
    if key not in _CPU_PEAKS:
      peak = cls(name, 0.0, _read_best(cache_path, _machine_key(name, n)), cache_path, n)
      peak.measure()
      _CPU_PEAKS[key] = peak
    return _CPU_PEAKS[key]

  def measure(self) -> float:
    """Measures the matmul again; remembers the figure where it beats the best known. Returns
    the new peak."""
    self.measured = measure_cpu_matmul(self.dtype, self.n)
    if self.measured > self.best:
      self.best = self.measured
      _write_best(self.cache_path, _machine_key(self.dtype, self.n), self.best)
    return self.flops

  def describe(self) -> str:
    text = (f'a {self.n}^3 {self.dtype} matmul, the best seen on this machine: '
            f'{self.flops / 1e9:,.0f} GFLOP/s')
    if self.measured < self.flops:
      text += f' (measured now: {self.measured / 1e9:,.0f}; {self.cache_path})'
    return text


_CPU_PEAKS: dict[tuple, CpuPeak] = {}


def _machine_key(dtype: str, n: int) -> str:
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  return f'{precision.cpu_model()} | {cores} cores | jaxlib {jax.lib.__version__} | {dtype} {n}^3'


def _read_best(path: str, key: str) -> float:
  try:
    with open(path) as f:
      value = json.load(f).get(key, 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0
  except (OSError, ValueError, AttributeError):
    return 0.0


def _write_best(path: str, key: str, flops: float):
  """Best effort: a read-only home costs only the memory of the figure across runs."""
  try:
    with open(path) as f:
      table = json.load(f)
    table = table if isinstance(table, dict) else {}
  except (OSError, ValueError):
    table = {}
  table[key] = max(flops, float(table.get(key, 0.0) or 0.0))
  try:
    files.write_atomically(path, json.dumps(table, indent=1, sort_keys=True))
  except OSError:
    pass
