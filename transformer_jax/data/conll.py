"""Token classification data (CoNLL-style tagging): a file reader, sub-word labels and batches.

A CoNLL file has one word per line with its tag in the LAST whitespace-separated column (CoNLL-2003
has `word POS chunk NER`; a two-column `word tag` file works the same), a blank line between
sentences, and `-DOCSTART-` lines between documents, which are skipped.

The tokenizer (WordPiece, ALBERT's SentencePiece or RoBERTa's byte-level BPE) splits a word into
sub-words, each word as it reads inside a sentence (`encode_words`); as in BERT's tagging recipe
(Devlin et al. 2019, 5.3) the word's label goes on its FIRST sub-word and the others get IGNORE
(-100), which the batches turn into weight 0, so they count neither in the loss nor in the
accuracy. [CLS] and [SEP] are ignored too. Sentences longer than max_len sub-words are truncated
(the count is reported).

Batches are {'inputs', 'segments', 'labels': int32[B, L], 'weights': float32[B, L]} (labels 0
where the weight is 0); L is the smallest length bucket that fits the batch's longest row, as in
data/classification.py, whose shuffling and resumable position these batches share.
"""

import dataclasses
import os

import numpy as np

from transformer_jax.data.batches import ShuffledEpochBatches
from transformer_jax.data.classification import default_buckets
from transformer_jax.errors import DataError

Batch = dict[str, np.ndarray]
IGNORE = -100  # the label of sub-words that are not scored (HF's convention)
DOCSTART = '-DOCSTART-'


@dataclasses.dataclass(frozen=True)
class Sentence:
  """One tagged sentence; `line` is the 1-based line of its first word (for error messages)."""
  words: tuple[str, ...]
  tags: tuple[str, ...]
  line: int


def read_conll(path: str) -> list[Sentence]:
  """Sentences of a CoNLL-style file; one DataError naming file:line for a malformed line."""
  if not os.path.exists(path):
    raise DataError(f'{path} does not exist (relative paths start from {os.getcwd()})')
  sentences, words, tags, first = [], [], [], 0

  def flush():
    if words:
      sentences.append(Sentence(tuple(words), tuple(tags), first))
      words.clear()
      tags.clear()

  with open(path, encoding='utf-8') as f:
    for n, line in enumerate(f, start=1):
      fields = line.split()
      if not fields:
        flush()
        continue
      if fields[0] == DOCSTART:
        flush()
        continue
      if len(fields) < 2:
        raise DataError(f'{path}:{n}: expected a word and its tag separated by whitespace, got '
                        f'{line.strip()!r}')
      if not words:
        first = n
      words.append(fields[0])
      tags.append(fields[-1])
  flush()
  if not sentences:
    raise DataError(f'{path} has no tagged sentences (expected "word tag" lines)')
  return sentences


def tag_vocabulary(sentences: list[Sentence]) -> list[str]:
  """The label names, sorted (so the ids do not depend on the order of the file), 'O' first."""
  tags = sorted({t for s in sentences for t in s.tags})
  return (['O'] + [t for t in tags if t != 'O']) if 'O' in tags else tags


def check_tags(path: str, sentences: list[Sentence], label_names: list[str]) -> None:
  """One DataError naming file:line of the first tag outside `label_names` (the training tags)."""
  known = set(label_names)
  for s in sentences:
    for i, tag in enumerate(s.tags):
      if tag not in known:
        raise DataError(f'{path}:{s.line + i}: tag {tag!r} is not among the training tags '
                        f'{label_names}')


@dataclasses.dataclass
class Encoded:
  """Sub-word rows ([CLS] ... [SEP]) and their labels (IGNORE off the first sub-words)."""
  rows: list[np.ndarray]
  labels: list[np.ndarray]
  truncated: int = 0  # sentences cut to max_len
  words_dropped: int = 0  # labelled words lost to the cut


def encode_sentences(tokenizer, sentences: list[Sentence], label_names: list[str],
                     max_len: int) -> Encoded:
  """Each word tokenised on its own (so sub-words never cross words) as it reads inside a sentence
  (`tokenizer.encode_words`); a word that encodes to nothing (e.g. a control character) becomes
  [UNK], so every word keeps its label."""
  label_id = {t: i for i, t in enumerate(label_names)}
  vocabulary = sorted({w for s in sentences for w in s.words})
  pieces = dict(zip(vocabulary, tokenizer.encode_words(vocabulary)))
  out = Encoded([], [])
  budget = max_len - 2
  for s in sentences:
    ids, labels = [], []
    for word, tag in zip(s.words, s.tags):
      word_ids = pieces[word] or [tokenizer.unk_id]
      ids += word_ids
      labels += [label_id[tag]] + [IGNORE] * (len(word_ids) - 1)
    if len(ids) > budget:
      out.truncated += 1
      out.words_dropped += sum(1 for y in labels[budget:] if y != IGNORE)
      ids, labels = ids[:budget], labels[:budget]
    out.rows.append(np.asarray([tokenizer.cls_id] + ids + [tokenizer.sep_id], np.int32))
    out.labels.append(np.asarray([IGNORE] + labels + [IGNORE], np.int32))
  return out


def make_batch(rows: list[np.ndarray], labels: list[np.ndarray], buckets: list[int],
               batch_size: int) -> Batch:
  """Pads rows (and absent rows) to [batch_size, bucket]; IGNORE and padding get weight 0."""
  longest = max((len(r) for r in rows), default=1)
  length = next(b for b in buckets if b >= longest)
  inputs = np.zeros((batch_size, length), np.int32)
  targets = np.full((batch_size, length), IGNORE, np.int32)
  for i, (r, y) in enumerate(zip(rows, labels)):
    inputs[i, :len(r)], targets[i, :len(y)] = r, y
  weights = (targets != IGNORE).astype(np.float32)
  return {
      'inputs': inputs, 'segments': np.zeros_like(inputs),
      'labels': np.where(targets == IGNORE, 0, targets).astype(np.int32), 'weights': weights
  }


class TaggingBatches(ShuffledEpochBatches):
  """Endless shuffled training batches of `batch_size` rows (this process's slice); the same
  order and resumable (epoch, batch) position as `classification.ClassificationBatches`."""

  def __init__(self, encoded: Encoded, *, batch_size: int, max_len: int, seed: int,
               process_index: int = 0, process_count: int = 1):
    super().__init__(len(encoded.rows), batch_size=batch_size, seed=seed,
                     process_index=process_index, process_count=process_count,
                     what='training sentences')
    self.rows, self.labels = encoded.rows, encoded.labels
    self.buckets = default_buckets(max_len)

  def make_batch(self, chosen: np.ndarray) -> Batch:
    return make_batch([self.rows[i] for i in chosen], [self.labels[i] for i in chosen],
                      self.buckets, len(chosen))


def eval_batches(encoded: Encoded, *, batch_size: int, max_len: int, process_index: int = 0,
                 process_count: int = 1) -> list[Batch]:
  """Every sentence once, sorted by length (each batch pads little); the last batch padded with
  weight-0 rows."""
  order = np.argsort([len(r) for r in encoded.rows], kind='stable')
  buckets = default_buckets(max_len)
  local = batch_size // process_count
  out = []
  for start in range(0, len(order), batch_size):
    chosen = order[start:start + batch_size]
    batch = make_batch([encoded.rows[i] for i in chosen], [encoded.labels[i] for i in chosen],
                       buckets, batch_size)
    out.append({k: v[process_index * local:(process_index + 1) * local] for k, v in batch.items()})
  return out
