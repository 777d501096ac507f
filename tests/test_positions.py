"""Tests for transformer_jax.layers.position: sinusoidal, learned, rotary and T5 relative
positions."""

import math

import flax.linen as nn
from flax.linen import meta
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.layers import position


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
  """Comparisons here are at ~1e-5; GPUs would otherwise multiply float32 in TF32."""
  with jax.default_matmul_precision('highest'):
    yield


# ---------------------------------------------------------------------------------------------
# Sinusoidal


def test_sinusoidal_table_shape_dtype_and_range():
  table = position.sinusoidal_table(50, 16)
  assert table.shape == (50, 16)
  assert table.dtype == np.float32
  assert np.all(np.abs(table) <= 1.0)


@pytest.mark.parametrize('pos, i', [(0, 0), (1, 0), (3, 1), (7, 7), (49, 3)])
def test_sinusoidal_table_matches_formula_at_hand_checked_entries(pos, i):
  """PE[pos, 2i] = sin(pos / 10000^(2i/d)) and PE[pos, 2i+1] = cos(pos / 10000^(2i/d))."""
  d = 16
  table = position.sinusoidal_table(50, d)
  angle = pos / 10000**(2 * i / d)
  assert table[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-6)
  assert table[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-6)


def test_sinusoidal_table_first_rows_by_hand():
  table = position.sinusoidal_table(4, 4)
  # Position 0: sin 0 = 0, cos 0 = 1 in every pair.
  np.testing.assert_allclose(table[0], [0.0, 1.0, 0.0, 1.0], atol=1e-7)
  # d = 4: frequencies 1 and 10000^(-1/2) = 0.01.
  np.testing.assert_allclose(
      table[2], [math.sin(2), math.cos(2), math.sin(0.02),
                 math.cos(0.02)], atol=1e-6)


def test_sinusoidal_table_matches_formula_everywhere():
  length, d = 20, 10
  table = position.sinusoidal_table(length, d)
  for pos in range(length):
    for i in range(d // 2):
      angle = pos / 10000**(2 * i / d)
      assert abs(table[pos, 2 * i] - math.sin(angle)) < 1e-6
      assert abs(table[pos, 2 * i + 1] - math.cos(angle)) < 1e-6


def test_sinusoidal_embedding_adds_the_table_row_of_each_position():
  x = jax.random.normal(jax.random.key(0), (2, 5, 8))
  positions = jnp.array([0, 3, 1, 9, 4])
  module = position.AbsolutePositionEmbedding('sinusoidal', max_len=10)
  variables = module.init(jax.random.key(1), x, positions)
  assert 'params' not in variables  # Nothing to learn.
  out = module.apply(variables, x, positions)
  table = position.sinusoidal_table(10, 8)
  np.testing.assert_allclose(out, np.asarray(x) + table[np.asarray(positions)][None], atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Learned


def test_learned_position_embedding_param_and_lookup():
  x = jax.random.normal(jax.random.key(0), (2, 4, 8))
  module = position.AbsolutePositionEmbedding('learned', max_len=12)
  positions = jnp.array([[0, 1, 2, 3], [5, 6, 7, 11]])  # Per-row positions [B, T].
  variables = module.init(jax.random.key(1), x, positions)
  spec = nn.get_partition_spec(variables)['params']['embedding']
  assert tuple(spec) == ('position', 'embed')
  table = np.asarray(meta.unbox(variables['params'])['embedding'])
  assert table.shape == (12, 8)
  out = module.apply(variables, x, positions)
  np.testing.assert_allclose(out, np.asarray(x) + table[np.asarray(positions)], atol=1e-6)


def test_unknown_absolute_position_kind_is_rejected():
  module = position.AbsolutePositionEmbedding('bogus', max_len=4)
  with pytest.raises(ValueError, match='bogus'):
    module.init(jax.random.key(0), jnp.zeros((1, 2, 4)), jnp.arange(2))


# ---------------------------------------------------------------------------------------------
# Rotary

# Compiled once per input shape; the tests share shapes to keep compiles few.
rotary = jax.jit(position.apply_rotary)
X = jax.random.normal(jax.random.key(0), (2, 5, 3, 8))  # [B, T, H, Dh]


def test_rotary_preserves_norms():
  rotated = rotary(X, jnp.arange(5) * 5)
  assert rotated.shape == X.shape and rotated.dtype == X.dtype
  np.testing.assert_allclose(jnp.linalg.norm(rotated, axis=-1), jnp.linalg.norm(X, axis=-1),
                             rtol=1e-5)
  assert np.max(np.abs(rotated - X)) > 1e-2  # It does rotate.


def test_rotary_position_zero_is_identity():
  np.testing.assert_array_equal(rotary(X, jnp.zeros(5, jnp.int32)), X)


def test_rotary_rotates_half_pairs_by_hand():
  """Dh = 4: pairs (x0, x2) at frequency 1 and (x1, x3) at frequency base^(-1/2) = 0.01."""
  a, b, c, d = 0.3, -1.2, 0.7, 2.0
  p = 3
  x = jnp.array([a, b, c, d]).reshape(1, 1, 1, 4)
  out = np.asarray(rotary(x, jnp.array([p]))).reshape(4)
  f = 0.01 * p
  expected = [
      a * math.cos(p) - c * math.sin(p), b * math.cos(f) - d * math.sin(f),
      c * math.cos(p) + a * math.sin(p), d * math.cos(f) + b * math.sin(f)
  ]
  np.testing.assert_allclose(out, expected, atol=1e-6)


def test_rotary_dot_products_depend_only_on_the_offset():
  q, k = X[0, 0, 0], X[0, 0, 1]

  def scores(positions):
    """scores[i, j] = <rot(q, positions[i]), rot(k, positions[j])>."""
    rq = rotary(jnp.broadcast_to(q, X.shape), positions)[0, :, 0]
    rk = rotary(jnp.broadcast_to(k, X.shape), positions)[0, :, 0]
    return np.asarray(rq @ rk.T, np.float64)

  positions = jnp.array([0, 2, 5, 9, 40])
  base = scores(positions)
  # Shifting every position by the same constant changes no score.
  for shift in (1, 31, 200):
    np.testing.assert_allclose(scores(positions + shift), base, atol=1e-4)
  # Every (i, i) pair has offset 0, wherever it sits.
  np.testing.assert_allclose(np.diag(base), base[0, 0], atol=1e-4)
  # Different offsets give different scores.
  assert abs(base[2, 1] - base[1, 2]) > 1e-3  # offsets +3 and -3
  assert abs(base[2, 1] - base[2, 0]) > 1e-3  # offsets 3 and 5


def test_rotary_per_row_positions_match_shared_positions():
  shared = rotary(X, jnp.arange(5))
  per_row = rotary(X, jnp.stack([jnp.arange(5), jnp.arange(5) + 4]))
  np.testing.assert_allclose(per_row[0], shared[0], atol=1e-6)
  np.testing.assert_allclose(per_row[1], rotary(X, jnp.arange(5) + 4)[1], atol=1e-6)


def test_rotary_keeps_bfloat16_dtype():
  out = rotary(X.astype(jnp.bfloat16), jnp.arange(5))
  assert out.dtype == jnp.bfloat16
  expected = rotary(X.astype(jnp.bfloat16).astype(jnp.float32), jnp.arange(5))
  np.testing.assert_allclose(out.astype(jnp.float32), expected, atol=3e-2)


# ---------------------------------------------------------------------------------------------
# T5 relative position buckets. relative = key_pos - query_pos; n = query_pos - key_pos.


def buckets(relative, bidirectional, num_buckets=32, max_distance=128):
  return np.asarray(
      position.relative_position_bucket(jnp.asarray(relative, jnp.int32), bidirectional,
                                        num_buckets, max_distance))


def test_bidirectional_buckets_by_hand():
  """32 buckets, max_distance 128: 16 per direction, 8 exact, then 8 log-spaced up to 128.

  Keys before the query (relative < 0) use buckets 0..15, keys after it 16..31. For n >= 8 the
  bucket is 8 + floor(log(n / 8) / log(128 / 8) * 8), capped at 15.
  """
  relative = [0, -1, -7, -8, -12, -16, -20, -64, -100, -128, -1000, 1, 7, 8, 16, 128]
  expected = [
      0,
      1,
      7,
      8,  # log(1) = 0
      9,  # log(1.5)/log(16) * 8 = 1.17
      10,  # log(2)/log(16) * 8 = 2
      10,  # log(2.5)/log(16) * 8 = 2.64
      14,  # log(8)/log(16) * 8 = 6
      15,  # log(12.5)/log(16) * 8 = 7.29
      15,  # 8 + 8 = 16, capped at 15
      15,
      16 + 1,
      16 + 7,
      16 + 8,
      16 + 10,
      16 + 15
  ]
  np.testing.assert_array_equal(buckets(relative, True), expected)


def test_causal_buckets_by_hand():
  """Causal: all 32 buckets describe the past (16 exact, 16 log-spaced); the future is 0."""
  relative = [0, -1, -15, -16, -32, -100, -128, -500, 1, 5, 100]
  expected = [
      0,
      1,
      15,
      16,  # log(1) = 0
      21,  # log(2)/log(8) * 16 = 5.33
      30,  # log(6.25)/log(8) * 16 = 14.1
      31,  # 16 + 16 = 32, capped at 31
      31,
      0,
      0,
      0
  ]
  np.testing.assert_array_equal(buckets(relative, False), expected)


def test_small_offsets_get_distinct_buckets_and_sign_matters_when_bidirectional():
  offsets = np.arange(-7, 8)
  result = buckets(offsets, True)
  assert len(set(result.tolist())) == len(offsets)
  for n in range(1, 8):
    assert buckets([-n], True)[0] != buckets([n], True)[0]
  causal = buckets(np.arange(-15, 1), False)
  assert len(set(causal.tolist())) == 16


@pytest.mark.parametrize('bidirectional', [True, False])
@pytest.mark.parametrize('num_buckets, max_distance', [(32, 128), (8, 16), (16, 64)])
def test_buckets_lie_in_range_and_are_monotonic_in_distance(bidirectional, num_buckets,
                                                            max_distance):
  relative = np.arange(-400, 401)
  result = buckets(relative, bidirectional, num_buckets, max_distance)
  assert result.min() >= 0 and result.max() < num_buckets
  past = result[relative <= 0][::-1]  # n = 0, 1, 2, ...
  assert np.all(np.diff(past) >= 0)
  assert past[-1] == (num_buckets // 2 if bidirectional else num_buckets) - 1
  if bidirectional:
    future = result[relative > 0]
    assert np.all(future >= num_buckets // 2) and np.all(np.diff(future) >= 0)


def test_relative_position_bias_looks_up_buckets_per_head():
  module = position.RelativePositionBias(num_heads=3, num_buckets=8, max_distance=16,
                                         bidirectional=True)
  q_positions, k_positions = jnp.arange(4), jnp.arange(6)
  variables = module.init(jax.random.key(0), q_positions, k_positions)
  spec = nn.get_partition_spec(variables)['params']['rel_embedding']
  assert tuple(spec) == ('relpos_buckets', 'heads')
  table = np.asarray(meta.unbox(variables['params'])['rel_embedding'])
  assert table.shape == (8, 3)
  bias = np.asarray(module.apply(variables, q_positions, k_positions))
  assert bias.shape == (1, 3, 4, 6)
  for i in range(4):
    for j in range(6):
      bucket = buckets([j - i], True, 8, 16)[0]
      np.testing.assert_allclose(bias[0, :, i, j], table[bucket])
  # Only the offset matters: the bias is constant along diagonals.
  np.testing.assert_allclose(bias[0, :, 1:, 1:], bias[0, :, :-1, :-1])
