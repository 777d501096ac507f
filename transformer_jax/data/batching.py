"""Padded batches of static shape, grouped by length, whose position can be saved.

XLA compiles one program per input shape. Padding every batch to the longest
sentence would waste most of the compute on padding; padding each batch to its
own longest sentence would compile a new program for nearly every batch. Length
buckets are the compromise: each example is padded up to the smallest bucket that
fits it, so there are only `len(buckets)` shapes and little padding.

The order of an epoch is a pure function of (seed, epoch), so the position
{'epoch', 'position'} is enough to resume exactly where a run stopped.
"""

from collections.abc import Iterator, Sequence

from absl import logging
import numpy as np

from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.special_tokens import EOS_ID, PAD_ID
from transformer_jax.errors import ConfigError, DataError

# Sentences are encoded this many at a time: the tokenizer returns Python lists,
# which take ~10x the memory of the int32 arrays we keep, so never hold them all.
_ENCODE_CHUNK = 8192


def _fit_length(ids: list[int], max_len: int) -> np.ndarray:
  """Appends EOS, cutting the sentence so that the result has at most `max_len` ids."""
  return np.asarray(ids[:max_len - 1] + [EOS_ID], dtype=np.int32)


def encode_pairs(tokenizer_src: Tokenizer, tokenizer_tgt: Tokenizer, src: list[str], tgt: list[str],
                 max_len: int,
                 overflow: str = 'filter') -> tuple[list[np.ndarray], list[np.ndarray], dict]:
  """Encodes sentence pairs and appends EOS to both sides.

  Pairs longer than `max_len` (EOS included) on either side are dropped with
  overflow='filter' or cut to `max_len` with overflow='truncate'.

  Returns:
    (source ids, target ids, stats) where stats counts 'total', 'filtered' and
    'truncated' pairs.
  """
  if overflow not in ('filter', 'truncate'):
    raise ConfigError(f"overflow must be 'filter' or 'truncate', got {overflow!r}")
  if max_len < 2:
    raise ConfigError(f'max_len must be at least 2 (one token plus EOS), got {max_len}')
  if len(src) != len(tgt):
    raise ValueError(f'src and tgt must have the same length, got {len(src)} and {len(tgt)}')

  src_out, tgt_out = [], []
  filtered = truncated = 0
  for start in range(0, len(src), _ENCODE_CHUNK):
    src_ids = tokenizer_src.encode_batch(src[start:start + _ENCODE_CHUNK])
    tgt_ids = tokenizer_tgt.encode_batch(tgt[start:start + _ENCODE_CHUNK])
    for s, t in zip(src_ids, tgt_ids):
      # `>=` because EOS still has to fit.
      if len(s) >= max_len or len(t) >= max_len:
        if overflow == 'filter':
          filtered += 1
          continue
        truncated += 1
      src_out.append(_fit_length(s, max_len))
      tgt_out.append(_fit_length(t, max_len))

  stats = {'total': len(src), 'filtered': filtered, 'truncated': truncated}
  logging.info('encoded %d pairs (max_len=%d): %d filtered, %d truncated', len(src), max_len,
               filtered, truncated)
  if not src_out:
    raise DataError(f'no sentence pair fits in max_len={max_len} tokens ({len(src)} pairs, '
                    f'{filtered} too long); increase max_len or use overflow="truncate"')
  return src_out, tgt_out, stats


def default_buckets(max_len: int) -> list[int]:
  """Bucket lengths 8, 16, 24, 32, 48, 64, 96, 128, 192, ... ending at max_len.

  Multiples of 8 suit accelerator tiles; the roughly geometric growth keeps the
  padding waste at most about a third while keeping the number of shapes small.
  The last bucket is `max_len` rounded up to a multiple of 8.
  """
  if max_len < 1:
    raise ConfigError(f'max_len must be positive, got {max_len}')
  last = -(-max_len // 8) * 8
  candidates = [8, 16, 24]
  power = 32
  while power < last:
    candidates += [power, power * 3 // 2]
    power *= 2
  return [length for length in candidates if length < last] + [last]


def bucket_lengths(max_len: int, buckets=()) -> list[int]:
  """The configured bucket lengths (`data.buckets`), or `default_buckets(max_len)` if none.

  A single length gives every batch the same shape, so the train and eval steps compile once:
  worth the extra padding where compiling dominates (short runs, tests) or where every new shape
  is expensive (TPU).
  """
  if not buckets:
    return default_buckets(max_len)
  lengths = [int(b) for b in buckets]
  if lengths[-1] < max_len:
    raise ConfigError(f'data.buckets must end at data.max_len ({max_len}) or above, got '
                      f'{tuple(lengths)}')
  return lengths


class _PackedSequences:
  """Many variable-length id arrays stored as one flat array plus offsets.

  Millions of small NumPy arrays cost ~100 bytes of overhead each; one flat array
  costs only the ids themselves.
  """

  def __init__(self, sequences: Sequence[np.ndarray]):
    self.lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
    self.ids = (np.concatenate(sequences).astype(np.int32, copy=False)
                if len(sequences) else np.zeros(0, np.int32))

  def pad(self, indices: np.ndarray, length: int) -> np.ndarray:
    """Returns the sequences at `indices` padded to `length`; index -1 gives a PAD row."""
    out = np.full((len(indices), length), PAD_ID, dtype=np.int32)
    for row, i in enumerate(indices):
      if i >= 0:
        out[row, :self.lengths[i]] = self.ids[self.offsets[i]:self.offsets[i + 1]]
    return out


def parse_position(state: dict) -> tuple[int, int]:
  """(epoch, position) of a saved {'epoch', 'position'}; a one-line ConfigError if malformed."""
  try:
    return int(state['epoch']), int(state['position'])
  except (KeyError, TypeError, ValueError):
    raise ConfigError(f"data position must look like {{'epoch': 0, 'position': 0}}, "
                      f'got {state!r}') from None


def check_examples(src: Sequence[np.ndarray], tgt: Sequence[np.ndarray] | None, *, seed: int,
                   process_index: int, process_count: int, verb: str) -> None:
  """The checks every batcher of examples starts with: as many targets as sources, at least one
  example, a seed that numpy takes, and this process among `process_count`."""
  if tgt is not None and len(tgt) != len(src):
    raise ValueError(f'src and tgt must have the same length, got {len(src)} and {len(tgt)}')
  if len(src) == 0:
    raise DataError(f'there are no examples to {verb}')
  if seed < 0:
    raise ConfigError(f'seed must be non-negative, got {seed}')
  if not 0 <= process_index < process_count:
    raise ConfigError(f'process_index must be in [0, {process_count}), got {process_index}')


class BucketedBatcher:
  """Yields padded batches {'inputs', 'targets', 'index'} grouped by length bucket.

  Each example goes to the smallest bucket length L that fits both of its sides.
  A batch of bucket L has `rows(L)` rows of L tokens, where rows(L) is about
  `batch_tokens / L` rounded down to a multiple of `multiple_of` (e.g. the number
  of devices). The last batch of a bucket is topped up with all-PAD rows whose
  'index' is -1, so each bucket has exactly one shape.

  With shuffle=True (training) iteration never ends and each epoch shuffles the
  examples within buckets and the order of the batches. With shuffle=False
  (evaluation) each iteration is one pass over every example in a fixed order.

  With several processes, all of them compute the same global batch and each
  keeps only its own contiguous share of the rows.
  """

  def __init__(self, src: list[np.ndarray], tgt: list[np.ndarray] | None, *, batch_tokens: int,
               buckets: list[int], seed: int, shuffle: bool = True, multiple_of: int = 1,
               max_rows: int | None = None, process_index: int = 0, process_count: int = 1):
    """Groups the examples into buckets.

    Args:
      src: Token ids per example (the encoder input, or the only sequence).
      tgt: Target token ids per example, or None for single-sequence data.
      batch_tokens: Token budget of a global batch (rows * bucket length).
      buckets: Increasing bucket lengths; the last must fit the longest example.
      seed: Seed of the shuffling; with the epoch it fixes the order of batches.
      shuffle: True for training, False for a single ordered evaluation pass.
      multiple_of: Rows of every batch are a multiple of this, e.g. the device count.
      max_rows: Optional upper bound on rows, e.g. to limit memory for short buckets.
      process_index: Index of this process among `process_count`.
      process_count: Number of processes that share each global batch.
    """
    check_examples(src, tgt, seed=seed, process_index=process_index, process_count=process_count,
                   verb='batch')
    if batch_tokens < 1 or multiple_of < 1:
      raise ConfigError(f'batch_tokens and multiple_of must be positive, got {batch_tokens} '
                        f'and {multiple_of}')
    if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
      raise ConfigError(f'buckets must be positive, strictly increasing lengths, got {buckets}')
    if max_rows is not None and max_rows < multiple_of:
      raise ConfigError(f'max_rows ({max_rows}) must be at least multiple_of ({multiple_of})')

    self._buckets = [int(b) for b in buckets]
    self._seed = seed
    self._shuffle = shuffle
    self._process_index = process_index
    self._process_count = process_count
    self._src = _PackedSequences(src)
    self._tgt = _PackedSequences(tgt) if tgt is not None else None

    lengths = self._src.lengths
    if self._tgt is not None:
      lengths = np.maximum(lengths, self._tgt.lengths)
    longest = int(np.argmax(lengths))
    if lengths[longest] > self._buckets[-1]:
      raise DataError(f'example {longest} has {lengths[longest]} tokens but the largest bucket '
                      f'is {self._buckets[-1]}; encode with max_len <= {self._buckets[-1]} or '
                      'add a larger bucket')
    bucket_of = np.searchsorted(self._buckets, lengths, side='left')
    # A stable sort keeps the original order inside each bucket (used by evaluation).
    order = np.argsort(bucket_of, kind='stable')
    splits = np.searchsorted(bucket_of[order], np.arange(1, len(self._buckets)))
    self._members = np.split(order, splits)

    self._rows = []
    for length in self._buckets:
      rows = max(multiple_of, (batch_tokens // length) // multiple_of * multiple_of)
      if max_rows is not None:
        rows = min(rows, max_rows // multiple_of * multiple_of)
      if rows % process_count:
        raise ConfigError(f'a batch of {rows} rows (bucket length {length}) cannot be split '
                          f'evenly over {process_count} processes; make multiple_of a '
                          f'multiple of {process_count}')
      self._rows.append(rows)

    self._epoch = 0
    self._position = 0
    self._cached_plan: tuple[int, list[tuple[int, np.ndarray]]] | None = None

  @property
  def num_examples(self) -> int:
    return len(self._src.lengths)

  @property
  def num_batches_per_epoch(self) -> int:
    return sum(-(-len(m) // rows) for m, rows in zip(self._members, self._rows))

  @property
  def global_rows(self) -> list[int]:
    """Rows of the global batches, one count per bucket that has examples."""
    return [rows for members, rows in zip(self._members, self._rows) if len(members)]

  @property
  def num_tokens(self) -> int:
    """Ids of every example, both streams: what an epoch's batches hold besides padding."""
    return int(self._src.offsets[-1] + (self._tgt.offsets[-1] if self._tgt is not None else 0))

  def epoch_batches(self, epoch: int) -> list[tuple[int, np.ndarray]]:
    """The global batches of `epoch` as (bucket number, example indices; -1 = filler)."""
    if self._cached_plan is not None and self._cached_plan[0] == epoch:
      return self._cached_plan[1]
    rng = np.random.default_rng((self._seed, epoch)) if self._shuffle else None
    plan = []
    for bucket, (members, rows) in enumerate(zip(self._members, self._rows)):
      if not len(members):
        continue
      if rng is not None:
        members = rng.permutation(members)
      num_batches = -(-len(members) // rows)
      indices = np.full(num_batches * rows, -1, dtype=np.int64)
      indices[:len(members)] = members
      plan += [(bucket, batch_indices) for batch_indices in indices.reshape(num_batches, rows)]
    if rng is not None:
      plan = [plan[i] for i in rng.permutation(len(plan))]
    self._cached_plan = (epoch, plan)
    return plan

  def _make_batch(self, bucket: int, indices: np.ndarray) -> dict[str, np.ndarray]:
    """Pads this process's share of one global batch."""
    share = len(indices) // self._process_count
    indices = indices[self._process_index * share:(self._process_index + 1) * share]
    length = self._buckets[bucket]
    batch = {'inputs': self._src.pad(indices, length)}
    if self._tgt is not None:
      batch['targets'] = self._tgt.pad(indices, length)
    batch['index'] = indices.astype(np.int32)
    return batch

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    """Evaluation: one full ordered pass. Training: endless, from the saved position.

    Training iterators share the batcher's position, so `state()` after
    taking k batches points at batch k + 1.
    """
    if not self._shuffle:
      for bucket, indices in self.epoch_batches(0):
        yield self._make_batch(bucket, indices)
      return
    while True:
      plan = self.epoch_batches(self._epoch)
      bucket, indices = plan[self._position]
      # Advance before yielding so that the state is right while the caller holds the batch.
      self._position += 1
      if self._position == len(plan):
        self._epoch, self._position = self._epoch + 1, 0
      yield self._make_batch(bucket, indices)

  def state(self) -> dict[str, int]:
    """The position to save with a checkpoint: the epoch and batches taken from it."""
    return {'epoch': self._epoch, 'position': self._position}

  def restore(self, state: dict[str, int]) -> None:
    """Restores a position from `state()`; the next batch is the one that was next."""
    epoch, position = parse_position(state)
    if epoch < 0 or not 0 <= position <= self.num_batches_per_epoch:
      raise ConfigError(f'saved data position {state} does not fit this data, which has '
                        f'{self.num_batches_per_epoch} batches per epoch; the data or batch '
                        'settings changed since it was saved')
    if position == self.num_batches_per_epoch:
      epoch, position = epoch + 1, 0
    self._epoch, self._position = epoch, position
