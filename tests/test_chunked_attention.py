"""Chunked (block-causal) attention equals the reference formula, forward and backward, and the
models give the same numbers whichever attention implementation they run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import kernels
from transformer_jax.layers import attention
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.bert import Bert, bert_config
from transformer_jax.models.encoder_decoder import EncoderDecoder
from transformer_jax.models.gpt import GPT, gpt2_config, llama_config

B, H, D = 2, 4, 8
RTOL, ATOL = 1e-5, 1e-5


def qkv(seed, t, s, kv_heads=H):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (B, t, H, D)), jax.random.normal(keys[1], (B, s, kv_heads, D)),
          jax.random.normal(keys[2], (B, s, kv_heads, D)))


def padding_mask(t, s):
  """Row 0 full length, row 1 with its last 3 queries and last 4 keys padded."""
  q_valid = jnp.arange(t)[None, :] < jnp.array([[t], [t - 3]])
  k_valid = jnp.arange(s)[None, :] < jnp.array([[s], [s - 4]])
  return kernels.make_padding_mask(q_valid, k_valid)


def reference(q, k, v, mask=None, bias=None, causal=False):
  if causal:
    mask = kernels.combine_masks(mask, kernels.make_causal_mask(q.shape[1], k.shape[1]))
  return kernels.reference_attention(q, k, v, mask=mask, bias=bias)[0]


@pytest.mark.parametrize('chunk', [3, 4, 16])  # uneven last chunk, even split, one chunk
@pytest.mark.parametrize('padding', [False, True])
@pytest.mark.parametrize('use_bias', [False, True])
def test_causal_chunked_matches_reference(chunk, padding, use_bias):
  t = 10
  q, k, v = qkv(0, t, t)
  mask = padding_mask(t, t) if padding else None
  bias = jax.random.normal(jax.random.key(1), (1, H, t, t)) if use_bias else None
  out = kernels.chunked_attention(q, k, v, mask=mask, bias=bias, causal=True, chunk_size=chunk)
  np.testing.assert_allclose(out, reference(q, k, v, mask, bias, causal=True), rtol=RTOL, atol=ATOL)


def test_causal_flag_and_explicit_causal_mask_agree():
  """GPT passes the causal mask *and* sets causal: the two must not interfere."""
  q, k, v = qkv(2, 12, 12)
  mask = kernels.make_causal_mask(12)
  with_mask = kernels.chunked_attention(q, k, v, mask=mask, causal=True, chunk_size=5)
  flag_only = kernels.chunked_attention(q, k, v, causal=True, chunk_size=5)
  np.testing.assert_allclose(with_mask, flag_only, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(flag_only, reference(q, k, v, mask), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize('t,s', [(7, 11), (12, 5)])
def test_cross_attention_with_key_padding_matches_reference(t, s):
  q, k, v = qkv(3, t, s)
  key_mask = (jnp.arange(s)[None, :] < jnp.array([[s], [s - 2]]))[:, None, None, :]
  out = kernels.chunked_attention(q, k, v, mask=key_mask, chunk_size=4)
  np.testing.assert_allclose(out, reference(q, k, v, key_mask), rtol=RTOL, atol=ATOL)
  # A full [B, 1, T, S] padding mask too (pad queries output zero).
  mask = padding_mask(t, s)
  out = kernels.chunked_attention(q, k, v, mask=mask, chunk_size=4)
  np.testing.assert_allclose(out, reference(q, k, v, mask), rtol=RTOL, atol=ATOL)
  np.testing.assert_array_equal(np.asarray(out)[1, -3:], 0.0)


def test_grouped_query_heads_match_reference():
  q, k, v = qkv(4, 9, 9, kv_heads=2)
  out = kernels.chunked_attention(q, k, v, causal=True, chunk_size=4)
  np.testing.assert_allclose(out, reference(q, k, v, causal=True), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    'causal,use_bias,kv_heads,t,s',
    [
        (False, True, H, 10, 10),
        (True, True, H, 10, 10),  # bias gradient too
        (True, False, 2, 10, 10),  # grouped-query heads
        (False, False, 2, 7, 11)
    ])  # cross-attention, S != T
def test_gradients_match_reference(causal, use_bias, kv_heads, t, s):
  q, k, v = qkv(5, t, s, kv_heads)
  mask = padding_mask(t, s)
  bias = jax.random.normal(jax.random.key(6), (1, H, t, s)) if use_bias else None
  cotangent = jax.random.normal(jax.random.key(7), (B, t, H, D))

  def loss(fn):
    return lambda q, k, v, bias: jnp.sum(fn(q, k, v, bias) * cotangent)

  chunked = loss(lambda q, k, v, bias: kernels.chunked_attention(q, k, v, mask=mask, bias=bias,
                                                                 causal=causal, chunk_size=3))
  ref = loss(lambda q, k, v, bias: reference(q, k, v, mask, bias, causal))
  argnums = (0, 1, 2, 3) if use_bias else (0, 1, 2)
  got = jax.grad(chunked, argnums=argnums)(q, k, v, bias)
  want = jax.grad(ref, argnums=argnums)(q, k, v, bias)
  for g, w in zip(got, want):
    assert np.max(np.abs(np.asarray(w))) > 1e-3  # a real gradient, not all zeros
    np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def test_causal_chunks_skip_hidden_key_blocks():
  """Block-causal: the compiled program does fewer score FLOPs than the full T x T product."""
  t = 256
  q, k, v = qkv(8, t, t)

  def flops(fn):
    return jax.jit(fn).lower(q, k, v).compile().cost_analysis()['flops']

  full = flops(lambda q, k, v: reference(q, k, v, causal=True))
  chunked = flops(lambda q, k, v: kernels.chunked_attention(q, k, v, causal=True))
  assert chunked < 0.75 * full, (chunked, full)


def test_auto_is_chunked_on_cpu_and_equal_to_reference():
  assert jax.default_backend() == 'cpu'
  assert kernels.auto_implementation() == 'chunked'
  q, k, v = qkv(9, 70, 70)  # longer than one 64-row chunk
  out = kernels.dot_product_attention(q, k, v, causal=True)
  np.testing.assert_allclose(out, reference(q, k, v, causal=True), rtol=RTOL, atol=ATOL)


def test_fused_xla_path_honours_causal_flag():
  q, k, v = qkv(10, 9, 9)
  mask = padding_mask(9, 9)
  out = kernels.dot_product_attention(q, k, v, mask=mask, causal=True, implementation='xla')
  np.testing.assert_allclose(out, reference(q, k, v, mask, causal=True), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# Whole models: every implementation gives the same logits; sown weights still come out.

TINY = dict(vocab_size=40, emb_dim=32, num_heads=4, mlp_dim=64, num_decoder_layers=1, max_len=80,
            dropout_rate=0.0, attention_dropout_rate=0.0)


@pytest.mark.slow
@pytest.mark.parametrize('make_config', [gpt2_config, llama_config])
def test_gpt_logits_equal_across_implementations(make_config):
  tokens = jax.random.randint(jax.random.key(11), (2, 72), 0, 40)
  base = make_config(**TINY)
  params = GPT(base.replace(attention_implementation='reference')).init(jax.random.key(0),
                                                                        tokens)['params']
  logits = lambda implementation: jax.jit(
      GPT(base.replace(attention_implementation=implementation)).apply)({'params': params}, tokens)
  np.testing.assert_allclose(logits('auto'), logits('reference'), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_encoder_decoder_logits_equal_across_implementations():
  cfg = TransformerConfig(vocab_size=40, emb_dim=32, num_heads=4, mlp_dim=64, num_encoder_layers=1,
                          num_decoder_layers=1, max_len=80, dropout_rate=0.0,
                          attention_dropout_rate=0.0)
  r = np.random.RandomState(0)
  inputs = r.randint(2, 40, (2, 70)).astype(np.int32)
  targets = r.randint(2, 40, (2, 66)).astype(np.int32)
  inputs[1, 50:] = 0
  targets[1, 40:] = 0
  params = EncoderDecoder(cfg).init(jax.random.key(0), inputs, targets)['params']
  logits = lambda implementation: jax.jit(
      EncoderDecoder(cfg.replace(attention_implementation=implementation)).apply
  )({'params': params}, inputs, targets)
  np.testing.assert_allclose(logits('chunked'), logits('reference'), rtol=1e-4, atol=1e-4)


def test_models_give_causality_as_a_flag_and_padding_as_the_smallest_mask(monkeypatch):
  """What each attention call of the models receives: causal self-attention gets the flag and
  no [T, T] mask (which a flash kernel would have to read as a score-sized bias); BERT-style key
  padding and cross-attention get [B, 1, 1, S] masks (segment ids for the TPU kernel)."""
  calls = []
  implementation = kernels.dot_product_attention

  def recording(q, k, v, *, mask=None, causal=False, **kwargs):
    calls.append((None if mask is None else mask.shape, causal))
    return implementation(q, k, v, mask=mask, causal=causal, **kwargs)

  monkeypatch.setattr(attention, 'dot_product_attention', recording)
  tokens = jax.random.randint(jax.random.key(13), (2, 12), 1, 40)
  jax.eval_shape(GPT(gpt2_config(**TINY)).init, jax.random.key(0), tokens)  # traces a forward
  assert calls and set(calls) == {(None, True)}, calls
  calls.clear()
  cfg = TransformerConfig(vocab_size=40, emb_dim=32, num_heads=4, mlp_dim=64, num_encoder_layers=1,
                          num_decoder_layers=1, max_len=80)
  targets = tokens[:, :9]
  jax.eval_shape(EncoderDecoder(cfg).init, jax.random.key(0), tokens, targets)
  # Encoder self-attention (query and key padding), decoder self-attention, cross-attention.
  assert calls == [((2, 1, 12, 12), False), (None, True), ((2, 1, 1, 12), False)], calls
  calls.clear()
  jax.eval_shape(Bert(bert_config(**TINY, num_encoder_layers=1)).init, jax.random.key(0), tokens)
  assert calls == [((2, 1, 1, 12), False)], calls


def test_sown_attention_weights_are_causal_and_normalised():
  cfg = gpt2_config(**TINY).replace(attention_implementation='chunked')
  tokens = jax.random.randint(jax.random.key(12), (1, 10), 0, 40)
  model = GPT(cfg)
  params = model.init(jax.random.key(0), tokens)['params']
  logits, state = model.apply({'params': params}, tokens, mutable=['intermediates'])
  np.testing.assert_allclose(logits, model.apply({'params': params}, tokens), rtol=1e-4, atol=1e-4)
  weights = jax.tree.leaves(state['intermediates'])
  assert len(weights) == 1
  for w in weights:
    w = np.asarray(w)
    assert w.shape == (1, 4, 10, 10)
    np.testing.assert_array_equal(np.triu(w[0, 0], k=1), 0.0)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
