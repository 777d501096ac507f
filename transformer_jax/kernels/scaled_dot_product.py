"""Scaled dot-product attention: the reference formula, the block-causal `chunked` version with a
written-out gradient (CPU), the fused kernels (cuDNN, Pallas) and the per-backend choice.

Shapes: B batch, T/S query/key length, H query heads, K key/value heads (K divides H), D head
dim; q [B, T, H, D], k and v [B, S, K, D]. Masks as in `masks.py`.
"""

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.kernels.masks import as_4d, combine_masks, make_causal_mask


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


def _softmax_weights(q, k_t, mask, bias):
  """Masked softmax(q k^T + bias) in float32, [B, H, T, S], from head-major q [B, H, T, D] (scaled)
  and k^T [B, H, D, S]; masked weights exactly zero, as `reference_attention`."""
  scores = jnp.einsum('bhtd,bhds->bhts', q, k_t, preferred_element_type=jnp.float32)
  if bias is not None:
    scores = scores + bias.astype(jnp.float32)
  if mask is not None:
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  exp = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
  weights = exp * (1.0 / jnp.sum(exp, axis=-1, keepdims=True))
  return weights if mask is None else jnp.where(mask, weights, 0.0)


@jax.custom_vjp
def _attention_core(q, k_t, v, mask, bias):
  """softmax(q k^T + bias, masked) v for head-major q [B, H, T, D] (scaled), k^T [B, H, D, S] and
  v [B, H, S, D]; output [B, H, T, D]. The numbers of `reference_attention`, with the gradient
  written out (`_attention_core_bwd`)."""
  return _attention_core_fwd(q, k_t, v, mask, bias)[0]


def _attention_core_fwd(q, k_t, v, mask, bias):
  weights = _softmax_weights(q, k_t, mask, bias)
  out = jnp.einsum('bhts,bhsd->bhtd', weights.astype(v.dtype), v,
                   preferred_element_type=jnp.float32).astype(v.dtype)
  return out, (q, k_t, v, mask, bias, weights, out)


def _attention_core_bwd(residuals, d_out):
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
  d_weights = jnp.einsum('bhtd,bhds->bhts', d_out, swap(v), preferred_element_type=f32)
  row_dot = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1, keepdims=True)
  d_scores = weights * (d_weights - row_dot)  # zero where masked, as the weights are
  d_q = jnp.einsum('bhts,bhsd->bhtd', d_scores.astype(q.dtype), swap(k_t),
                   preferred_element_type=f32)
  d_k_t = jnp.einsum('bhdt,bhts->bhds', swap(q), d_scores.astype(q.dtype),
                     preferred_element_type=f32)
  d_v = swap(
      jnp.einsum('bhdt,bhts->bhds', swap(d_out), weights.astype(d_out.dtype),
                 preferred_element_type=f32))
  d_mask = None if mask is None else np.zeros(mask.shape, jax.dtypes.float0)
  d_bias = None
  if bias is not None:  # summed over the axes the bias broadcasts along
    axes = tuple(i for i in range(4) if bias.shape[i] == 1 and d_scores.shape[i] != 1)
    d_bias = jnp.sum(d_scores, axis=axes, keepdims=True).astype(bias.dtype)
  return (d_q.astype(q.dtype), d_k_t.astype(k_t.dtype), d_v.astype(v.dtype), d_mask, d_bias)


_attention_core.defvjp(_attention_core_fwd, _attention_core_bwd)


def chunked_attention(q, k, v, *, mask=None, bias=None, causal=False, chunk_size=None,
                      dropout_rng=None, dropout_rate=0.0, deterministic=True, dtype=jnp.float32):
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
  are repeated for the core (autodiff sums their gradients back).
  """
  t, s = q.shape[1], k.shape[1]
  blocks = list(
      _query_blocks(t, s, chunk_size or default_chunk_size(t, s, causal), causal, as_4d(mask),
                    as_4d(bias)))
  concat = lambda outputs, axis: (outputs[0]
                                  if len(outputs) == 1 else jnp.concatenate(outputs, axis=axis))
  if deterministic or dropout_rate == 0.0:
    # Head-major once per call ([B, H, T, D]; keys as k^T), so no block transposes its operands.
    groups, d = q.shape[2] // k.shape[2], q.shape[3]
    q = jnp.swapaxes(q.astype(dtype) * d**-0.5, 1, 2)
    k_t = jnp.transpose(jnp.repeat(k.astype(dtype), groups, axis=2), (0, 2, 3, 1))
    v = jnp.swapaxes(jnp.repeat(v.astype(dtype), groups, axis=2), 1, 2)
    outputs = [
        _attention_core(q[:, :, lo:hi], k_t[..., :k_hi], v[:, :, :k_hi], block_mask, block_bias)
        for lo, hi, k_hi, block_mask, block_bias in blocks
    ]
    return jnp.swapaxes(concat(outputs, 2), 1, 2)
  outputs = []
  for index, (lo, hi, k_hi, block_mask, block_bias) in enumerate(blocks):
    rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, index)
    outputs.append(
        reference_attention(q[:, lo:hi], k[:, :k_hi], v[:, :k_hi], mask=block_mask, bias=block_bias,
                            dropout_rng=rng, dropout_rate=dropout_rate, deterministic=deterministic,
                            dtype=dtype)[0])
  return concat(outputs, 1)


def _query_blocks(t, s, chunk, causal, mask, bias):
  """(q_lo, q_hi, k_hi, mask, bias) per block of query rows; with `causal` a block sees keys
  :k_hi only and its mask adds the causal one. Mask and bias are sliced to the block."""
  for lo in range(0, t, chunk):
    hi = min(lo + chunk, t)
    k_hi = min(hi, s) if causal else s
    block_mask = _slice_scores_array(mask, lo, hi, k_hi)
    if causal:
      block_causal = (jnp.arange(k_hi)[None, :] <= jnp.arange(lo, hi)[:, None])[None, None]
      block_mask = combine_masks(block_mask, block_causal)
    yield lo, hi, k_hi, block_mask, _slice_scores_array(bias, lo, hi, k_hi)


def _zero_fully_masked_rows(out, mask):
  """Fused kernels average over a fully masked row; the reference outputs zero there."""
  if mask is None:
    return out
  mask = as_4d(mask)
  any_visible = jnp.any(mask, axis=-1)  # [B or 1, H or 1, T or 1]
  return out * jnp.swapaxes(any_visible, 1, 2)[..., None].astype(out.dtype)


def _fused_attention(q, k, v, mask, bias, causal, dtype, implementation):
  out = jax.nn.dot_product_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), bias=bias,
                                     mask=mask, is_causal=causal, implementation=implementation)
  if causal:
    mask = combine_masks(mask, make_causal_mask(q.shape[1], k.shape[1]))
  return _zero_fully_masked_rows(out, mask)


_PALLAS_TILE = 128  # the Pallas kernel's default tile along both sequences (and its lane width)


def _pallas_bias_and_key_segments(mask, bias, shape, t_pad, s_pad):
  """What the Pallas kernel takes for `mask` and `bias` at its tile-padded lengths: an additive
  bias [B, H, T', S'] (or None) and key segment ids [B, S'] (1 = a key to attend to, or None).

  Key padding (a mask [B or 1, 1, 1, S], as BERT and cross-attention pass) and the keys added
  to fill the last tile become segment ids, checked inside the kernel: nothing [T, S]-sized is
  built for them. Any other mask is folded into the bias (correct, but it materialises
  [B, H, T, S]).
  """
  b, h, t, s = shape
  key_valid = None  # [B, S]: the mask, when it only hides keys
  if mask is not None and mask.shape[1:3] == (1, 1):
    key_valid, mask = jnp.broadcast_to(mask[:, 0, 0, :], (b, s)), None
  ab = None
  if bias is not None or mask is not None:
    ab = jnp.zeros(shape, jnp.float32)
    if bias is not None:
      ab = ab + bias.astype(jnp.float32)
    if mask is not None:
      ab = jnp.where(mask, ab, -0.7 * float(jnp.finfo(jnp.float32).max))
    ab = jnp.pad(ab, ((0, 0), (0, 0), (0, t_pad), (0, s_pad)))
  key_segments = None
  if key_valid is not None or s_pad:
    key_valid = jnp.ones((b, s), jnp.bool_) if key_valid is None else key_valid
    key_segments = jnp.pad(key_valid.astype(jnp.int32), ((0, 0), (0, s_pad)))
  return ab, key_segments


def _pallas_tpu_attention(q, k, v, mask, bias, causal, dtype):
  """TPU: the Pallas flash-attention kernel.

  The kernel tiles both sequences by 128, so other lengths are padded up to a multiple (the
  padded keys hidden by segment ids, the padded query rows dropped); masks and bias as
  `_pallas_bias_and_key_segments` says; causality stays inside the kernel. The kernel scales
  the scores after adding its bias, so q is scaled here instead.
  """
  # Imported here: the module needs a TPU-enabled jaxlib and is never used elsewhere.
  from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash
  b, t, h, d = q.shape
  s = k.shape[1]
  groups = h // k.shape[2]
  if groups > 1:  # the kernel wants as many key/value heads as query heads
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  mask = as_4d(mask)
  t_pad, s_pad = -t % _PALLAS_TILE, -s % _PALLAS_TILE
  ab, key_segments = _pallas_bias_and_key_segments(mask, bias, (b, h, t, s), t_pad, s_pad)
  segment_ids = None if key_segments is None else pallas_flash.SegmentIds(
      q=jnp.ones((b, t + t_pad), jnp.int32), kv=key_segments)
  to_bhtd = lambda x, pad: jnp.swapaxes(
      jnp.pad(x.astype(dtype), ((0, 0), (0, pad), (0, 0), (0, 0))), 1, 2)
  out = pallas_flash.flash_attention(to_bhtd(q * d**-0.5, t_pad), to_bhtd(k, s_pad),
                                     to_bhtd(v, s_pad), ab=ab, segment_ids=segment_ids,
                                     causal=causal)
  out = jnp.swapaxes(out, 1, 2)[:, :t]
  if causal:
    mask = combine_masks(mask, make_causal_mask(t, s))
  return _zero_fully_masked_rows(out, mask)


# The fused kernels and the one backend each runs on ('auto' picks the one of its backend).
KERNEL_BACKENDS = {'cudnn': 'gpu', 'pallas': 'tpu'}


def auto_implementation(dropout: bool = False) -> str:
  """The attention implementation 'auto' resolves to on the current backend.

  CPU: 'chunked' (block-causal; XLA:CPU runs the T x T score matmuls slowly, so skipping the
  masked blocks pays). GPU: cuDNN's fused kernel (falls back to XLA's when cuDNN rejects the
  shapes/dtype, e.g. float32). TPU: the Pallas flash kernel. The fused kernels have no attention
  dropout, so with dropout on the chunked path is used.
  """
  kernels = {backend: kernel for kernel, backend in KERNEL_BACKENDS.items()}
  return 'chunked' if dropout else kernels.get(jax.default_backend(), 'chunked')


def dot_product_attention(q, k, v, *, mask=None, bias=None, dropout_rng=None, dropout_rate=0.0,
                          deterministic=True, dtype=jnp.float32, implementation='auto',
                          causal=False):
  """Attention output [B, T, H, D], by the implementation best for the backend.

  'reference' is the explicit formula above; 'chunked' the block-causal version of it;
  'xla'/'cudnn' call `jax.nn.dot_product_attention` (fused kernels on GPU); 'pallas' the TPU
  flash kernel. The fused ones have no attention dropout. 'auto' picks per backend
  (`auto_implementation`). `causal` adds the causal mask (query i sees keys 0..i) to `mask` and
  lets the implementations skip the hidden blocks.
  """
  dropout = not deterministic and dropout_rate > 0.0
  fallback = None
  if implementation == 'auto':
    implementation = auto_implementation(dropout)
    fallback = 'xla' if implementation == 'cudnn' else 'chunked'
  if implementation == 'chunked':
    return chunked_attention(q, k, v, mask=mask, bias=bias, causal=causal, dropout_rng=dropout_rng,
                             dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype)
  if implementation == 'reference':
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
        return _pallas_tpu_attention(q, k, v, mask, bias, causal, dtype)
      return _fused_attention(q, k, v, mask, bias, causal, dtype, implementation)
    except Exception:
      # Only 'auto' falls back (at trace time): cuDNN rejects e.g. float32 or some head sizes.
      if fallback is None:
        raise
      return dot_product_attention(q, k, v, mask=mask, bias=bias, dtype=dtype,
                                   implementation=fallback, causal=causal)
  raise ValueError(f'unknown attention implementation {implementation!r}')
