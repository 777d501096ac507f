"""Position encodings: sinusoidal, learned, rotary (RoPE) and T5 relative bias.

Attention is permutation-invariant, so order must be injected. Two families:
- absolute (sinusoidal, learned): a vector per position added to the token embedding;
- relative (rotary, T5 bias): applied inside attention, so scores depend on q_pos - k_pos.

Every function takes explicit integer `positions`, so incremental decoding (one token at
position t) uses exactly the same code as a full forward pass.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def sinusoidal_table(length: int, dim: int, base: float = 10000.0) -> np.ndarray:
  """PE[pos, 2i] = sin(pos / base^(2i/dim)), PE[pos, 2i+1] = cos(...) (Vaswani et al. 2017).

  Each pair of dimensions is a clock at its own frequency, from one cycle per 2*pi positions
  to one per 2*pi*base; PE[pos + k] is a fixed rotation of PE[pos], which makes relative
  offsets easy for attention to read.
  """
  positions = np.arange(length, dtype=np.float64)[:, None]
  frequencies = np.exp(-math.log(base) * np.arange(0, dim, 2, dtype=np.float64) / dim)
  angles = positions * frequencies[None, :]
  table = np.zeros((length, dim), dtype=np.float32)
  table[:, 0::2] = np.sin(angles)
  table[:, 1::2] = np.cos(angles[:, :dim // 2])
  return table


class AbsolutePositionEmbedding(nn.Module):
  """Adds a sinusoidal (fixed) or learned (trained) vector per position to x [B, T, D]."""
  kind: str  # 'sinusoidal' or 'learned'
  max_len: int
  dtype: object = jnp.float32
  param_dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
    dim = x.shape[-1]
    if self.kind == 'sinusoidal':
      table = jnp.asarray(sinusoidal_table(self.max_len, dim))
    elif self.kind == 'learned':
      table = self.param(
          'embedding',
          nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02), ('position', 'embed')),
          (self.max_len, dim), self.param_dtype)
    else:
      raise ValueError(f'unknown absolute position kind {self.kind!r}')
    # positions: [T] (shared by the batch) or [B, T].
    pe = jnp.take(table, positions, axis=0).astype(self.dtype)
    if pe.ndim == 2:
      pe = pe[None]
    return x + pe


def packed_positions(segment_ids: jnp.ndarray) -> jnp.ndarray:
  """Positions [B, T] that restart at 0 with every example of packed rows (`segment_ids`
  [B, T], a new example wherever the id changes; 0 on padding). Data pipelines give them with
  the batch (`data/packing.py`); this derives them when only the ids are at hand."""
  index = jnp.arange(segment_ids.shape[1])
  starts = jnp.concatenate(
      [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
  return jnp.where(segment_ids > 0, index - first, 0).astype(jnp.int32)


def apply_rotary(x: jnp.ndarray, positions: jnp.ndarray, base: float = 10000.0) -> jnp.ndarray:
  """Rotary position embedding (Su et al. 2021) of x [B, T, H, Dh] at `positions` [T] or [B, T].

  Dimension i of the first half and i of the second half form a 2-D vector rotated by angle
  pos * base^(-2i/Dh) (the "rotate half" layout of GPT-NeoX/LLaMA). A dot product of a rotated
  query and key then depends only on their distance.
  """
  half = x.shape[-1] // 2
  inv_freq = base**(-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [T, half] or [B, T, half]
  if angles.ndim == 2:
    angles = angles[None]
  sin = jnp.sin(angles)[:, :, None, :]
  cos = jnp.cos(angles)[:, :, None, :]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)


@functools.lru_cache(maxsize=None)
def _distance_buckets(num_buckets: int, max_distance: int) -> np.ndarray:
  """Bucket of each distance n = 0..max(max_distance, num_buckets // 2), for one direction's
  `num_buckets`; farther distances share the last entry's bucket.

  A host-side table, computed as T5's reference code (Hugging Face's `_relative_position_bucket`,
  Mesh TensorFlow's) computes it in float32: max_exact + trunc(log(n / max_exact) /
  log(max_distance / max_exact) * (num_buckets - max_exact)). Computed by XLA the same formula
  came out one bucket lower at some exact boundaries (e.g. 128 buckets, max_distance 100,
  n = 80: 31.999998 instead of 32), because XLA turns the division by a constant into a
  multiplication by its rounded reciprocal. Here every division is IEEE, and the log is
  correctly rounded (float64, then float32): that matched Hugging Face's buckets for offsets
  -3000..3000 in all 44,846 valid combinations of 2-129 buckets, max_distance 2-199, 500 or
  1000, and either direction (the formula computed by XLA differed in 4 of the 708 of them
  whose sizes are multiples of 8).
  """
  max_exact = num_buckets // 2
  n = np.arange(max(max_distance, max_exact) + 1)
  ratio = np.log((np.maximum(n, 1).astype(np.float32) / np.float32(max_exact)).astype(np.float64))
  ratio = ratio.astype(np.float32) / np.float32(math.log(max_distance / max_exact))
  large = max_exact + (ratio * np.float32(num_buckets - max_exact)).astype(np.int32)
  return np.where(n < max_exact, n, np.minimum(large, num_buckets - 1)).astype(np.int32)


def relative_position_bucket(relative_position: jnp.ndarray, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> jnp.ndarray:
  """T5's bucketing of key_pos - query_pos: exact for small offsets, logarithmic beyond.

  Bidirectional attention spends half the buckets on each direction (keys after the query in
  the upper half); causal attention only ever sees keys at or before the query, so all buckets
  describe the past. Equal to Hugging Face's T5 bucketing for every offset
  (`_distance_buckets`).
  """
  bucket = jnp.zeros_like(relative_position)
  n = -relative_position
  if bidirectional:
    num_buckets //= 2
    bucket = bucket + (n < 0).astype(relative_position.dtype) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  # Offsets from max_exact up to max_distance share log-spaced buckets; farther ones share the last.
  table = _distance_buckets(num_buckets, max_distance)
  n = jnp.minimum(n, len(table) - 1)
  return bucket + jnp.asarray(table)[n].astype(relative_position.dtype)


def relative_position_bias(table: jnp.ndarray, q_positions: jnp.ndarray, k_positions: jnp.ndarray,
                           *, bidirectional: bool, max_distance: int,
                           dtype=jnp.float32) -> jnp.ndarray:
  """table [buckets, H], q_positions [Tq] (or [B, Tq]: each row's own, as when decoding rows
  at different points), k_positions [Tk] -> bias [1 (or B), H, Tq, Tk]."""
  q_positions = q_positions if q_positions.ndim == 2 else q_positions[None]
  relative = k_positions[None, None, :] - q_positions[:, :, None]
  buckets = relative_position_bucket(relative, bidirectional, table.shape[0], max_distance)
  bias = jnp.take(table, buckets, axis=0)  # [1 or B, Tq, Tk, H]
  return jnp.transpose(bias, (0, 3, 1, 2)).astype(dtype)


class RelativePositionBias(nn.Module):
  """A learned scalar per (bucket of q_pos - k_pos, head), added to the attention logits.

  `table` [buckets, H] is public so that lifted transforms (nn.scan, nn.remat), which take
  arrays rather than modules, can be handed the table and apply `relative_position_bias`.
  """
  num_heads: int
  num_buckets: int = 32
  max_distance: int = 128
  bidirectional: bool = True
  dtype: object = jnp.float32
  param_dtype: object = jnp.float32

  def setup(self):
    self.table = self.param(
        'rel_embedding',
        nn.with_logical_partitioning(nn.initializers.normal(stddev=0.1),
                                     ('relpos_buckets', 'heads')),
        (self.num_buckets, self.num_heads), self.param_dtype)

  def __call__(self, q_positions: jnp.ndarray, k_positions: jnp.ndarray) -> jnp.ndarray:
    """q_positions [Tq] or [B, Tq], k_positions [Tk] -> bias [1 or B, H, Tq, Tk]."""
    return relative_position_bias(self.table, q_positions, k_positions,
                                  bidirectional=self.bidirectional, max_distance=self.max_distance,
                                  dtype=self.dtype)
