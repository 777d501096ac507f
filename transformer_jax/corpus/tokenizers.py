"""The tokenizer a corpus is prepared with: trained on a sample, or taken from a workdir or a
Hugging Face folder, saved beside the shards, and identified by the SHA-256 of its files.

Kinds, and the file or folder each is saved as (the names the workflows use in a workdir):
  char           tokenizer.json   one id per character (data/lm.py's CharTokenizer)
  sentencepiece  spm.model        the project's SentencePiece (fixed special ids)
  byte_bpe       tokenizer/       GPT-2's byte-level BPE (data/hf_tokenizer.py)
  wordpiece      vocab.txt        BERT's WordPiece (data/wordpiece.py); `lowercase` is recorded
  roberta_bpe    tokenizer/       RoBERTa's byte-level BPE (data/roberta_tokenizer.py)
  hf             tokenizer/       any Hugging Face tokenizer folder, taken as it is
"""

import hashlib
import os
import shutil
from collections.abc import Iterable

from transformer_jax.data import lm as lm_data
from transformer_jax.data.hf_tokenizer import HFTokenizer
from transformer_jax.data.roberta_tokenizer import RobertaTokenizer
from transformer_jax.data.tokenizer import Tokenizer, train_tokenizer
from transformer_jax.data.wordpiece import WordPieceTokenizer
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.files import write_atomically

FILE_NAMES = {
    'char': 'tokenizer.json', 'sentencepiece': 'spm.model', 'byte_bpe': 'tokenizer',
    'wordpiece': 'vocab.txt', 'roberta_bpe': 'tokenizer', 'hf': 'tokenizer'
}
KINDS = tuple(FILE_NAMES)
TRAINABLE = ('char', 'sentencepiece', 'byte_bpe', 'wordpiece', 'roberta_bpe')


def check_kind(kind: str):
  if kind not in KINDS:
    raise ConfigError(f'tokenizer must be one of {list(KINDS)}, got {kind!r}')


def load(kind: str, path: str, lowercase: bool = True):
  """The tokenizer of `kind` saved at `path` (a file or a folder, FILE_NAMES)."""
  check_kind(kind)
  if not os.path.exists(path):
    raise DataError(f'no {kind} tokenizer at {path}')
  if kind == 'char':
    return lm_data.CharTokenizer.load(path)
  if kind == 'sentencepiece':
    return Tokenizer.from_file(path)
  if kind == 'wordpiece':
    return WordPieceTokenizer.from_vocab(path, lowercase=lowercase)
  if kind == 'roberta_bpe':
    return RobertaTokenizer.from_dir(path)
  return HFTokenizer.from_dir(path)  # byte_bpe, hf


def save(tokenizer, kind: str, path: str):
  """Writes `tokenizer` to `path` as `load` reads it (a folder appears whole: written beside,
  then renamed)."""
  if kind == 'char':
    tokenizer.save(path)
  elif kind == 'sentencepiece':
    write_atomically(path, tokenizer.serialized_proto)
  elif kind == 'wordpiece':
    tokenizer.save(path)
  else:
    staging = path + '.tmp'
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer.save(staging)
    if os.path.isdir(path):
      shutil.rmtree(path)
    os.replace(staging, path)


def copy(source: str, kind: str, path: str):
  """Copies a saved tokenizer (`source`: its file or folder, or a workdir holding FILE_NAMES[kind])
  to `path`; refuses a source that does not load as `kind`."""
  source = resolve(source, kind)
  load(kind, source)  # one error line now rather than in every worker
  if os.path.isdir(source):
    staging = path + '.tmp'
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    if os.path.isdir(path):
      shutil.rmtree(path)
    os.replace(staging, path)
  else:
    shutil.copyfile(source, path + '.tmp')
    os.replace(path + '.tmp', path)


def resolve(source: str, kind: str) -> str:
  """`source` itself, or FILE_NAMES[kind] inside it when `source` is a workdir."""
  inside = os.path.join(source, FILE_NAMES[kind])
  if os.path.isdir(source) and os.path.exists(inside):
    return inside
  if kind in ('hf', 'byte_bpe', 'roberta_bpe') and os.path.isdir(source):
    return source  # a Hugging Face folder given directly
  if os.path.isfile(source):
    return source
  raise ConfigError(f'--tokenizer_from={source}: no {kind} tokenizer there (expected '
                    f'{FILE_NAMES[kind]} in a workdir, or the file or folder itself)')


def train(kind: str, texts: Iterable[str], vocab_size: int, path: str, *, lowercase: bool = True,
          model_type: str = 'unigram', max_sentences: int = 2_000_000):
  """A tokenizer of `kind` trained on `texts`, saved at `path`."""
  if kind not in TRAINABLE:
    raise ConfigError(f'tokenizer {kind!r} cannot be trained here: pass --tokenizer_from=FOLDER')
  if kind == 'char':
    tokenizer = lm_data.CharTokenizer.from_text(''.join(texts))
  elif kind == 'sentencepiece':
    # SentencePiece trains on sentences (it skips inputs over 4,192 bytes): the sample's lines.
    lines = (line for text in texts for line in text.split('\n') if line.strip())
    return train_tokenizer(lines, path, vocab_size, model_type=model_type,
                           max_sentences=max_sentences)
  elif kind == 'byte_bpe':
    tokenizer = HFTokenizer.train_byte_level_bpe(texts, vocab_size)
  elif kind == 'wordpiece':
    tokenizer = WordPieceTokenizer.train(texts, vocab_size, lowercase=lowercase)
  else:
    tokenizer = RobertaTokenizer.train(texts, vocab_size)
  save(tokenizer, kind, path)
  return tokenizer


def sha256(path: str) -> str:
  """SHA-256 of a tokenizer's file, or of a folder's files (names and bytes, in name order)."""
  digest = hashlib.sha256()
  if os.path.isdir(path):
    for root, dirs, names in os.walk(path):
      dirs.sort()
      for name in sorted(names):
        full = os.path.join(root, name)
        digest.update(os.path.relpath(full, path).encode('utf-8') + b'\0')
        with open(full, 'rb') as f:
          digest.update(f.read())
  else:
    with open(path, 'rb') as f:
      digest.update(f.read())
  return digest.hexdigest()


def eos_id(kind: str, tokenizer) -> int | None:
  """The id that ends a document in a language-model stream (none for characters)."""
  if kind in ('wordpiece', 'roberta_bpe'):
    return None
  return lm_data.lm_eos_id(tokenizer)
