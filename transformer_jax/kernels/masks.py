"""Attention masks: boolean, broadcastable to [B, H, T, S], True where a query may attend to
a key."""

import functools

import jax.numpy as jnp


def make_causal_mask(query_length: int, key_length: int | None = None) -> jnp.ndarray:
  """[1, 1, T, S]: query i may see keys 0..i (the future is hidden)."""
  key_length = key_length or query_length
  return (jnp.arange(key_length)[None, :] <= jnp.arange(query_length)[:, None])[None, None]


def make_padding_mask(query_valid: jnp.ndarray, key_valid: jnp.ndarray) -> jnp.ndarray:
  """[B, 1, T, S] from per-token validity [B, T] and [B, S]: pads neither see nor are seen."""
  return (query_valid[:, None, :, None] & key_valid[:, None, None, :])


def make_segment_mask(query_segment_ids: jnp.ndarray | None,
                      key_segment_ids: jnp.ndarray | None) -> jnp.ndarray | None:
  """[B, 1, T, S] from the segment ids of packed rows ([B, T] and [B, S]; None = unpacked):
  a query sees only the keys of its own example (equal ids). Padding (id 0) sees only padding,
  so no row is fully masked; real tokens never see it."""
  if query_segment_ids is None:
    return None
  return query_segment_ids[:, None, :, None] == key_segment_ids[:, None, None, :]


def combine_masks(*masks: jnp.ndarray | None) -> jnp.ndarray | None:
  """Logical AND of the masks that are not None (None means "attend everywhere")."""
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  return functools.reduce(jnp.logical_and, masks)


def as_4d(x):
  """A mask/bias broadcastable to [B, H, T, S], with its missing leading axes made explicit."""
  return None if x is None else x.reshape((1,) * (4 - x.ndim) + x.shape)


def zero_fully_masked_rows(out, mask):
  """Fused kernels average over a fully masked row; the reference outputs zero there."""
  if mask is None:
    return out
  mask = as_4d(mask)
  any_visible = jnp.any(mask, axis=-1)  # [B or 1, H or 1, T or 1]
  return out * jnp.swapaxes(any_visible, 1, 2)[..., None].astype(out.dtype)
