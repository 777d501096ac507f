"""OPT, the family added through the registry (convert/families.py + convert/hf_opt.py): its
imported weights give transformers' logits, its export loads in transformers and round-trips
bitwise, and `experiments.generate --hf_dir` continues a prompt as transformers does.

Needs the `parity` extra; no download: a small OPT with seeded random weights.
"""

import gzip
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch', reason='needs the parity extra: pip install -e ".[parity]"')
transformers = pytest.importorskip('transformers',
                                   reason='needs the parity extra: pip install -e ".[parity]"')

from conftest import REPO_ROOT
from transformer_jax.convert import families
from transformer_jax.convert.export import write_hf_directory
from transformer_jax.data.hf_tokenizer import HFTokenizer
from transformer_jax.errors import ConfigError
from transformer_jax.models.gpt import GPT

pytestmark = pytest.mark.parity

VOCAB = 300
HF_CONFIG = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                 num_attention_heads=4, max_position_embeddings=64, dropout=0.0,
                 attention_dropout=0.0, activation_function='relu')


def hf_model(**overrides):
  torch.manual_seed(0)
  model = transformers.OPTForCausalLM(transformers.OPTConfig(**{**HF_CONFIG, **overrides}))
  # HF starts biases at 0 and norms at 1, which would hide a mis-mapped one: perturb them all.
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return model.eval()


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.numpy()


def our_logits(cfg, params, tokens: np.ndarray) -> np.ndarray:
  return np.asarray(GPT(cfg).apply({'params': params}, jnp.asarray(tokens)))


@pytest.fixture(scope='module')
def saved(tmp_path_factory, corpus):
  """(HF model, its folder with a byte-level BPE tokenizer, the tokenizer)."""
  with gzip.open(corpus('multi30k') / 'train.en.gz', 'rt', encoding='utf-8') as f:
    tokenizer = HFTokenizer.train_byte_level_bpe(f.read().splitlines()[:3000], VOCAB)
  model = hf_model(bos_token_id=tokenizer.eos_id, eos_token_id=tokenizer.eos_id,
                   pad_token_id=tokenizer.eos_id)
  directory = tmp_path_factory.mktemp('opt')
  model.save_pretrained(str(directory), safe_serialization=True)
  tokenizer.save(str(directory))
  return model, str(directory), tokenizer


def test_the_registry_reads_opt_folders(saved):
  _, directory, _ = saved
  family = families.of_directory(directory)
  assert family.name == 'opt' and family.kind == families.CAUSAL_LM
  assert families.of_directory(directory, families.CAUSAL_LM).name == 'opt'
  model = family.load(directory)
  cfg = model.config
  assert (cfg.num_decoder_layers, cfg.num_heads, cfg.emb_dim, cfg.mlp_dim) == (2, 4, 64, 128)
  assert cfg.activation == 'relu' and cfg.max_len == 64 and cfg.tie_output
  init = jax.eval_shape(GPT(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  expected = jax.tree.map(lambda x: (x.shape, x.dtype), nn.meta.unbox(init['params']))
  assert jax.tree.map(lambda x: (x.shape, x.dtype), model.params) == expected


@pytest.mark.parametrize('batch,length', [(3, 17), (2, 64)])
def test_logits_match_transformers(saved, batch, length):
  model, directory, _ = saved
  imported = families.named('opt').load(directory)
  tokens = np.random.default_rng(batch).integers(0, VOCAB, (batch, length), dtype=np.int32)
  ours, theirs = our_logits(imported.config, imported.params, tokens), hf_logits(model, tokens)
  assert np.abs(theirs).max() > 0.1  # not a comparison of near-zero logits
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_export_loads_in_transformers_and_round_trips_bitwise(saved, tmp_path):
  model, directory, _ = saved
  family = families.named('opt')
  imported = family.load(directory)
  config_to_hf, export_state_dict = family.exporters(
      special_ids={'bos_token_id': 0, 'eos_token_id': 0, 'pad_token_id': 0})
  out = write_hf_directory(str(tmp_path / 'out'), config_to_hf(imported.config),
                           export_state_dict(imported.config, imported.params))
  reloaded = transformers.OPTForCausalLM.from_pretrained(out).eval()
  tokens = np.random.default_rng(7).integers(0, VOCAB, (2, 33), dtype=np.int32)
  np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(model, tokens), atol=1e-5)
  again = family.load(out)
  assert again.config == imported.config
  leaves = zip(jax.tree.leaves(again.params), jax.tree.leaves(imported.params))
  assert all(np.array_equal(a, b) for a, b in leaves)


def test_greedy_generation_matches_transformers(saved, translate_cli):
  model, directory, tokenizer = saved
  prompt = 'A man in a blue shirt'
  ids = [tokenizer.eos_id] + tokenizer.encode(prompt)  # the prompt starts after an EOS
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]),
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=8,
                         do_sample=False, pad_token_id=tokenizer.eos_id)
  new = out[0, len(ids):].tolist()
  new = new[:new.index(tokenizer.eos_id)] if tokenizer.eos_id in new else new
  assert len(new) >= 4, new  # a continuation worth comparing, not an immediate EOS
  result = subprocess.run([
      sys.executable, '-m', 'experiments.generate', f'--hf_dir={directory}', f'--prompt={prompt}',
      '--max_new_tokens=8', '--temperature=0'
  ], cwd=REPO_ROOT, env=translate_cli.env(), capture_output=True, text=True, timeout=600,
                          check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout == prompt + tokenizer.decode(new) + '\n', (result.stdout, new)


@pytest.mark.parametrize('change,message', [
    (dict(do_layer_norm_before=False), 'do_layer_norm_before=False is not supported'),
    (dict(word_embed_proj_dim=32), 'word_embed_proj_dim=32 differs from hidden_size=64'),
    (dict(enable_bias=False), 'enable_bias=False is not supported'),
    (dict(activation_function='tanh'), "activation_function='tanh' is not supported"),
])
def test_what_opt_config_we_cannot_compute_is_one_error_line(change, message):
  config = transformers.OPTConfig(**{**HF_CONFIG, **change}).to_dict()
  with pytest.raises(ConfigError, match=message):
    families.named('opt').converter.config_from_hf(config)
