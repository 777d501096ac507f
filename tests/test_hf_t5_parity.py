"""Imported Hugging Face T5 weights give the logits and greedy translations of transformers' own
T5ForConditionalGeneration, and exported ones load back into transformers with the same logits.

Needs the `parity` extra (torch, transformers, safetensors). No download: the reference models
are small seeded random T5s, v1.0 (ReLU, tied output rescaled by d_model**-0.5) and v1.1
(gated GELU, untied lm_head), with head_dim (d_kv 16) != d_model / num_heads. Tolerance: max
|difference| <= 1e-4 in float32.
"""

import functools
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch', reason='needs the parity extra: pip install -e ".[parity]"')
transformers = pytest.importorskip('transformers',
                                   reason='needs the parity extra: pip install -e ".[parity]"')
safetensors_numpy = pytest.importorskip('safetensors.numpy')

from transformer_jax.convert import hf_t5
from transformer_jax.errors import ConfigError
from transformer_jax.layers.position import relative_position_bucket
from transformer_jax.models.encoder_decoder import EncoderDecoder, shift_right, t5_config
from transformer_jax.tasks.translation import TranslationTask

pytestmark = pytest.mark.parity

VOCAB = 200
SMALL = dict(vocab_size=VOCAB, d_model=64, d_kv=16, num_heads=4, d_ff=96, num_layers=2,
             num_decoder_layers=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
             eos_token_id=1)
VERSIONS = {
    '1.0': dict(feed_forward_proj='relu'),
    '1.1': dict(feed_forward_proj='gated-gelu', tie_word_embeddings=False),
}


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
  with jax.default_matmul_precision('highest'):
    yield


def _hf_model(version):
  torch.manual_seed(0)
  model = transformers.T5ForConditionalGeneration(
      transformers.T5Config(**SMALL, **VERSIONS[version]))
  if version == '1.1':
    # transformers 5 ties lm_head to `shared` whatever tie_word_embeddings says (that flag now
    # only turns the rescale off); a real v1.1 checkpoint has its own lm_head.weight, and HF
    # leaves such a head untied. Give the model one.
    model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
  # Weights away from HF's init: norms at 1 would hide a mis-mapped norm, and at HF's scales
  # (embeddings N(0, 1), small projections) greedy decoding just repeats one token. At these
  # scales every sublayer matters to the logits and the greedy translations vary (two rows of
  # the v1.1 model end in EOS early). Queries get 1/sqrt(d_kv) of the others' gain, as T5's
  # init gives them: unscaled attention logits would otherwise be so sharp that float32
  # rounding alone (ours or HF's, against a float64 run) reaches 1e-4.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'relative_attention_bias' in name:
        p.normal_(0.0, 1.0)
      elif name in ('shared.weight', 'lm_head.weight'):
        p.normal_(0.0, 0.3)
      elif p.ndim == 2:  # linear layers, [out, in]: gain 2 (queries 0.5)
        gain = 0.5 if name.endswith('.q.weight') else 2.0
        p.normal_(0.0, gain / p.shape[1]**0.5)
      else:  # norms
        p.add_(0.1 * torch.randn_like(p))
  return model.eval()


@pytest.fixture(scope='module', params=sorted(VERSIONS))
def saved(request, tmp_path_factory):
  """(version, HF model, directory of its save_pretrained checkpoint)."""
  model = _hf_model(request.param)
  directory = str(tmp_path_factory.mktemp(f't5_v{request.param}'))
  model.save_pretrained(directory)
  assert os.path.exists(os.path.join(directory, 'model.safetensors'))
  return request.param, model, directory


def _batch(seed=0):
  """Sources [3, 12] (rows 1 and 2 padded after 7 and 3 tokens), targets [3, 10]."""
  rng = np.random.default_rng(seed)
  inputs = rng.integers(2, VOCAB, (3, 12)).astype(np.int32)
  valid = np.arange(12)[None] < np.array([12, 7, 3])[:, None]
  inputs = np.where(valid, inputs, 0)
  inputs[np.arange(3), valid.sum(1) - 1] = 1  # each source ends in EOS, as T5's do
  targets = rng.integers(2, VOCAB, (3, 10)).astype(np.int32)
  return inputs, valid, targets


def _hf_logits(model, inputs, valid, decoder_inputs):
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(inputs).long(),
                 attention_mask=torch.from_numpy(valid.astype(np.int64)),
                 decoder_input_ids=torch.tensor(np.array(decoder_inputs)).long()).logits.numpy()


def _our_logits(cfg, params, inputs, targets):
  return np.asarray(EncoderDecoder(cfg).apply({'params': params}, inputs, targets))


def test_config_and_param_tree(saved):
  version, _, directory = saved
  imported_model = hf_t5.load(directory)
  cfg, params = imported_model.config, imported_model.params
  v10 = version == '1.0'
  assert (cfg.emb_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim) == (64, 4, 16, 96)
  assert (cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.vocab_size) == (2, 2, VOCAB)
  assert (cfg.relative_buckets, cfg.relative_max_distance, cfg.norm_epsilon) == (32, 128, 1e-6)
  assert cfg.activation == ('relu' if v10 else 'geglu')
  assert cfg.tie_output == cfg.rescale_tied_output == v10
  assert not cfg.scale_attention_scores and cfg.max_len == hf_t5.DEFAULT_MAX_LEN
  # The switches are those of t5_config at these sizes.
  sizes = {
      k: getattr(cfg, k) for k in ('vocab_size', 'emb_dim', 'num_heads', 'head_dim', 'mlp_dim',
                                  'num_encoder_layers', 'num_decoder_layers')
  }
  assert cfg == t5_config(version, **sizes, dropout_rate=0.0, attention_dropout_rate=0.0)
  dummy = jnp.ones((1, 4), jnp.int32)
  init = jax.eval_shape(EncoderDecoder(cfg).init, jax.random.key(0), dummy, dummy)
  shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
  assert shapes(params) == shapes(nn.meta.unbox(init['params']))


def test_logits_match_transformers(saved):
  version, model, directory = saved
  imported_model = hf_t5.load(directory)
  cfg, params = imported_model.config, imported_model.params
  inputs, valid, targets = _batch()
  ours = _our_logits(cfg, params, inputs, targets)
  theirs = _hf_logits(model, inputs, valid, shift_right(targets))
  assert ours.shape == theirs.shape == (3, 10, VOCAB)
  assert np.abs(theirs).max() > 0.5  # not a comparison of near-zero logits
  diff = float(np.abs(ours - theirs).max())
  print(f'T5 v{version}: max |logit difference| vs transformers = {diff:.3g}')
  assert diff <= 1e-4


def test_greedy_generation_matches_transformers(saved):
  version, model, directory = saved
  imported_model = hf_t5.load(directory)
  cfg, params = imported_model.config, imported_model.params
  inputs, valid, _ = _batch(seed=1)
  # beam_size 1 is greedy_search (alpha is not used).
  predict = jax.jit(
      functools.partial(TranslationTask(cfg).predict_tokens, max_len=32, beam_size=1, alpha=0.6))
  ours = np.asarray(predict(params, jnp.asarray(inputs)))
  with torch.no_grad():
    theirs = model.generate(input_ids=torch.from_numpy(inputs).long(),
                            attention_mask=torch.from_numpy(valid.astype(np.int64)),
                            do_sample=False, num_beams=1, max_new_tokens=32).numpy()
  assert (theirs[:, 0] == 0).all()  # the decoder start token, which ours leaves out
  theirs = np.pad(theirs[:, 1:], ((0, 0), (0, 33 - theirs.shape[1])))  # PAD after EOS, as ours
  lengths = [int(np.argmax(row == 1)) + 1 if (row == 1).any() else 32 for row in theirs]
  print(f'T5 v{version}: greedy lengths {lengths}, distinct tokens {[len(set(r)) for r in ours]}')
  # A real comparison: varied tokens, not one repeated, and not an early EOS.
  assert max(lengths) >= 16 and max(len(set(row)) for row in ours) >= 6
  np.testing.assert_array_equal(ours, theirs)


def test_export_loads_in_transformers_with_the_same_logits(saved, tmp_path):
  version, model, directory = saved
  imported_model = hf_t5.load(directory)
  cfg, params = imported_model.config, imported_model.params
  state = hf_t5.export_t5_state_dict(cfg, params)
  # The tensors save_pretrained writes, bitwise (ours came from them).
  written = safetensors_numpy.load_file(os.path.join(directory, 'model.safetensors'))
  assert sorted(state) == sorted(written)
  for name, value in written.items():
    np.testing.assert_array_equal(state[name], value, err_msg=name)
  # Written as any exporter would: safetensors + config.json, then read by transformers.
  out = tmp_path / 'exported'
  out.mkdir()
  safetensors_numpy.save_file(state, str(out / 'model.safetensors'), metadata={'format': 'pt'})
  (out / 'config.json').write_text(json.dumps(hf_t5.t5_config_to_hf(cfg), indent=2))
  reloaded, info = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(out),
                                                                      output_loading_info=True)
  reloaded.eval()
  assert not info['missing_keys'] and not info['unexpected_keys'], info
  assert type(reloaded).__name__ == 'T5ForConditionalGeneration'
  assert reloaded.config.scale_decoder_outputs == (version == '1.0')
  untied = reloaded.lm_head.weight.data_ptr() != reloaded.shared.weight.data_ptr()
  assert untied == (version == '1.1')
  inputs, valid, targets = _batch(seed=2)
  theirs = _hf_logits(reloaded, inputs, valid, shift_right(targets))
  diff = float(np.abs(_our_logits(cfg, params, inputs, targets) - theirs).max())
  print(f'T5 v{version}: exported, max |logit difference| vs transformers = {diff:.3g}')
  assert diff <= 1e-4
  # And our importer reads the export back: same config, every tensor bitwise.
  imported_model = hf_t5.load(str(out))
  cfg2, params2 = imported_model.config, imported_model.params
  assert cfg2 == cfg
  assert jax.tree.structure(params2) == jax.tree.structure(params)
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_buckets_equal_transformers_bucketing():
  """Ours against HF's `_relative_position_bucket`, offsets -2000..2000, for T5's own sizes
  and for sizes where XLA's arithmetic (division by a constant as a multiplication) put the
  formula one bucket off at exact boundaries: 128/100 causal at offset -80, 20/1000 causal at
  -100, 6/100 bidirectional at -10 and 10."""
  bucket_fn = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket
  relative = np.arange(-2000, 2001)
  for num_buckets, max_distance in ((32, 128), (128, 100), (20, 1000), (6, 100), (8, 16)):
    for bidirectional in (True, False):
      theirs = bucket_fn(torch.from_numpy(relative), bidirectional=bidirectional,
                         num_buckets=num_buckets, max_distance=max_distance).numpy()
      ours = relative_position_bucket(jnp.asarray(relative, jnp.int32), bidirectional, num_buckets,
                                      max_distance)
      np.testing.assert_array_equal(ours, theirs,
                                    err_msg=f'{num_buckets}, {max_distance}, {bidirectional}')


# ---------------------------------------------------------------------------------------------
# Bad input: one ConfigError line naming the cause.


def _one_line_error(fn, *args, **kwargs) -> str:
  with pytest.raises(ConfigError) as info:
    fn(*args, **kwargs)
  message = str(info.value)
  assert '\n' not in message
  return message


@pytest.mark.parametrize('family', ['bert', 'gpt2'])
def test_another_family_is_refused_naming_its_model_type(family, tmp_path):
  config = (transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=64)
            if family == 'bert' else transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2))
  config.to_json_file(str(tmp_path / 'config.json'))
  message = _one_line_error(hf_t5.load, str(tmp_path))
  assert f"model_type='{family}'" in message


@pytest.mark.parametrize('proj', ['gated-tanh', 'gelu-relu', 'gated-gelu-new', 'sigmoid'])
def test_unsupported_feed_forward_proj_is_named(proj):
  message = _one_line_error(hf_t5.t5_config_from_hf,
                            {**SMALL, 'model_type': 't5', 'feed_forward_proj': proj})
  assert f'feed_forward_proj={proj!r}' in message


@pytest.mark.parametrize('proj, activation', [('relu', 'relu'), ('gated-gelu', 'geglu'),
                                              ('gated-gelu_new', 'geglu'), ('gelu', 'gelu_exact'),
                                              ('gated-silu', 'swiglu')])
def test_feed_forward_proj_names_as_transformers_reads_them(proj, activation):
  cfg = hf_t5.t5_config_from_hf({**SMALL, 'feed_forward_proj': proj})
  assert cfg.activation == activation
  # transformers agrees that the gated ones are gated and on the function's name.
  hf = transformers.T5Config(**SMALL, feed_forward_proj=proj)
  assert hf.is_gated_act == (activation in ('geglu', 'swiglu'))
  assert hf_t5.t5_config_to_hf(cfg)['feed_forward_proj'] in (proj, 'gated-gelu')


def test_missing_mis_shaped_and_unknown_tensors_are_named(saved):
  version, _, directory = saved
  state = safetensors_numpy.load_file(os.path.join(directory, 'model.safetensors'))
  with open(os.path.join(directory, 'config.json')) as f:
    cfg = hf_t5.t5_config_from_hf(json.load(f), tie_output=version == '1.0')
  name = 'decoder.block.1.layer.2.DenseReluDense.wo.weight'
  message = _one_line_error(hf_t5.convert_t5_state_dict,
                            {k: v for k, v in state.items() if k != name}, cfg)
  assert message == f'checkpoint lacks parameter(s) {name} that the config implies'
  bad = dict(state, **{'encoder.block.0.layer.0.SelfAttention.q.weight': np.zeros((60, 64))})
  assert _one_line_error(hf_t5.convert_t5_state_dict, bad, cfg) == (
      'encoder.block.0.layer.0.SelfAttention.q.weight has shape (60, 64) but the config implies '
      '(64, 64)')
  extra = dict(state, **{'encoder.block.2.layer.0.layer_norm.weight': np.ones(64, np.float32)})
  assert 'unknown parameter(s) encoder.block.2.layer.0.layer_norm.weight' in _one_line_error(
      hf_t5.convert_t5_state_dict, extra, cfg)
  # The other version's MLP layout: wi against wi_0 and wi_1.
  other, stray = (('geglu', 'wi.weight') if version == '1.0' else ('relu', 'wi_0.weight'))
  assert (f'unknown parameter(s) decoder.block.0.layer.2.DenseReluDense.{stray}'
          in _one_line_error(hf_t5.convert_t5_state_dict, state, cfg.replace(activation=other)))
  if version == '1.1':  # an untied head given to a tied config
    assert 'lm_head.weight differs from shared.weight' in _one_line_error(
        hf_t5.convert_t5_state_dict, state, cfg.replace(tie_output=True))
