"""Packed batches: several examples per row of one fixed length, whose position can be saved.

Length buckets (batching.BucketedBatcher) pad each example to its bucket and compile one
program per bucket. Packing instead places several short examples one after another in a row
of L tokens, as the flax WMT example, T5X/seqio and MaxText do: every batch has one shape
[rows, L], so the train and eval steps compile once, and little of the row is padding. Beside
the ids, each stream gets two int32 arrays of the same shape (the names every model and task
reads):

  <stream>_segment_ids: 1, 2, 3, ... = which example of the row a token belongs to, numbered
      from 1 along the row; 0 on padding (only at the row's end).
  <stream>_positions: the token's position inside its own example, from 0 at every example's
      first token; 0 on padding.

Translation pairs are packed pair by pair: example k of a row has its source in inputs segment
k and its target in targets segment k. A pair goes into a row only if BOTH of its sides still
fit (the flax WMT example's rule); with `window` > 1 the pair goes into the first of the last
`window` open rows where it fits (first fit), which leaves less padding than closing a row at
the first pair that does not fit (window=1, next fit, the flax rule).

The plan of an epoch (which examples go in which row, in which order) is a pure function of
(seed, epoch), so the position {'epoch', 'position'} is enough to resume exactly where a run
stopped.

The two packers here differ in what they know and when. `pack_rows` sees the examples of an
epoch one at a time in that epoch's shuffled order (online), needs room on both streams of a
pair, and lets an example join only the last `window` open rows, so rows close early and each
epoch packs afresh in O(window) per example. `pack_lengths` packs one stream once, knowing every
length first (offline): best fit decreasing over all rows (BERT's document chunks, packed once
and fed in a new order every epoch). Neither computes the other's rows: first fit in a given
order and best fit in decreasing order place examples differently, and the rows of each are what
the batches of their callers (and the packed == unpacked tests) are made of.
"""

from collections.abc import Iterator

from absl import logging
import numpy as np

from transformer_jax.data.batching import _PackedSequences, check_examples, parse_position
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.special_tokens import PAD_ID

# Measured on Multi30k train (29,000 pairs, max_len 64, 8k SentencePiece, 64 rows of 64), the
# padding of an epoch with its top-up rows: next fit (window 1) 17.0%, first fit over 4 open rows
# 9.0%, over 16 7.5%, over 64 6.8% (length buckets: 24.6%). The window costs O(window) per
# example once per epoch: 24 ms for Multi30k's epoch at 16.
DEFAULT_WINDOW = 16


def row_length(max_len: int) -> int:
  """L, the length of every packed row: `max_len` rounded up to a multiple of 8 (tiles)."""
  if max_len < 1:
    raise ConfigError(f'max_len must be positive, got {max_len}')
  return -(-int(max_len) // 8) * 8


def rows_per_batch(batch_tokens: int, length: int, multiple_of: int = 1) -> int:
  """Rows of a packed batch: batch_tokens // length, rounded down to a multiple of
  `multiple_of` (the data-parallel ways), and at least `multiple_of`."""
  return max(multiple_of, (int(batch_tokens) // length) // multiple_of * multiple_of)


def pack_rows(src_lengths: np.ndarray, tgt_lengths: np.ndarray | None, order: np.ndarray,
              length: int, window: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """Places the examples, taken in `order`, into rows of `length` tokens per stream.

  An example joins an open row only if every stream of it still fits there; it joins the first
  of the (at most `window`) open rows where it does, else it opens a new row, closing the
  oldest open row if there are already `window`. Rows are emitted in the order they close; a
  row that no example can join any more closes at once.

  Returns:
    (members, offsets): row r holds the examples members[offsets[r]:offsets[r + 1]], in the
    order they joined it.
  """
  src = src_lengths.tolist()
  tgt = tgt_lengths.tolist() if tgt_lengths is not None else [0] * len(src)
  # A row with less room than the shortest example on either side can take nothing more.
  min_src = int(src_lengths.min())
  min_tgt = int(tgt_lengths.min()) if tgt_lengths is not None else 0
  closed: list[list[int]] = []
  open_rows: list[list] = []  # [source tokens, target tokens, members]
  for i in order.tolist():
    s, t = src[i], tgt[i]
    for slot, row in enumerate(open_rows):
      if row[0] + s <= length and row[1] + t <= length:
        row[0] += s
        row[1] += t
        row[2].append(i)
        if length - row[0] < min_src or length - row[1] < min_tgt:
          closed.append(open_rows.pop(slot)[2])
        break
    else:
      if len(open_rows) == window:
        closed.append(open_rows.pop(0)[2])
      open_rows.append([s, t, [i]])
  closed += [row[2] for row in open_rows]
  offsets = np.zeros(len(closed) + 1, dtype=np.int64)
  np.cumsum([len(row) for row in closed], out=offsets[1:])
  members = np.fromiter((i for row in closed for i in row), dtype=np.int64, count=int(offsets[-1]))
  return members, offsets


def pack_lengths(lengths, capacity: int) -> list[list[int]]:
  """Rows of item indices whose lengths sum to at most `capacity` each: best-fit decreasing
  (each item, longest first, goes into the fullest row it fits, else a new row), which leaves
  little room unused. Each row lists its items in index order; rows in order of creation."""
  lengths = [int(n) for n in lengths]
  if any(not 0 < n <= capacity for n in lengths):
    raise DataError(f'items to pack must have 1 to {capacity} tokens')
  rows: list[list[int]] = []
  free: list[list[int]] = [[] for _ in range(capacity + 1)]  # free[c]: rows with c slots left
  for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
    n = lengths[i]
    room = next((c for c in range(n, capacity + 1) if free[c]), None)
    if room is None:
      rows.append([])
      row, room = len(rows) - 1, capacity
    else:
      row = free[room].pop()
    rows[row].append(i)
    free[room - n].append(row)
  return [sorted(row) for row in rows]


class _Plan:
  """One epoch's packing: the rows (as members/offsets) and what they hold."""

  def __init__(self, members: np.ndarray, offsets: np.ndarray, num_batches: int):
    self.members, self.offsets, self.num_batches = members, offsets, num_batches

  @property
  def num_rows(self) -> int:
    return len(self.offsets) - 1


class PackedBatcher:
  """Yields packed batches of one shape [rows, L], grouped into rows by `pack_rows`.

  Keys: 'inputs', 'inputs_segment_ids', 'inputs_positions', and with targets 'targets',
  'targets_segment_ids', 'targets_positions' (int32 [rows, L]); 'index' (int32
  [rows, max_per_row]) holds the example numbers of each row in segment order, -1 filled (the
  trainer does not send it to the devices). The last batch of an epoch is topped up with empty
  rows (all zeros, 'index' all -1), so every batch has the same shape.

  With shuffle=True (training) iteration never ends and each epoch packs the examples in a
  new random order. With shuffle=False (evaluation) each iteration is one pass over every
  example, packed in their order.

  With several processes, all of them compute the same global plan and each keeps only its own
  contiguous share of the rows of every batch.
  """

  def __init__(self, src: list[np.ndarray], tgt: list[np.ndarray] | None, *, batch_tokens: int,
               length: int, seed: int, shuffle: bool = True, multiple_of: int = 1,
               window: int = DEFAULT_WINDOW, process_index: int = 0, process_count: int = 1):
    """Checks the arguments and stores the examples.

    Args:
      src: Token ids per example (the encoder input, or the only sequence), EOS included.
      tgt: Target token ids per example, or None for single-sequence data.
      batch_tokens: Token budget of a global batch per stream (rows * length).
      length: L, the tokens per row (`row_length(max_len)`); no example may be longer.
      seed: Seed of the shuffling; with the epoch it fixes the packing.
      shuffle: True for training, False for a single ordered evaluation pass.
      multiple_of: Rows of every batch are a multiple of this, e.g. the device count.
      window: Open rows an example may join (first fit); 1 = next fit, the flax WMT rule.
      process_index: Index of this process among `process_count`.
      process_count: Number of processes that share each global batch.
    """
    check_examples(src, tgt, seed=seed, process_index=process_index, process_count=process_count,
                   verb='pack')
    if batch_tokens < 1 or multiple_of < 1 or length < 1 or window < 1:
      raise ConfigError(f'batch_tokens, length, multiple_of and window must be positive, got '
                        f'{batch_tokens}, {length}, {multiple_of} and {window}')
    self.length = int(length)
    self.rows = rows_per_batch(batch_tokens, self.length, multiple_of)
    if self.rows % process_count:
      raise ConfigError(f'a batch of {self.rows} packed rows cannot be split evenly over '
                        f'{process_count} processes; make multiple_of a multiple of '
                        f'{process_count}')
    self._src = _PackedSequences(src)
    self._tgt = _PackedSequences(tgt) if tgt is not None else None
    for name, seqs in (('source', self._src), ('target', self._tgt)):
      if seqs is None:
        continue
      longest = int(np.argmax(seqs.lengths))
      if seqs.lengths[longest] > self.length:
        raise DataError(f'example {longest} has {seqs.lengths[longest]} {name} tokens but packed '
                        f'rows have {self.length}; encode with max_len <= {self.length}')
      if seqs.lengths.min() < 1:
        raise DataError(f'example {int(np.argmin(seqs.lengths))} has an empty {name} side; '
                        'encode with EOS appended (batching.encode_pairs)')
    # The most examples a row can hold: one shape for 'index' in every batch.
    self.max_per_row = self.length // int(self._src.lengths.min())
    if self._tgt is not None:
      self.max_per_row = min(self.max_per_row, self.length // int(self._tgt.lengths.min()))
    self._seed = seed
    self._shuffle = shuffle
    self._window = int(window)
    self._process_index = process_index
    self._process_count = process_count
    self._epoch = 0
    self._position = 0
    self._cached_plan: tuple[int, _Plan] | None = None

  @property
  def num_examples(self) -> int:
    return len(self._src.lengths)

  @property
  def num_tokens(self) -> int:
    """Tokens of every example, both streams (the same every epoch)."""
    return int(self._src.offsets[-1]) + (int(self._tgt.offsets[-1]) if self._tgt else 0)

  @property
  def num_batches_per_epoch(self) -> int:
    """Batches of the current epoch (the count can differ by a batch from epoch to epoch, as
    the shuffled order packs a little better or worse)."""
    return self._plan(self._epoch if self._shuffle else 0).num_batches

  def _plan(self, epoch: int) -> _Plan:
    if self._cached_plan is not None and self._cached_plan[0] == epoch:
      return self._cached_plan[1]
    if self._shuffle:
      order = np.random.default_rng((self._seed, epoch)).permutation(self.num_examples)
    else:
      order = np.arange(self.num_examples)
    members, offsets = pack_rows(self._src.lengths,
                                 self._tgt.lengths if self._tgt is not None else None, order,
                                 self.length, self._window)
    plan = _Plan(members, offsets, -(-(len(offsets) - 1) // self.rows))
    self._cached_plan = (epoch, plan)
    stats = self._stats(plan)
    logging.info('packed %d %s into %d rows of %d (padding %.1f%%) in %d batches of %d rows%s',
                 self.num_examples, 'pairs' if self._tgt is not None else 'examples', plan.num_rows,
                 self.length, 100 * stats['padding_fraction'], plan.num_batches, self.rows,
                 f' (epoch {epoch})' if self._shuffle else '')
    return plan

  def _stats(self, plan: _Plan) -> dict:
    streams = 2 if self._tgt is not None else 1
    slots = streams * plan.num_batches * self.rows * self.length
    return {
        'examples': self.num_examples,
        'rows': plan.num_rows,
        'batches': plan.num_batches,
        'tokens': self.num_tokens,
        'slots': slots,
        'padding_fraction': 1.0 - self.num_tokens / slots,
    }

  def plan_stats(self, epoch: int = 0) -> dict:
    """Counters of the plan of `epoch`: 'examples' packed, 'rows' holding examples,
    'batches', 'tokens' and 'slots' (every stream's [rows, L] of every batch, top-up rows
    included) and 'padding_fraction' = 1 - tokens / slots."""
    return self._stats(self._plan(epoch if self._shuffle else 0))

  def epoch_batches(self, epoch: int) -> list[list[np.ndarray]]:
    """The global batches of `epoch`: per batch, per row, the example numbers in it (a
    top-up row is empty)."""
    plan = self._plan(epoch if self._shuffle else 0)
    rows = [plan.members[plan.offsets[r]:plan.offsets[r + 1]] for r in range(plan.num_rows)]
    rows += [np.zeros(0, np.int64)] * (plan.num_batches * self.rows - plan.num_rows)
    return [rows[b * self.rows:(b + 1) * self.rows] for b in range(plan.num_batches)]

  def _make_batch(self, plan: _Plan, batch: int) -> dict[str, np.ndarray]:
    """Packs this process's share of the rows of global batch `batch`."""
    share = self.rows // self._process_count
    first = batch * self.rows + self._process_index * share
    streams = [('inputs', self._src)] + ([('targets', self._tgt)] if self._tgt else [])
    out = {}
    for name, _ in streams:
      for suffix in ('', '_segment_ids', '_positions'):
        out[name + suffix] = np.full((share, self.length), PAD_ID if not suffix else 0, np.int32)
    index = np.full((share, self.max_per_row), -1, np.int32)
    for row in range(share):
      r = first + row
      if r >= plan.num_rows:  # a top-up row: stays empty
        continue
      members = plan.members[plan.offsets[r]:plan.offsets[r + 1]]
      index[row, :len(members)] = members
      for name, seqs in streams:
        ids, segments, positions = out[name], out[name + '_segment_ids'], out[name + '_positions']
        start = 0
        for segment, i in enumerate(members, start=1):
          n = int(seqs.lengths[i])
          ids[row, start:start + n] = seqs.ids[seqs.offsets[i]:seqs.offsets[i + 1]]
          segments[row, start:start + n] = segment
          positions[row, start:start + n] = np.arange(n, dtype=np.int32)
          start += n
    out['index'] = index
    return out

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    """Evaluation: one full ordered pass. Training: endless, from the saved position.

    Training iterators share the batcher's position, so `state()` after taking k batches
    points at batch k + 1.
    """
    if not self._shuffle:
      plan = self._plan(0)
      for batch in range(plan.num_batches):
        yield self._make_batch(plan, batch)
      return
    while True:
      plan = self._plan(self._epoch)
      batch = self._position
      # Advance before yielding so that the state is right while the caller holds the batch.
      self._position += 1
      if self._position == plan.num_batches:
        self._epoch, self._position = self._epoch + 1, 0
      yield self._make_batch(plan, batch)

  @property
  def global_rows(self) -> list[int]:
    """Rows of the global batches (every one has the same shape)."""
    return [self.rows]

  def state(self) -> dict[str, int]:
    """The position to save with a checkpoint: the epoch and batches taken from it."""
    return {'epoch': self._epoch, 'position': self._position}

  def restore(self, state: dict[str, int]) -> None:
    """Restores a position from `state()`; the next batch is the one that was next."""
    epoch, position = parse_position(state)
    if epoch < 0:
      raise ConfigError(f'saved data position {state} has a negative epoch')
    num_batches = self._plan(epoch if self._shuffle else 0).num_batches
    if not 0 <= position <= num_batches:
      raise ConfigError(f'saved data position {state} does not fit this data, whose epoch '
                        f'{epoch} has {num_batches} packed batches; the data or batch settings '
                        'changed since it was saved')
    if position == num_batches:
      epoch, position = epoch + 1, 0
    self._epoch, self._position = epoch, position
