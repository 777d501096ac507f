"""Tests for transformer_jax.layers.attention and the kernels under it: the formula, masks,
grouped-query heads and the KV cache.

The reference for every numerical check is `numpy_attention`, softmax(q k^T / sqrt(D) + bias) v
written out in float64 numpy, with masked keys removed before the softmax and fully masked
query rows defined to output zero (as the library documents).
"""

import flax.linen as nn
from flax.linen import meta
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import kernels
from transformer_jax.layers.attention import MultiHeadAttention
from transformer_jax.model_config import TransformerConfig


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
  """Comparisons here are at ~1e-5; GPUs would otherwise multiply float32 in TF32."""
  with jax.default_matmul_precision('highest'):
    yield


B, T, S, H, D = 2, 5, 6, 4, 8
EMB = 16

CFG = TransformerConfig(vocab_size=11, emb_dim=EMB, num_heads=H, mlp_dim=32, max_len=16,
                        num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0,
                        attention_dropout_rate=0.0, attention_implementation='reference')


def random_qkv(seed, t=T, s=S, heads=H, kv_heads=H, d=D):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (B, t, heads, d)), jax.random.normal(kk, (B, s, kv_heads, d)),
          jax.random.normal(kv, (B, s, kv_heads, d)))


def numpy_attention(q, k, v, mask=None, bias=None):
  """float64 (output [B, T, H, D], weights [B, H, T, S]); k/v heads are repeated for GQA."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  groups = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
  scores = np.einsum('bthd,bshd->bhts', q, k) / np.sqrt(q.shape[-1])
  if bias is not None:
    scores = scores + np.asarray(bias, np.float64)
  visible = np.broadcast_to(np.ones((), bool) if mask is None else np.asarray(mask), scores.shape)
  scores = np.where(visible, scores, -np.inf)
  row_max = np.max(scores, axis=-1, keepdims=True)
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  exp = np.where(visible, np.exp(scores - row_max), 0.0)
  total = np.sum(exp, axis=-1, keepdims=True)
  weights = np.where(total > 0, exp / np.where(total > 0, total, 1.0), 0.0)
  return np.einsum('bhts,bshd->bthd', weights, v), weights


def padding_validity(t=T, s=S):
  """Row 0: all valid. Row 1: last 2 queries and last 3 keys are padding."""
  q_valid = np.ones((B, t), bool)
  k_valid = np.ones((B, s), bool)
  q_valid[1, -2:] = False
  k_valid[1, -3:] = False
  return jnp.asarray(q_valid), jnp.asarray(k_valid)


def make_mask(kind, t=T, s=S):
  q_valid, k_valid = padding_validity(t, s)
  if kind == 'none':
    return None
  if kind == 'causal':
    return kernels.make_causal_mask(t, s)
  if kind == 'padding':
    return kernels.make_padding_mask(q_valid, k_valid)
  if kind == 'causal+padding':
    return kernels.combine_masks(kernels.make_causal_mask(t, s),
                                 kernels.make_padding_mask(q_valid, k_valid))
  raise ValueError(kind)


MASK_KINDS = ['none', 'causal', 'padding', 'causal+padding']

# ---------------------------------------------------------------------------------------------
# Masks


def test_causal_mask_hides_exactly_the_future():
  mask = np.asarray(kernels.make_causal_mask(4, 6))
  assert mask.shape == (1, 1, 4, 6)
  for i in range(4):
    for j in range(6):
      assert mask[0, 0, i, j] == (j <= i)


def test_padding_mask_hides_pad_queries_and_pad_keys():
  q_valid, k_valid = padding_validity()
  mask = np.asarray(kernels.make_padding_mask(q_valid, k_valid))
  assert mask.shape == (B, 1, T, S)
  expected = np.asarray(q_valid)[:, None, :, None] & np.asarray(k_valid)[:, None, None, :]
  np.testing.assert_array_equal(mask, expected)


def test_combine_masks_is_logical_and_ignoring_none():
  a = jnp.array([[True, True, False, False]])
  b = jnp.array([[True, False, True, False]])
  np.testing.assert_array_equal(kernels.combine_masks(a, None, b), [[True, False, False, False]])
  assert kernels.combine_masks(None, None) is None


# ---------------------------------------------------------------------------------------------
# Scaled dot-product attention against float64 numpy


@pytest.mark.parametrize('kind', MASK_KINDS)
def test_reference_attention_matches_numpy_formula(kind):
  q, k, v = random_qkv(0)
  mask = make_mask(kind)
  out, weights = kernels.reference_attention(q, k, v, mask=mask)
  expected_out, expected_weights = numpy_attention(q, k, v, mask)
  np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('kind', ['none', 'causal+padding'])
def test_reference_attention_adds_bias_to_scores(kind):
  q, k, v = random_qkv(1)
  bias = 2.0 * jax.random.normal(jax.random.key(2), (1, H, T, S))
  mask = make_mask(kind)
  out, weights = kernels.reference_attention(q, k, v, mask=mask, bias=bias)
  expected_out, expected_weights = numpy_attention(q, k, v, mask, bias)
  np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-6)
  # The bias really matters: without it the result is different.
  unbiased, _ = numpy_attention(q, k, v, mask)
  assert np.max(np.abs(unbiased - expected_out)) > 1e-2


@pytest.mark.parametrize('kind', MASK_KINDS)
@pytest.mark.parametrize('use_bias', [False, True])
def test_xla_attention_matches_reference(kind, use_bias):
  q, k, v = random_qkv(3)
  mask = make_mask(kind)
  bias = jax.random.normal(jax.random.key(4), (1, H, T, S)) if use_bias else None
  ref = kernels.dot_product_attention(q, k, v, mask=mask, bias=bias, implementation='reference')
  xla = kernels.dot_product_attention(q, k, v, mask=mask, bias=bias, implementation='xla')
  np.testing.assert_allclose(xla, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ref, numpy_attention(q, k, v, mask, bias)[0], rtol=1e-5, atol=1e-5)


def test_fully_masked_query_rows_output_zero_in_both_implementations():
  q, k, v = random_qkv(5)
  mask = make_mask('padding')  # Row 1's last two queries are padding and see nothing.
  for implementation in ('reference', 'xla'):
    out = np.asarray(
        kernels.dot_product_attention(q, k, v, mask=mask, implementation=implementation))
    np.testing.assert_array_equal(out[1, -2:], 0.0)
    assert np.all(np.abs(out[0]).sum(axis=-1) > 0)


def test_unknown_implementation_is_rejected():
  q, k, v = random_qkv(6)
  with pytest.raises(ValueError, match='bogus'):
    kernels.dot_product_attention(q, k, v, implementation='bogus')


@pytest.mark.parametrize('kind', ['causal', 'padding', 'causal+padding'])
def test_masked_weights_are_exactly_zero_and_visible_rows_sum_to_one(kind):
  q, k, v = random_qkv(7)
  mask = np.broadcast_to(np.asarray(make_mask(kind)), (B, H, T, S))
  _, weights = kernels.reference_attention(q, k, v, mask=jnp.asarray(mask))
  weights = np.asarray(weights)
  np.testing.assert_array_equal(weights[~mask], 0.0)
  assert np.all(weights[mask] > 0)
  has_visible_key = mask.any(axis=-1)
  np.testing.assert_allclose(weights.sum(-1)[has_visible_key], 1.0, rtol=1e-6)
  np.testing.assert_array_equal(weights.sum(-1)[~has_visible_key], 0.0)


@pytest.mark.parametrize('implementation', ['reference', 'xla'])
def test_causal_attention_never_reads_later_keys(implementation):
  q, k, v = random_qkv(8, t=T, s=T)
  mask = kernels.make_causal_mask(T)
  out = kernels.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
  for t in range(T - 1):
    k2 = k.at[:, t + 1:].add(10.0)
    v2 = v.at[:, t + 1:].multiply(-3.0)
    out2 = kernels.dot_product_attention(q, k2, v2, mask=mask, implementation=implementation)
    np.testing.assert_allclose(out2[:, :t + 1], out[:, :t + 1], rtol=1e-6, atol=1e-6)
    # ... while the later outputs do read them.
    assert np.max(np.abs(out2[:, t + 1:] - out[:, t + 1:])) > 1e-3


@pytest.mark.parametrize('implementation', ['reference', 'xla'])
def test_padded_keys_do_not_affect_real_queries(implementation):
  q, k, v = random_qkv(9)
  q_valid, k_valid = padding_validity()
  mask = kernels.make_padding_mask(q_valid, k_valid)
  out = kernels.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
  k2 = k.at[1, -3:].set(7.0)  # Row 1's last three keys are padding.
  v2 = v.at[1, -3:].set(-5.0)
  out2 = kernels.dot_product_attention(q, k2, v2, mask=mask, implementation=implementation)
  real = np.asarray(q_valid)
  np.testing.assert_allclose(np.asarray(out2)[real], np.asarray(out)[real], rtol=1e-6, atol=1e-6)
  # Unmasked, the same change is visible: the test would catch a mask that is ignored.
  out3 = kernels.dot_product_attention(q, k2, v2, implementation=implementation)
  out4 = kernels.dot_product_attention(q, k, v, implementation=implementation)
  assert np.max(np.abs(np.asarray(out3)[1] - np.asarray(out4)[1])) > 1e-2


@pytest.mark.parametrize('implementation', ['reference', 'xla'])
@pytest.mark.parametrize('kv_heads', [1, 2])
def test_grouped_query_attention_equals_mha_with_repeated_kv_heads(implementation, kv_heads):
  q, k, v = random_qkv(10, kv_heads=kv_heads)
  mask = make_mask('causal+padding')
  gqa = kernels.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
  groups = H // kv_heads
  # Query head h uses key/value head h // groups.
  mha = kernels.dot_product_attention(q, jnp.repeat(k, groups,
                                                    axis=2), jnp.repeat(v, groups, axis=2),
                                      mask=mask, implementation=implementation)
  np.testing.assert_allclose(gqa, mha, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(gqa, numpy_attention(q, k, v, mask)[0], rtol=1e-5, atol=1e-5)


def test_attention_dropout_only_when_not_deterministic():
  q, k, v = random_qkv(11)
  base, _ = kernels.reference_attention(q, k, v)
  same, _ = kernels.reference_attention(q, k, v, dropout_rng=jax.random.key(0), dropout_rate=0.5,
                                        deterministic=True)
  np.testing.assert_array_equal(same, base)
  dropped, _ = kernels.reference_attention(q, k, v, dropout_rng=jax.random.key(0), dropout_rate=0.5,
                                           deterministic=False)
  assert np.max(np.abs(dropped - base)) > 1e-2
  with pytest.raises(ValueError, match='dropout'):
    kernels.dot_product_attention(q, k, v, dropout_rng=jax.random.key(0), dropout_rate=0.5,
                                  deterministic=False, implementation='xla')


# ---------------------------------------------------------------------------------------------
# MultiHeadAttention


def init_mha(cfg, x, context=None):
  """The variables as shapes, dtypes and logical names (traced only, no initialiser compiled)."""
  return jax.eval_shape(MultiHeadAttention(cfg).init, jax.random.key(0), x, context)


def random_inputs(seed, length=T, width=EMB):
  return jax.random.normal(jax.random.key(seed), (B, length, width))


def project_qkv(params, x, context):
  """float64 q [B, T, H, D] and k, v [B, S, K, D] from MultiHeadAttention's parameters."""
  p = meta.unbox(params)
  x, context = np.asarray(x, np.float64), np.asarray(context, np.float64)
  q = np.einsum('bte,ehd->bthd', x, p['query']['kernel']) + p['query']['bias']
  k = np.einsum('bse,ehd->bshd', context, p['key']['kernel']) + p['key']['bias']
  v = np.einsum('bse,ehd->bshd', context, p['value']['kernel']) + p['value']['bias']
  return q, k, v


def manual_mha(params, x, context, mask=None):
  """MultiHeadAttention written out from its parameters with the numpy reference."""
  out, _ = numpy_attention(*project_qkv(params, x, context), mask)
  return np.einsum('bthd,hde->bte', out, params['out']['kernel']) + params['out']['bias']


def randomise(params, seed):
  """Plain arrays of the params' shapes, every leaf random (so biases are exercised too)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda leaf: jnp.asarray(0.3 * rng.normal(size=leaf.shape), jnp.float32),
                      meta.unbox(params))


@pytest.mark.parametrize('kv_heads', [None, 2])
def test_mha_self_attention_matches_manual_computation(kv_heads):
  cfg = CFG.replace(num_kv_heads=kv_heads)
  x = random_inputs(0)
  params = randomise(init_mha(cfg, x)['params'], 1)
  mask = kernels.make_causal_mask(T)
  out = MultiHeadAttention(cfg).apply({'params': params}, x, mask=mask)
  assert out.shape == (B, T, EMB)
  np.testing.assert_allclose(out, manual_mha(params, x, x, mask), rtol=1e-5, atol=1e-5)


def test_mha_cross_attention_reads_a_context_of_another_length():
  x, context = random_inputs(0, T), random_inputs(1, S)
  params = randomise(init_mha(CFG, x, context)['params'], 2)
  _, k_valid = padding_validity()
  mask = k_valid[:, None, None, :]
  mha = MultiHeadAttention(CFG)
  out = mha.apply({'params': params}, x, context, mask=mask)
  assert out.shape == (B, T, EMB)
  np.testing.assert_allclose(out, manual_mha(params, x, context, mask), rtol=1e-5, atol=1e-5)
  # Keys and values come from the context: another context changes the output.
  other = mha.apply({'params': params}, x, random_inputs(2, S), mask=mask)
  assert np.max(np.abs(other - out)) > 1e-3
  # Without a context it is self-attention over x.
  self_out = mha.apply({'params': params}, x)
  np.testing.assert_allclose(self_out, manual_mha(params, x, x), rtol=1e-5, atol=1e-5)


def test_mha_params_have_logical_axis_names_and_shapes():
  cfg = CFG.replace(num_kv_heads=2)
  x = random_inputs(0)
  params = init_mha(cfg, x)['params']
  specs = nn.get_partition_spec(params)
  assert tuple(specs['query']['kernel']) == ('embed', 'heads', 'kv')
  assert tuple(specs['key']['kernel']) == ('embed', 'kv_heads', 'kv')
  assert tuple(specs['value']['kernel']) == ('embed', 'kv_heads', 'kv')
  assert tuple(specs['out']['kernel']) == ('heads', 'kv', 'embed')
  assert tuple(specs['query']['bias']) == ('heads', 'kv')
  assert tuple(specs['out']['bias']) == ('embed',)
  plain = meta.unbox(params)
  assert plain['query']['kernel'].shape == (EMB, H, EMB // H)
  assert plain['key']['kernel'].shape == (EMB, 2, EMB // H)
  assert plain['out']['kernel'].shape == (H, EMB // H, EMB)


def test_mha_without_bias_has_no_bias_params():
  params = meta.unbox(init_mha(CFG.replace(use_bias=False), random_inputs(0))['params'])
  for name in ('query', 'key', 'value', 'out'):
    assert set(params[name]) == {'kernel'}


def test_mha_sows_attention_weights_when_intermediates_are_mutable():
  x, context = random_inputs(0, T), random_inputs(1, S)
  params = randomise(init_mha(CFG, x, context)['params'], 3)
  _, k_valid = padding_validity()
  mask = k_valid[:, None, None, :]
  mha = MultiHeadAttention(CFG)
  out, state = mha.apply({'params': params}, x, context, mask=mask, mutable=['intermediates'])
  (weights,) = state['intermediates']['attention_weights']
  assert weights.shape == (B, H, T, S)
  full_mask = np.broadcast_to(np.asarray(mask), (B, H, T, S))
  weights = np.asarray(weights)
  np.testing.assert_array_equal(weights[~full_mask], 0.0)
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
  _, expected = numpy_attention(*project_qkv(params, x, context), mask)
  np.testing.assert_allclose(weights, expected, rtol=1e-5, atol=1e-6)
  # Sowing does not change the output.
  np.testing.assert_allclose(out, mha.apply({'params': params}, x, context, mask=mask), rtol=1e-6,
                             atol=1e-6)
  # Not mutable: nothing is sown.
  _, state = mha.apply({'params': params}, x, context, mask=mask, mutable=['cache'])
  assert 'intermediates' not in state


# ---------------------------------------------------------------------------------------------
# KV cache


def test_decode_mode_init_allocates_a_zero_cache_of_the_full_length():
  cfg = CFG.replace(num_kv_heads=2, decode=True)
  x = random_inputs(0, 7)
  variables = MultiHeadAttention(cfg).init(jax.random.key(0), x)
  cache = variables['cache']
  assert set(cache) == {'cached_key', 'cached_value'}
  # keys [B, K, D, S], values [B, K, S, D]: the layouts a decode step reads in place.
  assert cache['cached_key'].shape == (B, 2, EMB // H, 7)
  assert cache['cached_value'].shape == (B, 2, 7, EMB // H)
  for name in ('cached_key', 'cached_value'):
    np.testing.assert_array_equal(cache[name], 0.0)
  # The allocating call attends like a normal (here unmasked) forward pass.
  params = variables['params']
  out = MultiHeadAttention(cfg).apply({'params': params}, x, mutable=['cache'])[0]
  full = MultiHeadAttention(cfg.replace(decode=False)).apply({'params': params}, x)
  np.testing.assert_allclose(out, full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('changes', [
    {},
    {'num_kv_heads': 2},
    {'num_kv_heads': 1, 'position': 'rotary', 'attention_implementation': 'xla'},
], ids=['mha', 'gqa', 'mqa-rotary-xla'])
def test_incremental_decoding_with_cache_matches_full_causal_pass(changes):
  cfg = CFG.replace(**changes)
  length = 6
  x = random_inputs(0, length)
  decoder = MultiHeadAttention(cfg.replace(decode=True))
  # A decode-mode init on the full length allocates the cache (zeros).
  variables = jax.eval_shape(decoder.init, jax.random.key(0), x)
  params = randomise(variables['params'], 4)
  cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), variables['cache'])
  assert cache['cached_value'].shape == (B, cfg.num_kv_heads, length, cfg.head_dim)

  full = MultiHeadAttention(cfg).apply({'params': params}, x, mask=kernels.make_causal_mask(length))
  for t in range(length):
    out, state = decoder.apply({'params': params, 'cache': cache}, x[:, t:t + 1],
                               positions=jnp.array([t]), mutable=['cache'])
    cache = state['cache']
    assert out.shape == (B, 1, EMB)
    np.testing.assert_allclose(out[:, 0], full[:, t], rtol=1e-5, atol=1e-5, err_msg=f'step {t}')
  # Every slot of the cache has been written.
  assert np.all(np.abs(np.asarray(cache['cached_value'])).sum(axis=(1, 3)) > 0)


@pytest.mark.parametrize('length, stop', [(64, 1), (13, 1), (1, 1), (1000, 16), (37, 16), (5, 16)])
def test_halving_dot_equals_sum_of_products(length, stop):
  """Halving (odd lengths carry their last row) leaves at most `stop` rows whose total is
  sum(a * b) over the axis; other axes broadcast, and b may lack one (`b_new_axis`)."""
  a = jax.random.normal(jax.random.key(length), (2, 3, length, 1))
  b = jax.random.normal(jax.random.key(length + 1), (2, length, 4))
  expected = (a * b[:, None]).sum(2)
  for b_view, new_axis in [(b[:, None], None), (b, 1)]:
    halved = kernels.halving_dot(a, b_view, axis=2, stop=stop, b_new_axis=new_axis)
    rows = halved.shape[2]
    assert rows == length if length <= stop else stop // 2 < rows <= stop
    np.testing.assert_allclose(halved.sum(2), expected, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match='lengths'):
    kernels.halving_dot(a, jnp.ones((2, length + 1, 4)), axis=2, b_new_axis=1)


@pytest.mark.parametrize('kv_heads', [H, 2, 1], ids=['mha', 'gqa', 'mqa'])
def test_decode_step_attention_matches_the_formula_with_mask_and_bias(kv_heads):
  """One query per row over cache-layout keys [B, K, D, S] and values [B, K, S, D]: equal to the
  float64 formula, with a padding mask (per row) and a per-head bias; masked keys get no weight
  (a masked key's value, changed to anything, changes nothing)."""
  q, k, v = random_qkv(3, t=1, s=S, kv_heads=kv_heads)
  key_valid = jnp.array([[True] * S, [True] * (S - 2) + [False] * 2])
  mask = key_valid[:, None, None, :]  # [B, 1, 1, S]
  bias = jax.random.normal(jax.random.key(4), (1, H, 1, S))
  keys, values = jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2)
  out = kernels.decode_step_attention(q, keys, values, mask=mask, bias=bias)
  expected, _ = numpy_attention(q, k, v, mask=mask, bias=bias)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
  values_changed = values.at[1, :, S - 1].set(1e3)
  np.testing.assert_array_equal(
      kernels.decode_step_attention(q, keys, values_changed, mask=mask, bias=bias), out)
  with pytest.raises(ValueError, match='one query per row'):
    kernels.decode_step_attention(jnp.concatenate([q, q], 1), keys, values)


def test_rotary_self_attention_depends_on_positions():
  cfg = CFG.replace(position='rotary')
  x = random_inputs(0)
  params = randomise(init_mha(cfg, x)['params'], 5)
  mha = MultiHeadAttention(cfg)
  base = mha.apply({'params': params}, x)
  shifted = mha.apply({'params': params}, x, positions=jnp.arange(T) + 3)
  # Only relative positions matter for rotary attention: a constant shift changes nothing...
  np.testing.assert_allclose(shifted, base, rtol=1e-4, atol=1e-5)
  # ... but a permutation of positions does.
  permuted = mha.apply({'params': params}, x, positions=jnp.arange(T)[::-1])
  assert np.max(np.abs(permuted - base)) > 1e-3
