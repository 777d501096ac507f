"""RoBERTa's byte-level BPE tokenizer in this package's id space (<pad> = 0).

RoBERTa's vocabulary puts <s> at 0 and <pad> at 1; everything here pads with 0 (PAD_ID). The
tokenizer swaps ids 0 and the checkpoint's pad id both ways (`swap_ids`), so the model, the
batches and the tasks keep padding at 0, and `to_hf` / `from_hf` give Hugging Face's ids back.
convert/hf_roberta.py swaps the embedding rows to match (its docstring says why).
"""

import json
import os
import tempfile

import numpy as np
from absl import logging
from tokenizers import Tokenizer, processors

from transformer_jax.data.hf_tokenizer import (SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG, HFTokenizer,
                                               special_token_names, train_byte_level_backend)
from transformer_jax.data.wordpiece import trim_pair
from transformer_jax.errors import DataError
from transformer_jax.files import write_atomically

# RoBERTa's special tokens, in the order of its vocabulary (<mask> is the last id of
# roberta-base's, the fifth of a vocabulary trained here).
SPECIAL_TOKENS = ('<s>', '<pad>', '</s>', '<unk>', '<mask>')
_TOKEN_DEFAULTS = {
    'bos': '<s>', 'cls': '<s>', 'pad': '<pad>', 'eos': '</s>', 'sep': '</s>', 'unk': '<unk>',
    'mask': '<mask>'
}


def swap_ids(ids, pad_id: int):
  """`ids` (an int array or list) with 0 and `pad_id` exchanged: HF ids <-> ours, both ways."""
  if isinstance(ids, list):
    return [pad_id if i == 0 else 0 if i == pad_id else i for i in ids]
  ids = np.asarray(ids)
  return np.where(ids == 0, pad_id, np.where(ids == pad_id, 0, ids)).astype(ids.dtype)


def _special_names(directory: str) -> dict[str, str]:
  """kind ('bos', 'cls', 'mask', ...) -> token text from tokenizer_config.json, else
  special_tokens_map.json, else RoBERTa's."""
  names = special_token_names(directory, _TOKEN_DEFAULTS)
  return {kind: names.get(kind, default) for kind, default in _TOKEN_DEFAULTS.items()}


class RobertaTokenizer:
  """RoBERTa's byte-level BPE with the interface of `data/wordpiece.WordPieceTokenizer` (what
  data/bert_pretrain.py, data/classification.py and the BERT workflow use), in our id space:
  ids 0 and `hf_pad_id` swapped, so `pad_id` is 0 (module docstring). `cls_id` is <s>,
  `sep_id` </s>; `build_pair` writes RoBERTa's `<s> A </s>` and `<s> A </s></s> B </s>` with
  all-zero segments (RoBERTa has no token types). `encode` adds no special token.
  """

  lowercase = False  # byte-level BPE sees the text as it is

  def __init__(self, hf: HFTokenizer, names: dict[str, str], source: str = ''):
    self.hf, self.names = hf, dict(names)
    hf_ids = {}
    for kind, token in self.names.items():
      i = hf.token_to_id(token)
      if i is None:
        raise DataError(f'{source or "the tokenizer"}: RoBERTa\'s {kind} token {token!r} is not in '
                        'the vocabulary')
      hf_ids[kind] = i
    self.hf_pad_id = hf_ids['pad']
    ours = {kind: swap_ids([i], self.hf_pad_id)[0] for kind, i in hf_ids.items()}
    self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
        ours[k] for k in ('pad', 'unk', 'cls', 'sep', 'mask'))
    self.bos_id, self.eos_id = ours['bos'], ours['eos']
    self.special_ids = np.asarray(sorted(set(ours.values())))
    self._hf_ids = hf_ids

  def __repr__(self) -> str:
    return (f'RobertaTokenizer(vocab_size={self.vocab_size}, hf_pad_id={self.hf_pad_id}, '
            f'mask_id={self.mask_id})')

  # -- building

  @classmethod
  def from_dir(cls, directory: str) -> 'RobertaTokenizer':
    """The tokenizer of an HF RoBERTa folder: tokenizer.json, else vocab.json + merges.txt;
    special tokens named by tokenizer_config.json / special_tokens_map.json, else RoBERTa's."""
    path = lambda name: os.path.join(directory, name)
    named = any(os.path.exists(path(n)) for n in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP))
    bare_bpe = all(os.path.exists(path(n)) for n in ('vocab.json', 'merges.txt'))
    if named or os.path.exists(path('tokenizer.json')) or not bare_bpe:
      return cls(HFTokenizer.from_dir(directory), _special_names(directory), directory)
    # Bare vocab.json + merges.txt (fairseq-era folders): HFTokenizer would take GPT-2's special
    # token for the unnamed ones, so name RoBERTa's beside copies of the two files.
    with tempfile.TemporaryDirectory() as tmp:
      for name in ('vocab.json', 'merges.txt'):
        with open(path(name), 'rb') as f:
          write_atomically(os.path.join(tmp, name), f.read())
      names = {f'{kind}_token': token for kind, token in _TOKEN_DEFAULTS.items()}
      write_atomically(os.path.join(tmp, SPECIAL_TOKENS_MAP), json.dumps(names))
      return cls(HFTokenizer.from_dir(tmp), _special_names(tmp), directory)

  @classmethod
  def train(cls, texts, vocab_size: int, *, min_frequency: int = 2) -> 'RobertaTokenizer':
    """A byte-level BPE learned from `texts` with RoBERTa's pipeline (GPT-2's regex split, no
    prefix space) and special tokens <s>=0 <pad>=1 </s>=2 <unk>=3 <mask>=4 (HF ids), so that an
    exported model has roberta-base's layout of the first four."""
    backend, seen = train_byte_level_backend(texts, vocab_size, list(SPECIAL_TOKENS),
                                             min_frequency=min_frequency)
    with tempfile.TemporaryDirectory() as tmp:  # HFTokenizer reads files: go through them
      _write_files(tmp, backend.to_str(), dict(_TOKEN_DEFAULTS))
      tokenizer = cls.from_dir(tmp)
    logging.info('trained a RoBERTa byte-level BPE with %d tokens on %d texts',
                 tokenizer.vocab_size, seen)
    return tokenizer

  @classmethod
  def load_or_train(cls, directory: str, texts_fn, vocab_size: int) -> 'RobertaTokenizer':
    """The tokenizer saved in `directory`, or one trained on `texts_fn()` and saved there."""
    if os.path.exists(os.path.join(directory, 'tokenizer.json')):
      return cls.from_dir(directory)
    tokenizer = cls.train(texts_fn(), vocab_size)
    tokenizer.save(directory)
    return tokenizer

  # -- using

  @property
  def vocab_size(self) -> int:
    return self.hf.vocab_size

  @property
  def hf_special_ids(self) -> dict[str, int]:
    """config.json's token ids, in HF's numbering: {'pad_token_id', 'bos_token_id',
    'eos_token_id'}."""
    return {f'{k}_token_id': self._hf_ids[k] for k in ('pad', 'bos', 'eos')}

  def to_hf(self, ids):
    """Our ids -> HF's (a list or an array)."""
    return swap_ids(ids, self.hf_pad_id)

  def from_hf(self, ids):
    """HF's ids -> ours (a list or an array)."""
    return swap_ids(ids, self.hf_pad_id)

  def encode(self, text: str) -> list[int]:
    return self.from_hf(self.hf.encode(text))

  def encode_batch(self, texts) -> list[list[int]]:
    return [self.from_hf(ids) for ids in self.hf.encode_batch(list(texts))]

  def encode_words(self, words) -> list[list[int]]:
    """Each word's ids as after a space inside a sentence: byte-level BPE spells a word's leading
    space into its first piece ('Ġword'), which the word alone would lack (transformers'
    `add_prefix_space=True` for words given one by one)."""
    return self.encode_batch([' ' + word for word in words])

  def encode_pair(self, first: str, second: str | None = None,
                  max_len: int | None = None) -> tuple[list[int], list[int]]:
    """(<s> a </s> (</s> b </s>), segment ids (all 0)), the longer side trimmed to fit."""
    a = self.encode(first)
    b = self.encode(second) if second is not None else None
    return self.build_pair(a, b, max_len)

  def build_pair(self, a, b, max_len: int | None = None) -> tuple[list[int], list[int]]:
    a, b = trim_pair(a, b, None if max_len is None else max_len - (4 if b is not None else 2))
    ids = [self.cls_id] + a + [self.sep_id]
    if b is not None:
      ids += [self.sep_id] + b + [self.sep_id]
    return ids, [0] * len(ids)

  def decode(self, ids) -> str:
    """Text of our ids; drops padding."""
    if hasattr(ids, '__array__'):
      ids = np.asarray(ids).reshape(-1).tolist()
    return self.hf.decode(self.to_hf([int(i) for i in ids if int(i) != self.pad_id]))

  # -- saving

  def save(self, directory: str, max_len: int | None = None):
    """Writes HF RoBERTa tokenizer files to `directory` (each file atomically; tokenizer.json,
    whose presence `load_or_train` checks, last): vocab.json, merges.txt, tokenizer_config.json
    (RobertaTokenizer), special_tokens_map.json, tokenizer.json (with RoBERTa's post-processor,
    so HF's `tokenizer(text)` adds <s> and </s>). `transformers.AutoTokenizer` loads them with
    the same HF ids; `from_dir` reads them back."""
    with tempfile.TemporaryDirectory() as tmp:
      self.hf.save(tmp)
      with open(os.path.join(tmp, 'tokenizer.json'), encoding='utf-8') as f:
        tokenizer_json = f.read()
    _write_files(directory, tokenizer_json, self.names, max_len)


def _write_files(directory: str, tokenizer_json: str, names: dict[str, str],
                 max_len: int | None = None) -> None:
  """The tokenizer files of `save` from a tokenizer.json text (see `RobertaTokenizer.save`)."""
  backend = Tokenizer.from_str(tokenizer_json)
  token_id = backend.token_to_id
  backend.post_processor = processors.RobertaProcessing((names['sep'], token_id(names['sep'])),
                                                        (names['cls'], token_id(names['cls'])),
                                                        trim_offsets=True, add_prefix_space=False)
  backend.no_padding()
  backend.no_truncation()
  os.makedirs(directory, exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp:
    for path in backend.model.save(tmp):  # vocab.json + merges.txt (a BPE model)
      with open(path, encoding='utf-8') as f:
        write_atomically(os.path.join(directory, os.path.basename(path)), f.read())
  special = {f'{kind}_token': token for kind, token in names.items()}
  config = dict(special, tokenizer_class='RobertaTokenizer', add_prefix_space=False,
                trim_offsets=True, errors='replace', clean_up_tokenization_spaces=False)
  if max_len:
    config['model_max_length'] = int(max_len)
  for name, value in ((TOKENIZER_CONFIG, config), (SPECIAL_TOKENS_MAP, special)):
    write_atomically(os.path.join(directory, name),
                     json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + '\n')
  write_atomically(os.path.join(directory, 'tokenizer.json'), backend.to_str(pretty=True))
