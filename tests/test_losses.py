"""The token losses: the fused projected cross-entropy equals logits + `cross_entropy_sums`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.layers import losses
from transformer_jax.models.bert import Bert, bert_config
from transformer_jax.models.encoder_decoder import EncoderDecoder
from transformer_jax.models.gpt import GPT, gpt2_config, llama_config
from transformer_jax.model_config import TransformerConfig

B, T, D, V = 3, 8, 16, 50


def data(seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  features = jax.random.normal(k[0], (B, T, D))
  embedding = 0.3 * jax.random.normal(k[1], (V, D))
  targets = jax.random.randint(k[2], (B, T), 0, V)
  weights = (jax.random.uniform(k[3], (B, T)) > 0.3).astype(jnp.float32)  # some rows unscored
  return features, embedding, targets, weights


def unfused(features, embedding, targets, weights, label_smoothing, bias=None):
  logits = (features.reshape(-1, D) @ embedding.T).reshape(B, T, V)
  if bias is not None:
    logits = logits + bias
  return losses.cross_entropy_sums(logits, targets, weights, label_smoothing)


@pytest.fixture
def two_step_slices(monkeypatch):
  """A logits budget of 3 time steps: T = 8 is scanned as four slices of 2."""
  monkeypatch.setattr(losses, '_CHUNK_BYTES', 4 * B * V * 3)
  assert losses._slicing_pays(V, D) and losses._slice_length(B, T, V) == 2


@pytest.mark.parametrize('label_smoothing,with_bias,sliced', [(0.0, False, True),
                                                              (0.1, False, True), (0.1, True, True),
                                                              (0.1, True, False)])
def test_projected_sums_and_gradients_equal_the_unfused_loss(two_step_slices, monkeypatch,
                                                             label_smoothing, with_bias, sliced):
  if not sliced:  # a table too big to slice for: the whole-logits path
    monkeypatch.setattr(losses, '_TABLE_BYTES', 4 * V * D - 1)
  assert losses._slicing_pays(V, D) == sliced
  features, embedding, targets, weights = data()
  bias = jax.random.normal(jax.random.key(7), (V,)) if with_bias else None
  fused = lambda f, e, b: losses.projected_cross_entropy_sums(f, e, targets, weights,
                                                              label_smoothing, bias=b)
  plain = lambda f, e, b: unfused(f, e, targets, weights, label_smoothing, b)
  np.testing.assert_allclose(
      jax.jit(fused)(features, embedding, bias), plain(features, embedding, bias), rtol=1e-5)
  # Both differentiable outputs at once (smoothed loss and NLL, with different cotangents).
  mix = lambda fn: lambda *a: 0.7 * fn(*a)[0] - 1.3 * fn(*a)[1]
  argnums = (0, 1, 2) if with_bias else (0, 1)
  got = jax.jit(jax.grad(mix(fused), argnums=argnums))(features, embedding, bias)
  want = jax.grad(mix(plain), argnums=argnums)(features, embedding, bias)
  for g, w in zip(got, want):
    assert float(jnp.max(jnp.abs(w))) > 0.1  # a real gradient, not zeros on both sides
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_projected_loss_has_no_gradient_on_unscored_rows(two_step_slices):
  features, embedding, targets, weights = data(1)
  grad = jax.grad(lambda f: losses.projected_cross_entropy_sums(f, embedding, targets, weights)[0])(
      features)
  assert np.all(np.asarray(grad)[np.asarray(weights) == 0] == 0)
  assert np.all(np.abs(np.asarray(grad)[np.asarray(weights) == 1]).sum(-1) > 0)


def test_correct_counts_equal_argmax_hits():
  features, embedding, targets, weights = data(2)
  logits = (features.reshape(-1, D) @ embedding.T).reshape(B, T, V)
  targets = jnp.where(jnp.arange(T) % 2 == 0, jnp.argmax(logits, -1), targets)  # half are hits
  want = float(jnp.sum((jnp.argmax(logits, -1) == targets) * weights))
  assert want > 0
  assert float(losses.cross_entropy_sums(logits, targets, weights)[2]) == want
  assert float(losses.projected_cross_entropy_sums(features, embedding, targets,
                                                   weights)[2]) == want


def test_slice_length_is_the_largest_divisor_within_budget(monkeypatch):
  monkeypatch.setattr(losses, '_CHUNK_BYTES', 4 * 2 * 10 * 6)  # 6 steps of [2, ., 10] logits
  assert losses._slice_length(2, 12, 10) == 6
  assert losses._slice_length(2, 10, 10) == 5
  assert losses._slice_length(2, 7, 10) == 1  # a prime length runs one step at a time
  assert losses._slice_length(2, 4, 10) == 4  # fits whole


@pytest.mark.parametrize('make_cfg', [gpt2_config, llama_config])  # tied and untied output
def test_gpt_features_project_to_its_logits(make_cfg):
  cfg = make_cfg(vocab_size=V, emb_dim=32, num_heads=4, num_kv_heads=2, mlp_dim=48,
                 num_decoder_layers=2, max_len=16)
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, V)
  variables = GPT(cfg).init(jax.random.key(0), tokens)
  logits = GPT(cfg).apply(variables, tokens)
  features, embedding = GPT(cfg).apply(variables, tokens, method=GPT.features_and_embedding)
  np.testing.assert_allclose(features @ embedding.T, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('tie_output', [True, False])
def test_encoder_decoder_features_project_to_its_logits(tie_output):
  cfg = TransformerConfig(vocab_size=V, emb_dim=32, num_heads=4, mlp_dim=48, num_encoder_layers=1,
                          num_decoder_layers=1, max_len=16, tie_output=tie_output)
  inputs = jax.random.randint(jax.random.key(1), (2, 7), 1, V)
  targets = jax.random.randint(jax.random.key(2), (2, 9), 1, V)
  variables = EncoderDecoder(cfg).init(jax.random.key(0), inputs, targets)
  logits = EncoderDecoder(cfg).apply(variables, inputs, targets)
  features, embedding = EncoderDecoder(cfg).apply(variables, inputs, targets,
                                                  method=EncoderDecoder.features_and_embedding)
  np.testing.assert_allclose(features @ embedding.T, logits, rtol=1e-5, atol=1e-5)


def test_bert_mlm_features_project_to_its_logits():
  cfg = bert_config(vocab_size=V, emb_dim=32, num_heads=4, mlp_dim=48, num_encoder_layers=1,
                    max_len=16)
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 1, V)
  positions = jnp.array([[1, 4, 7], [0, 2, 11]])
  model = Bert(cfg, mlm=True, sentence_classes=0)
  variables = model.init(jax.random.key(0), tokens, mlm_positions=positions)
  variables = jax.tree.map(lambda p: p + 0.1, variables)  # a non-zero MLM bias
  logits = model.apply(variables, tokens, mlm_positions=positions)['mlm_logits']
  out = model.apply(variables, tokens, mlm_positions=positions, method=Bert.features)
  assert 'mlm_logits' not in out and float(jnp.max(jnp.abs(out['mlm_bias']))) > 0
  np.testing.assert_allclose(out['mlm_features'] @ out['mlm_embedding'].T + out['mlm_bias'], logits,
                             rtol=1e-5, atol=1e-5)
