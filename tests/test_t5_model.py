"""T5's switches: attention logits without the 1/sqrt(head_dim) in every attention
implementation, the rescaled tied output (in the logits and in what the loss projects), cached
decoding, and `t5_config`'s published sizes. (Parity with transformers' T5 is in
test_hf_t5_parity.py.)"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from transformer_jax.convert import hf_t5
from transformer_jax.errors import ConfigError
from transformer_jax.layers import scan_layout
from transformer_jax.layers.attention import MultiHeadAttention
from transformer_jax.layers.position import relative_position_bias
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.encoder_decoder import (EncoderDecoder, T5_V1_0_ARCHITECTURE,
                                                    T5_V1_1_ARCHITECTURE, shift_right, t5_config)
from transformer_jax.tasks.translation import TranslationTask


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
  with jax.default_matmul_precision('highest'):
    yield


B, T, S, E, H, D = 2, 9, 11, 32, 4, 8  # head_dim 8: sqrt(8) is not exact in floating point
BUCKETS, MAX_DISTANCE = 8, 16


def attention_config(implementation, scaled=False):
  return TransformerConfig(emb_dim=E, num_heads=H, head_dim=D, use_bias=False, dropout_rate=0.0,
                           attention_dropout_rate=0.0, scale_attention_scores=scaled,
                           attention_implementation=implementation)


def softmax(x):
  x = x - x.max(-1, keepdims=True)
  return np.exp(x) / np.exp(x).sum(-1, keepdims=True)


def by_hand(params, x, context, mask, bias):
  """softmax(q.k + bias, masked) v, projected out: float64 numpy, no 1/sqrt(head_dim)."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x, context = np.asarray(x, np.float64), np.asarray(context, np.float64)
  q = np.einsum('bte,ehd->bthd', x, p['query']['kernel'])
  k = np.einsum('bse,ehd->bshd', context, p['key']['kernel'])
  v = np.einsum('bse,ehd->bshd', context, p['value']['kernel'])
  scores = np.einsum('bthd,bshd->bhts', q, k)
  if bias is not None:
    scores = scores + np.asarray(bias, np.float64)
  scores = np.where(mask, scores, -1e30) if mask is not None else scores
  weights = softmax(scores)
  if mask is not None:
    weights = np.where(mask, weights, 0.0)
  out = np.einsum('bhts,bshd->bthd', weights, v)
  return np.einsum('bthd,hde->bte', out, p['out']['kernel']), weights


def case(kind):
  """(x, context (None: self-attention), mask, causal, bias table (None: no bias))."""
  keys = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(keys[0], (B, T, E))
  if kind == 'causal':  # a decoder's self-attention with T5's causal relative bias
    return x, None, None, True, jax.random.normal(keys[2], (BUCKETS, H))
  if kind == 'padded':  # an encoder's: row 1's last 3 tokens are padding, bidirectional bias
    valid = jnp.arange(T)[None] < jnp.array([[T], [T - 3]])
    mask = valid[:, None, :, None] & valid[:, None, None, :]
    return x, None, mask, False, jax.random.normal(keys[2], (BUCKETS, H))
  # 'cross': S keys of another sequence, row 1's last 4 hidden, no bias (as T5)
  context = jax.random.normal(keys[1], (B, S, E))
  mask = (jnp.arange(S)[None] < jnp.array([[S], [S - 4]]))[:, None, None, :]
  return x, context, mask, False, None


def run(cfg, kind, params=None, intermediates=False):
  x, context, mask, causal, table = case(kind)
  bias_fn = None
  if table is not None:
    bias_fn = functools.partial(relative_position_bias, table, bidirectional=not causal,
                                max_distance=MAX_DISTANCE)
  module = MultiHeadAttention(cfg, causal=causal)
  if params is None:
    params = nn.meta.unbox(module.init(jax.random.key(0), x, context, mask=mask)['params'])
  apply = jax.jit(
      functools.partial(module.apply, mask=mask, bias_fn=bias_fn,
                        mutable=['intermediates'] if intermediates else False))
  out = apply({'params': params}, x, context)
  hand_mask = mask
  if causal:
    hand_mask = np.tril(np.ones((T, T), bool))[None, None]
  bias = None if bias_fn is None else bias_fn(jnp.arange(T), jnp.arange(T))
  return out, params, by_hand(params, x, x if context is None else context, hand_mask, bias)


IMPLEMENTATIONS = ['reference', 'chunked', 'xla', 'pallas']


@pytest.mark.parametrize('kind', ['causal', 'padded', 'cross'])
@pytest.mark.parametrize('implementation', IMPLEMENTATIONS)
def test_unscaled_attention_is_q_dot_k_in_every_implementation(implementation, kind):
  cfg = attention_config(implementation)
  if implementation == 'pallas':  # the TPU kernel, run by Pallas's interpreter on CPU
    with pltpu.force_tpu_interpret_mode():
      out, params, (expected, _) = run(cfg, kind)
  else:
    out, params, (expected, _) = run(cfg, kind)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
  # The same weights with the scale give something else: the check can fail.
  scaled, _, _ = run(attention_config('reference', scaled=True), kind, params)
  assert np.abs(np.asarray(scaled) - expected).max() > 0.05


def test_unscaled_attention_weights_sown_for_pictures():
  """The 'intermediates' path (reference attention, weights kept) honours the switch too."""
  (out, state), _, (expected, weights) = run(attention_config('chunked'), 'padded',
                                             intermediates=True)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
  sown = state['intermediates']['attention_weights'][0]
  np.testing.assert_allclose(sown, weights, rtol=1e-5, atol=1e-6)


def test_unscaled_query_kernel_starts_smaller_by_sqrt_head_dim():
  """T5 initialises the query projection head_dim**-0.5 smaller: the same draw, scaled."""
  x = jnp.ones((1, 3, E))
  init = lambda scaled: MultiHeadAttention(attention_config('reference', scaled)).init(
      jax.random.key(0), x)['params']
  unscaled, scaled = nn.meta.unbox(init(False)), nn.meta.unbox(init(True))
  np.testing.assert_allclose(unscaled['query']['kernel'], scaled['query']['kernel'] * D**-0.5,
                             rtol=1e-6)
  np.testing.assert_array_equal(unscaled['key']['kernel'], scaled['key']['kernel'])


# ---------------------------------------------------------------------------------------------
# The T5 models

TINY = dict(vocab_size=60, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=48, num_encoder_layers=2,
            num_decoder_layers=2, dropout_rate=0.0, attention_dropout_rate=0.0, max_len=32)


@functools.partial(jax.jit, static_argnums=0, static_argnames=('method', 'mutable'))
def jit_apply(model, variables, *args, **kwargs):
  return model.apply(variables, *args, **kwargs)


@pytest.fixture(scope='module', params=['1.0', '1.1'])
def t5_model(request):
  cfg = t5_config(request.param, **TINY)
  inputs = jax.random.randint(jax.random.key(1), (2, 7), 2, 60).at[1, -3:].set(0)
  targets = jax.random.randint(jax.random.key(2), (2, 6), 2, 60)
  params = nn.meta.unbox(
      jax.jit(EncoderDecoder(cfg).init)(jax.random.key(0), inputs, targets)['params'])
  return request.param, cfg, params, inputs, targets


def test_cached_decoding_equals_the_full_forward_pass(t5_model):
  _, cfg, params, inputs, targets = t5_model
  model = EncoderDecoder(cfg)
  full = jit_apply(model, {'params': params}, inputs, targets)
  encoded = jit_apply(model, {'params': params}, inputs, method=EncoderDecoder.encode)
  decoder = EncoderDecoder(cfg.replace(decode=True))
  cache = decoder.init(jax.random.key(0), inputs, targets)['cache']
  decoder_inputs = shift_right(targets)
  for t in range(targets.shape[1]):
    logits, state = jit_apply(decoder, {'params': params, 'cache': cache}, encoded, inputs,
                              decoder_inputs[:, t:t + 1], method=EncoderDecoder.decode,
                              mutable=('cache',))
    cache = state['cache']
    np.testing.assert_allclose(logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5, err_msg=f'step {t}')


def test_output_rescale_in_logits_and_in_what_the_loss_projects(t5_model):
  version, cfg, params, inputs, targets = t5_model
  assert cfg.rescale_tied_output == cfg.tie_output == (version == '1.0')
  model = EncoderDecoder(cfg)
  logits = jit_apply(model, {'params': params}, inputs, targets)
  features, embedding = jit_apply(model, {'params': params}, inputs, targets,
                                  method=EncoderDecoder.features_and_embedding)
  np.testing.assert_allclose(features @ embedding.T, logits, rtol=1e-5, atol=1e-5)
  encoded = jit_apply(model, {'params': params}, inputs, method=EncoderDecoder.encode)
  raw = jit_apply(model, {'params': params}, encoded, inputs, shift_right(targets),
                  method=EncoderDecoder.decoder_features)
  factor = cfg.emb_dim**-0.5 if version == '1.0' else 1.0
  np.testing.assert_allclose(features, raw * factor, rtol=1e-6, atol=1e-6)
  # The training loss is the cross-entropy of those logits.
  _, sums = TranslationTask(cfg).loss_fn(params, {'inputs': inputs, 'targets': targets}, None,
                                         deterministic=True)
  log_probs = jax.nn.log_softmax(logits)
  nll = -np.take_along_axis(np.asarray(log_probs), np.asarray(targets)[..., None], -1).sum()
  np.testing.assert_allclose(sums['loss'], nll, rtol=1e-5)


def test_export_then_import_gives_every_tensor_back_bitwise(t5_model):
  """HF names and layouts out, ours back: from either layer layout, in float32 and bfloat16."""
  version, cfg, params, _, _ = t5_model
  state = hf_t5.export_t5_state_dict(cfg, params)
  assert ('lm_head.weight' in state) == (version == '1.1') and 'shared.weight' in state
  assert state['encoder.block.0.layer.0.SelfAttention.q.weight'].shape == (2 * 16, 32)
  back = hf_t5.convert_t5_state_dict(state, cfg)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  jax.tree.map(np.testing.assert_array_equal, back, params)
  scanned = hf_t5.export_t5_state_dict(cfg.replace(scan_layers=True),
                                       scan_layout.stack_layers(params))
  assert scanned.keys() == state.keys()
  jax.tree.map(np.testing.assert_array_equal, scanned, state)
  bf16 = cfg.replace(param_dtype=jnp.bfloat16)
  params16 = jax.tree.map(lambda x: np.asarray(x, jnp.bfloat16), params)
  back16 = hf_t5.convert_t5_state_dict(hf_t5.export_t5_state_dict(bf16, params16), bf16)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16)),
               back16, params16)


@pytest.mark.parametrize('version, count', [('1.0', 60_506_624), ('1.1', 76_961_152)])
def test_t5_config_has_the_published_small_sizes(version, count):
  """t5-small has 60,506,624 parameters (HF's T5ForConditionalGeneration(T5Config()) too);
  google/t5-v1_1-small 76,961,152 (its lm_head untied). Counted from shapes, nothing run."""
  cfg = t5_config(version)
  dummy = jnp.ones((1, 8), jnp.int32)
  shapes = jax.eval_shape(EncoderDecoder(cfg).init, jax.random.key(0), dummy, dummy)['params']
  assert sum(x.size for x in jax.tree.leaves(nn.meta.unbox(shapes))) == count
  architecture = T5_V1_0_ARCHITECTURE if version == '1.0' else T5_V1_1_ARCHITECTURE
  assert all(getattr(cfg, k) == v for k, v in architecture.items())
  assert (cfg.vocab_size, cfg.emb_dim, cfg.head_dim, cfg.max_len) == (32128, 512, 64, 512)
  assert t5_config() == t5_config('1.1')
  assert t5_config('1.0', num_heads=4).num_heads == 4


def test_bad_t5_and_switch_combinations_raise_one_line_config_errors():
  with pytest.raises(ConfigError, match=r"T5 version must be one of \['1.0', '1.1'\], got '2'"):
    t5_config('2')
  with pytest.raises(ConfigError, match='rescale_tied_output=True .* needs tie_output=True'):
    t5_config('1.0', tie_output=False)
  with pytest.raises(ConfigError, match='relative_max_distance > relative_buckets // 2'):
    t5_config('1.0', relative_buckets=32, relative_max_distance=16)


@pytest.mark.parametrize('family', ['gpt', 'bert'])
def test_rescale_tied_output_is_refused_outside_the_encoder_decoder(family):
  """T5's output rescale is a switch of the encoder-decoder: GPT and BERT refuse it rather than
  silently ignore it."""
  from transformer_jax.models import GPT, Bert, bert_config, gpt2_config
  preset, model = (gpt2_config, GPT) if family == 'gpt' else (bert_config, Bert)
  cfg = preset(vocab_size=50, emb_dim=32, num_heads=2, mlp_dim=64, num_encoder_layers=1,
               num_decoder_layers=1, max_len=16, rescale_tied_output=True)
  with pytest.raises(ConfigError, match='rescale_tied_output'):
    model(cfg).init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))
