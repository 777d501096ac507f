"""Tests for the layers: DenseGeneral, FeedForward, the norms and TransformerBlock."""

import functools
import math

import flax.linen as nn
from flax.linen import meta
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.layers.blocks import TransformerBlock
from transformer_jax.layers.dense import DenseGeneral
from transformer_jax.layers.feedforward import FeedForward
from transformer_jax.model_config import TransformerConfig
from transformer_jax.layers.normalization import make_norm


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
  """Comparisons here are at ~1e-5; GPUs would otherwise multiply float32 in TF32."""
  with jax.default_matmul_precision('highest'):
    yield


EMB, MLP, H = 16, 24, 4

CFG = TransformerConfig(vocab_size=11, emb_dim=EMB, num_heads=H, mlp_dim=MLP, max_len=16,
                        num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0,
                        attention_dropout_rate=0.0)


def abstract_init(module, *args, **kwargs):
  """The module's variables as shapes, dtypes and logical names (traced, nothing compiled)."""
  rngs = {'params': jax.random.key(0), 'dropout': jax.random.key(1)}
  return jax.eval_shape(functools.partial(module.init, **kwargs), rngs, *args)


def randomise(params, seed, scale=0.3):
  """Plain arrays of the params' shapes, every leaf random (biases too, so they are exercised)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda leaf: jnp.asarray(scale * rng.normal(size=leaf.shape), jnp.float32),
                      meta.unbox(params))


def np64(x):
  return np.asarray(x, np.float64)


# ---------------------------------------------------------------------------------------------
# DenseGeneral


def test_dense_general_projects_to_heads_like_einsum():
  x = jax.random.normal(jax.random.key(0), (2, 3, EMB))
  layer = DenseGeneral((H, 5), ('embed', 'heads', 'kv'))
  params = randomise(abstract_init(layer, x)['params'], 2)
  assert params['kernel'].shape == (EMB, H, 5) and params['bias'].shape == (H, 5)
  y = layer.apply({'params': params}, x)
  expected = np.einsum('bte,ehd->bthd', np64(x), np64(params['kernel'])) + np64(params['bias'])
  assert y.shape == (2, 3, H, 5)
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_dense_general_contracts_two_trailing_axes_like_einsum():
  x = jax.random.normal(jax.random.key(0), (2, 3, H, 5))
  layer = DenseGeneral((EMB,), ('heads', 'kv', 'embed'), num_in_axes=2)
  params = randomise(abstract_init(layer, x)['params'], 3)
  assert params['kernel'].shape == (H, 5, EMB) and params['bias'].shape == (EMB,)
  y = layer.apply({'params': params}, x)
  expected = np.einsum('bthd,hde->bte', np64(x), np64(params['kernel'])) + np64(params['bias'])
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_dense_general_logical_names_and_optional_bias():
  x = jnp.ones((1, 2, EMB))
  params = DenseGeneral((H, 5), ('embed', 'heads', 'kv')).init(jax.random.key(0), x)['params']
  specs = nn.get_partition_spec(params)
  assert tuple(specs['kernel']) == ('embed', 'heads', 'kv')
  assert tuple(specs['bias']) == ('heads', 'kv')  # The output axes only.
  np.testing.assert_array_equal(meta.unbox(params)['bias'], 0.0)
  no_bias = abstract_init(DenseGeneral((MLP,), ('embed', 'mlp'), use_bias=False), x)
  assert set(no_bias['params']) == {'kernel'}


def test_dense_general_initialises_as_the_equivalent_2d_matrix():
  seen = []

  def kernel_init(key, shape, dtype):
    seen.append(shape)
    return jnp.arange(math.prod(shape), dtype=dtype).reshape(shape)

  x = jnp.ones((1, 2, H, 5))
  layer = DenseGeneral((EMB,), ('heads', 'kv', 'embed'), num_in_axes=2, kernel_init=kernel_init)
  kernel = meta.unbox(layer.init(jax.random.key(0), x)['params'])['kernel']
  assert seen == [(H * 5, EMB)]  # fan_in = H * 5, fan_out = EMB
  np.testing.assert_array_equal(kernel, np.arange(H * 5 * EMB).reshape(H, 5, EMB))


@pytest.mark.parametrize('matmul_dtype', [None, jnp.bfloat16])
def test_dense_general_out_in_is_the_same_layer_with_its_kernel_transposed(matmul_dtype):
  """kernel_layout='out_in' declares [out..., in...] with the names in that order, draws the
  transposed weights of 'in_out' from the same key, and computes the same outputs (up to the
  order of the sums)."""
  x = jax.random.normal(jax.random.key(0), (2, 3, H, 5))
  kwargs = dict(features=(EMB,), kernel_axes=('heads', 'kv', 'embed'), num_in_axes=2,
                matmul_dtype=matmul_dtype)
  in_out = DenseGeneral(**kwargs).init(jax.random.key(7), x)['params']
  out_in = DenseGeneral(**kwargs, kernel_layout='out_in').init(jax.random.key(7), x)['params']
  assert tuple(nn.get_partition_spec(out_in)['kernel']) == ('embed', 'heads', 'kv')
  assert tuple(nn.get_partition_spec(out_in)['bias']) == ('embed',)
  np.testing.assert_array_equal(
      meta.unbox(out_in)['kernel'], np.transpose(meta.unbox(in_out)['kernel'], (2, 0, 1)))
  params = randomise(abstract_init(DenseGeneral(**kwargs), x)['params'], 5)
  transposed = {**params, 'kernel': jnp.transpose(params['kernel'], (2, 0, 1))}
  y = DenseGeneral(**kwargs).apply({'params': params}, x)
  y_out_in = DenseGeneral(**kwargs, kernel_layout='out_in').apply({'params': transposed}, x)
  np.testing.assert_allclose(y_out_in, y, rtol=1e-5, atol=1e-5)  # the sums' order may differ
  with pytest.raises(ValueError, match='kernel_layout must be one of'):
    DenseGeneral(**kwargs, kernel_layout='io').init(jax.random.key(0), x)


def test_dense_general_computes_in_its_dtype():
  x = jax.random.normal(jax.random.key(0), (2, 3, EMB))
  layer = DenseGeneral((MLP,), ('embed', 'mlp'), dtype=jnp.bfloat16)
  abstract = abstract_init(layer, x)
  assert meta.unbox(abstract['params'])['kernel'].dtype == jnp.float32  # param_dtype
  variables = {'params': randomise(abstract['params'], 4)}
  y = layer.apply(variables, x)
  assert y.dtype == jnp.bfloat16
  y32 = DenseGeneral((MLP,), ('embed', 'mlp')).apply(variables, x)
  np.testing.assert_allclose(y.astype(jnp.float32), y32, rtol=3e-2, atol=3e-2)


# ---------------------------------------------------------------------------------------------
# FeedForward


def np_gelu_tanh(x):
  return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def np_gelu_exact(x):
  return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def np_silu(x):
  return x / (1.0 + np.exp(-x))


def np_relu(x):
  return np.maximum(x, 0.0)


PLAIN = {'relu': np_relu, 'gelu': np_gelu_tanh, 'gelu_exact': np_gelu_exact, 'silu': np_silu}
GATED = {'swiglu': np_silu, 'geglu': np_gelu_tanh, 'reglu': np_relu}


@pytest.mark.parametrize('activation', sorted(PLAIN) + sorted(GATED))
def test_feedforward_computes_its_activation(activation):
  cfg = CFG.replace(activation=activation)
  x = jax.random.normal(jax.random.key(0), (2, 3, EMB))
  module = FeedForward(cfg)
  params = randomise(abstract_init(module, x)['params'], 2, scale=0.5)
  out = module.apply({'params': params}, x)
  p = jax.tree.map(np64, params)
  x64 = np64(x)

  def dense(name, h):
    return h @ p[name]['kernel'] + p[name]['bias']

  if activation in GATED:
    assert set(p) == {'wi_gate', 'wi_up', 'wo'}
    hidden = GATED[activation](dense('wi_gate', x64)) * dense('wi_up', x64)
  else:
    assert set(p) == {'wi', 'wo'}
    hidden = PLAIN[activation](dense('wi', x64))
  np.testing.assert_allclose(out, dense('wo', hidden), rtol=1e-5, atol=1e-5)


def test_feedforward_activations_are_distinguishable():
  """The manual references above would not tell gelu from gelu_exact if inputs were tiny."""
  x = np.linspace(-3, 3, 13)
  assert np.max(np.abs(np_gelu_tanh(x) - np_gelu_exact(x))) > 1e-4
  assert np.max(np.abs(np_silu(x) - np_gelu_tanh(x))) > 1e-2


def test_feedforward_param_names_and_shapes():
  x = jnp.ones((1, 2, EMB))
  params = abstract_init(FeedForward(CFG.replace(activation='swiglu', use_bias=False)), x)['params']
  specs = nn.get_partition_spec(params)
  assert tuple(specs['wi_gate']['kernel']) == ('embed', 'mlp')
  assert tuple(specs['wi_up']['kernel']) == ('embed', 'mlp')
  assert tuple(specs['wo']['kernel']) == ('mlp', 'embed')
  plain = meta.unbox(params)
  assert plain['wi_gate']['kernel'].shape == (EMB, MLP)
  assert plain['wo']['kernel'].shape == (MLP, EMB)
  assert 'bias' not in plain['wo']


# ---------------------------------------------------------------------------------------------
# Norms


def np_layernorm(x, eps):
  x = np64(x)
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean)**2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps)


def np_rmsnorm(x, eps):
  x = np64(x)
  return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)


def init_norm(cfg, x):
  module = make_norm(cfg, 'norm')
  return module, module.init(jax.random.key(0), x)


def test_layernorm_normalises_each_token_and_has_scale_and_bias():
  x = 3.0 + 5.0 * jax.random.normal(jax.random.key(0), (2, 4, 64))
  module, variables = init_norm(CFG, x)
  y = np.asarray(module.apply(variables, x))
  np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-5)
  np.testing.assert_allclose(y.var(-1), 1.0, rtol=1e-4)
  specs = nn.get_partition_spec(variables['params'])
  assert tuple(specs['scale']) == ('embed',) and tuple(specs['bias']) == ('embed',)
  # Scale and bias are applied after normalising.
  params = randomise(variables['params'], 1)
  y = module.apply({'params': params}, x)
  expected = np_layernorm(x, CFG.norm_epsilon) * np64(params['scale']) + np64(params['bias'])
  np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)


def test_rmsnorm_gives_unit_rms_without_centring():
  cfg = CFG.replace(norm_type='rmsnorm')
  x = 3.0 + 5.0 * jax.random.normal(jax.random.key(0), (2, 4, 64))
  module, variables = init_norm(cfg, x)
  assert set(variables['params']) == {'scale'}
  y = np.asarray(module.apply(variables, x))
  np.testing.assert_allclose(np.sqrt((y**2).mean(-1)), 1.0, rtol=1e-4)
  assert np.all(y.mean(-1) > 0.1)  # Not centred: the positive mean survives.
  np.testing.assert_allclose(y, np_rmsnorm(x, cfg.norm_epsilon), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('norm_type', ['layernorm', 'rmsnorm'])
def test_norms_compute_statistics_in_float32_for_bfloat16_inputs(norm_type):
  """bf16 in, bf16 out, float64-accurate to bf16 output precision.

  The common offset of 64 makes LayerNorm's variance a small difference of large numbers
  (E[x^2] ~ 4096 has a spacing of 32 in bf16), so only float32 statistics pass for it. (For
  RMSNorm bf16 statistics would be off by about bf16 precision only, which this cannot tell.)
  """
  cfg = CFG.replace(norm_type=norm_type, dtype=jnp.bfloat16)
  x = (64.0 + jax.random.normal(jax.random.key(0), (2, 4, 128))).astype(jnp.bfloat16)
  module, variables = init_norm(cfg, x)
  y = module.apply(variables, x)
  assert y.dtype == jnp.bfloat16
  reference = np_layernorm if norm_type == 'layernorm' else np_rmsnorm
  expected = reference(np.asarray(x.astype(jnp.float32)), cfg.norm_epsilon)
  np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), expected, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# TransformerBlock


def block_and_params(cfg, x, encoded=None, cross_attention=False, seed=0):
  """A block and random params, with the norms at their initial scale 1 and bias 0."""
  block = TransformerBlock(cfg, cross_attention)
  params = randomise(abstract_init(block, x, encoded)['params'], seed)

  def norm_defaults(path, leaf):
    names = [getattr(p, 'key', '') for p in path]
    if names[-2].endswith('_norm'):
      return jnp.ones_like(leaf) if names[-1] == 'scale' else jnp.zeros_like(leaf)
    return leaf

  return block, jax.tree_util.tree_map_with_path(norm_defaults, params)


def zero_output_projections(params):
  """Zeroes every sublayer's last projection ('out' of attention, 'wo' of the MLP)."""

  def zero(path, leaf):
    names = [getattr(p, 'key', None) for p in path]
    return jnp.zeros_like(leaf) if ('out' in names or 'wo' in names) else leaf

  return jax.tree_util.tree_map_with_path(zero, params)


def test_post_ln_block_output_is_normalised():
  x = 4.0 + 3.0 * jax.random.normal(jax.random.key(0), (2, 5, EMB))
  block, params = block_and_params(CFG, x)
  y = np.asarray(block.apply({'params': params}, x))
  assert y.shape == x.shape
  np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-5)
  np.testing.assert_allclose(y.var(-1), 1.0, rtol=1e-3)


def test_pre_ln_block_is_identity_when_sublayer_outputs_are_zero():
  cfg = CFG.replace(norm_position='pre')
  x = 4.0 + 3.0 * jax.random.normal(jax.random.key(0), (2, 5, EMB))
  encoded = jax.random.normal(jax.random.key(1), (2, 3, EMB))
  block, params = block_and_params(cfg, x, encoded, cross_attention=True)
  assert {'self_attention', 'cross_attention', 'mlp'} <= set(params)
  zeroed = zero_output_projections(params)
  np.testing.assert_array_equal(block.apply({'params': zeroed}, x, encoded), x)
  # With the trained projections the sublayers do contribute.
  assert np.max(np.abs(block.apply({'params': params}, x, encoded) - x)) > 1e-2
  # Post-LN with the same zeroed sublayers is not the identity but norm(norm(x)).
  post = CFG.replace(norm_position='post')
  block, params = block_and_params(post, x, encoded, cross_attention=True)
  y = block.apply({'params': zero_output_projections(params)}, x, encoded)
  np.testing.assert_allclose(y, np_layernorm(x, post.norm_epsilon), rtol=1e-4, atol=1e-4)


def test_block_self_mask_is_causal():
  cfg = CFG.replace(norm_position='pre')
  x = jax.random.normal(jax.random.key(0), (2, 5, EMB))
  block, params = block_and_params(cfg, x)
  mask = jnp.tril(jnp.ones((5, 5), bool))[None, None]
  y = block.apply({'params': params}, x, self_mask=mask)
  y2 = block.apply({'params': params}, x.at[:, 3:].add(1.0), self_mask=mask)
  np.testing.assert_allclose(y2[:, :3], y[:, :3], rtol=1e-6, atol=1e-6)
  assert np.max(np.abs(y2[:, 3:] - y[:, 3:])) > 1e-3


@pytest.mark.parametrize('norm_position', ['pre', 'post'])
def test_dropout_is_off_when_deterministic_and_on_otherwise(norm_position):
  cfg = CFG.replace(norm_position=norm_position, dropout_rate=0.3, attention_dropout_rate=0.3)
  x = jax.random.normal(jax.random.key(0), (2, 5, EMB))
  block, params = block_and_params(cfg, x)
  variables = {'params': params}

  def run(seed, deterministic):
    return block.apply(variables, x, deterministic=deterministic,
                       rngs={'dropout': jax.random.key(seed)})

  no_dropout = TransformerBlock(CFG.replace(norm_position=norm_position)).apply(variables, x)
  np.testing.assert_array_equal(run(1, True), run(2, True))
  np.testing.assert_allclose(run(1, True), no_dropout, rtol=1e-6, atol=1e-6)
  a, b = run(1, False), run(2, False)
  assert np.max(np.abs(a - b)) > 1e-2
  assert np.max(np.abs(a - no_dropout)) > 1e-2
  np.testing.assert_array_equal(run(1, False), a)  # Same rng, same mask.
