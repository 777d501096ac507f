"""Tests for the decoder-only GPT: shapes and parameters of both styles, causality, KV cache."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from transformer_jax.models.gpt import GPT, gpt2_config, llama_config

VOCAB, LENGTH = 37, 12


def tiny(style: str, **overrides):
  base = dict(vocab_size=VOCAB, emb_dim=32, num_heads=4, mlp_dim=48, num_decoder_layers=2,
              max_len=16, dropout_rate=0.0, attention_dropout_rate=0.0)
  if style == 'gpt2':
    return gpt2_config(**base, **overrides)
  return llama_config(**dict(base, num_kv_heads=2), **overrides)


def init(cfg, length=LENGTH, batch=2):
  tokens = jax.random.randint(jax.random.key(1), (batch, length), 0, VOCAB)
  variables = GPT(cfg).init(jax.random.key(0), tokens)
  return variables, tokens


def flat_params(variables):
  params = nn.meta.unbox(variables['params'])
  return {'/'.join(k): v for k, v in traverse_util.flatten_dict(params).items()}


@pytest.mark.parametrize('style', ['gpt2', 'llama'])
def test_logits_shape_and_dtype(style):
  cfg = tiny(style)
  variables, tokens = init(cfg)
  logits = GPT(cfg).apply(variables, tokens)
  assert logits.shape == (2, LENGTH, VOCAB)
  assert logits.dtype == jnp.float32
  assert np.all(np.isfinite(np.asarray(logits)))


def test_gpt2_style_parameters():
  params = flat_params(init(tiny('gpt2'))[0])
  # Learned positions, tied output (no separate head), LayerNorm with bias, biased dense layers.
  assert params['input_embedding/position_embedding/embedding'].shape == (16, 32)
  assert params['token_embed/embedding'].shape == (VOCAB, 32)
  assert not any('lm_head' in k for k in params)
  assert 'stack/final_norm/bias' in params and 'stack/final_norm/scale' in params
  assert 'stack/layer_0/self_attention/query/bias' in params
  assert params['stack/layer_0/mlp/wi/kernel'].shape == (32, 48)
  assert not any('wi_gate' in k for k in params)
  # GPT-2 initialises embeddings with std 0.02.
  assert abs(float(np.std(params['token_embed/embedding'])) - 0.02) < 0.005


def test_llama_style_parameters():
  params = flat_params(init(tiny('llama'))[0])
  assert not any(k.endswith('bias') for k in params), [k for k in params if k.endswith('bias')]
  assert not any('position_embedding' in k for k in params)  # rotary: nothing learned
  # Grouped-query attention: 4 query heads share 2 key/value heads of width 8.
  attention = 'stack/layer_0/self_attention'
  assert params[f'{attention}/query/kernel'].shape == (32, 4, 8)
  assert params[f'{attention}/key/kernel'].shape == (32, 2, 8)
  assert params[f'{attention}/value/kernel'].shape == (32, 2, 8)
  # SwiGLU: gate and up projections; RMSNorm: a scale and no centring bias.
  assert params['stack/layer_0/mlp/wi_gate/kernel'].shape == (32, 48)
  assert params['stack/layer_0/mlp/wi_up/kernel'].shape == (32, 48)
  assert set(k.rsplit('/', 1)[1] for k in params if 'norm' in k) == {'scale'}
  # An untied output head.
  assert params['lm_head/kernel'].shape == (32, VOCAB)


@pytest.mark.parametrize('style', ['gpt2', 'llama'])
def test_every_parameter_has_logical_axis_names(style):
  variables, _ = init(tiny(style))
  leaves = jax.tree.leaves(variables['params'],
                           is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  assert leaves
  for leaf in leaves:
    assert isinstance(leaf, nn.LogicallyPartitioned), type(leaf)
    assert len(leaf.names) == leaf.value.ndim
    assert all(isinstance(n, str) for n in leaf.names), leaf.names


@pytest.mark.parametrize('style', ['gpt2', 'llama'])
def test_causal_future_tokens_do_not_change_past_logits(style):
  cfg = tiny(style)
  variables, tokens = init(cfg)
  model = GPT(cfg)
  logits = np.asarray(model.apply(variables, tokens))
  for t in (0, 4, LENGTH - 2):
    changed = tokens.at[:, t + 1:].set((tokens[:, t + 1:] + 5) % VOCAB)
    new = np.asarray(model.apply(variables, changed))
    np.testing.assert_allclose(new[:, :t + 1], logits[:, :t + 1], atol=1e-6)
    # ...while the changed positions do change (the test can fail).
    assert np.abs(new[:, t + 1:] - logits[:, t + 1:]).max() > 1e-3


@pytest.mark.parametrize('style', ['gpt2', 'llama'])
@pytest.mark.parametrize('prefill', [1, 5])
def test_kv_cache_decoding_matches_full_forward(style, prefill):
  cfg = tiny(style)
  variables, tokens = init(cfg)
  full = np.asarray(GPT(cfg).apply(variables, tokens))

  decoder = GPT(cfg.replace(decode=True))
  # A decode-mode init on the full length allocates the cache (all zeros).
  cache = decoder.init(jax.random.key(0), jnp.zeros_like(tokens))['cache']
  step = jax.jit(lambda cache, chunk: decoder.apply({'params': variables['params'], 'cache': cache},
                                                    chunk, mutable=['cache']))
  logits, updated = step(cache, tokens[:, :prefill])
  cache = updated['cache']
  np.testing.assert_allclose(np.asarray(logits), full[:, :prefill], atol=1e-5)
  for t in range(prefill, LENGTH):
    logits, updated = step(cache, tokens[:, t:t + 1])
    cache = updated['cache']
    np.testing.assert_allclose(np.asarray(logits[:, 0]), full[:, t], atol=1e-5,
                               err_msg=f'position {t}')
