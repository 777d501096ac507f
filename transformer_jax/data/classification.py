"""Sentence classification data (SST-2): TSV / TFDS readers and padded batches for `Bert`.

GLUE's SST-2 TSVs have a header row naming the columns; which column is 'label' differs
between distributions (`sentence\tlabel` in GLUE, `label\tsentence` elsewhere), so columns are
found by the header, never by position. The TFDS `glue/sst2` test split has no labels (-1):
use train and validation.

Batches are {'inputs', 'segments': int32[B, L], 'labels': int32[B], 'weights': float32[B]}. L is
the smallest length bucket that fits the longest row, so short sentences do not pay for
max_len; each bucket is one compiled shape. Training order is a permutation drawn from
(seed, epoch), and the position is (epoch, batch), so a resumed run continues exactly.
"""

import csv
import os
from collections.abc import Iterator

import numpy as np

from transformer_jax.errors import DataError

Batch = dict[str, np.ndarray]
TEXT_COLUMNS = ('sentence', 'content', 'text')


def read_tsv(path: str) -> tuple[list[str], list[int]]:
  """(sentences, labels) from a TSV with a header naming 'label' and a text column."""
  if not os.path.exists(path):
    raise DataError(f'{path} does not exist (relative paths start from {os.getcwd()})')
  with open(path, encoding='utf-8', newline='') as f:
    rows = list(csv.reader(f, delimiter='\t', quoting=csv.QUOTE_NONE))
  if not rows:
    raise DataError(f'{path} is empty: expected a header row and examples')
  header = [h.strip().lower() for h in rows[0]]
  if 'label' not in header:
    raise DataError(f'{path}: the header row {rows[0]} has no "label" column')
  text_cols = [c for c in TEXT_COLUMNS if c in header]
  if not text_cols:
    raise DataError(f'{path}: the header row {rows[0]} has no text column (one of '
                    f'{TEXT_COLUMNS})')
  li, ti = header.index('label'), header.index(text_cols[0])
  sentences, labels = [], []
  for n, row in enumerate(rows[1:], start=2):
    if not row:
      continue
    if len(row) != len(header):
      raise DataError(f'{path} line {n} has {len(row)} fields, the header has {len(header)}')
    try:
      labels.append(int(row[li]))
    except ValueError:
      raise DataError(f'{path} line {n}: label {row[li]!r} is not an integer') from None
    sentences.append(row[ti])
  if not sentences:
    raise DataError(f'{path} has a header but no examples')
  return sentences, labels


def load_sst2_tsv(directory: str) -> dict[str, tuple[list[str], list[int]]]:
  """{'train': ..., 'dev': ...} from DIR/train.tsv and DIR/dev.tsv."""
  if not os.path.isdir(directory):
    raise DataError(f'SST-2 directory {directory} does not exist (set --config.data.dir)')
  return {split: read_tsv(os.path.join(directory, f'{split}.tsv')) for split in ('train', 'dev')}


def load_sst2_tfds(data_dir: str | None = None, name: str = 'glue/sst2',
                   max_examples: int = 0) -> dict[str, tuple[list[str], list[int]]]:
  """{'train', 'dev'} from TFDS glue/sst2 (train and validation splits)."""
  import tensorflow_datasets as tfds
  out = {}
  for split, tfds_split in (('train', 'train'), ('dev', 'validation')):
    if max_examples:
      tfds_split = f'{tfds_split}[:{max_examples}]'
    try:
      dataset = tfds.load(name, split=tfds_split, data_dir=data_dir)
    except Exception as e:
      raise DataError(f'cannot load TFDS {name}[{tfds_split}]: {str(e).splitlines()[0]}') from None
    sentences, labels = [], []
    for example in tfds.as_numpy(dataset):
      sentences.append(example['sentence'].decode('utf-8'))
      labels.append(int(example['label']))
    out[split] = (sentences, labels)
  return out


def default_buckets(max_len: int) -> list[int]:
  buckets, length = [], 16
  while length < max_len:
    buckets.append(length)
    length *= 2
  return buckets + [max_len]


def encode_examples(tokenizer, sentences: list[str], max_len: int) -> list[np.ndarray]:
  """[CLS] sentence [SEP] ids per sentence, truncated to max_len."""
  out = []
  for ids in tokenizer.encode_batch(sentences):
    row, _ = tokenizer.build_pair(ids, None, max_len)
    out.append(np.asarray(row, np.int32))
  return out


def make_batch(rows: list[np.ndarray], labels: np.ndarray, weights: np.ndarray, buckets: list[int],
               batch_size: int) -> Batch:
  """Pads rows (and absent rows, weight 0) to [batch_size, bucket]."""
  longest = max((len(r) for r in rows), default=1)
  length = next(b for b in buckets if b >= longest)
  inputs = np.zeros((batch_size, length), np.int32)
  for i, r in enumerate(rows):
    inputs[i, :len(r)] = r
  pad = batch_size - len(rows)
  return {
      'inputs': inputs, 'segments': np.zeros_like(inputs),
      'labels': np.pad(np.asarray(labels, np.int32),
                       (0, pad)), 'weights': np.pad(np.asarray(weights, np.float32), (0, pad))
  }


class ClassificationBatches:
  """Endless shuffled training batches of `batch_size` rows (this process's slice)."""

  def __init__(self, rows: list[np.ndarray], labels: list[int], *, batch_size: int, max_len: int,
               seed: int, process_index: int = 0, process_count: int = 1):
    if len(rows) < batch_size:
      raise DataError(f'{len(rows)} training examples are fewer than one batch of {batch_size}')
    if batch_size % process_count:
      raise DataError(f'batch size {batch_size} is not divisible by {process_count} processes')
    self.rows, self.labels = rows, np.asarray(labels, np.int32)
    self.batch_size, self.seed, self.buckets = batch_size, seed, default_buckets(max_len)
    local = batch_size // process_count
    self._local = slice(process_index * local, (process_index + 1) * local)
    self.batches_per_epoch = len(rows) // batch_size
    self.epoch, self.index = 0, 0

  def batch(self, epoch: int, index: int) -> Batch:
    order = np.random.default_rng((self.seed, epoch)).permutation(len(self.rows))
    chosen = order[index * self.batch_size:(index + 1) * self.batch_size][self._local]
    return make_batch([self.rows[i] for i in chosen], self.labels[chosen],
                      np.ones(len(chosen), np.float32), self.buckets, len(chosen))

  def __iter__(self) -> Iterator[Batch]:
    while True:
      if self.index >= self.batches_per_epoch:
        self.epoch, self.index = self.epoch + 1, 0
      batch = self.batch(self.epoch, self.index)
      self.index += 1
      yield batch

  def get_state(self) -> dict:
    return {'epoch': self.epoch, 'index': self.index}

  def set_state(self, state: dict):
    self.epoch, self.index = int(state['epoch']), int(state['index'])


def eval_batches(rows: list[np.ndarray], labels: list[int], *, batch_size: int, max_len: int,
                 process_index: int = 0, process_count: int = 1) -> list[Batch]:
  """Every example once, in order; the last batch padded with weight-0 rows. Rows are sorted
  by length first so each batch pads little (accuracy does not depend on the order)."""
  order = np.argsort([len(r) for r in rows], kind='stable')
  labels = np.asarray(labels, np.int32)
  buckets = default_buckets(max_len)
  local = batch_size // process_count
  out = []
  for start in range(0, len(order), batch_size):
    chosen = order[start:start + batch_size]
    batch = make_batch([rows[i] for i in chosen], labels[chosen], np.ones(len(chosen), np.float32),
                       buckets, batch_size)
    out.append({k: v[process_index * local:(process_index + 1) * local] for k, v in batch.items()})
  return out
