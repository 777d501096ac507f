"""Hugging Face LLaMA import and export agree with transformers' own `LlamaForCausalLM`.

Needs the `parity` extra (torch, transformers, safetensors). No download: the reference models
are small seeded random configs with grouped-query attention, a rope_theta and rms_norm_eps
away from the defaults (a mis-read one changes the logits), untied and tied heads. Tolerance:
max |difference| <= 1e-4 in float32; generation and round trips are exact.
"""

import copy
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

from transformer_jax.convert import hf_llama
from transformer_jax.errors import ConfigError
from transformer_jax.layers import scan_layout
from transformer_jax.models.gpt import GPT, gpt2_config

pytestmark = pytest.mark.parity

VOCAB = 256
HF_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=128,
                 rope_theta=500.0, rms_norm_eps=1e-3, bos_token_id=1, eos_token_id=2)


def _hf_model(**overrides):
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF_CONFIG, **overrides}))
  # HF initialises the norms to 1, which would hide a mis-mapped norm: perturb every parameter.
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return model.eval()


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.numpy()


def _our_logits(cfg, params, tokens: np.ndarray) -> np.ndarray:
  return np.asarray(GPT(cfg).apply({'params': params}, jnp.asarray(tokens)))


def _tokens(batch, length, seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, (batch, length), dtype=np.int32)


@pytest.fixture(scope='module', params=['untied', 'tied'])
def saved(request, tmp_path_factory):
  """(HF model, directory of its safetensors checkpoint), untied and tied output head."""
  model = _hf_model(tie_word_embeddings=request.param == 'tied')
  directory = str(tmp_path_factory.mktemp(f'llama_{request.param}'))
  model.save_pretrained(directory, safe_serialization=True)
  return model, directory


@pytest.fixture(scope='module')
def untied(tmp_path_factory):
  model = _hf_model()
  directory = str(tmp_path_factory.mktemp('llama'))
  model.save_pretrained(directory, safe_serialization=True)
  return model, directory


def test_config_and_params_match_gpt_init_tree(saved):
  model, directory = saved
  imported_model = hf_llama.load(directory)
  cfg, params = imported_model.config, imported_model.params
  tied = model.config.tie_word_embeddings
  assert (cfg.num_decoder_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.emb_dim,
          cfg.mlp_dim) == (2, 4, 2, 16, 64, 96)
  assert (cfg.rotary_base, cfg.norm_epsilon, cfg.max_len, cfg.tie_output) == (500.0, 1e-3, 128,
                                                                              tied)
  assert (cfg.position, cfg.norm_type, cfg.activation, cfg.use_bias) == ('rotary', 'rmsnorm',
                                                                         'swiglu', False)
  init = jax.eval_shape(GPT(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
  assert shapes(params) == shapes(nn.meta.unbox(init['params']))


def test_logits_match_transformers(saved):
  model, directory = saved
  imported_model = hf_llama.load(directory)
  cfg, params = imported_model.config, imported_model.params
  tokens = _tokens(3, 40)
  ours, theirs = _our_logits(cfg, params, tokens), _hf_logits(model, tokens)
  assert ours.shape == theirs.shape == (3, 40, VOCAB)
  assert np.abs(theirs).max() > 0.5  # the comparison is not between near-zero logits
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


def test_greedy_generation_matches_transformers(untied):
  from transformer_jax.tasks.lm import LanguageModelTask
  model, directory = untied
  imported_model = hf_llama.load(directory)
  cfg, params = imported_model.config, imported_model.params
  prompt = _tokens(2, 8, seed=3)
  # Our KV-cache decoding (rotary angles at the cached positions) against HF's.
  ours = LanguageModelTask(cfg).generate(params, prompt, 32, jax.random.key(0), temperature=0.0)
  model.generation_config.eos_token_id = None  # both run the full 32 tokens
  with torch.no_grad():
    theirs = model.generate(
        torch.from_numpy(prompt).long(), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
        do_sample=False, max_new_tokens=32, pad_token_id=0).numpy()[:, 8:]
  assert len(set(theirs.ravel().tolist())) > 4  # not a degenerate repetition of one token
  np.testing.assert_array_equal(ours, theirs)


def _write_hf_dir(directory, hf_config: dict, state: dict):
  """config.json + model.safetensors, as a user's export would leave them."""
  os.makedirs(directory)
  safetensors_numpy.save_file(state, os.path.join(directory, 'model.safetensors'),
                              metadata={'format': 'pt'})
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump(hf_config, f, indent=2)


def test_export_loads_in_transformers_and_round_trips_bitwise(saved, tmp_path):
  model, directory = saved
  imported_model = hf_llama.load(directory)
  cfg, params = imported_model.config, imported_model.params
  state = hf_llama.export_llama_state_dict(cfg, params)
  # The exported tensors are HF's own, bit for bit (a tied model has no separate head).
  original = {k: v.numpy() for k, v in model.state_dict().items()}
  if cfg.tie_output:
    del original['lm_head.weight']
  assert sorted(state) == sorted(original)
  for name, value in state.items():
    assert value.dtype == np.float32 and np.array_equal(value, original[name]), name
  # import(export(params)) == params, every tensor bitwise.
  again = hf_llama.convert_llama_state_dict(state, cfg)
  assert jax.tree.structure(again) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params)):
    assert a.dtype == b.dtype and np.array_equal(a, b)

  out = str(tmp_path / 'exported')
  hf_config = hf_llama.llama_config_to_hf(cfg, bos_token_id=1, eos_token_id=2)
  _write_hf_dir(out, hf_config, state)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(loaded).__name__ == 'LlamaForCausalLM'
  assert loaded.dtype == torch.float32
  assert (loaded.config.bos_token_id, loaded.config.eos_token_id) == (1, 2)
  assert loaded.config.rope_parameters['rope_theta'] == 500.0
  tokens = _tokens(2, 33, seed=4)
  ours = _our_logits(cfg, params, tokens)
  np.testing.assert_allclose(_hf_logits(loaded, tokens), ours, rtol=0, atol=1e-4)
  # What we wrote reads back as the same config.
  assert hf_llama.llama_config_from_hf(hf_config) == cfg


def test_export_takes_scanned_params_and_refuses_other_architectures(untied):
  _, directory = untied
  imported_model = hf_llama.load(directory)
  cfg, params = imported_model.config, imported_model.params
  unrolled = hf_llama.export_llama_state_dict(cfg, params)
  scanned = hf_llama.export_llama_state_dict(cfg, scan_layout.stack_layers(params))
  assert sorted(scanned) == sorted(unrolled)
  assert all(np.array_equal(scanned[k], unrolled[k]) for k in unrolled)
  with pytest.raises(ConfigError, match=r"model\.norm_type='layernorm' cannot be exported"):
    hf_llama.llama_config_to_hf(gpt2_config(vocab_size=50, emb_dim=32, num_heads=2))
  with pytest.raises(ConfigError, match='params have entries lm_head/kernel'):
    hf_llama.export_llama_state_dict(cfg.replace(tie_output=True), params)


def test_bfloat16_and_sharded_checkpoints(untied, tmp_path):
  model, _ = untied
  # Most LLaMA checkpoints are stored in bfloat16, which safetensors.numpy cannot read.
  bf16_dir, sharded_dir = str(tmp_path / 'bf16'), str(tmp_path / 'sharded')
  copy.deepcopy(model).to(torch.bfloat16).save_pretrained(bf16_dir, safe_serialization=True)
  imported_model = hf_llama.load(bf16_dir)
  cfg, params = imported_model.config, imported_model.params
  assert cfg.param_dtype == jnp.float32
  state = hf_llama.export_llama_state_dict(cfg, params)
  for name, value in model.state_dict().items():
    assert np.array_equal(state[name], value.to(torch.bfloat16).float().numpy()), name
  model.save_pretrained(sharded_dir, safe_serialization=True, max_shard_size='100KB')
  assert os.path.exists(os.path.join(sharded_dir, 'model.safetensors.index.json'))
  sharded = hf_llama.load(sharded_dir).params
  single = hf_llama.load(str(untied[1])).params
  for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
    assert np.array_equal(a, b)


def _state_and_config(directory):
  state = safetensors_numpy.load_file(os.path.join(directory, 'model.safetensors'))
  with open(os.path.join(directory, 'config.json')) as f:
    return state, hf_llama.llama_config_from_hf(json.load(f))


def test_bare_names_and_rotary_buffers_are_accepted(untied):
  model, directory = untied
  state, cfg = _state_and_config(directory)
  bare = {k.removeprefix('model.'): v for k, v in state.items()}  # a LlamaModel's names
  bare['layers.0.self_attn.rotary_emb.inv_freq'] = np.ones((8,), np.float32)  # transformers<4.31
  params = hf_llama.convert_llama_state_dict(bare, cfg)
  tokens = _tokens(1, 12, seed=9)
  np.testing.assert_allclose(_our_logits(cfg, params, tokens), _hf_logits(model, tokens), rtol=0,
                             atol=1e-4)


def _one_line_error(call) -> str:
  with pytest.raises(ConfigError) as info:
    call()
  message = str(info.value)
  assert '\n' not in message
  return message


def test_gpt2_directory_is_refused(tmp_path):
  gpt2 = transformers.GPT2LMHeadModel(
      transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=16, vocab_size=50))
  gpt2.save_pretrained(str(tmp_path), safe_serialization=True)
  message = _one_line_error(lambda: hf_llama.load(str(tmp_path)))
  assert "model_type='gpt2'" in message


def test_bad_tensors_are_named(untied, tmp_path):
  _, directory = untied
  state, cfg = _state_and_config(directory)
  missing = {k: v for k, v in state.items() if k != 'model.layers.1.mlp.up_proj.weight'}
  message = _one_line_error(lambda: hf_llama.convert_llama_state_dict(missing, cfg))
  assert message == ('checkpoint lacks parameter(s) model.layers.1.mlp.up_proj.weight that the '
                     'config implies')
  wrong = dict(state, **{'model.layers.0.self_attn.k_proj.weight': np.zeros((64, 64), np.float32)})
  message = _one_line_error(lambda: hf_llama.convert_llama_state_dict(wrong, cfg))
  assert message == ('model.layers.0.self_attn.k_proj.weight has shape (64, 64) but the config '
                     'implies (32, 64)')
  # Through the directory reader: an extra tensor, e.g. a bias our LLaMA does not have.
  extra = dict(state, **{'model.layers.0.self_attn.q_proj.bias': np.zeros((64,), np.float32)})
  with open(os.path.join(directory, 'config.json')) as f:
    _write_hf_dir(str(tmp_path / 'extra'), json.load(f), extra)
  message = _one_line_error(lambda: hf_llama.load(str(tmp_path / 'extra')))
  assert message.startswith('checkpoint has unknown parameter(s) '
                            'model.layers.0.self_attn.q_proj.bias: ')
  # A config with more layers than the weights.
  message = _one_line_error(
      lambda: hf_llama.convert_llama_state_dict(state, cfg.replace(num_decoder_layers=3)))
  assert message.startswith('checkpoint lacks parameter(s) model.layers.2.')
  # A tied config whose checkpoint carries a different head.
  message = _one_line_error(
      lambda: hf_llama.convert_llama_state_dict(state, cfg.replace(tie_output=True)))
  assert message.startswith('lm_head.weight differs from model.embed_tokens.weight')


@pytest.mark.parametrize('change,named', [
    (dict(rope_scaling={'type': 'linear', 'factor': 2.0}), "rope_type='linear'"),
    (dict(rope_parameters={'rope_type': 'llama3', 'rope_theta': 5e5, 'factor': 8.0}),
     "rope_type='llama3'"),
    (dict(attention_bias=True), 'attention_bias=True'),
    (dict(mlp_bias=True), 'mlp_bias=True'),
    (dict(hidden_act='gelu'), "hidden_act='gelu'"),
    (dict(model_type='mistral'), "model_type='mistral'"),
    (dict(hidden_size=None), "lacks 'hidden_size'"),
])
def test_unsupported_config_is_refused(change, named):
  hf_config = {k: v for k, v in {**HF_CONFIG, **change}.items() if v is not None}
  message = _one_line_error(lambda: hf_llama.llama_config_from_hf(hf_config))
  assert named in message


def test_rope_theta_spellings():
  old = hf_llama.llama_config_from_hf({**HF_CONFIG, 'rope_scaling': None})
  new = hf_llama.llama_config_from_hf({
      **{k: v for k, v in HF_CONFIG.items() if k != 'rope_theta'}, 'rope_parameters': {
          'rope_type': 'default', 'rope_theta': 500.0
      }
  })
  assert old.rotary_base == new.rotary_base == 500.0
  assert hf_llama.llama_config_from_hf({
      'num_attention_heads': 4, 'hidden_size': 64, 'vocab_size': 10, 'intermediate_size': 8,
      'num_hidden_layers': 1
  }).rotary_base == 10000.0
