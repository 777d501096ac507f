"""Imported Hugging Face GPT-2 weights give the same logits as transformers' own model.

Needs the `parity` extra (torch, transformers, safetensors): `pip install -e ".[test,parity]"`. No
download: the reference model is built from a small config with seeded random weights.
"""

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

from transformer_jax.convert import hf_gpt2
from transformer_jax.errors import ConfigError
from transformer_jax.models.gpt import GPT

pytestmark = pytest.mark.parity

HF_CONFIG = dict(n_layer=2, n_head=4, n_embd=64, n_positions=128, vocab_size=101, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0, activation_function='gelu_new',
                 layer_norm_epsilon=1e-5, bos_token_id=100, eos_token_id=100)


def _hf_model(**overrides):
  torch.manual_seed(0)
  model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**HF_CONFIG, **overrides}))
  # HF initialises biases to 0 and norms to 1, which would hide a mis-mapped bias or norm:
  # perturb every parameter so each one matters to the logits.
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return model.eval()


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.numpy()


def _our_logits(cfg, params, tokens: np.ndarray) -> np.ndarray:
  return np.asarray(GPT(cfg).apply({'params': params}, jnp.asarray(tokens)))


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """(HF model, directory of its safetensors checkpoint)."""
  model = _hf_model()
  directory = str(tmp_path_factory.mktemp('gpt2'))
  model.save_pretrained(directory, safe_serialization=True)
  assert os.path.exists(os.path.join(directory, 'model.safetensors'))
  return model, directory


def test_params_match_gpt_init_tree(saved):
  _, directory = saved
  imported_model = hf_gpt2.load(directory)
  cfg, params = imported_model.config, imported_model.params
  init = jax.eval_shape(GPT(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  expected = jax.tree.map(lambda x: (x.shape, x.dtype), nn.meta.unbox(init['params']))
  got = jax.tree.map(lambda x: (x.shape, x.dtype), params)
  assert got == expected


@pytest.mark.parametrize('batch,length', [(3, 17), (2, 128)])
def test_logits_match_transformers(saved, batch, length):
  model, directory = saved
  imported_model = hf_gpt2.load(directory)
  cfg, params = imported_model.config, imported_model.params
  assert (cfg.num_decoder_layers, cfg.num_heads, cfg.emb_dim, cfg.mlp_dim) == (2, 4, 64, 256)
  assert cfg.activation == 'gelu' and cfg.max_len == 128 and cfg.vocab_size == 101
  tokens = np.random.default_rng(batch).integers(0, 101, (batch, length), dtype=np.int32)
  ours, theirs = _our_logits(cfg, params, tokens), _hf_logits(model, tokens)
  assert ours.shape == theirs.shape == (batch, length, 101)
  assert np.abs(theirs).max() > 0.1  # the comparison is not between near-zero logits
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_untied_head_and_exact_gelu(tmp_path):
  model = _hf_model(tie_word_embeddings=False, activation_function='gelu')
  model.save_pretrained(str(tmp_path), safe_serialization=True)
  imported_model = hf_gpt2.load(str(tmp_path))
  cfg, params = imported_model.config, imported_model.params
  assert not cfg.tie_output and cfg.activation == 'gelu_exact'
  tokens = np.random.default_rng(5).integers(0, 101, (2, 33), dtype=np.int32)
  np.testing.assert_allclose(_our_logits(cfg, params, tokens), _hf_logits(model, tokens), rtol=0,
                             atol=1e-4)


@pytest.mark.slow
def test_legacy_pytorch_bin(saved, tmp_path):
  model, directory = saved
  # Recent transformers only write safetensors: write the legacy pickle-format file by hand.
  torch.save(model.state_dict(), str(tmp_path / 'pytorch_model.bin'))
  with open(os.path.join(directory, 'config.json')) as f:
    (tmp_path / 'config.json').write_text(f.read())
  imported_model = hf_gpt2.load(str(tmp_path))
  cfg, params = imported_model.config, imported_model.params
  tokens = np.random.default_rng(7).integers(0, 101, (2, 9), dtype=np.int32)
  np.testing.assert_allclose(_our_logits(cfg, params, tokens), _hf_logits(model, tokens), rtol=0,
                             atol=1e-4)


def _state_and_config(directory):
  state = safetensors_numpy.load_file(os.path.join(directory, 'model.safetensors'))
  with open(os.path.join(directory, 'config.json')) as f:
    cfg = hf_gpt2.gpt2_config_from_hf(json.load(f))
  return state, cfg


def test_buffers_and_unprefixed_names_are_accepted(saved):
  model, directory = saved
  state, cfg = _state_and_config(directory)
  bare = {k.removeprefix('transformer.'): v for k, v in state.items()}
  bare['h.0.attn.bias'] = np.tril(np.ones((1, 1, 128, 128), bool))  # old mask buffers
  bare['h.1.attn.masked_bias'] = np.float32(-1e4)
  bare['lm_head.weight'] = bare['wte.weight']
  params = hf_gpt2.convert_gpt2_state_dict(bare, cfg)
  tokens = np.random.default_rng(9).integers(0, 101, (1, 12), dtype=np.int32)
  np.testing.assert_allclose(_our_logits(cfg, params, tokens), _hf_logits(model, tokens), rtol=0,
                             atol=1e-4)


def test_unknown_key_is_named(saved, tmp_path):
  _, directory = saved
  state, _ = _state_and_config(directory)
  state['transformer.h.0.attn.c_attn.extra'] = np.zeros((3,), np.float32)
  safetensors_numpy.save_file(state, str(tmp_path / 'model.safetensors'))
  with open(os.path.join(directory, 'config.json')) as f:
    (tmp_path / 'config.json').write_text(f.read())
  with pytest.raises(ConfigError) as info:
    hf_gpt2.load(str(tmp_path))
  assert 'unknown parameter(s) transformer.h.0.attn.c_attn.extra' in str(info.value)


def test_wrong_shape_is_named(saved):
  _, directory = saved
  state, cfg = _state_and_config(directory)
  state['transformer.h.1.attn.c_attn.weight'] = np.zeros((64, 128), np.float32)
  with pytest.raises(ConfigError) as info:
    hf_gpt2.convert_gpt2_state_dict(state, cfg)
  assert str(info.value) == ('transformer.h.1.attn.c_attn.weight has shape (64, 128) but the '
                             'config implies (64, 192)')


def test_config_that_disagrees_with_weights_is_named(saved):
  _, directory = saved
  state, _ = _state_and_config(directory)
  with open(os.path.join(directory, 'config.json')) as f:
    cfg = hf_gpt2.gpt2_config_from_hf({**json.load(f), 'n_layer': 3})
  with pytest.raises(ConfigError, match=r'lacks parameter\(s\) h\.2\.'):
    hf_gpt2.convert_gpt2_state_dict(state, cfg)
  with open(os.path.join(directory, 'config.json')) as f:
    cfg = hf_gpt2.gpt2_config_from_hf({**json.load(f), 'n_layer': 1})
  with pytest.raises(ConfigError, match=r'unknown parameter\(s\) transformer\.h\.1\.'):
    hf_gpt2.convert_gpt2_state_dict(state, cfg)


def test_unsupported_config_is_refused():
  with pytest.raises(ConfigError, match='scale_attn_by_inverse_layer_idx'):
    hf_gpt2.gpt2_config_from_hf({**HF_CONFIG, 'scale_attn_by_inverse_layer_idx': True})
  with pytest.raises(ConfigError, match="model_type='llama'"):
    hf_gpt2.gpt2_config_from_hf({**HF_CONFIG, 'model_type': 'llama'})
  with pytest.raises(ConfigError, match="lacks 'n_head'"):
    hf_gpt2.gpt2_config_from_hf({k: v for k, v in HF_CONFIG.items() if k != 'n_head'})
