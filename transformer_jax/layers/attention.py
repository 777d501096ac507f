"""Multi-head (grouped-query) attention with a KV cache, and the attention functions it uses.

Shapes: B batch, T/S query/key length, H query heads, K key/value heads (K divides H; K == H is
ordinary multi-head attention, K == 1 multi-query), D head dim. Masks are boolean, broadcastable
to [B, H, T, S], True where a query may attend to a key.

The functions live by concept in `masks.py`, `scaled_dot_product.py` and `decode_attention.py`;
they are re-exported here, so `attention.chunked_attention` etc. keep working.
"""

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from transformer_jax.layers.dense import DenseGeneral
from transformer_jax.kernels.cached_attention import decode_step_attention
from transformer_jax.kernels.masks import combine_masks, make_causal_mask, make_segment_mask
from transformer_jax.model_config import TransformerConfig
from transformer_jax.layers.position import apply_rotary
from transformer_jax.kernels.scaled_dot_product import dot_product_attention, reference_attention

# ---------------------------------------------------------------------------------------------
# Multi-head attention


def attention_partition():
  """(batch axes, head axes): the mesh axes the active logical-axis rules split attention's
  batch and heads over (those of the constraints on q, k and v in `MultiHeadAttention`), for
  `dot_product_attention`'s per-device kernels; None when the rules split neither.

  The rules are the ones `parallel.sharding.use_mesh` activates; the kernels cannot read them
  (they sit below the layers). Key/value heads must be split as the query heads are (the kernel
  repeats them per device), so rules that split them differently leave the heads whole.
  """
  batch, _, heads, _ = nn.logical_to_mesh_axes(('batch', 'length', 'heads', 'kv'))
  kv_heads = nn.logical_to_mesh_axes(('batch', 'length', 'kv_heads', 'kv'))[2]
  if heads != kv_heads:
    heads = None
  return None if batch is None and heads is None else (batch, heads)


def _scaled_init(init, factor: float):
  """`init` with its draws multiplied by `factor`."""

  def scaled(key, shape, dtype=jnp.float32):
    return init(key, shape, dtype) * jnp.asarray(factor, dtype)

  return scaled


class MultiHeadAttention(nn.Module):
  """Multi-head (grouped-query) attention: self-attention when `context` is None, else cross.

  In decode mode (cfg.decode) self-attention keeps a KV cache in the 'cache' collection: each
  call writes the new tokens' keys/values at `positions` and attends over everything written
  so far. Initialise the cache by calling the model once with decode=True on a full-length
  input (that call only allocates). If the 'intermediates' collection is mutable, the attention
  weights [B, H, T, S] are sown there as 'attention_weights' (for pictures).

  Call arguments: `mask` (boolean, broadcastable to [B, H, T, S]); `bias_fn(q_positions,
  k_positions) -> [1 or B, H, T, S]` for a relative position bias; `positions` [T] of the query
  tokens (rotary angles and cache slots; default 0..T-1), or [B, T] for packed rows, where each
  example's positions restart at 0, and when decoding, where each row is at its own point.
  `segment_ids` [B, T] (packed rows): a query sees only the keys of its own example;
  `context_segment_ids` [B, S] are the keys' ids for cross-attention (self-attention uses
  `segment_ids` for both). Not in decode mode (decoding is unpacked).

  `causal` (self-attention only): queries also never see later keys, whatever `mask` says, and
  the implementation may skip those blocks. Ignored when decoding (the cache mask does it).

  With cfg.scale_attention_scores=False (T5) the logits are q.k, not q.k / sqrt(head_dim): q is
  multiplied by sqrt(head_dim) before the attention functions, which all divide by it, so every
  implementation (and the KV-cache step and the 'intermediates' path) computes the same thing.
  The query kernel then starts head_dim**-0.5 smaller (as T5 initialises it), so a fresh model
  attends as softly as a scaled one.
  """
  cfg: TransformerConfig
  kernel_init: Any = nn.initializers.xavier_uniform()
  causal: bool = False

  @nn.compact
  def __call__(self, x, context=None, *, mask=None, bias_fn=None, positions=None, segment_ids=None,
               context_segment_ids=None, deterministic: bool = True):
    cfg = self.cfg
    is_self = context is None
    context = x if is_self else context
    if is_self:
      context_segment_ids = segment_ids
    if segment_ids is not None and cfg.decode:
      raise ValueError('segment ids (packed rows) are for training and scoring; decode mode '
                       'takes one sequence per row')
    dense = functools.partial(DenseGeneral, use_bias=cfg.use_bias, dtype=cfg.dtype,
                              matmul_dtype=cfg.matmul_dtype, param_dtype=cfg.param_dtype,
                              kernel_init=self.kernel_init, kernel_layout=cfg.kernel_layout)
    query_init = self.kernel_init
    if not cfg.scale_attention_scores:
      query_init = _scaled_init(self.kernel_init, cfg.head_dim**-0.5)
    q = dense((cfg.num_heads, cfg.head_dim), ('embed', 'heads', 'kv'), kernel_init=query_init,
              name='query')(x)
    k = dense((cfg.num_kv_heads, cfg.head_dim), ('embed', 'kv_heads', 'kv'), name='key')(context)
    v = dense((cfg.num_kv_heads, cfg.head_dim), ('embed', 'kv_heads', 'kv'), name='value')(context)
    q = nn.with_logical_constraint(q, ('batch', 'length', 'heads', 'kv'))
    k = nn.with_logical_constraint(k, ('batch', 'length', 'kv_heads', 'kv'))
    v = nn.with_logical_constraint(v, ('batch', 'length', 'kv_heads', 'kv'))

    if positions is None:
      positions = jnp.arange(x.shape[1])
    if is_self and cfg.position == 'rotary':
      q = apply_rotary(q, positions, cfg.rotary_base)
      k = apply_rotary(k, positions, cfg.rotary_base)

    if not cfg.scale_attention_scores:
      # Undoes the 1/sqrt(head_dim) every attention function applies. (Exact in floating point
      # when head_dim is a power of 4, as T5's 64.)
      q = q * math.sqrt(cfg.head_dim)

    causal = self.causal and is_self and not cfg.decode
    cache = None
    if is_self and cfg.decode:
      cache, mask = self._update_cache(k, v, mask, positions)
      if cache is not None:  # (None on the allocating call: attend over this call's k, v)
        # Back to the [B, S, K, D] the attention functions take (XLA folds the transposes into
        # the matmuls of a multi-token prefill).
        k, v = jnp.transpose(cache[0], (0, 3, 1, 2)), jnp.swapaxes(cache[1], 1, 2)
    # A relative position bias (T5) is a function of key position - query position. Packed rows
    # ([B, T] positions) keep the row's offsets: within an example they equal the example's own
    # (its positions restart at 0 but differences do not change), and across examples the
    # segment ids hide the keys anyway. So one [1, H, T, S] bias serves the whole batch.
    bias = None
    if bias_fn is not None:
      if cache is not None:  # decode: every row's own positions [B, T] over the cache's slots
        q_positions = positions
      elif segment_ids is not None:
        q_positions = jnp.arange(q.shape[1])
      else:
        q_positions = positions if positions.ndim == 1 else positions[0]
      bias = bias_fn(q_positions, jnp.arange(k.shape[1]))

    dropout_rng = None
    if not deterministic and cfg.attention_dropout_rate > 0.0:
      dropout_rng = self.make_rng('dropout')
    intermediates = self.is_mutable_collection('intermediates')
    if cache is not None and q.shape[1] == 1 and not intermediates:
      out = decode_step_attention(q, *cache, mask=mask, bias=bias, dtype=cfg.dtype)
    elif intermediates:
      if causal:
        mask = combine_masks(mask, make_causal_mask(q.shape[1], k.shape[1]))
      if segment_ids is not None:
        mask = combine_masks(mask, make_segment_mask(segment_ids, context_segment_ids))
      out, weights = reference_attention(q, k, v, mask=mask, bias=bias, dropout_rng=dropout_rng,
                                         dropout_rate=cfg.attention_dropout_rate,
                                         deterministic=deterministic, dtype=cfg.dtype)
      self.sow('intermediates', 'attention_weights', weights)
    else:
      out = dot_product_attention(q, k, v, mask=mask, bias=bias, dropout_rng=dropout_rng,
                                  dropout_rate=cfg.attention_dropout_rate,
                                  deterministic=deterministic, dtype=cfg.dtype,
                                  implementation=cfg.attention_implementation, causal=causal,
                                  partition=attention_partition(), query_segment_ids=segment_ids,
                                  key_segment_ids=context_segment_ids,
                                  matmul_dtype=cfg.matmul_dtype)
    out = nn.with_logical_constraint(out, ('batch', 'length', 'heads', 'kv'))
    return dense((cfg.emb_dim,), ('heads', 'kv', 'embed'), num_in_axes=2, name='out')(out)

  def _update_cache(self, k, v, mask, positions):
    """Writes this call's k/v into the cache; returns ((keys, values) or None, mask).

    keys are stored [B, K, D, S] and values [B, K, S, D]: the layouts `decode_step_attention`
    reads in place. Each row writes at its own slot, `positions` [B, T] (a row's slot is its
    token's position). The returned mask adds each row's causal cache mask to `mask`. The first
    (allocating) call writes nothing and returns None and `mask` unchanged.
    """
    initialised = self.has_variable('cache', 'cached_key')
    batch, length, kv_heads, head_dim = k.shape
    cached_key = self.variable('cache', 'cached_key', jnp.zeros,
                               (batch, kv_heads, head_dim, length), k.dtype)
    cached_value = self.variable('cache', 'cached_value', jnp.zeros,
                                 (batch, kv_heads, length, head_dim), v.dtype)
    if not initialised:
      return None, mask
    positions = jnp.broadcast_to(positions, (batch, length))  # [B, T]: per row (StepPositions)
    start = positions[:, 0]

    def write(cache, update, axis):  # each row's `update` at its own slot `start`

      def write_row(row, row_update, row_start):
        index = [0] * row.ndim
        index[axis - 1] = row_start
        return lax.dynamic_update_slice(row, row_update, index)

      return jax.vmap(write_row)(cache, update.astype(cache.dtype), start)

    # [B, T, K, D] -> keys [B, K, D, T] and values [B, K, T, D].
    cached_key.value = write(cached_key.value, jnp.transpose(k, (0, 2, 3, 1)), axis=3)
    cached_value.value = write(cached_value.value, jnp.swapaxes(v, 1, 2), axis=2)
    cache_length = cached_key.value.shape[3]
    # Row b's query at position p sees its cached keys 0..p; later slots are empty (zeros) or
    # hold a longer prompt's padding (`blocks.set_cache_positions`), so hide them.
    cache_mask = (jnp.arange(cache_length)[None, None, :] <= positions[:, :, None])[:, None]
    return (cached_key.value, cached_value.value), combine_masks(mask, cache_mask)
