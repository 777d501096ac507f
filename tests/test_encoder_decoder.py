"""Tests for the encoder-decoder model, its config and translation decoding.

Models are tiny (width 16, two layers per stack, vocabulary 13) and the checks are properties
that hold for any weights: causality, padding invariance, cache == teacher forcing, greedy
decoding with the cache == greedy decoding by repeated full forward passes.
"""

import functools
import math

import flax.linen as nn
from flax.linen import meta
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.inference import search
from transformer_jax.parallel import sharding
from transformer_jax.special_tokens import EOS_ID, PAD_ID
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig, model_config_from_dict
from transformer_jax.models import EncoderDecoder, shift_right
from transformer_jax.tasks.translation import TranslationTask


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
  """Comparisons here are at ~1e-5; GPUs would otherwise multiply float32 in TF32."""
  with jax.default_matmul_precision('highest'):
    yield


VOCAB = 13
BASE = dict(vocab_size=VOCAB, emb_dim=16, num_heads=4, mlp_dim=32, num_encoder_layers=2,
            num_decoder_layers=2, max_len=16, dropout_rate=0.0, attention_dropout_rate=0.0)

CONFIGS = {
    # Vaswani et al.: Post-LN LayerNorm, sinusoidal positions, ReLU, biases, tied output.
    'original':
        TransformerConfig(**BASE),
    # T5-style: Pre-RMSNorm, relative position bias, gated GELU, no biases.
    't5':
        TransformerConfig(**BASE, norm_position='pre', norm_type='rmsnorm', position='relative',
                          relative_buckets=8, relative_max_distance=16, activation='geglu',
                          use_bias=False, scale_embeddings=False),
    # The remaining two differ from the original only in positions and key/value heads.
    'learned_gqa':
        TransformerConfig(**BASE, position='learned', num_kv_heads=2),
    'rotary':
        TransformerConfig(**BASE, position='rotary', num_kv_heads=2),
}


@functools.partial(jax.jit, static_argnums=0, static_argnames=('method', 'mutable'))
def jit_apply(model, variables, *args, **kwargs):
  """`model.apply` compiled whole: once per model and shapes, instead of op by op (the eager
  path compiles each small op on first use: seconds per config on CPU)."""
  return model.apply(variables, *args, **kwargs)


def tokens(seed, shape, low=2):
  """Random non-PAD, non-EOS token ids."""
  return jax.random.randint(jax.random.key(seed), shape, low, VOCAB, jnp.int32)


def source_batch():
  """Two rows; row 1 ends in two PAD columns."""
  inputs = tokens(0, (2, 7))
  return inputs.at[1, -2:].set(PAD_ID)


def abstract_params(cfg, inputs=None, targets=None):
  """The boxed params tree as shapes, dtypes and logical names (traced, nothing compiled)."""
  inputs = source_batch() if inputs is None else inputs
  targets = tokens(1, (2, 6)) if targets is None else targets
  return jax.eval_shape(EncoderDecoder(cfg).init, jax.random.key(0), inputs, targets)['params']


def random_params(cfg, seed=0, **kwargs):
  """Plain params of the model's shapes with random values at initialiser-like scales.

  Every property tested with them holds for any weights; skipping the real initialisers saves
  compiling them (seconds per config on CPU).
  """
  rng = np.random.default_rng(seed)

  def value(path, leaf):
    noise = rng.normal(size=leaf.shape)
    name = path[-1].key
    if name == 'scale':
      noise = 1.0 + 0.1 * noise
    elif name == 'bias':
      noise = 0.1 * noise
    else:  # Kernels and tables: 1 / sqrt(fan-in).
      noise = noise / np.sqrt(math.prod(leaf.shape[:-1]))
    return jnp.asarray(noise, leaf.dtype)

  return jax.tree_util.tree_map_with_path(value, meta.unbox(abstract_params(cfg, **kwargs)))


@pytest.fixture(scope='module')
def params_by_config():
  return {name: random_params(cfg) for name, cfg in CONFIGS.items()}


# ---------------------------------------------------------------------------------------------
# Shapes and parameters


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_logits_shape_and_dtype(name, params_by_config):
  inputs, targets = source_batch(), tokens(1, (2, 6))
  logits = jit_apply(EncoderDecoder(CONFIGS[name]), {'params': params_by_config[name]}, inputs,
                     targets)
  assert logits.shape == (2, 6, VOCAB)
  assert logits.dtype == jnp.float32
  assert np.all(np.isfinite(logits))


def test_configs_build_the_parts_they_name(params_by_config):
  original, t5 = params_by_config['original'], params_by_config['t5']
  layer = original['decoder']['layer_0']
  assert {'self_attention', 'cross_attention', 'mlp'} <= set(layer)
  assert 'cross_attention' not in original['encoder']['layer_0']
  assert 'final_norm' not in original['decoder']  # Post-LN has no final norm.
  assert 'wi' in layer['mlp'] and 'bias' in layer['mlp']['wi']
  assert 'decoder_input' not in original  # Sinusoidal positions have no parameters.
  # T5: one shared relative bias per stack, a final norm, gated MLP, no biases anywhere.
  assert 'relative_bias' in t5['encoder'] and 'relative_bias' in t5['decoder']
  assert 'final_norm' in t5['decoder'] and set(t5['decoder']['final_norm']) == {'scale'}
  assert {'wi_gate', 'wi_up'} <= set(t5['decoder']['layer_0']['mlp'])
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(t5)]
  assert not [p for p in paths if 'bias' in p and 'relative_bias' not in p]
  # Learned positions and GQA.
  gqa = params_by_config['learned_gqa']
  assert gqa['decoder_input']['position_embedding']['embedding'].shape == (16, 16)
  assert gqa['encoder']['layer_0']['self_attention']['key']['kernel'].shape == (16, 2, 4)
  assert params_by_config['rotary']['decoder']['layer_0']['self_attention']['key'][
      'kernel'].shape == (16, 2, 4)


def test_separate_vocabularies_have_separate_embeddings():
  cfg = CONFIGS['original'].replace(source_vocab_size=17, share_embeddings=False)
  # Source ids 13..16 exist only in the source vocabulary.
  inputs = jax.random.randint(jax.random.key(0), (2, 7), 1, 17).at[:, 0].set(16)
  params = random_params(cfg, inputs=inputs)
  assert params['source_embed']['embedding'].shape == (17, 16)
  assert params['target_embed']['embedding'].shape == (VOCAB, 16)
  logits = jit_apply(EncoderDecoder(cfg), {'params': params}, inputs, tokens(1, (2, 6)))
  assert logits.shape == (2, 6, VOCAB)
  assert np.all(np.isfinite(logits))  # An out-of-range lookup would give NaN.
  # The source table is what the encoder reads.
  changed = jax.tree.map(lambda x: x, params)
  changed['source_embed'] = {'embedding': params['source_embed']['embedding'].at[16].add(1.0)}
  assert np.max(
      np.abs(
          jit_apply(EncoderDecoder(cfg), {'params': changed}, inputs, tokens(1, (2, 6))) -
          logits)) > 1e-4
  # Shared: one table only.
  shared = abstract_params(CONFIGS['original'])
  assert 'source_embed' not in shared and 'target_embed' in shared


def test_shared_embeddings_need_equal_vocabularies():
  cfg = CONFIGS['original'].replace(source_vocab_size=17, share_embeddings=True)
  with pytest.raises(ConfigError, match='17'):
    abstract_params(cfg)


def test_untied_output_uses_its_own_projection():
  cfg = CONFIGS['original'].replace(tie_output=False)
  boxed = abstract_params(cfg)
  params = random_params(cfg)
  assert params['logits_dense']['kernel'].shape == (16, VOCAB)
  assert tuple(nn.get_partition_spec(boxed)['logits_dense']['kernel']) == ('embed', 'vocab')
  inputs, targets = source_batch(), tokens(1, (2, 6))
  model = EncoderDecoder(cfg)
  logits = jit_apply(model, {'params': params}, inputs, targets)
  # Logits are linear in the output kernel (no bias): scaling it scales them.
  scaled = jax.tree.map(lambda x: x, params)
  scaled['logits_dense'] = {'kernel': 2.0 * params['logits_dense']['kernel']}
  np.testing.assert_allclose(jit_apply(model, {'params': scaled}, inputs, targets), 2.0 * logits,
                             rtol=1e-5, atol=1e-5)


def test_tied_output_is_the_embedding_transpose(params_by_config):
  cfg = CONFIGS['original']
  params = params_by_config['original']
  inputs, targets = source_batch(), tokens(1, (2, 6))
  model = EncoderDecoder(cfg)
  logits, state = model.apply({'params': params}, inputs, targets,
                              capture_intermediates=lambda mdl, _: mdl.name == 'decoder',
                              mutable=['intermediates'])
  (hidden,) = state['intermediates']['decoder']['__call__']
  expected = np.asarray(hidden, np.float64) @ np.asarray(params['target_embed']['embedding'],
                                                         np.float64).T
  np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


ALLOWED_AXES = {name for name, _ in sharding.LOGICAL_AXIS_RULES}


@pytest.mark.parametrize('name', sorted(CONFIGS) + ['untied_separate'])
def test_every_param_has_known_logical_axis_names(name):
  if name == 'untied_separate':
    cfg = CONFIGS['t5'].replace(tie_output=False, share_embeddings=False, source_vocab_size=17)
  else:
    cfg = CONFIGS[name]
  boxed = abstract_params(cfg)
  leaves = jax.tree_util.tree_leaves_with_path(
      boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  assert len(leaves) > 10
  for path, leaf in leaves:
    where = jax.tree_util.keystr(path)
    assert isinstance(leaf, nn.LogicallyPartitioned), f'{where} has no logical axis names'
    names = leaf.names
    assert len(names) == leaf.value.ndim, where
    assert None not in names and set(names) <= ALLOWED_AXES, f'{where}: {names}'


# ---------------------------------------------------------------------------------------------
# Causality and padding


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_decoder_is_causal(name, params_by_config):
  model, params = EncoderDecoder(CONFIGS[name]), params_by_config[name]
  inputs, targets = source_batch(), tokens(1, (2, 6))
  logits = jit_apply(model, {'params': params}, inputs, targets)
  for t in (1, 3):
    # The decoder reads targets shifted right: logits at <= t see targets < t only.
    changed = targets.at[:, t:].set((targets[:, t:] + 1) % VOCAB)
    logits2 = jit_apply(model, {'params': params}, inputs, changed)
    np.testing.assert_allclose(logits2[:, :t + 1], logits[:, :t + 1], rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(logits2[:, t + 1:] - logits[:, t + 1:])) > 1e-4


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_extra_source_padding_does_not_change_logits(name, params_by_config):
  model, params = EncoderDecoder(CONFIGS[name]), params_by_config[name]
  inputs, targets = source_batch(), tokens(1, (2, 6))
  logits = jit_apply(model, {'params': params}, inputs, targets)
  padded = jnp.pad(inputs, ((0, 0), (0, 4)), constant_values=PAD_ID)
  np.testing.assert_allclose(jit_apply(model, {'params': params}, padded, targets), logits,
                             rtol=1e-5, atol=1e-5)
  # The source does matter: changing a real token changes the logits.
  changed = inputs.at[:, 0].set((inputs[:, 0] + 1) % VOCAB + 1)
  assert np.max(np.abs(jit_apply(model, {'params': params}, changed, targets) - logits)) > 1e-4


def test_shift_right_delays_targets_by_one():
  targets = jnp.array([[5, 6, 7], [8, 1, 0]])
  np.testing.assert_array_equal(shift_right(targets), [[0, 5, 6], [0, 8, 1]])
  np.testing.assert_array_equal(shift_right(targets, start_id=3), [[3, 5, 6], [3, 8, 1]])


# ---------------------------------------------------------------------------------------------
# Incremental decoding


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_incremental_decode_with_cache_matches_teacher_forcing(name, params_by_config):
  cfg, params = CONFIGS[name], params_by_config[name]
  inputs, targets = source_batch(), tokens(1, (2, 6))
  model = EncoderDecoder(cfg)
  full = jit_apply(model, {'params': params}, inputs, targets)
  encoded = jit_apply(model, {'params': params}, inputs, method=EncoderDecoder.encode)

  decoder = EncoderDecoder(cfg.replace(decode=True))
  cache = decoder.init(jax.random.key(0), inputs, targets)['cache']  # Allocates, full length.
  decoder_inputs = shift_right(targets)
  for t in range(targets.shape[1]):
    logits, state = jit_apply(decoder, {'params': params, 'cache': cache}, encoded, inputs,
                              decoder_inputs[:, t:t + 1], method=EncoderDecoder.decode,
                              mutable=('cache',))
    cache = state['cache']
    assert logits.shape == (2, 1, VOCAB)
    np.testing.assert_allclose(logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5,
                               err_msg=f'{name} step {t}')
  # Every row's own counter (StepPositions) has moved past the targets.
  np.testing.assert_array_equal(cache['decoder_positions']['position'], [targets.shape[1]] * 2)


# ---------------------------------------------------------------------------------------------
# Translation decoding

TRANSLATION_CFG = CONFIGS['original'].replace(tie_output=False)


def sharpened(params, factor):
  """The model with all logits multiplied by `factor` (near-deterministic for a large one).

  The config is Post-LN with an untied output without bias: logits = y @ W, where y = n * g + b
  is the last norm's output, so scaling g and b scales the logits.
  """
  params = jax.tree.map(lambda x: x, params)
  norm = params['decoder']['layer_1']['mlp_norm']
  norm['scale'], norm['bias'] = factor * norm['scale'], factor * norm['bias']
  return params


def greedy_by_full_passes(apply, params, inputs, max_len):
  """Greedy decoding without a cache: one teacher-forced forward pass (`apply`) per step."""
  batch = inputs.shape[0]
  out = np.zeros((batch, max_len), np.int32)
  finished = np.zeros(batch, bool)
  for t in range(max_len):
    logits = apply({'params': params}, inputs, jnp.asarray(out))
    next_tokens = np.asarray(jnp.argmax(logits[:, t], axis=-1))
    next_tokens = np.where(finished, PAD_ID, next_tokens)
    out[:, t] = next_tokens
    finished |= next_tokens == EOS_ID
  return out


def eos_positions(sequences):
  """Index of each row's first EOS, or None."""
  return [
      int(np.flatnonzero(r == EOS_ID)[0]) if EOS_ID in r else None for r in np.asarray(sequences)
  ]


def check_pad_after_eos(sequences):
  for row, eos in zip(np.asarray(sequences), eos_positions(sequences)):
    if eos is not None:
      np.testing.assert_array_equal(row[eos + 1:], PAD_ID)


def sequence_log_probs(apply, params, inputs, sequences):
  """Model log-probability of each row up to and including its first EOS."""
  seqs = jnp.asarray(sequences)
  log_probs = jax.nn.log_softmax(apply({'params': params}, inputs, seqs), axis=-1)
  token_lp = jnp.take_along_axis(log_probs, seqs[..., None], axis=-1)[..., 0]
  after_eos = jnp.cumsum(jnp.cumsum(seqs == EOS_ID, axis=1), axis=1) > 1
  return np.asarray(jnp.sum(jnp.where(after_eos, 0.0, token_lp), axis=1))


class JitTask(TranslationTask):
  """A TranslationTask whose predict_tokens is compiled once per (max_len, beam, alpha)."""

  def predict_tokens(self, params, inputs, *, max_len, beam_size, alpha):
    key = (max_len, beam_size, alpha)
    if key not in self._predict_fns:
      self._predict_fns[key] = jax.jit(
          functools.partial(super().predict_tokens, max_len=max_len, beam_size=beam_size,
                            alpha=alpha))
    return self._predict_fns[key](params, inputs)


@pytest.fixture(scope='module')
def translation_setup():
  task = JitTask(TRANSLATION_CFG)
  # Seed 2 makes greedy decoding stop at different steps in different rows (checked below).
  params = random_params(TRANSLATION_CFG, seed=2)
  inputs = tokens(5, (4, 6)).at[2, -3:].set(PAD_ID)
  # Teacher-forced logits, compiled once for the reference computations.
  task.apply = jax.jit(task.model.apply)
  return task, params, inputs


@pytest.mark.slow
def test_predict_tokens_greedy_matches_greedy_by_full_passes(translation_setup):
  task, params, inputs = translation_setup
  max_len = 8
  predicted = np.asarray(
      task.predict_tokens(params, inputs, max_len=max_len, beam_size=1, alpha=0.6))
  expected = greedy_by_full_passes(task.apply, params, inputs, max_len)
  assert predicted.shape == (4, max_len) and predicted.dtype == np.int32
  np.testing.assert_array_equal(predicted, expected)
  # The fixture exercises stopping: rows end at different steps, one not at all.
  ends = eos_positions(expected)
  assert None in ends and len(set(ends)) >= 3, ends
  check_pad_after_eos(predicted)


@pytest.mark.slow
def test_beam_search_with_one_beam_is_greedy(translation_setup, monkeypatch):
  """Routes predict_tokens' beam-1 path through beam_search instead of greedy_search."""
  task, params, inputs = translation_setup
  max_len = 8
  expected = greedy_by_full_passes(task.apply, params, inputs, max_len)
  calls = []

  def beam_as_greedy(tokens_to_logits, cache, *, batch_size, max_len, eos_id):
    calls.append(batch_size)
    sequences, _ = search.beam_search(tokens_to_logits, cache, batch_size=batch_size, beam_size=1,
                                      max_len=max_len, alpha=0.6, eos_id=eos_id)
    return sequences[:, 0]

  monkeypatch.setattr(search, 'greedy_search', beam_as_greedy)
  predicted = TranslationTask.predict_tokens(task, params, inputs, max_len=max_len, beam_size=1,
                                             alpha=0.6)
  assert calls == [4]
  np.testing.assert_array_equal(predicted, expected)


def test_predict_tokens_beam_search_returns_valid_sequences(translation_setup):
  task, params, inputs = translation_setup
  max_len = 8
  predicted = np.asarray(
      task.predict_tokens(params, inputs, max_len=max_len, beam_size=4, alpha=0.6))
  assert predicted.shape == (4, max_len) and predicted.dtype == np.int32
  assert predicted.min() >= 0 and predicted.max() < VOCAB
  check_pad_after_eos(predicted)
  assert any(e is not None for e in eos_positions(predicted))


def test_beam_search_agrees_with_greedy_on_a_near_deterministic_model(translation_setup):
  """If greedy's finished output has probability > 0.9, every other finished hypothesis has
  probability < 0.1, so it loses even after the length penalty; beam 4 must return it."""
  task, params, inputs = translation_setup
  params = sharpened(params, 100.0)
  max_len = 8
  greedy = np.asarray(task.predict_tokens(params, inputs, max_len=max_len, beam_size=1, alpha=0.6))
  beam = np.asarray(task.predict_tokens(params, inputs, max_len=max_len, beam_size=4, alpha=0.6))
  finished = np.array([e is not None for e in eos_positions(greedy)])
  assert finished.sum() >= 2
  log_probs = sequence_log_probs(task.apply, params, inputs, greedy)
  assert np.all(log_probs[finished] > np.log(0.9)), log_probs  # The premise.
  np.testing.assert_array_equal(beam[finished], greedy[finished])


# ---------------------------------------------------------------------------------------------
# bfloat16


@pytest.mark.parametrize('name', ['original', 't5'])
def test_bfloat16_compute_is_close_to_float32(name, params_by_config):
  cfg, params = CONFIGS[name], params_by_config[name]
  inputs, targets = source_batch(), tokens(1, (2, 6))
  bf16 = cfg.replace(dtype=jnp.bfloat16, param_dtype=jnp.float32)
  abstract = meta.unbox(abstract_params(bf16))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(abstract))
  logits16 = jit_apply(EncoderDecoder(bf16), {'params': params}, inputs, targets)
  logits32 = jit_apply(EncoderDecoder(cfg), {'params': params}, inputs, targets)
  assert logits16.dtype == jnp.float32
  assert np.all(np.isfinite(logits16))
  scale = float(np.std(logits32))
  np.testing.assert_allclose(logits16, logits32, atol=0.1 * scale + 0.05)
  assert np.max(np.abs(logits16 - logits32)) > 0  # It really computed in bf16.


# ---------------------------------------------------------------------------------------------
# Config validation


def test_heads_must_divide_width_and_message_names_both():
  with pytest.raises(ConfigError) as info:
    TransformerConfig(emb_dim=30, num_heads=4)
  assert '30' in str(info.value) and '4' in str(info.value)
  # An explicit head_dim lifts the restriction.
  assert TransformerConfig(emb_dim=30, num_heads=4, head_dim=8).head_dim == 8


def test_kv_heads_must_divide_heads():
  with pytest.raises(ConfigError, match='num_kv_heads=3'):
    TransformerConfig(emb_dim=16, num_heads=4, num_kv_heads=3)


@pytest.mark.parametrize('field, value', [
    ('norm_type', 'batchnorm'),
    ('norm_position', 'middle'),
    ('position', 'alibi'),
    ('activation', 'tanh'),
    ('attention_implementation', 'flash'),
])
def test_bad_choice_names_raise_config_error_naming_the_value(field, value):
  with pytest.raises(ConfigError) as info:
    TransformerConfig(**{field: value})
  assert field in str(info.value) and repr(value) in str(info.value)


@pytest.mark.parametrize('changes',
                         [{'emb_dim': 0}, {'dropout_rate': 1.0}, {'num_encoder_layers': -1},
                          {'position': 'rotary', 'emb_dim': 12, 'num_heads': 4}])
def test_other_invalid_values_raise_config_error(changes):
  with pytest.raises(ConfigError):
    TransformerConfig(**changes)


def test_replace_revalidates():
  with pytest.raises(ConfigError):
    CONFIGS['original'].replace(num_heads=5)


def test_model_config_from_dict_names_unknown_keys():
  with pytest.raises(ConfigError) as info:
    model_config_from_dict({'emb_dim': 16, 'num_heads': 4, 'num_layerz': 3})
  assert 'num_layerz' in str(info.value)
  with pytest.raises(ConfigError, match='bogus_override'):
    model_config_from_dict({}, bogus_override=1)


def test_model_config_from_dict_maps_dtype_strings_and_applies_overrides():
  cfg = model_config_from_dict(
      {'emb_dim': 16, 'num_heads': 4, 'dtype': 'bfloat16', 'param_dtype': 'float32'}, num_heads=2)
  assert cfg.dtype == jnp.bfloat16 and cfg.param_dtype == jnp.float32
  assert cfg.num_heads == 2 and cfg.emb_dim == 16
  assert model_config_from_dict({'dtype': 'float16'}).dtype == jnp.float16
  with pytest.raises(ConfigError, match='float64'):
    model_config_from_dict({'dtype': 'float64'})
