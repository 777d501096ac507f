"""BERT's WordPiece tokenizer: loaded from a `vocab.txt`, or trained on the corpus.

Backed by Hugging Face `tokenizers` (Rust; the same normalisation, pre-tokenisation and greedy
longest-match-first WordPiece as BERT's reference and `transformers.BertTokenizerFast`). The
vocabulary file is the whole state: a workdir keeps its `vocab.txt`, and reruns reuse it.
"""

import os
from collections.abc import Iterable

import numpy as np
from tokenizers import BertWordPieceTokenizer

from transformer_jax.errors import DataError
from transformer_jax.files import write_atomically

SPECIAL_TOKENS = ('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]')  # [PAD] first: id 0


class WordPieceTokenizer:
  """ids <-> text with BERT's special tokens; `encode` never adds [CLS]/[SEP] itself."""

  def __init__(self, vocab: dict[str, int], lowercase: bool = True):
    missing = [t for t in SPECIAL_TOKENS if t not in vocab]
    if missing:
      raise DataError(f'WordPiece vocabulary lacks the special token(s) {missing}')
    self.vocab, self.lowercase = dict(vocab), lowercase
    self._tokenizer = BertWordPieceTokenizer(self.vocab, lowercase=lowercase)
    self._tokenizer.no_padding()
    self._tokenizer.no_truncation()
    self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
        vocab[t] for t in SPECIAL_TOKENS)
    self.special_ids = np.asarray(
        sorted({self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id} |
               {i for t, i in vocab.items() if t.startswith('[unused')}))
    self._inverse = {i: t for t, i in vocab.items()}

  @property
  def vocab_size(self) -> int:
    return max(self.vocab.values()) + 1

  @classmethod
  def from_vocab(cls, path: str, lowercase: bool = True) -> 'WordPieceTokenizer':
    """Reads a vocab.txt: one token per line, the line number is the id."""
    if not os.path.exists(path):
      raise DataError(f'WordPiece vocabulary {path} does not exist')
    with open(path, encoding='utf-8') as f:
      tokens = [line.rstrip('\n') for line in f]
    if tokens and tokens[-1] == '':
      tokens.pop()
    return cls({t: i for i, t in enumerate(tokens)}, lowercase=lowercase)

  @classmethod
  def train(cls, texts: Iterable[str], vocab_size: int, lowercase: bool = True,
            min_frequency: int = 2) -> 'WordPieceTokenizer':
    """A WordPiece vocabulary of at most `vocab_size` tokens learned from `texts`."""
    trainer = BertWordPieceTokenizer(lowercase=lowercase)
    trainer.train_from_iterator(iter(texts), vocab_size=vocab_size, min_frequency=min_frequency,
                                special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    learned = trainer.get_vocab()
    if len(learned) <= len(SPECIAL_TOKENS):
      raise DataError('the training text is too small to learn a WordPiece vocabulary')
    # The trainer numbers its tokens in the order of a Rust hash map (the '##' alphabet) and
    # breaks ties between merges of equal count arbitrarily, so two trainings on one text give
    # the same tokens other ids (tokenizers 0.23.3). Numbered canonically, a vocabulary trained
    # again (another process, a resume, another host) is the same one; WordPiece's greedy
    # longest-match encoding does not depend on the ids' order.
    tokens = list(SPECIAL_TOKENS) + sorted(set(learned) - set(SPECIAL_TOKENS))
    return cls({token: i for i, token in enumerate(tokens)}, lowercase=lowercase)

  def save(self, path: str):
    """Writes vocab.txt atomically (line i = the token with id i)."""
    tokens = [self._inverse.get(i, f'[unused_{i}]') for i in range(self.vocab_size)]
    write_atomically(path, '\n'.join(tokens) + '\n')

  @classmethod
  def load_or_train(cls, path: str, texts_fn, vocab_size: int,
                    lowercase: bool = True) -> 'WordPieceTokenizer':
    """The vocab.txt at `path`, or one trained on `texts_fn()` and saved there."""
    if os.path.exists(path):
      return cls.from_vocab(path, lowercase=lowercase)
    tokenizer = cls.train(texts_fn(), vocab_size, lowercase=lowercase)
    tokenizer.save(path)
    return tokenizer

  def encode(self, text: str) -> list[int]:
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    """Many texts at once (parallel in Rust)."""
    return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

  def encode_words(self, words: list[str]) -> list[list[int]]:
    """Each word's ids as inside a sentence (WordPiece reads every word alike)."""
    return self.encode_batch(words)

  def encode_pair(self, first: str, second: str | None = None,
                  max_len: int | None = None) -> tuple[list[int], list[int]]:
    """([CLS] a [SEP] (b [SEP]), segment ids), the longer side trimmed to fit `max_len`."""
    a = self.encode(first)
    b = self.encode(second) if second is not None else None
    return self.build_pair(a, b, max_len)

  def build_pair(self, a: list[int], b: list[int] | None,
                 max_len: int | None = None) -> tuple[list[int], list[int]]:
    return bert_pair(self.cls_id, self.sep_id, a, b, max_len)

  def decode(self, ids: Iterable[int]) -> str:
    return self._tokenizer.decode(list(ids))

  def id_to_token(self, i: int) -> str:
    return self._inverse.get(int(i), '[UNK]')


def bert_pair(cls_id: int, sep_id: int, a: list[int], b: list[int] | None,
              max_len: int | None = None) -> tuple[list[int], list[int]]:
  """BERT's layout: ([CLS] a [SEP] (b [SEP]), segment ids 0 ... (1 ...)), the longer side
  trimmed to fit `max_len`."""
  a, b = trim_pair(a, b, None if max_len is None else max_len - (3 if b is not None else 2))
  ids = [cls_id] + a + [sep_id]
  segments = [0] * len(ids)
  if b is not None:
    ids += b + [sep_id]
    segments += [1] * (len(b) + 1)
  return ids, segments


def trim_pair(a, b, budget: int | None) -> tuple[list[int], list[int] | None]:
  """Copies of segments `a` and `b` (or None) cut to `budget` tokens together (None: uncut), by
  dropping the last token of the longer one (of `a` on a tie) until they fit, as BERT does."""
  a, b = list(a), (list(b) if b is not None else None)
  if budget is not None:
    while len(a) + (len(b) if b is not None else 0) > budget:
      if b is not None and len(b) > len(a):
        b.pop()
      else:
        a.pop()
  return a, b
