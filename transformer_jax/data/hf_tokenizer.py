"""Hugging Face tokenizers (GPT-2's byte-level BPE, LLaMA's SentencePiece) with their own ids.

    tokenizer = HFTokenizer.from_dir('/path/to/gpt2')        # an HF model or tokenizer folder
    ids = tokenizer.encode('Hello world')                     # no special tokens added
    tokenizer.decode(ids) == 'Hello world'
    bpe = HFTokenizer.train_byte_level_bpe(texts, vocab_size=2048)
    bpe.save('/tmp/tok')       # transformers.AutoTokenizer.from_pretrained('/tmp/tok'): same ids

Unlike `data/tokenizer.py`, whose SentencePiece models are trained here with the project's fixed
special ids (pad 0, eos 1, ...), an imported model comes with a vocabulary of its own: GPT-2's
'<|endoftext|>' is id 50256 and is both its BOS and EOS; LLaMA has '<s>' = 1 and '</s>' = 2. So
these ids are attributes (`eos_id`, `bos_id`, `pad_id`, None where the tokenizer has none), read
from the folder's tokenizer_config.json / special_tokens_map.json / config.json.

Backed by the `tokenizers` library (Rust; the implementation behind transformers' fast
tokenizers, so the ids are transformers' ids), or by `sentencepiece` for a folder that only has
a tokenizer.model (SentencePiece's own ids). No code from the folder is run.
"""

import json
import os
from collections.abc import Iterable, Sequence

import numpy as np
import sentencepiece as spm
from absl import logging
from tokenizers import (AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors,
                        trainers)

from transformer_jax.data.tokenizer import SentencePieceEncoding
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.files import read_json_object, write_atomically

# GPT-2's one special token: it ends every document and starts every generation.
GPT2_EOS = '<|endoftext|>'
TOKENIZER_JSON = 'tokenizer.json'
VOCAB_JSON, MERGES_TXT = 'vocab.json', 'merges.txt'
SENTENCEPIECE_MODEL = 'tokenizer.model'
TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, MODEL_CONFIG = ('tokenizer_config.json',
                                                      'special_tokens_map.json', 'config.json')
_KINDS = ('eos', 'bos', 'pad', 'unk')
# Conventional names, used only when no file of the folder names a special token.
_CONVENTIONAL = {'eos': (GPT2_EOS, '</s>'), 'bos': (GPT2_EOS, '<s>'), 'pad': (), 'unk': ('<unk>',)}


def _first_line(error: Exception) -> str:
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__


def _token_content(value) -> str | None:
  """A special token as tokenizer_config.json writes it: a string, or {'content': ...}."""
  if isinstance(value, dict):
    value = value.get('content')
  return value if isinstance(value, str) else None


def special_token_names(directory: str, kinds) -> dict[str, str]:
  """kind ('eos', 'bos', ...) -> token text, for each of `kinds` that tokenizer_config.json
  names, else special_tokens_map.json (the first file to name a kind wins)."""
  names = {}
  for file in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):
    path = os.path.join(directory, file)
    if os.path.exists(path):
      data = read_json_object(path)
      for kind in kinds:
        content = _token_content(data.get(f'{kind}_token'))
        if kind not in names and content is not None:
          names[kind] = content
  return names


def tokenizer_lowercase(directory: str) -> bool:
  """tokenizer_config.json's do_lower_case (BERT's uncased checkpoints); default True."""
  path = os.path.join(directory, TOKENIZER_CONFIG)
  if os.path.exists(path):
    return bool(read_json_object(path).get('do_lower_case', True))
  return True


# -- backends: one interface over `tokenizers` and `sentencepiece` --------------------------------


class _Fast:
  """A `tokenizers.Tokenizer` (tokenizer.json, or vocab.json + merges.txt, or trained here)."""

  def __init__(self, tokenizer):
    tokenizer.no_padding()  # a tokenizer.json may ask for them; ids here are never padded or cut
    tokenizer.no_truncation()
    self.tokenizer = tokenizer

  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: list[int]) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=False)

  def token_to_id(self, token: str) -> int | None:
    return self.tokenizer.token_to_id(token)

  def write(self, directory: str) -> str:
    write_atomically(os.path.join(directory, TOKENIZER_JSON), self.tokenizer.to_str(pretty=True))
    # transformers' generic fast tokenizer reads tokenizer.json as it is, whatever the model.
    return 'PreTrainedTokenizerFast'


class _SentencePiece(SentencePieceEncoding):
  """A SentencePiece model file (LLaMA's tokenizer.model), with SentencePiece's own ids."""

  def __init__(self, serialized: bytes):
    self.serialized = serialized
    self.processor = spm.SentencePieceProcessor()
    self.processor.LoadFromSerializedProto(serialized)

  def vocab_size(self) -> int:
    return self.processor.get_piece_size()

  def decode(self, ids: list[int]) -> str:
    return self.processor.decode(ids)

  def token_to_id(self, token: str) -> int | None:
    i = self.processor.piece_to_id(token)  # an unknown piece maps to <unk>: check it round-trips
    return i if 0 <= i < self.vocab_size() and self.processor.id_to_piece(i) == token else None

  def special_ids(self) -> dict[str, int]:
    ids = {
        'eos': self.processor.eos_id(), 'bos': self.processor.bos_id(),
        'pad': self.processor.pad_id(), 'unk': self.processor.unk_id()
    }
    return {k: v for k, v in ids.items() if v >= 0}  # -1: the model has no such piece

  def write(self, directory: str) -> str:
    write_atomically(os.path.join(directory, SENTENCEPIECE_MODEL), self.serialized)
    # transformers converts tokenizer.model itself, as it does LLaMA's. Its conversion (a BPE
    # with Metaspace) gives SentencePiece's ids except for text that starts with whitespace,
    # where SentencePiece adds a second '▁' and transformers none.
    return 'LlamaTokenizer'


# -- the tokenizer --------------------------------------------------------------------------------


def train_byte_level_backend(texts: Iterable[str], vocab_size: int, special_tokens: list[str], *,
                             min_frequency: int = 2):
  """(a `tokenizers.Tokenizer`, the number of texts it learned from): a byte-level BPE with
  GPT-2's pipeline (its regex split, bytes shown as printable characters, no prefix space)
  learned from the non-empty `texts`, `special_tokens` its first ids. ConfigError if
  `vocab_size` cannot hold every byte and the special tokens; DataError if there is no text."""
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  if vocab_size < len(alphabet) + len(special_tokens):
    raise ConfigError(f'a byte-level BPE needs vocab_size >= '
                      f'{len(alphabet) + len(special_tokens)} (every byte and '
                      f'{", ".join(special_tokens)}), got {vocab_size}')
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                special_tokens=list(special_tokens), initial_alphabet=alphabet,
                                show_progress=False)
  seen = 0

  def counted():
    nonlocal seen
    for text in texts:
      if text:
        seen += 1
        yield text

  tokenizer.train_from_iterator(counted(), trainer)
  if not seen:
    raise DataError('cannot train a byte-level BPE: the training text is empty')
  return tokenizer, seen


class HFTokenizer:
  """Text <-> ids with a Hugging Face vocabulary and its special ids (None where absent).

  `encode` adds no special token (callers decide: documents end with `eos_id`, a generation
  starts with `bos_id` or `eos_id`); `decode` drops only `pad_id` (and ids outside the
  vocabulary, which a model with a rounded-up embedding can emit) and shows every other special
  token as its text, e.g. '<|endoftext|>' between documents.
  """

  def __init__(self, backend, *, eos_id: int | None = None, bos_id: int | None = None,
               pad_id: int | None = None, unk_id: int | None = None):
    self._backend = backend
    self.eos_id, self.bos_id, self.pad_id, self.unk_id = eos_id, bos_id, pad_id, unk_id

  def __repr__(self) -> str:
    return (f'HFTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, '
            f'bos_id={self.bos_id}, pad_id={self.pad_id})')

  # -- building

  @classmethod
  def from_dir(cls, directory: str) -> 'HFTokenizer':
    """The tokenizer of an HF folder: tokenizer.json, else vocab.json + merges.txt (GPT-2),
    else tokenizer.model (SentencePiece). Special tokens come from tokenizer_config.json,
    special_tokens_map.json and config.json, in that order, else from the conventional names."""
    if not os.path.isdir(directory):
      raise DataError(f'tokenizer folder {directory} does not exist')
    path = lambda name: os.path.join(directory, name)
    names = special_token_names(directory, _KINDS)
    if os.path.exists(path(TOKENIZER_JSON)):
      backend = _Fast(_load_tokenizer_json(path(TOKENIZER_JSON)))
    elif os.path.exists(path(VOCAB_JSON)) or os.path.exists(path(MERGES_TXT)):
      backend = _Fast(_load_gpt2_files(path(VOCAB_JSON), path(MERGES_TXT), names))
    elif os.path.exists(path(SENTENCEPIECE_MODEL)):
      backend = _SentencePiece(_read_sentencepiece(path(SENTENCEPIECE_MODEL)))
    else:
      raise DataError(f'{directory} holds no {TOKENIZER_JSON}, {VOCAB_JSON} + {MERGES_TXT} or '
                      f'{SENTENCEPIECE_MODEL}: not a Hugging Face tokenizer folder')
    ids = cls._resolve_ids(directory, backend, names)
    tokenizer = cls(backend, **{f'{k}_id': ids.get(k) for k in _KINDS})
    logging.info('tokenizer from %s: %s', directory, tokenizer)
    return tokenizer

  @staticmethod
  def _resolve_ids(directory: str, backend, names: dict[str, str]) -> dict[str, int]:
    """kind -> id: the named tokens, then config.json's *_token_id, then the model's own
    (SentencePiece) or the conventional names present in the vocabulary."""
    ids = {}
    for kind, name in names.items():
      i = backend.token_to_id(name)
      if i is not None:
        ids[kind] = i
      elif kind in ('eos', 'bos'):  # generation depends on them: refuse a guess
        raise DataError(f'{directory}: the {kind}_token {name!r} named by {TOKENIZER_CONFIG} or '
                        f'{SPECIAL_TOKENS_MAP} is not in the vocabulary; fix the file')
      else:
        logging.warning('%s: %s_token %r is not in the vocabulary; ignoring it', directory, kind,
                        name)
    config_path = os.path.join(directory, MODEL_CONFIG)
    if os.path.exists(config_path):
      config = read_json_object(config_path)
      for kind in _KINDS:
        value = config.get(f'{kind}_token_id')
        if isinstance(value, list):  # LLaMA 3 lists several EOS ids: the first is the text end
          value = value[0] if value else None
        if kind not in ids and isinstance(value, int) and 0 <= value < backend.vocab_size():
          ids[kind] = value
    own = backend.special_ids() if hasattr(backend, 'special_ids') else {}
    for kind in _KINDS:
      if kind not in ids and kind in own:
        ids[kind] = own[kind]
      for name in () if kind in ids else _CONVENTIONAL[kind]:
        if backend.token_to_id(name) is not None:
          ids[kind] = backend.token_to_id(name)
          break
    return ids

  @classmethod
  def train_byte_level_bpe(cls, texts: Iterable[str], vocab_size: int, *,
                           min_frequency: int = 2) -> 'HFTokenizer':
    """A GPT-2 style byte-level BPE learned from `texts`, '<|endoftext|>' its one special token.

    All 256 bytes are in the vocabulary, so any text encodes without an unknown token; the rest
    are the most frequent merges. '<|endoftext|>' is id 0 (GPT-2 has it last, 50256), the id
    that generation pads with after an EOS, so a padded row reads as repeated EOS.
    """
    tokenizer, seen = train_byte_level_backend(texts, vocab_size, [GPT2_EOS],
                                               min_frequency=min_frequency)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    eos = tokenizer.token_to_id(GPT2_EOS)
    result = cls(_Fast(tokenizer), eos_id=eos, bos_id=eos)
    logging.info('trained a byte-level BPE with %d tokens (%d requested) on %d texts',
                 result.vocab_size, vocab_size, seen)
    return result

  # -- using

  @property
  def vocab_size(self) -> int:
    return self._backend.vocab_size()

  def token_to_id(self, token: str) -> int | None:
    """The id of one token of the vocabulary (e.g. '<|endoftext|>'), None if absent."""
    return self._backend.token_to_id(token)

  def encode(self, text: str) -> list[int]:
    """The ids of `text`, without any special token added."""
    return self._backend.encode(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """`encode` of each text (`tokenizers` spreads the work over threads)."""
    return self._backend.encode_batch(texts)

  def decode(self, ids: Iterable[int]) -> str:
    """The text of `ids` (a list or an array); drops PAD and ids outside the vocabulary."""
    if hasattr(ids, '__array__'):  # a NumPy or JAX array: convert in one go, not per element
      ids = np.asarray(ids).reshape(-1).tolist()
    size = self.vocab_size
    return self._backend.decode([i for i in map(int, ids) if i != self.pad_id and 0 <= i < size])

  # -- saving

  def save(self, directory: str):
    """Writes the tokenizer files to `directory` (created if needed, each file atomically):
    tokenizer.json (or tokenizer.model), tokenizer_config.json, special_tokens_map.json.

    `transformers.AutoTokenizer.from_pretrained(directory)` loads them and gives the same ids
    (`encode(text, add_special_tokens=False)`), and `from_dir` reads them back. A tokenizer
    read from a bare tokenizer.model is saved as that file, which transformers converts with a
    difference of its own: text starting with whitespace (see `_SentencePiece.write`).
    """
    os.makedirs(directory, exist_ok=True)
    tokenizer_class = self._backend.write(directory)
    special = {}
    for kind in _KINDS:
      i = getattr(self, f'{kind}_id')
      if i is not None:
        special[f'{kind}_token'] = self._id_to_token(i)
    config = dict(
        special,
        tokenizer_class=tokenizer_class,
        # Callers add special tokens themselves; transformers' decode must not edit spaces.
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False)
    if tokenizer_class == 'LlamaTokenizer':
      config['legacy'] = False
    write_atomically(os.path.join(directory, TOKENIZER_CONFIG),
                     json.dumps(config, indent=2, ensure_ascii=False) + '\n')
    write_atomically(os.path.join(directory, SPECIAL_TOKENS_MAP),
                     json.dumps(special, indent=2, ensure_ascii=False) + '\n')

  def _id_to_token(self, i: int) -> str:
    backend = self._backend
    if isinstance(backend, _Fast):
      return backend.tokenizer.id_to_token(i)
    return backend.processor.id_to_piece(i)


# -- reading files --------------------------------------------------------------------------------


def _load_tokenizer_json(path: str):
  try:
    return Tokenizer.from_file(path)
  except Exception as e:  # tokenizers raises plain Exception for unreadable or malformed files
    raise DataError(f'cannot read {path}: {_first_line(e)}') from None


def _load_gpt2_files(vocab_path: str, merges_path: str, names: dict[str, str]):
  """GPT-2's original files as transformers' GPT2TokenizerFast reads them."""
  for path in (vocab_path, merges_path):
    if not os.path.exists(path):
      other = MERGES_TXT if path == vocab_path else VOCAB_JSON
      raise DataError(f'{path} is missing (a GPT-2 tokenizer is {VOCAB_JSON} + {MERGES_TXT}; '
                      f'{other} is there)')
  read_json_object(vocab_path)  # a one-line error naming the file if it is not JSON
  try:
    with open(merges_path, encoding='utf-8') as f:
      f.read(1)
    model = models.BPE.from_file(vocab_path, merges_path)
  except Exception as e:  # OSError, UnicodeDecodeError, or tokenizers' parse errors
    raise DataError(f'cannot read {merges_path} with {vocab_path}: {_first_line(e)}') from None
  tokenizer = Tokenizer(model)
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
  # GPT2Tokenizer's special tokens (all '<|endoftext|>' by default) match whole in the text.
  specials = list(dict.fromkeys(names.get(k, GPT2_EOS) for k in ('unk', 'bos', 'eos')))
  if 'pad' in names:
    specials.append(names['pad'])
  tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
  return tokenizer


def _read_sentencepiece(path: str) -> bytes:
  try:
    with open(path, 'rb') as f:
      serialized = f.read()
    _SentencePiece(serialized)
  except (OSError, RuntimeError) as e:
    raise DataError(f'cannot read {path} as a SentencePiece model: {_first_line(e)}') from None
  return serialized
