"""Hugging Face tokenizers (transformer_jax/data/hf_tokenizer.py) and the 'byte_bpe' LM workflow.

Parity tests (marked `parity`, need transformers) load one GPT-2 style byte-level BPE, trained
here with the `tokenizers` library on Multi30k's training text, both with `HFTokenizer` and with
`transformers`, and compare the ids on every line of Multi30k's validation files and on lines
made to be hard (emoji, CJK, combining characters, runs of spaces, newlines). No download.
"""

import gzip
import json
import math
import os

import numpy as np
import pytest

from transformer_jax.data import lm as lm_data
from transformer_jax.data.hf_tokenizer import GPT2_EOS, HFTokenizer
from transformer_jax.errors import ConfigError, DataError

# Text where byte-level BPEs go wrong: multi-byte and multi-code-point characters, whitespace.
HARD_LINES = [
    'Hello world',
    ' leading space',
    'trailing space ',
    '   three leading, two trailing  ',
    'many     spaces   inside',
    '\tTab\tseparated\t',
    'line one\nline two\n\nline four\n',
    '\n',
    ' ',
    '',
    'emoji 😀🎉 family 👩\u200d👩\u200d👧 flag 🇩🇪 skin 👍🏽',
    'CJK 日本語のテキスト 中文字符 한국어 텍스트',
    'combining e\u0301 a\u0308 n\u0303 o\u0328\u0301 (NFD) vs é ä ñ (NFC)',
    "contractions it's we'll I'M they've",
    'numbers 3.14159 1,000,000 and 2024-12-02',
    f'a document{GPT2_EOS}the next one',
    'zero\u200bwidth and\u00a0no-break space',
    'RTL שלום עולם مرحبا بالعالم',
    'control \x00\x01\x7f characters',
    'windows\r\nline ends\r\n',
    '🙂' * 20 + '  ' + '語' * 30,
]


def _multi30k_train_lines(corpus, limit: int = 3000) -> list[str]:
  lines = []
  for lang in ('en', 'de', 'fr'):
    with gzip.open(corpus('multi30k') / f'train.{lang}.gz', 'rt', encoding='utf-8') as f:
      lines += f.read().splitlines()[:limit]
  return lines


@pytest.fixture(scope='module')
def validation_lines(corpus) -> list[str]:
  """Every line of every Multi30k validation file (val.*.gz), then HARD_LINES."""
  files = sorted(corpus('multi30k').glob('val.*.gz'))
  assert len(files) >= 5, files
  lines = []
  for path in files:
    with gzip.open(path, 'rt', encoding='utf-8') as f:
      lines += f.read().split('\n')
  return lines + HARD_LINES + ['\n'.join(HARD_LINES)]


@pytest.fixture(scope='module')
def gpt2_files(corpus, tmp_path_factory):
  """(folder with vocab.json + merges.txt, folder with tokenizer.json) of one BPE, trained with
  the `tokenizers` library's own GPT-2 style trainer (not HFTokenizer's)."""
  from tokenizers import ByteLevelBPETokenizer
  trained = ByteLevelBPETokenizer(add_prefix_space=False)
  trained.train_from_iterator(_multi30k_train_lines(corpus), vocab_size=700, min_frequency=2,
                              special_tokens=[GPT2_EOS], show_progress=False)
  original = tmp_path_factory.mktemp('gpt2_original')
  trained.save_model(str(original))  # vocab.json + merges.txt, GPT-2's original format
  fast = tmp_path_factory.mktemp('gpt2_fast')
  trained.save(str(fast / 'tokenizer.json'))
  assert sorted(os.listdir(original)) == ['merges.txt', 'vocab.json']
  return str(original), str(fast)


# -- training a byte-level BPE --------------------------------------------------------------------


def test_train_byte_level_bpe(corpus):
  lines = _multi30k_train_lines(corpus, limit=1000)
  tokenizer = HFTokenizer.train_byte_level_bpe(lines, 600)
  assert tokenizer.vocab_size == 600
  assert tokenizer.eos_id == tokenizer.bos_id == tokenizer.token_to_id(GPT2_EOS) == 0
  assert tokenizer.pad_id is None
  # Merges learned: far fewer tokens than bytes on text like the training text.
  ids = tokenizer.encode(lines[0])
  assert len(ids) < 0.5 * len(lines[0].encode('utf-8'))
  for text in HARD_LINES:  # every byte is in the vocabulary: anything encodes and round-trips
    ids = tokenizer.encode(text)
    assert all(0 <= i < 600 for i in ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(np.asarray(ids, np.int32)) == text
  assert tokenizer.encode(GPT2_EOS) == [0]  # the special token is matched whole
  assert tokenizer.encode_batch(lines[:3]) == [tokenizer.encode(t) for t in lines[:3]]
  with pytest.raises(ConfigError, match='vocab_size >= 257'):
    HFTokenizer.train_byte_level_bpe(lines, 200)
  with pytest.raises(DataError, match='training text is empty'):
    HFTokenizer.train_byte_level_bpe(['', ''], 300)


def test_save_and_from_dir_round_trip(tmp_path, corpus):
  tokenizer = HFTokenizer.train_byte_level_bpe(_multi30k_train_lines(corpus, limit=500), 400)
  tokenizer.save(str(tmp_path / 'tok'))
  assert sorted(os.listdir(
      tmp_path / 'tok')) == ['special_tokens_map.json', 'tokenizer.json', 'tokenizer_config.json']
  config = json.loads((tmp_path / 'tok' / 'tokenizer_config.json').read_text())
  assert config['eos_token'] == config['bos_token'] == GPT2_EOS
  loaded = HFTokenizer.from_dir(str(tmp_path / 'tok'))
  assert (loaded.vocab_size, loaded.eos_id, loaded.bos_id, loaded.pad_id) == (400, 0, 0, None)
  for text in HARD_LINES:
    assert loaded.encode(text) == tokenizer.encode(text)


def test_decode_drops_only_pad_and_unknown_ids(tmp_path, corpus):
  tokenizer = HFTokenizer.train_byte_level_bpe(_multi30k_train_lines(corpus, limit=500), 300)
  ids = tokenizer.encode('a dog')
  assert tokenizer.decode(ids + [0] + ids) == f'a dog{GPT2_EOS}a dog'  # EOS shows, stops nothing
  assert tokenizer.decode(ids + [300, 5000, -1]) == 'a dog'  # past the vocabulary: dropped
  padded = HFTokenizer(tokenizer._backend, eos_id=0, bos_id=0, pad_id=ids[0])
  assert padded.decode([ids[0]] + ids[1:]) == tokenizer.decode(ids[1:])


# -- special ids from the folder's files ----------------------------------------------------------


def _llama_like_tokenizer_json(corpus, directory):
  """A tokenizer.json with LLaMA's special tokens <unk>=0, <s>=1, </s>=2 (a byte-level BPE
  underneath; the names and ids are what matter here)."""
  from tokenizers import ByteLevelBPETokenizer
  trained = ByteLevelBPETokenizer()
  trained.train_from_iterator(_multi30k_train_lines(corpus, limit=300), vocab_size=300,
                              special_tokens=['<unk>', '<s>', '</s>'], show_progress=False)
  os.makedirs(directory, exist_ok=True)
  trained.save(os.path.join(directory, 'tokenizer.json'))


def test_special_ids_from_config_files(tmp_path, corpus):
  directory = tmp_path / 'llama_like'
  _llama_like_tokenizer_json(corpus, str(directory))
  # No config file: the conventional names.
  bare = HFTokenizer.from_dir(str(directory))
  assert (bare.unk_id, bare.bos_id, bare.eos_id, bare.pad_id) == (0, 1, 2, None)
  # BOS distinct from EOS: a prompt starts with BOS (as LLaMA was trained), documents end with EOS.
  assert lm_data.prompt_ids(bare, 'a dog') == [1] + bare.encode('a dog')
  assert lm_data.lm_eos_id(bare) == 2
  np.testing.assert_array_equal(lm_data.encode_documents(bare, ['a dog', 'two']),
                                bare.encode('a dog') + [2] + bare.encode('two') + [2])
  # tokenizer_config.json (as transformers writes it: AddedToken dicts) wins over config.json.
  (directory / 'tokenizer_config.json').write_text(
      json.dumps({'eos_token': {'content': '<s>', '__type': 'AddedToken'}, 'pad_token': '</s>'}))
  (directory / 'config.json').write_text(json.dumps({'eos_token_id': 2, 'bos_token_id': 2}))
  configured = HFTokenizer.from_dir(str(directory))
  assert (configured.eos_id, configured.pad_id, configured.bos_id) == (1, 2, 2)
  # config.json's list of EOS ids (LLaMA 3): the first one.
  (directory / 'tokenizer_config.json').write_text('{}')
  (directory / 'config.json').write_text(json.dumps({'eos_token_id': [0, 2]}))
  assert HFTokenizer.from_dir(str(directory)).eos_id == 0
  # A named EOS that the vocabulary lacks: one line naming it.
  (directory / 'tokenizer_config.json').write_text(json.dumps({'eos_token': '<|eot_id|>'}))
  with pytest.raises(DataError, match=r"eos_token '<\|eot_id\|>' .* is not in the vocabulary"):
    HFTokenizer.from_dir(str(directory))


def test_gpt2_style_prompt_starts_with_endoftext(corpus):
  tokenizer = HFTokenizer.train_byte_level_bpe(_multi30k_train_lines(corpus, limit=300), 300)
  assert lm_data.prompt_ids(tokenizer, 'A dog') == [0] + tokenizer.encode('A dog')
  assert lm_data.prompt_ids(tokenizer, '') == [0]
  stream = lm_data.encode_documents(tokenizer, ['A dog.', 'A cat.'])
  assert stream.dtype == np.uint16
  assert stream.tolist() == tokenizer.encode('A dog.') + [0] + tokenizer.encode('A cat.') + [0]


# -- missing and broken files ---------------------------------------------------------------------


def test_missing_and_broken_files_are_one_line_naming_the_file(tmp_path, gpt2_files):
  original, fast = gpt2_files

  def error(directory) -> str:
    with pytest.raises(DataError) as info:
      HFTokenizer.from_dir(str(directory))
    message = str(info.value)
    assert '\n' not in message, message
    return message

  assert 'does not exist' in error(tmp_path / 'nowhere')
  (tmp_path / 'empty').mkdir()
  assert 'holds no tokenizer.json, vocab.json + merges.txt or tokenizer.model' in error(tmp_path /
                                                                                        'empty')
  only_vocab = tmp_path / 'only_vocab'
  only_vocab.mkdir()
  (only_vocab / 'vocab.json').write_text(open(os.path.join(original, 'vocab.json')).read())
  assert f'{only_vocab / "merges.txt"} is missing' in error(only_vocab)
  bad_vocab = tmp_path / 'bad_vocab'
  bad_vocab.mkdir()
  (bad_vocab / 'vocab.json').write_text('{"a": 0,')
  (bad_vocab / 'merges.txt').write_text('#version: 0.2\n')
  assert f'cannot read {bad_vocab / "vocab.json"}' in error(bad_vocab)
  bad_merges = tmp_path / 'bad_merges'
  bad_merges.mkdir()
  (bad_merges / 'vocab.json').write_text('{"a": 0, "b": 1}')
  (bad_merges / 'merges.txt').write_text('#version: 0.2\na c\n')  # 'c' is not in the vocab
  assert str(bad_merges / 'merges.txt') in error(bad_merges)
  broken = tmp_path / 'broken'
  broken.mkdir()
  (broken / 'tokenizer.json').write_text('{"model": {"type": "BPE"')
  assert f'cannot read {broken / "tokenizer.json"}' in error(broken)
  bad_config = tmp_path / 'bad_config'
  bad_config.mkdir()
  (bad_config / 'tokenizer.json').write_text(open(os.path.join(fast, 'tokenizer.json')).read())
  (bad_config / 'tokenizer_config.json').write_text('not json')
  assert f'cannot read {bad_config / "tokenizer_config.json"}' in error(bad_config)
  bad_model = tmp_path / 'bad_model'
  bad_model.mkdir()
  (bad_model / 'tokenizer.model').write_bytes(b'\x00not a sentencepiece model')
  assert f'cannot read {bad_model / "tokenizer.model"} as a SentencePiece model' in error(bad_model)


# -- SentencePiece (a bare tokenizer.model, LLaMA's original format) ------------------------------


@pytest.fixture(scope='module')
def llama_sentencepiece(corpus, tmp_path_factory):
  """(folder with a LLaMA-style tokenizer.model, its bytes)."""
  import io
  import sentencepiece as spm
  model = io.BytesIO()
  # LLaMA's recipe: BPE, bytes for unseen characters, no normalisation, <unk> <s> </s> = 0 1 2.
  spm.SentencePieceTrainer.train(sentence_iterator=iter(_multi30k_train_lines(corpus, limit=2000)),
                                 model_writer=model, vocab_size=500, model_type='bpe',
                                 byte_fallback=True, normalization_rule_name='identity',
                                 remove_extra_whitespaces=False, split_digits=True, minloglevel=2)
  directory = tmp_path_factory.mktemp('sentencepiece')
  (directory / 'tokenizer.model').write_bytes(model.getvalue())
  return str(directory), model.getvalue()


def test_sentencepiece_model_folder(tmp_path, llama_sentencepiece, validation_lines):
  import sentencepiece as spm
  directory, serialized = llama_sentencepiece
  reference = spm.SentencePieceProcessor(model_proto=serialized)
  tokenizer = HFTokenizer.from_dir(directory)
  assert (tokenizer.vocab_size, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id,
          tokenizer.pad_id) == (500, 0, 1, 2, None)
  assert tokenizer.encode_batch(validation_lines) == reference.encode(validation_lines)
  for text in validation_lines:
    assert tokenizer.decode(tokenizer.encode(text)) == text
  assert lm_data.prompt_ids(tokenizer, 'A dog') == [1] + reference.encode('A dog')
  tokenizer.save(str(tmp_path / 'saved'))
  again = HFTokenizer.from_dir(str(tmp_path / 'saved'))
  assert (again.bos_id, again.eos_id) == (1, 2)
  assert again.encode_batch(HARD_LINES) == reference.encode(HARD_LINES)
  assert (tmp_path / 'saved' / 'tokenizer.model').read_bytes() == serialized


# -- parity with transformers ---------------------------------------------------------------------


@pytest.fixture(scope='module')
def transformers():
  return pytest.importorskip('transformers',
                             reason='needs the parity extra: pip install -e ".[parity]"')


def _transformers_ids(tokenizer, lines: list[str]) -> list[list[int]]:
  return tokenizer(lines, add_special_tokens=False)['input_ids']


@pytest.mark.parity
def test_byte_level_bpe_ids_match_transformers(gpt2_files, validation_lines, transformers):
  original, fast = gpt2_files
  reference = transformers.GPT2TokenizerFast.from_pretrained(original)
  expected = _transformers_ids(reference, validation_lines)
  assert len(validation_lines) > 5000 and sum(map(len, expected)) > 50_000
  for folder in (original, fast):  # vocab.json + merges.txt, and tokenizer.json
    tokenizer = HFTokenizer.from_dir(folder)
    assert tokenizer.vocab_size == len(reference) == 700
    assert tokenizer.eos_id == tokenizer.bos_id == reference.eos_token_id == 0
    assert tokenizer.encode_batch(validation_lines) == expected
    for text, ids in zip(validation_lines, expected):
      assert tokenizer.encode(text) == ids, text
      assert tokenizer.decode(ids) == text
      assert reference.decode(ids) == text


@pytest.mark.parity
def test_saved_tokenizer_loads_in_transformers_with_the_same_ids(gpt2_files, validation_lines,
                                                                 transformers, tmp_path, corpus):
  original, _ = gpt2_files
  tokenizers = {
      'imported': HFTokenizer.from_dir(original),
      'trained': HFTokenizer.train_byte_level_bpe(_multi30k_train_lines(corpus, limit=1000), 500)
  }
  for name, tokenizer in tokenizers.items():
    tokenizer.save(str(tmp_path / name))
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / name))
    assert len(loaded) == tokenizer.vocab_size
    assert loaded.eos_token == loaded.bos_token == GPT2_EOS
    assert loaded.eos_token_id == tokenizer.eos_id
    expected = tokenizer.encode_batch(validation_lines)
    assert _transformers_ids(loaded, validation_lines) == expected
    assert loaded.decode(expected[0]) == validation_lines[0]
    # With its defaults (add_special_tokens=True) transformers adds nothing either, as GPT-2.
    assert loaded(HARD_LINES[0])['input_ids'] == tokenizer.encode(HARD_LINES[0])


@pytest.mark.parity
def test_saved_sentencepiece_loads_in_transformers(llama_sentencepiece, validation_lines,
                                                   transformers, tmp_path):
  """A tokenizer.model saved for transformers' LlamaTokenizer: the same ids, except where
  transformers' own conversion departs from SentencePiece (text starting with a space, where it
  adds no second '▁'; LLaMA's published tokenizer.json keeps SentencePiece's behaviour and is
  read as it is)."""
  directory, _ = llama_sentencepiece
  tokenizer = HFTokenizer.from_dir(directory)
  tokenizer.save(str(tmp_path / 'saved'))
  loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / 'saved'))
  assert (loaded.bos_token_id, loaded.eos_token_id, loaded.unk_token_id) == (1, 2, 0)
  expected = tokenizer.encode_batch(validation_lines)
  got = _transformers_ids(loaded, validation_lines)
  differ = [text for text, a, b in zip(validation_lines, expected, got) if a != b]
  assert differ and all(text[:1].isspace() for text in differ), differ
  assert sum(a == b for a, b in zip(expected, got)) > 5000


# -- the 'byte_bpe' language-model workflow -------------------------------------------------------


def _tiny_bpe_config(path: str, **overrides):
  from experiments.configs import gpt2_shakespeare_bpe
  config = gpt2_shakespeare_bpe.get_config()
  assert config.tokenizer.type == 'byte_bpe' and 1024 <= config.tokenizer.vocab_size <= 2048
  values = {
      'data.path': path, 'tokenizer.vocab_size': 320, 'model.emb_dim': 32, 'model.num_heads': 2,
      'model.mlp_dim': 64, 'model.num_decoder_layers': 1, 'data.block_size': 16,
      'data.batch_size': 8, 'data.eval_batches': 2, 'optimizer.learning_rate': 1e-2,
      'optimizer.end_learning_rate': 1e-3, 'optimizer.warmup_steps': 5, 'optimizer.decay_steps': 40,
      'train.num_steps': 40, 'train.log_every': 5, 'train.eval_every': 0,
      'train.checkpoint_every': 0, 'train.eval_max_batches': 0, 'eval.sample_tokens': 8, **overrides
  }
  for key, value in values.items():
    *parents, leaf = key.split('.')
    node = config
    for part in parents:
      node = node[part]
    assert leaf in node, key
    node[leaf] = value
  return config


def test_gpt2_shakespeare_bpe_trains(tmp_path, tiny_shakespeare):
  """The config shrunk: a BPE trained on the text and saved in the workdir, a loss that falls,
  and a rerun that reuses the saved tokenizer."""
  from transformer_jax.workflows import lm
  config = _tiny_bpe_config(tiny_shakespeare)
  workdir = str(tmp_path / 'work')
  results = lm.train_and_evaluate(config, workdir)
  assert sorted(os.listdir(os.path.join(workdir, 'tokenizer'))) == [
      'special_tokens_map.json', 'tokenizer.json', 'tokenizer_config.json'
  ]
  assert not [f for f in os.listdir(workdir) if '.tmp' in f]
  tokenizer = HFTokenizer.from_dir(os.path.join(workdir, 'tokenizer'))
  assert tokenizer.vocab_size == 320 and tokenizer.eos_id == 0
  corpus = lm.prepared_corpus(lm.sections_of(config), workdir)  # WORKDIR/corpus, as it is
  train = corpus.split('train')
  stream = train.tokens(0, len(train))
  assert stream.dtype == np.uint16 and stream[-1] == tokenizer.eos_id
  # ~1 MB of text in 320 tokens: merges make a token worth more than one byte.
  assert len(stream) < 0.7 * 0.9 * os.path.getsize(tiny_shakespeare)
  assert (stream == tokenizer.eos_id).sum() == len(train.document_bounds()) > 1000  # speeches

  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    losses = [r['train/loss'] for r in map(json.loads, f) if 'train/loss' in r]
  uniform = math.log(320)
  assert losses[0] > 0.9 * uniform, losses  # near-zero initial logits: about ln(V)
  assert losses[-1] < losses[0] - 0.8, losses  # 5.71 -> 4.53 when written
  assert results['eval_loss'] < uniform - 0.8 and results['step'] == 40

  # A rerun keeps the saved tokenizer and corpus whatever vocab_size says (the ids must not
  # change).
  rerun = _tiny_bpe_config(tiny_shakespeare, **{'tokenizer.vocab_size': 400})
  again = lm.load_tokenizer(lm.sections_of(rerun).tokenizer, workdir)
  assert again.vocab_size == 320
  train = lm.prepared_corpus(lm.sections_of(rerun), workdir).split('train')
  np.testing.assert_array_equal(train.tokens(0, len(train)), stream)
  with pytest.raises(
      ConfigError,
      match="tokenizer.type must be 'char', 'sentencepiece', 'byte_bpe' or 'hf', got 'bpe'"):
    lm.sections_of(_tiny_bpe_config(tiny_shakespeare, **{'tokenizer.type': 'bpe'}))


def test_evaluation_sample_shows_the_prompt_and_stops_at_eos():
  """The sample text written at every evaluation is the prompt (without the document-start
  token it is fed after) plus the continuation up to EOS: neither '<|endoftext|>' nor the
  padding after it is shown, for a byte-level BPE and for a SentencePiece-style EOS alike."""
  import jax
  from transformer_jax.models import gpt2_config
  from transformer_jax.tasks.lm import LanguageModelTask
  tokenizer = HFTokenizer.train_byte_level_bpe(['ROMEO: But soft, what light'] * 20, 300)
  cfg = gpt2_config(vocab_size=tokenizer.vocab_size, emb_dim=32, num_heads=2, mlp_dim=64,
                    num_decoder_layers=1, max_len=32, dropout_rate=0.0, attention_dropout_rate=0.0)
  prompt = lm_data.prompt_ids(tokenizer, 'ROMEO:')
  assert prompt[0] == tokenizer.eos_id
  task = LanguageModelTask(cfg, tokenizer=tokenizer, eos_id=tokenizer.eos_id, sample_prompt=prompt,
                           sample_tokens=8, temperature=0.0)
  import flax.linen as nn
  import jax.numpy as jnp
  params = nn.meta.unbox(task.init_variables(jax.random.key(0))['params'])
  # A final norm scaled to zero makes every logit 0: greedy decoding takes the first maximum,
  # id 0, which is '<|endoftext|>' here, so the continuation ends at once.
  norm = params['stack']['final_norm']
  norm['scale'], norm['bias'] = jnp.zeros_like(norm['scale']), jnp.zeros_like(norm['bias'])
  assert tokenizer.eos_id == 0
  assert task.sample_text(params) == 'ROMEO:'
