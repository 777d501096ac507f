"""Scaled dot-product attention, masks, and multi-head (grouped-query) attention with a KV cache.

Shapes: B batch, T/S query/key length, H query heads, K key/value heads (K divides H; K == H is
ordinary multi-head attention, K == 1 multi-query), D head dim. Masks are boolean, broadcastable
to [B, H, T, S], True where a query may attend to a key.
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from transformer_jax.dense import DenseGeneral
from transformer_jax.model_config import TransformerConfig
from transformer_jax.position import apply_rotary

# ---------------------------------------------------------------------------------------------
# Masks


def make_causal_mask(query_length: int, key_length: int | None = None) -> jnp.ndarray:
  """[1, 1, T, S]: query i may see keys 0..i (the future is hidden)."""
  key_length = key_length or query_length
  return (jnp.arange(key_length)[None, :] <= jnp.arange(query_length)[:, None])[None, None]


def make_padding_mask(query_valid: jnp.ndarray, key_valid: jnp.ndarray) -> jnp.ndarray:
  """[B, 1, T, S] from per-token validity [B, T] and [B, S]: pads neither see nor are seen."""
  return (query_valid[:, None, :, None] & key_valid[:, None, None, :])


def combine_masks(*masks: jnp.ndarray | None) -> jnp.ndarray | None:
  """Logical AND of the masks that are not None (None means "attend everywhere")."""
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  return functools.reduce(jnp.logical_and, masks)


# ---------------------------------------------------------------------------------------------
# Scaled dot-product attention


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


def dot_product_attention(q, k, v, *, mask=None, bias=None, dropout_rng=None, dropout_rate=0.0,
                          deterministic=True, dtype=jnp.float32, implementation='auto'):
  """Attention output [B, T, H, D], by the implementation best for the backend.

  'reference' is the explicit formula above. 'xla'/'cudnn' call `jax.nn.dot_product_attention`
  (fused kernels on GPU); they need no attention dropout. 'auto' picks per backend.
  """
  if implementation == 'auto':
    implementation = 'reference'
    if jax.default_backend() == 'gpu' and (deterministic or dropout_rate == 0.0):
      implementation = 'xla'
  if implementation == 'reference':
    return reference_attention(q, k, v, mask=mask, bias=bias, dropout_rng=dropout_rng,
                               dropout_rate=dropout_rate, deterministic=deterministic,
                               dtype=dtype)[0]
  if implementation in ('xla', 'cudnn'):
    if not deterministic and dropout_rate > 0.0:
      raise ValueError(f"attention implementation {implementation!r} has no attention dropout")
    out = jax.nn.dot_product_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype),
                                       bias=bias, mask=mask, implementation=implementation)
    if mask is not None:  # Match the reference: fully masked query rows output zero.
      any_visible = jnp.any(jnp.broadcast_to(mask, mask.shape[:3] + (mask.shape[3],)), axis=-1)
      out = out * jnp.swapaxes(any_visible, 1, 2)[..., None].astype(out.dtype)
    return out
  raise ValueError(f'unknown attention implementation {implementation!r}')


# ---------------------------------------------------------------------------------------------
# Multi-head attention


class MultiHeadAttention(nn.Module):
  """Multi-head (grouped-query) attention: self-attention when `context` is None, else cross.

  In decode mode (cfg.decode) self-attention keeps a KV cache in the 'cache' collection: each
  call writes the new tokens' keys/values at `positions` and attends over everything written
  so far. Initialise the cache by calling the model once with decode=True on a full-length
  input (that call only allocates). If the 'intermediates' collection is mutable, the attention
  weights [B, H, T, S] are sown there as 'attention_weights' (for pictures).

  Call arguments: `mask` (boolean, broadcastable to [B, H, T, S]); `bias_fn(q_positions,
  k_positions) -> [1, H, T, S]` for a relative position bias; `positions` [T] of the query
  tokens (rotary angles and cache slots; default 0..T-1).
  """
  cfg: TransformerConfig
  kernel_init: Any = nn.initializers.xavier_uniform()

  @nn.compact
  def __call__(self, x, context=None, *, mask=None, bias_fn=None, positions=None,
               deterministic: bool = True):
    cfg = self.cfg
    is_self = context is None
    context = x if is_self else context
    dense = functools.partial(DenseGeneral, use_bias=cfg.use_bias, dtype=cfg.dtype,
                              param_dtype=cfg.param_dtype, kernel_init=self.kernel_init)
    q = dense((cfg.num_heads, cfg.qkv_dim), ('embed', 'heads', 'kv'), name='query')(x)
    k = dense((cfg.kv_heads, cfg.qkv_dim), ('embed', 'kv_heads', 'kv'), name='key')(context)
    v = dense((cfg.kv_heads, cfg.qkv_dim), ('embed', 'kv_heads', 'kv'), name='value')(context)
    q = nn.with_logical_constraint(q, ('batch', 'length', 'heads', 'kv'))
    k = nn.with_logical_constraint(k, ('batch', 'length', 'kv_heads', 'kv'))
    v = nn.with_logical_constraint(v, ('batch', 'length', 'kv_heads', 'kv'))

    if positions is None:
      positions = jnp.arange(x.shape[1])
    if is_self and cfg.position == 'rotary':
      q = apply_rotary(q, positions, cfg.rotary_base)
      k = apply_rotary(k, positions, cfg.rotary_base)

    if is_self and cfg.decode:
      k, v, mask = self._update_cache(k, v, mask, positions)
    # A relative position bias (T5) is a function of query and key positions.
    bias = None
    if bias_fn is not None:
      q_positions = positions if positions.ndim == 1 else positions[0]
      bias = bias_fn(q_positions, jnp.arange(k.shape[1]))

    dropout_rng = None
    if not deterministic and cfg.attention_dropout_rate > 0.0:
      dropout_rng = self.make_rng('dropout')
    if self.is_mutable_collection('intermediates'):
      out, weights = reference_attention(
          q, k, v, mask=mask, bias=bias, dropout_rng=dropout_rng,
          dropout_rate=cfg.attention_dropout_rate, deterministic=deterministic, dtype=cfg.dtype)
      self.sow('intermediates', 'attention_weights', weights)
    else:
      out = dot_product_attention(
          q, k, v, mask=mask, bias=bias, dropout_rng=dropout_rng,
          dropout_rate=cfg.attention_dropout_rate, deterministic=deterministic, dtype=cfg.dtype,
          implementation=cfg.attention_implementation)
    out = nn.with_logical_constraint(out, ('batch', 'length', 'heads', 'kv'))
    return dense((cfg.emb_dim,), ('heads', 'kv', 'embed'), num_in_axes=2, name='out')(out)

  def _update_cache(self, k, v, mask, positions):
    """Writes this call's k/v into the cache; returns all cached k/v and a causal cache mask."""
    initialised = self.has_variable('cache', 'cached_key')
    cached_key = self.variable('cache', 'cached_key', jnp.zeros, k.shape, k.dtype)
    cached_value = self.variable('cache', 'cached_value', jnp.zeros, v.shape, v.dtype)
    if not initialised:  # The allocating call: attend as in a normal forward pass.
      return k, v, mask
    positions = positions if positions.ndim == 1 else positions[0]
    start = positions[0]
    cached_key.value = lax.dynamic_update_slice(cached_key.value, k.astype(cached_key.value.dtype),
                                                (0, start, 0, 0))
    cached_value.value = lax.dynamic_update_slice(
        cached_value.value, v.astype(cached_value.value.dtype), (0, start, 0, 0))
    cache_length = cached_key.value.shape[1]
    # Query at position p sees cached keys 0..p; slots beyond are empty (zeros), so hide them.
    cache_mask = (jnp.arange(cache_length)[None, :] <= positions[:, None])[None, None]
    return cached_key.value, cached_value.value, combine_masks(mask, cache_mask)
