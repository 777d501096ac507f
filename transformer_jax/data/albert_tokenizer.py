"""ALBERT's SentencePiece tokenizer, read from a Hugging Face folder's tokenizer.json.

    tokenizer = AlbertTokenizer.from_dir('/path/to/albert')   # tokenizer.json + its config
    ids, segments = tokenizer.encode_pair('the cat sat', 'on the mat', max_len=128)

ALBERT's vocabulary already pads with id 0 (<pad>), as everything here does, so its ids are
transformers' ids unchanged (RoBERTa's need a swap: data/roberta_tokenizer.py). Pairs are BERT's
`[CLS] a [SEP] b [SEP]` with segment ids 0 then 1. The `tokenizers` library runs the folder's
tokenizer.json (normalizer, Metaspace pre-tokenizer, unigram model), which is what transformers'
AlbertTokenizer runs; a folder with only the older spiece.model is refused (its lowercasing and
accent stripping live in Python code of transformers that is not reproduced here).
"""

import json
import os

import numpy as np

from transformer_jax.data.hf_tokenizer import (SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG, TOKENIZER_JSON,
                                               HFTokenizer, special_token_names)
from transformer_jax.data.wordpiece import bert_pair
from transformer_jax.errors import DataError
from transformer_jax.files import read_json_object, write_atomically

# ALBERT's special tokens, where the folder's tokenizer_config.json names none.
_TOKEN_DEFAULTS = {'cls': '[CLS]', 'sep': '[SEP]', 'pad': '<pad>', 'unk': '<unk>', 'mask': '[MASK]'}
# What tokenizer_config.json says a saved copy is (transformers loads tokenizer.json with it).
TOKENIZER_CLASS = 'AlbertTokenizer'


class AlbertTokenizer:
  """The interface of `WordPieceTokenizer` (encode, encode_batch, build_pair, decode, the
  special ids) over an ALBERT tokenizer.json."""

  def __init__(self, hf: HFTokenizer, names: dict[str, str], source: str = ''):
    self.hf, self.names = hf, names
    ids = {}
    for kind, token in names.items():
      i = hf.token_to_id(token)
      if i is None:
        raise DataError(f'{source or "tokenizer"}: the {kind} token {token!r} is not in the '
                        'vocabulary')
      ids[kind] = i
    if ids['pad'] != 0:
      raise DataError(f'{source or "tokenizer"}: the pad token {names["pad"]!r} is id '
                      f'{ids["pad"]}; the models here pad with id 0')
    self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
        ids[k] for k in ('pad', 'unk', 'cls', 'sep', 'mask'))
    self.special_ids = np.asarray(sorted(set(ids.values())))

  def __repr__(self) -> str:
    return f'AlbertTokenizer(vocab_size={self.vocab_size}, mask_id={self.mask_id})'

  @classmethod
  def from_dir(cls, directory: str) -> 'AlbertTokenizer':
    """The tokenizer of an HF ALBERT folder (tokenizer.json; special tokens named by
    tokenizer_config.json / special_tokens_map.json, else ALBERT's)."""
    if not os.path.isfile(os.path.join(directory, TOKENIZER_JSON)):
      raise DataError(f'{directory} has no {TOKENIZER_JSON}: save the tokenizer with a recent '
                      'transformers (AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))')
    names = special_token_names(directory, _TOKEN_DEFAULTS)
    names = {kind: names.get(kind, default) for kind, default in _TOKEN_DEFAULTS.items()}
    return cls(HFTokenizer.from_dir(directory), names, directory)

  @property
  def vocab_size(self) -> int:
    return self.hf.vocab_size

  def encode(self, text: str) -> list[int]:
    return self.hf.encode(text)

  def encode_batch(self, texts) -> list[list[int]]:
    return self.hf.encode_batch(list(texts))

  def encode_words(self, words) -> list[list[int]]:
    """Each word's ids as inside a sentence: SentencePiece marks the start of every word (▁),
    so a word encodes alike alone."""
    return self.encode_batch(words)

  def encode_pair(self, first: str, second: str | None = None,
                  max_len: int | None = None) -> tuple[list[int], list[int]]:
    b = self.encode(second) if second is not None else None
    return self.build_pair(self.encode(first), b, max_len)

  def build_pair(self, a, b, max_len: int | None = None) -> tuple[list[int], list[int]]:
    """([CLS] a [SEP] (b [SEP]), segment ids 0 ... (1 ...)), the longer side trimmed to fit."""
    return bert_pair(self.cls_id, self.sep_id, a, b, max_len)

  def decode(self, ids) -> str:
    """Text of `ids` (special tokens shown, padding dropped)."""
    return self.hf.decode(ids)

  def save(self, directory: str) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json in `directory`, which
    `from_dir` and transformers' AutoTokenizer read back with the same ids."""
    self.hf.save(directory)
    special = {f'{kind}_token': token for kind, token in self.names.items()}
    config = dict(special, tokenizer_class=TOKENIZER_CLASS, clean_up_tokenization_spaces=False)
    write_atomically(os.path.join(directory, SPECIAL_TOKENS_MAP),
                     json.dumps(special, indent=2, ensure_ascii=False) + '\n')
    write_atomically(os.path.join(directory, TOKENIZER_CONFIG),
                     json.dumps(config, indent=2, ensure_ascii=False) + '\n')


def is_saved_here(directory: str) -> bool:
  """Whether `directory` holds a tokenizer `AlbertTokenizer.save` wrote (by the class its
  tokenizer_config.json names)."""
  path = os.path.join(directory, TOKENIZER_CONFIG)
  return os.path.isfile(path) and read_json_object(path).get('tokenizer_class') == TOKENIZER_CLASS
