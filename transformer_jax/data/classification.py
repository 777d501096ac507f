"""Sentence and sentence-pair classification data (SST-2, GLUE pairs): TSV / TFDS readers and
padded batches for `Bert`.

GLUE's SST-2 TSVs have a header row naming the columns; which column is 'label' differs
between distributions (`sentence\tlabel` in GLUE, `label\tsentence` elsewhere), so columns are
found by the header, never by position. The TFDS `glue/sst2` test split has no labels (-1):
use train and validation.

Sentence pairs (RTE, MRPC, MNLI...): `read_tsv` with two `text_columns` (header names or 0-based
positions) gives (first, second) tuples, encoded as [CLS] a [SEP] b [SEP] with segment ids 0 for
[CLS] a [SEP] and 1 for b [SEP]; an encoded pair row is int32[2, L] (ids, segments), a single
sentence int32[L]. Labels are integers, or names mapped by `label_names` (MNLI's 'entailment').

Batches are {'inputs', 'segments': int32[B, L], 'labels': int32[B], 'weights': float32[B]}. L is
the smallest length bucket that fits the longest row, so short sentences do not pay for
max_len; each bucket is one compiled shape. Training order is a permutation drawn from
(seed, epoch), and the position is (epoch, batch), so a resumed run continues exactly.
"""

import csv
import os

import numpy as np

from transformer_jax.data.batches import ShuffledEpochBatches
from transformer_jax.data.tfds_text import import_tfds
from transformer_jax.errors import DataError

Batch = dict[str, np.ndarray]
TEXT_COLUMNS = ('sentence', 'content', 'text')


def _column(header: list[str], spec, path: str, row0) -> int:
  """Index of a column given by header name or 0-based position (an int or a digit string)."""
  if isinstance(spec, int) or (isinstance(spec, str) and spec.isdigit()):
    index = int(spec)
    if not 0 <= index < len(header):
      raise DataError(f'{path}: column {index} is outside the {len(header)} columns {row0}')
    return index
  name = str(spec).strip().lower()
  if name not in header:
    raise DataError(f'{path}: the header row {row0} has no {spec!r} column')
  return header.index(name)


def read_tsv(path: str, text_columns=(), label_column='', label_names=()) -> tuple[list, list[int]]:
  """(texts, labels) from a TSV with a header row.

  `text_columns` empty: one text column found by name (one of TEXT_COLUMNS), texts are strings;
  one or two columns (header names or 0-based positions): strings or (first, second) pairs.
  `label_column` ('' = the column named 'label'): integers, or names listed in `label_names`.
  """
  if not os.path.exists(path):
    raise DataError(f'{path} does not exist (relative paths start from {os.getcwd()})')
  with open(path, encoding='utf-8', newline='') as f:
    rows = list(csv.reader(f, delimiter='\t', quoting=csv.QUOTE_NONE))
  if not rows:
    raise DataError(f'{path} is empty: expected a header row and examples')
  header = [h.strip().lower() for h in rows[0]]
  if label_column in ('', None) and 'label' not in header:
    raise DataError(f'{path}: the header row {rows[0]} has no "label" column')
  li = _column(header, label_column or 'label', path, rows[0])
  if text_columns:
    if len(text_columns) > 2:
      raise DataError(f'text_columns={tuple(text_columns)}: one or two columns, not more')
    tis = [_column(header, c, path, rows[0]) for c in text_columns]
  else:
    text_cols = [c for c in TEXT_COLUMNS if c in header]
    if not text_cols:
      raise DataError(f'{path}: the header row {rows[0]} has no text column (one of '
                      f'{TEXT_COLUMNS})')
    tis = [header.index(text_cols[0])]
  names = {str(n): i for i, n in enumerate(label_names)}
  texts, labels = [], []
  for n, row in enumerate(rows[1:], start=2):
    if not row:
      continue
    if len(row) != len(header):
      raise DataError(f'{path} line {n} has {len(row)} fields, the header has {len(header)}')
    value = row[li].strip()
    if value in names:
      labels.append(names[value])
    else:
      try:
        labels.append(int(value))
      except ValueError:
        known = f' or one of {sorted(names)}' if names else ''
        raise DataError(f'{path} line {n}: label {row[li]!r} is not an integer{known}') from None
    texts.append(row[tis[0]] if len(tis) == 1 else (row[tis[0]], row[tis[1]]))
  if not texts:
    raise DataError(f'{path} has a header but no examples')
  return texts, labels


def load_sst2_tsv(
    directory: str, text_columns=(), label_column='', label_names=(), files=('train.tsv', 'dev.tsv')
) -> dict[str, tuple[list, list[int]]]:
  """{'train': ..., 'dev': ...} from DIR/train.tsv and DIR/dev.tsv (or the given `files`, e.g.
  MNLI's dev_matched.tsv); the column arguments are `read_tsv`'s."""
  if not os.path.isdir(directory):
    raise DataError(f'data directory {directory} does not exist (set --config.data.dir)')
  return {
      split: read_tsv(os.path.join(directory, name), text_columns, label_column, label_names)
      for split, name in zip(('train', 'dev'), files)
  }


# TFDS GLUE tasks: their text features (two for sentence pairs) and validation split.
GLUE_FEATURES = {
    'sst2': ('sentence',
            ), 'cola': ('sentence',
                       ), 'rte': ('sentence1', 'sentence2'), 'mrpc': ('sentence1', 'sentence2'),
    'wnli': ('sentence1', 'sentence2'), 'qqp': ('question1', 'question2'),
    'qnli': ('question', 'sentence'), 'mnli': ('premise', 'hypothesis')
}
GLUE_DEV_SPLITS = {'mnli': 'validation_matched'}


def glue_task(name: str) -> str:
  """'rte' of 'glue/rte' (or 'glue/rte:2.0.0'); DataError for a task without labels to fit."""
  task = name.split('/')[-1].split(':')[0]
  if not name.startswith('glue/') or task not in GLUE_FEATURES:
    raise DataError(f'TFDS {name!r} is not a GLUE classification task; known: '
                    f'{", ".join("glue/" + t for t in GLUE_FEATURES)}')
  return task


def load_glue_tfds(data_dir: str | None = None, name: str = 'glue/sst2',
                   max_examples: int = 0) -> dict[str, tuple[list, list[int]]]:
  """{'train', 'dev'} from a TFDS GLUE task: train and validation (MNLI: validation_matched).
  Single-sentence tasks give strings, pair tasks (first, second) tuples. GLUE's test splits
  have no labels (-1), so they are never read."""
  tfds = import_tfds()
  task = glue_task(name)
  features = GLUE_FEATURES[task]
  out = {}
  for split, tfds_split in (('train', 'train'), ('dev', GLUE_DEV_SPLITS.get(task, 'validation'))):
    if max_examples:
      tfds_split = f'{tfds_split}[:{max_examples}]'
    try:
      dataset = tfds.load(name, split=tfds_split, data_dir=data_dir)
    except Exception as e:
      raise DataError(f'cannot load TFDS {name}[{tfds_split}]: {str(e).splitlines()[0]}') from None
    texts, labels = [], []
    for example in tfds.as_numpy(dataset):
      values = tuple(example[f].decode('utf-8') for f in features)
      texts.append(values[0] if len(values) == 1 else values)
      labels.append(int(example['label']))
    out[split] = (texts, labels)
  return out


def load_sst2_tfds(data_dir: str | None = None, name: str = 'glue/sst2',
                   max_examples: int = 0) -> dict[str, tuple[list, list[int]]]:
  """{'train', 'dev'} from TFDS glue/sst2 (train and validation splits)."""
  return load_glue_tfds(data_dir, name, max_examples)


def default_buckets(max_len: int) -> list[int]:
  buckets, length = [], 16
  while length < max_len:
    buckets.append(length)
    length *= 2
  return buckets + [max_len]


def row_length(row: np.ndarray) -> int:
  """Tokens in an encoded row (int32[L], or int32[2, L] ids and segments of a pair)."""
  return int(row.shape[-1])


def encode_rows(tokenizer, texts: list, max_len: int) -> tuple[list[np.ndarray], int]:
  """(rows, number truncated): [CLS] a [SEP] per string, [CLS] a [SEP] b [SEP] with segments
  per (a, b) pair (int32[2, L]), cut to max_len (the longer side of a pair first)."""
  pairs = [isinstance(t, tuple) for t in texts]
  firsts = tokenizer.encode_batch([t[0] if p else t for t, p in zip(texts, pairs)])
  seconds = iter(tokenizer.encode_batch([t[1] for t, p in zip(texts, pairs) if p]))
  out, truncated = [], 0
  for a, pair in zip(firsts, pairs):
    b = next(seconds) if pair else None
    ids, segments = tokenizer.build_pair(a, b, max_len)
    truncated += len(a) + (len(b) + 3 if pair else 2) > len(ids)
    out.append(np.asarray([ids, segments] if pair else ids, np.int32))
  return out, truncated


def encode_examples(tokenizer, sentences: list, max_len: int) -> list[np.ndarray]:
  """`encode_rows` without the count."""
  return encode_rows(tokenizer, sentences, max_len)[0]


def make_batch(rows: list[np.ndarray], labels: np.ndarray, weights: np.ndarray, buckets: list[int],
               batch_size: int) -> Batch:
  """Pads rows (and absent rows, weight 0) to [batch_size, bucket]."""
  longest = max((row_length(r) for r in rows), default=1)
  length = next(b for b in buckets if b >= longest)
  inputs = np.zeros((batch_size, length), np.int32)
  segments = np.zeros_like(inputs)
  for i, r in enumerate(rows):
    if r.ndim == 2:
      inputs[i, :r.shape[1]], segments[i, :r.shape[1]] = r
    else:
      inputs[i, :len(r)] = r
  pad = batch_size - len(rows)
  return {
      'inputs': inputs, 'segments': segments, 'labels': np.pad(np.asarray(labels, np.int32),
                                                               (0, pad)),
      'weights': np.pad(np.asarray(weights, np.float32), (0, pad))
  }


class ClassificationBatches(ShuffledEpochBatches):
  """Endless shuffled training batches of `batch_size` rows (this process's slice)."""

  def __init__(self, rows: list[np.ndarray], labels: list[int], *, batch_size: int, max_len: int,
               seed: int, process_index: int = 0, process_count: int = 1):
    super().__init__(len(rows), batch_size=batch_size, seed=seed, process_index=process_index,
                     process_count=process_count)
    self.rows, self.labels = rows, np.asarray(labels, np.int32)
    self.buckets = default_buckets(max_len)

  def make_batch(self, chosen: np.ndarray) -> Batch:
    return make_batch([self.rows[i] for i in chosen], self.labels[chosen],
                      np.ones(len(chosen), np.float32), self.buckets, len(chosen))


def eval_batches(rows: list[np.ndarray], labels: list[int], *, batch_size: int, max_len: int,
                 process_index: int = 0, process_count: int = 1) -> list[Batch]:
  """Every example once, in order; the last batch padded with weight-0 rows. Rows are sorted
  by length first so each batch pads little (accuracy does not depend on the order)."""
  order = np.argsort([row_length(r) for r in rows], kind='stable')
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
