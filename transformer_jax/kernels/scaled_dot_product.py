"""Scaled dot-product attention: the reference formula, the block-causal `chunked` version with a
written-out gradient (CPU), the fused kernels (cuDNN, Pallas) and the choice per target platform.

Shapes: B batch, T/S query/key length, H query heads, K key/value heads (K divides H), D head
dim; q [B, T, H, D], k and v [B, S, K, D]. Masks as in `masks.py`.

Packed rows (several examples in one row, `data/packing.py`) pass segment ids: int32
`query_segment_ids` [B, T] and `key_segment_ids` [B, S], equal for a query and the keys of its
own example (0 on padding). Each implementation takes them in its cheapest form: 'chunked'
builds each block's [B, 1, rows, keys] mask from slices of the ids, the Pallas kernel compares
the ids itself (nothing [T, S]-sized), and 'reference', 'xla' and 'cudnn' (whose
`jax.nn.dot_product_attention` has no segment ids) get the boolean mask [B, 1, T, S].
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.kernels.masks import (as_4d, combine_masks, make_causal_mask,
                                           make_segment_mask, zero_fully_masked_rows)
from transformer_jax.kernels.pallas_attention import pallas_tpu_attention


def reference_attention(q, k, v, *, mask=None, bias=None, dropout_rng=None, dropout_rate=0.0,
                        deterministic=True, dtype=jnp.float32):
  """softmax(q k^T / sqrt(D) + bias, masked) v, written out; returns (output, weights).

  q [B, T, H, D]; k, v [B, S, K, D]. Query heads are grouped over the K key/value heads, so
  grouped-query attention needs no copies of k and v. Scores and softmax are float32 whatever
  the compute dtype. Masked weights are exactly zero (a fully masked query row, e.g. a padding
  query, gets all-zero weights and a zero output rather than a uniform average).
  """
  b, t, h, d = q.shape
  kv_heads = k.shape[2]
  groups = h // kv_heads
  q = q.reshape(b, t, kv_heads, groups, d)
  scores = jnp.einsum('btkgd,bskd->bkgts', q, k, preferred_element_type=jnp.float32)
  scores = scores.reshape(b, h, t, k.shape[1]) / jnp.sqrt(jnp.float32(d))
  if bias is not None:
    scores = scores + bias.astype(jnp.float32)
  if mask is not None:
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1)
  if mask is not None:
    weights = jnp.where(mask, weights, 0.0)
  probs = weights
  if not deterministic and dropout_rate > 0.0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
    probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
  probs = probs.astype(dtype).reshape(b, kv_heads, groups, t, k.shape[1])
  out = jnp.einsum('bkgts,bskd->btkgd', probs, v.astype(dtype)).reshape(b, t, h, d)
  return out, weights


def _slice_scores_array(x, q_lo, q_hi, k_hi):
  """Rows q_lo:q_hi and keys :k_hi of a 4-D mask/bias, leaving broadcast (size 1) axes alone."""
  if x is None:
    return None
  rows = slice(q_lo, q_hi) if x.shape[2] > 1 else slice(None)
  keys = slice(0, k_hi) if x.shape[3] > 1 else slice(None)
  return x[:, :, rows, keys]


def default_chunk_size(query_length: int, key_length: int, causal: bool) -> int:
  """Query rows per chunk for `chunked_attention`.

  Causal: 64 rows (measured best on CPU at T=256: skips ~37% of the score work without making the
  matmuls too small), at most 16 chunks so long sequences don't unroll into huge programs.
  Non-causal attention saves no work by chunking, so it only chunks to bound the score memory.
  """
  if causal:
    return max(64, -(-query_length // 16))
  if query_length * key_length <= 1024 * 1024:
    return query_length
  return max(64, -(-query_length // 16))


def _product(subscripts, a, b, narrow):
  """einsum in float32. `narrow`: the product is rounded to the operands' dtype first, as PyTorch's
  autocast does (the CPU precision policy, precision.py: XLA:CPU's bf16 dots with bf16 results
  made the mid GPT step 1,038 ms against 1,160 with float32 results); else the operands are
  multiplied with float32 results."""
  if narrow:  # the barrier: nothing fused into the dot (layers/dense.py says why)
    return jax.lax.optimization_barrier(jnp.einsum(subscripts, a, b)).astype(jnp.float32)
  return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32)


def _softmax_weights(q, k_t, mask, bias, narrow=False):
  """Masked softmax(q k^T + bias) in float32, [B, H, T, S], from head-major q [B, H, T, D] (scaled)
  and k^T [B, H, D, S]; masked weights exactly zero, as `reference_attention`."""
  scores = _product('bhtd,bhds->bhts', q, k_t, narrow)
  if bias is not None:
    scores = scores + bias.astype(jnp.float32)
  if mask is not None:
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  exp = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
  weights = exp * (1.0 / jnp.sum(exp, axis=-1, keepdims=True))
  return weights if mask is None else jnp.where(mask, weights, 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention_core(narrow, q, k_t, v, mask, bias):
  """softmax(q k^T + bias, masked) v for head-major q [B, H, T, D] (scaled), k^T [B, H, D, S] and
  v [B, H, S, D]; output [B, H, T, D]. The numbers of `reference_attention`, with the gradient
  written out (`_attention_core_bwd`). `narrow`: every product rounded to the operands' dtype
  (`_product`); softmax and its gradient stay float32."""
  return _attention_core_fwd(narrow, q, k_t, v, mask, bias)[0]


def _attention_core_fwd(narrow, q, k_t, v, mask, bias):
  weights = _softmax_weights(q, k_t, mask, bias, narrow)
  out = _product('bhts,bhsd->bhtd', weights.astype(v.dtype), v, narrow).astype(v.dtype)
  return out, (q, k_t, v, mask, bias, weights, out)


def _attention_core_bwd(narrow, residuals, d_out):
  """The attention gradient with every [T, S]-sized tensor in the layout the matmuls want.

  Autodiff of the formula made XLA:CPU copy (transpose) the score-sized gradient and weights for
  the key and value gradients, and reduce over the scores once more for the softmax gradient. Here
  d k^T = q^T ds and d v^T = d_out^T p transpose only [T, D]-sized operands, and the softmax
  gradient ds = p (dp - rowsum(dp p)) uses rowsum(dp p) = rowsum(d_out * out) (FlashAttention's
  identity), a pass over [T, D] instead of [T, S]. (BERT-size attention forward + backward on CPU:
  27 -> 22 ms per layer.)
  """
  q, k_t, v, mask, bias, weights, out = residuals
  f32 = jnp.float32
  swap = lambda x: jnp.swapaxes(x, -1, -2)
  d_out = d_out.astype(v.dtype)
  d_weights = _product('bhtd,bhds->bhts', d_out, swap(v), narrow)
  row_dot = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1, keepdims=True)
  d_scores = weights * (d_weights - row_dot)  # zero where masked, as the weights are
  d_q = _product('bhts,bhsd->bhtd', d_scores.astype(q.dtype), swap(k_t), narrow)
  d_k_t = _product('bhdt,bhts->bhds', swap(q), d_scores.astype(q.dtype), narrow)
  d_v = swap(_product('bhdt,bhts->bhds', swap(d_out), weights.astype(d_out.dtype), narrow))
  d_mask = None if mask is None else np.zeros(mask.shape, jax.dtypes.float0)
  d_bias = None
  if bias is not None:  # summed over the axes the bias broadcasts along
    axes = tuple(i for i in range(4) if bias.shape[i] == 1 and d_scores.shape[i] != 1)
    d_bias = jnp.sum(d_scores, axis=axes, keepdims=True).astype(bias.dtype)
  return (d_q.astype(q.dtype), d_k_t.astype(k_t.dtype), d_v.astype(v.dtype), d_mask, d_bias)


_attention_core.defvjp(_attention_core_fwd, _attention_core_bwd)


def chunked_attention(q, k, v, *, mask=None, bias=None, causal=False, chunk_size=None,
                      dropout_rng=None, dropout_rate=0.0, deterministic=True, dtype=jnp.float32,
                      query_segment_ids=None, key_segment_ids=None, matmul_dtype=None):
  """Attention output [B, T, H, D] computed one block of query rows at a time.

  With `causal` (query i sees keys 0..i, as `make_causal_mask`, on top of `mask`), a query block
  ending at row e only needs keys 0..e-1: the fully masked key blocks above the diagonal are never
  computed, nearly halving the score/value matmuls for long sequences. Each block is an exact
  softmax over its (static) key prefix, so the result equals `reference_attention` up to float
  rounding and the gradient is exact. Padding masks, biases and cross-attention (non-causal,
  S != T) are sliced per block. Without dropout each block is `_attention_core` (head-major, its
  gradient written out for XLA:CPU: BERT step ~3.5% faster than autodiff of the formula); with
  attention dropout, `reference_attention` per block, drawing per block (fold_in of the block
  index), so not bit-identical to the reference's dropout pattern. Grouped-query key/value heads
  are repeated for the core (autodiff sums their gradients back). Segment ids (packed rows)
  become each block's own mask, from the block's slices of the ids.
  """
  t, s = q.shape[1], k.shape[1]
  segments = None if query_segment_ids is None else (query_segment_ids, key_segment_ids)
  blocks = list(
      _query_blocks(t, s, chunk_size or default_chunk_size(t, s, causal), causal, as_4d(mask),
                    as_4d(bias), segments))
  concat = lambda outputs, axis: (outputs[0]
                                  if len(outputs) == 1 else jnp.concatenate(outputs, axis=axis))
  if deterministic or dropout_rate == 0.0:
    # Head-major once per call ([B, H, T, D]; keys as k^T), so no block transposes its operands.
    # The CPU precision policy (`matmul_dtype` narrower than `dtype`): operands cast once here.
    narrow = matmul_dtype is not None and jnp.dtype(matmul_dtype) != jnp.dtype(dtype)
    operand_dtype = matmul_dtype if narrow else dtype
    groups, d = q.shape[2] // k.shape[2], q.shape[3]
    q = jnp.swapaxes((q.astype(dtype) * d**-0.5).astype(operand_dtype), 1, 2)
    k_t = jnp.transpose(jnp.repeat(k.astype(operand_dtype), groups, axis=2), (0, 2, 3, 1))
    v = jnp.swapaxes(jnp.repeat(v.astype(operand_dtype), groups, axis=2), 1, 2)
    outputs = [
        _attention_core(narrow, q[:, :, lo:hi], k_t[..., :k_hi], v[:, :, :k_hi], block_mask,
                        block_bias) for lo, hi, k_hi, block_mask, block_bias in blocks
    ]
    return jnp.swapaxes(concat(outputs, 2), 1, 2).astype(dtype)
  outputs = []
  for index, (lo, hi, k_hi, block_mask, block_bias) in enumerate(blocks):
    rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, index)
    outputs.append(
        reference_attention(q[:, lo:hi], k[:, :k_hi], v[:, :k_hi], mask=block_mask, bias=block_bias,
                            dropout_rng=rng, dropout_rate=dropout_rate, deterministic=deterministic,
                            dtype=dtype)[0])
  return concat(outputs, 1)


def _query_blocks(t, s, chunk, causal, mask, bias, segments=None):
  """(q_lo, q_hi, k_hi, mask, bias) per block of query rows; with `causal` a block sees keys
  :k_hi only and its mask adds the causal one. Mask and bias are sliced to the block;
  `segments` = (query ids [B, T], key ids [B, S]) add the block's segment mask."""
  for lo in range(0, t, chunk):
    hi = min(lo + chunk, t)
    k_hi = min(hi, s) if causal else s
    block_mask = _slice_scores_array(mask, lo, hi, k_hi)
    if segments is not None:
      block_mask = combine_masks(block_mask,
                                 make_segment_mask(segments[0][:, lo:hi], segments[1][:, :k_hi]))
    if causal:
      block_causal = (jnp.arange(k_hi)[None, :] <= jnp.arange(lo, hi)[:, None])[None, None]
      block_mask = combine_masks(block_mask, block_causal)
    yield lo, hi, k_hi, block_mask, _slice_scores_array(bias, lo, hi, k_hi)


def _fused_attention(q, k, v, mask, bias, causal, dtype, implementation):
  out = jax.nn.dot_product_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), bias=bias,
                                     mask=mask, is_causal=causal, implementation=implementation)
  if causal:
    mask = combine_masks(mask, make_causal_mask(q.shape[1], k.shape[1]))
  return zero_fully_masked_rows(out, mask)


# The fused kernels and the one platform each runs on ('auto' picks the one of its platform).
KERNEL_BACKENDS = {'cudnn': 'gpu', 'pallas': 'tpu'}

# How jax names a platform in `jax.default_backend()` where its devices may say otherwise.
_PLATFORM_ALIASES = {'cuda': 'gpu', 'rocm': 'gpu'}


def target_platform() -> str:
  """The platform the program being traced is compiled for ('cpu', 'gpu' or 'tpu').

  That of the active mesh's devices when a mesh is set (`jax.set_mesh`, as
  `parallel.sharding.use_mesh` does), else jax's default backend. The two differ when a program
  is compiled ahead of time for another target: for a TPU topology
  (`jax.experimental.topologies`) from a CPU host the mesh says 'tpu' while the host is 'cpu'.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and mesh.abstract_device is not None:
    platform = mesh.abstract_device.platform
    return _PLATFORM_ALIASES.get(platform, platform)
  return jax.default_backend()


def auto_implementation(dropout: bool = False, causal: bool = True) -> str:
  """The attention implementation 'auto' resolves to on the target platform (`target_platform`).

  CPU: 'chunked' (block-causal; XLA:CPU runs the T x T score matmuls slowly, so skipping the
  masked blocks pays). GPU: cuDNN's fused kernel (falls back to XLA's when cuDNN rejects the
  shapes/dtype, e.g. float32). TPU: the Pallas flash kernel for causal attention, 'chunked' for
  bidirectional attention. The fused kernels have no attention dropout, so with dropout on the
  chunked path is used.

  The TPU split is what XLA:TPU's compiled steps show (docs/scaling.md, "Defaults per
  platform"): causal, Pallas moves 43% fewer bytes than 'chunked' for GPT-2 small at 1,024 tokens
  and 14% fewer at 128; bidirectional, it moves 26% more for BERT-base at 128 tokens and 3% more
  at 512, and needs 0.4-1.9 GiB more memory per chip.
  """
  if dropout:
    return 'chunked'
  platform = target_platform()
  if platform == 'tpu':
    return 'pallas' if causal else 'chunked'
  return {'gpu': 'cudnn'}.get(platform, 'chunked')


def dot_product_attention(q, k, v, *, mask=None, bias=None, dropout_rng=None, dropout_rate=0.0,
                          deterministic=True, dtype=jnp.float32, implementation='auto',
                          causal=False, partition=None, query_segment_ids=None,
                          key_segment_ids=None, matmul_dtype=None):
  """Attention output [B, T, H, D], by the implementation best for the target platform.

  'reference' is the explicit formula above; 'chunked' the block-causal version of it;
  'xla'/'cudnn' call `jax.nn.dot_product_attention` (fused kernels on GPU); 'pallas' the TPU
  flash kernel. The fused ones have no attention dropout. 'auto' picks per platform
  (`auto_implementation`: the active mesh's, else the default backend's). `causal` adds the
  causal mask (query i sees keys 0..i) to `mask` and lets the implementations skip the hidden
  blocks. `partition` = (batch axes, head axes): the mesh axes the caller's sharding splits the
  batch and the heads over (None when nothing is split); 'pallas' runs per device over those
  blocks on a multi-device mesh (`pallas_attention.pallas_tpu_attention`), the others ignore it.
  `query_segment_ids` [B, T] and `key_segment_ids` [B, S] (packed rows; both or neither) hide
  every key of another example, in each implementation's cheapest form (module docstring).
  """
  if (query_segment_ids is None) != (key_segment_ids is None):
    raise ValueError('pass both query_segment_ids and key_segment_ids, or neither')
  segments = None if query_segment_ids is None else (query_segment_ids, key_segment_ids)
  dropout = not deterministic and dropout_rate > 0.0
  fallback = None
  if implementation == 'auto':
    implementation = auto_implementation(dropout, causal)
    fallback = 'xla' if implementation == 'cudnn' else 'chunked'
  if implementation == 'chunked':
    return chunked_attention(q, k, v, mask=mask, bias=bias, causal=causal, dropout_rng=dropout_rng,
                             dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype,
                             query_segment_ids=query_segment_ids, key_segment_ids=key_segment_ids,
                             matmul_dtype=matmul_dtype)
  if implementation == 'reference':
    mask = combine_masks(mask, None if segments is None else make_segment_mask(*segments))
    if causal:
      mask = combine_masks(mask, make_causal_mask(q.shape[1], k.shape[1]))
    return reference_attention(q, k, v, mask=mask, bias=bias, dropout_rng=dropout_rng,
                               dropout_rate=dropout_rate, deterministic=deterministic,
                               dtype=dtype)[0]
  if implementation in ('xla', 'cudnn', 'pallas'):
    if dropout:
      raise ValueError(f"attention implementation {implementation!r} has no attention dropout")
    try:
      if implementation == 'pallas':
        return pallas_tpu_attention(q, k, v, mask, bias, causal, dtype, partition, segments)
      # No shard_map for cuDNN: jax registers partitioning rules for its custom call
      # (`custom_partitioning` in jax/_src/cudnn/fused_attention_stablehlo.py), so XLA splits it
      # over batch and heads itself (it refuses split sequences, which our rules never split).
      # `jax.nn.dot_product_attention` has no segment ids: they go in as the boolean mask.
      fused_mask = combine_masks(mask, None if segments is None else make_segment_mask(*segments))
      return _fused_attention(q, k, v, fused_mask, bias, causal, dtype, implementation)
    except Exception:
      # Only 'auto' falls back (at trace time): cuDNN rejects e.g. float32 or some head sizes.
      # (Errors at lowering never reach here, hence the shard_map around the Pallas kernel.)
      if fallback is None:
        raise
      return dot_product_attention(q, k, v, mask=mask, bias=bias, dtype=dtype,
                                   implementation=fallback, causal=causal,
                                   query_segment_ids=query_segment_ids,
                                   key_segment_ids=key_segment_ids)
  raise ValueError(f'unknown attention implementation {implementation!r}')
