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
(`chips.py`) and, on CPU, a 2048^3 matmul timed once per run in the dtype the model's
matmuls run in, compiled as the steps are (`benchmarks/train_step.py` divides by the same).
"""

import functools

import numpy as np

from transformer_jax import chips, precision

CPU_MATMUL_N = 2048
FORMULA = ('6 x matmul parameters x tokens + 12 x layers x queries x keys x attention width, '
           'causal halved')


def kernel_parameters(tree, parents: tuple[str, ...] = ()) -> int:
  """Parameters of the dense kernels in `tree` (every leaf named 'kernel'); with `parents`, only
  those of kernels whose path ends in parents + ('kernel',)."""
  import jax
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
    flops = measured_cpu_matmul(matmul_dtype)
    name = np.dtype(matmul_dtype).name
    return flops, f'a {CPU_MATMUL_N}^3 {name} matmul measured now: {flops / 1e9:,.0f} GFLOP/s'
  kind = getattr(device, 'device_kind', '')
  chip = chips.for_device_kind(kind)
  if chip is None:
    return None, f'no nominal peak known for {kind!r}'
  return chip.peak_flops, f'{kind} nominal dense bf16: {chip.peak_flops / 1e12:,.0f} TFLOP/s'


@functools.lru_cache(maxsize=None)
def measured_cpu_matmul(matmul_dtype, n: int = CPU_MATMUL_N, repeats: int = 3) -> float:
  """FLOP/s of the fastest of `repeats` n^3 matmuls in `matmul_dtype`, compiled with the
  options the policy's steps use (a fraction of a second; once per process and dtype)."""
  return 2.0 * n**3 / precision.matmul_seconds(matmul_dtype, n, repeats=repeats)
