"""`experiments.generate --hf_dir`: an imported Hugging Face causal LM continues a prompt exactly as
transformers' own greedy `generate` does; `convert.families` picks the converter by model_type.

The reference is a tiny random GPT2LMHeadModel (perturbed weights) saved with a byte-level BPE
trained here, so nothing is downloaded. Needs the `parity` extra (torch, transformers).
"""

import gzip
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip('torch', reason='needs the parity extra: pip install -e ".[parity]"')
transformers = pytest.importorskip('transformers',
                                   reason='needs the parity extra: pip install -e ".[parity]"')

from transformer_jax.convert import families
from transformer_jax.convert.hf_files import HFModel
from transformer_jax.data import lm as lm_data
from transformer_jax.data.hf_tokenizer import GPT2_EOS, HFTokenizer
from transformer_jax.errors import ConfigError, DataError

pytestmark = pytest.mark.parity

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VOCAB = 400
PROMPT = 'A man in a blue shirt'


def _tokenizer(corpus) -> HFTokenizer:
  with gzip.open(corpus('multi30k') / 'train.en.gz', 'rt', encoding='utf-8') as f:
    lines = f.read().splitlines()[:3000]
  return HFTokenizer.train_byte_level_bpe(lines, VOCAB)


def _gpt2(vocab_size: int, eos_id: int):
  torch.manual_seed(0)
  config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64,
                                   vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
  model = transformers.GPT2LMHeadModel(config)
  # HF starts biases at 0 and norms at 1, which would hide a mis-mapped one: perturb them all.
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return model.eval()


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory, corpus):
  """(folder with a tiny GPT-2 and its tokenizer, the model, the tokenizer)."""
  tokenizer = _tokenizer(corpus)
  model = _gpt2(VOCAB, tokenizer.eos_id)
  directory = tmp_path_factory.mktemp('hf_gpt2')
  model.save_pretrained(str(directory), safe_serialization=True)
  tokenizer.save(str(directory))
  return directory, model, tokenizer


def _generate(translate_cli, *flags) -> subprocess.CompletedProcess:
  """`python -m experiments.generate FLAGS` with the test run's environment (CPU, XLA cache)."""
  return subprocess.run([sys.executable, '-m', 'experiments.generate', *flags], cwd=REPO_ROOT,
                        env=translate_cli.env(), capture_output=True, text=True, timeout=600,
                        check=False)


def _one_error_line(result) -> str:
  assert result.returncode == 1, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], result.stderr
  return errors[0]


def test_greedy_continuation_matches_transformers_generate(hf_dir, translate_cli):
  directory, model, tokenizer = hf_dir
  # Both sides read the same ids: '<|endoftext|>' (GPT-2 starts documents with it), then the text.
  prompt_ids = [tokenizer.eos_id] + tokenizer.encode(PROMPT)
  assert tokenizer.token_to_id(GPT2_EOS) == prompt_ids[0] == 0
  with torch.no_grad():
    out = model.generate(torch.tensor([prompt_ids]),
                         attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_id)
  new = out[0, len(prompt_ids):].tolist()
  new = new[:new.index(tokenizer.eos_id)] if tokenizer.eos_id in new else new
  assert len(new) >= 4, new  # a continuation worth comparing, not an immediate EOS
  result = _generate(translate_cli, f'--hf_dir={directory}', f'--prompt={PROMPT}',
                     '--max_new_tokens=8', '--temperature=0')
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout == PROMPT + tokenizer.decode(new) + '\n', (result.stdout, new)


def test_in_process_generation_matches_transformers_past_the_context(hf_dir):
  """The same model through LanguageModelTask: 70 greedy tokens after a 10-token prompt exceed
  max_len 64, so generation continues in segments; the first segment (prompt + new tokens within
  the context) must be transformers' tokens."""
  import jax
  from experiments import generate
  directory, model, tokenizer = hf_dir
  task, loaded, params = generate.load_hf_model(str(directory))
  assert task.cfg.max_len == 64 and task.eos_id == loaded.eos_id == 0
  prompt = [0] + tokenizer.encode(PROMPT)
  ours = task.generate(params, np.asarray([prompt], np.int32), 70, jax.random.key(0),
                       temperature=0.0, eos_id=-1)  # no EOS: compare every position
  assert ours.shape == (1, 70)
  fits = 64 - len(prompt)
  theirs = list(prompt)
  with torch.no_grad():  # transformers' model, greedy, one full forward pass per token
    for _ in range(fits):
      theirs.append(int(model(torch.tensor([theirs])).logits[0, -1].argmax()))
  np.testing.assert_array_equal(ours[0, :fits], theirs[len(prompt):])
  assert 0 < len(set(ours[0].tolist())) and not np.any(ours[0] >= VOCAB)


def test_hf_dir_errors_are_one_line(hf_dir, tmp_path, translate_cli, corpus):
  bert = tmp_path / 'bert'
  bert.mkdir()
  (bert / 'config.json').write_text(json.dumps({'model_type': 'bert', 'vocab_size': 30522}))
  line = _one_error_line(_generate(translate_cli, f'--hf_dir={bert}', '--max_new_tokens=2'))
  assert "model_type='bert'" in line and 'gpt2, llama' in line, line

  small = tmp_path / 'small_embedding'
  _gpt2(300, 0).save_pretrained(str(small), safe_serialization=True)
  _tokenizer(corpus).save(str(small))
  line = _one_error_line(_generate(translate_cli, f'--hf_dir={small}', '--max_new_tokens=2'))
  assert f'has {VOCAB} tokens' in line and 'embedding has 300 rows' in line, line

  directory, _, _ = hf_dir
  line = _one_error_line(_generate(translate_cli, f'--hf_dir={directory}', f'--workdir={tmp_path}'))
  assert 'exactly one of --workdir' in line, line


def test_llama_folder_with_sentencepiece_model(tmp_path, corpus):
  """LLaMA through the same path: model_type 'llama' -> convert.hf_llama, a bare
  tokenizer.model read with SentencePiece, the prompt after BOS (not EOS)."""
  import io
  import jax
  import sentencepiece as spm
  from experiments import generate
  with gzip.open(corpus('multi30k') / 'train.en.gz', 'rt', encoding='utf-8') as f:
    lines = f.read().splitlines()[:3000]
  serialized = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=serialized,
                                 vocab_size=VOCAB, model_type='bpe', byte_fallback=True,
                                 normalization_rule_name='identity', minloglevel=2)
  (tmp_path / 'tokenizer.model').write_bytes(serialized.getvalue())
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(
      transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                               max_position_embeddings=64, bos_token_id=1, eos_token_id=2))
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  model.eval().save_pretrained(str(tmp_path), safe_serialization=True)

  task, tokenizer, params = generate.load_hf_model(str(tmp_path))
  assert (tokenizer.bos_id, tokenizer.eos_id, task.eos_id) == (1, 2, 2)
  prompt = lm_data.prompt_ids(tokenizer, PROMPT)
  assert prompt[0] == 1 and prompt[1:] == tokenizer.encode(PROMPT)
  ours = task.generate(params, np.asarray([prompt], np.int32), 12, jax.random.key(0),
                       temperature=0.0)[0]
  with torch.no_grad():
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                            pad_token_id=2)[0, len(prompt):].tolist()
  theirs = generate.until_eos(theirs, 2)
  assert len(theirs) >= 4, theirs
  assert generate.until_eos(ours, task.eos_id) == theirs
  assert tokenizer.decode(theirs) == tokenizer.decode(generate.until_eos(ours, 2))


# -- families.of_directory ------------------------------------------------------------------------


def load_causal_lm(directory: str, **overrides):
  """(family name, HFModel) of the causal LM folder `directory`, as workflows/lm.py reads it."""
  family = families.of_directory(directory, families.CAUSAL_LM)
  return family.name, family.load(directory, **overrides)


def test_a_causal_lm_is_loaded_by_its_model_type(hf_dir, tmp_path, monkeypatch):
  directory, _, _ = hf_dir
  family, model = load_causal_lm(str(directory), dropout_rate=0.0)
  assert family == 'gpt2' and model.config.vocab_size == VOCAB
  assert model.config.num_decoder_layers == 2 and model.config.dropout_rate == 0.0
  assert model.params['token_embed']['embedding'].shape == (VOCAB, 32)

  # 'llama' goes to convert.hf_llama.load with the overrides (a stand-in module here:
  # the LLaMA converter's own tests check the conversion).
  calls = []
  fake = types.ModuleType('transformer_jax.convert.hf_llama')
  fake.load = lambda d, **kw: calls.append((d, kw)) or HFModel('cfg', 'params')
  monkeypatch.setitem(sys.modules, 'transformer_jax.convert.hf_llama', fake)
  import transformer_jax.convert as convert_package
  monkeypatch.setattr(convert_package, 'hf_llama', fake, raising=False)
  llama = tmp_path / 'llama'
  llama.mkdir()
  (llama / 'config.json').write_text(json.dumps({'model_type': 'llama'}))
  assert load_causal_lm(str(llama), dtype='bfloat16') == ('llama', HFModel('cfg', 'params'))
  assert calls == [(str(llama), {'dtype': 'bfloat16'})]

  (llama / 'config.json').write_text(json.dumps({'model_type': 't5'}))
  causal = ', '.join(families.names(families.CAUSAL_LM))  # gpt2, llama, ...
  with pytest.raises(ConfigError, match=r"model_type='t5'; supported causal language models: "
                     f'{causal}$'):
    load_causal_lm(str(llama))
  (llama / 'config.json').write_text('{}')
  with pytest.raises(ConfigError, match='has no model_type'):
    load_causal_lm(str(llama))
  with pytest.raises(DataError, match='config.json does not exist'):
    load_causal_lm(str(tmp_path / 'nowhere'))
  (llama / 'config.json').write_text('{"model_type": ')
  with pytest.raises(DataError, match='cannot read .*config.json'):
    load_causal_lm(str(llama))
