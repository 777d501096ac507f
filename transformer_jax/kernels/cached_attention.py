"""Attention of one new query per row over a KV cache (a decoding step), as multiply-and-sum
passes that read the cache in place."""

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from transformer_jax.kernels.masks import as_4d


def _add_halves(part: Callable[[int, int], jnp.ndarray], n: int, axis: int) -> jnp.ndarray:
  """part(0, n//2) + part(n//2, 2*(n//2)), with an odd length's last entry carried along."""
  half = n // 2
  summed = part(0, half) + part(half, 2 * half)
  if n % 2:
    summed = jnp.concatenate([summed, part(n - 1, n)], axis=axis)
  return summed


def halving_sum(x: jnp.ndarray, axis: int, stop: int = 1) -> jnp.ndarray:
  """Sums `axis` down to at most `stop` entries by adding its two halves, repeatedly. Only
  slices and elementwise adds, which XLA fuses."""
  axis = axis % x.ndim
  while x.shape[axis] > stop:
    x = _add_halves(functools.partial(lax.slice_in_dim, x, axis=axis), x.shape[axis], axis)
  return x


def halving_dot(a: jnp.ndarray, b: jnp.ndarray, axis: int, stop: int = 1,
                b_new_axis: int | None = None) -> jnp.ndarray:
  """sum(a * b) over `axis`, left with at most `stop` entries there (a and b have it at the same
  length; other axes broadcast). The first halving multiplies the halves' slices, then
  `halving_sum` adds. `b_new_axis`: b lacks that axis of the result (size 1 after broadcasting)
  and gets it after slicing.

  Why not `jnp.sum(a * b, axis)`: for a reduction over a non-minor axis XLA:CPU writes the whole
  product out, then reduces it in windows of 32, so a KV cache is read about three times. Here
  XLA fuses the products into the first additions and every pass is elementwise, vectorised
  along the contiguous minor axis: the cache is read once, in place. (Reshaping a cache that
  was just updated, instead of its slices, made XLA copy it to redo the update.)
  """
  axis = axis % a.ndim
  n = a.shape[axis]
  expand = (lambda x: x) if b_new_axis is None else (lambda x: jnp.expand_dims(x, b_new_axis))
  b_axis = axis if b_new_axis is None or b_new_axis % a.ndim > axis else axis - 1
  if b.shape[b_axis] != n:
    raise ValueError(f'halving_dot: the summed axis has lengths {n} and {b.shape[b_axis]}')
  if n <= stop:
    return a * expand(b)

  def product(start, end):
    return (lax.slice_in_dim(a, start, end, axis=axis) *
            expand(lax.slice_in_dim(b, start, end, axis=b_axis)))

  return halving_sum(_add_halves(product, n, axis), axis, stop)


def decode_step_attention(q, keys, values, *, mask=None, bias=None, dtype=jnp.float32):
  """Attention of one new query per row over a KV cache (a decoding step); returns [B, 1, H, D].

  q [B, 1, H, D]; `keys` [B, K, D, S] and `values` [B, K, S, D] in the cache's own layouts.
  Equal to `reference_attention` (float32 scores and softmax, masked weights exactly zero), but
  with one query the two matmuls are matrix-vector products, bound by reading the cache, so they
  are written as multiply-and-sum over the cache's second-minor axis (`halving_dot`): XLA fuses
  each into vectorised passes over the cache in place. As dots, XLA:CPU copied (transposed)
  every layer's cache in every step, which cost more than the attention itself at long
  contexts; as `jnp.sum(a * b)` it wrote out the product first. (On CPU, jit decode loops with
  `search.decode_compiler_options()`.)
  """
  b, t, h, d = q.shape
  if t != 1:
    raise ValueError(f'decode_step_attention takes one query per row, got {t}')
  kv_heads = keys.shape[1]
  groups = h // kv_heads
  f32 = jnp.float32
  q = q.reshape(b, kv_heads, groups, d, 1).astype(f32) / jnp.sqrt(f32(d))
  scores = halving_dot(q, keys.astype(f32), axis=3, b_new_axis=2)[..., 0, :]  # [B, K, G, S]

  def grouped(x):  # [B?, H?, 1, S] (H? = 1 or H) -> broadcastable to [B, K, G, S]
    x = as_4d(x)
    if x.shape[1] == 1:
      return x.reshape(x.shape[0], 1, 1, x.shape[3])
    return x.reshape(x.shape[0], kv_heads, groups, x.shape[3])

  if bias is not None:
    scores = scores + grouped(bias).astype(f32)
  if mask is not None:
    mask = grouped(mask)
    scores = jnp.where(mask, scores, jnp.finfo(f32).min)
  weights = jax.nn.softmax(scores, axis=-1)
  if mask is not None:
    weights = jnp.where(mask, weights, 0.0)
  # Halve the S axis down to 16 rows, then a plain sum of those few.
  out = jnp.sum(halving_dot(weights[..., None], values.astype(f32), axis=3, stop=16, b_new_axis=2),
                axis=3)  # [B, K, G, D]
  return out.astype(dtype).reshape(b, 1, h, d)
