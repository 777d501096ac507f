"""Position encodings: sinusoidal, learned, rotary (RoPE) and T5 relative bias.

Attention is permutation-invariant, so order must be injected. Two families:
- absolute (sinusoidal, learned): a vector per position added to the token embedding;
- relative (rotary, T5 bias): applied inside attention, so scores depend on q_pos - k_pos.

Every function takes explicit integer `positions`, so incremental decoding (one token at
position t) uses exactly the same code as a full forward pass.
"""

import math

import flax.linen as nn
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


def relative_position_bucket(relative_position: jnp.ndarray, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> jnp.ndarray:
  """T5's bucketing of key_pos - query_pos: exact for small offsets, logarithmic beyond.

  Bidirectional attention spends half the buckets on each direction; causal attention only
  ever sees keys at or before the query, so all buckets describe the past.
  """
  bucket = jnp.zeros_like(relative_position)
  n = -relative_position
  if bidirectional:
    num_buckets //= 2
    bucket = bucket + (n < 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  # Offsets from max_exact up to max_distance share log-spaced buckets; farther ones share the last.
  log_ratio = jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact) / math.log(
      max_distance / max_exact)
  large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return bucket + jnp.where(is_small, n, large)


def relative_position_bias(table: jnp.ndarray, q_positions: jnp.ndarray, k_positions: jnp.ndarray,
                           *, bidirectional: bool, max_distance: int,
                           dtype=jnp.float32) -> jnp.ndarray:
  """table [buckets, H], q_positions [Tq], k_positions [Tk] -> bias [1, H, Tq, Tk]."""
  relative = k_positions[None, :] - q_positions[:, None]
  buckets = relative_position_bucket(relative, bidirectional, table.shape[0], max_distance)
  bias = jnp.take(table, buckets, axis=0)  # [Tq, Tk, H]
  return jnp.transpose(bias, (2, 0, 1))[None].astype(dtype)


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
    """q_positions [Tq], k_positions [Tk] -> bias [1, H, Tq, Tk]."""
    return relative_position_bias(self.table, q_positions, k_positions,
                                  bidirectional=self.bidirectional, max_distance=self.max_distance,
                                  dtype=self.dtype)
