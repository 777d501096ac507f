"""T5 span corruption over a token stream read on demand (a prepared corpus's split).

`StreamChunks` cuts the stream into the chunks of `span_corruption.pack_and_split` without
reading it; `SpanCorruptionSteps` makes training batch s from them as a pure function of
(seed, s), so nothing is tokenized at start or resume and nothing grows with the corpus but one
permutation of the chunk numbers. The objective itself is data/span_corruption.py's.
"""

from collections.abc import Iterator
from typing import Protocol

import numpy as np

from transformer_jax.data import batches
from transformer_jax.data.span_corruption import (MEAN_NOISE_SPAN_LENGTH, NOISE_DENSITY,
                                                  NUM_SENTINELS, chunk_length, span_corruption,
                                                  targets_length)
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.special_tokens import PAD_ID


class TokenSource(Protocol):
  """A token stream read on demand: `len(source)` tokens and `source.tokens(start, stop)`, the
  ids [start, stop) as an integer array. A prepared corpus's split (corpus/reader.py's
  TokenSplit) is one; this layer does not import the corpus package, it only reads the stream."""

  def __len__(self) -> int:
    ...

  def tokens(self, start: int, stop: int) -> np.ndarray:
    ...


class TokenArray:
  """A `TokenSource` over ids in memory (tests, small texts)."""

  def __init__(self, ids):
    self.ids = np.asarray(ids).reshape(-1)

  def __len__(self) -> int:
    return len(self.ids)

  def tokens(self, start: int, stop: int) -> np.ndarray:
    return self.ids[start:stop]


class StreamChunks:
  """The chunks of `pack_and_split` cut from a `TokenSource` without reading it: chunk i is the
  stream's tokens [i * length, (i + 1) * length) (the last one shorter), read when asked for.

  On the stream of a text's lines tokenized one after another (a prepared 'lines' corpus), they
  are exactly `pack_and_split` of those lines. `limit` > 0 keeps the first `limit` chunks.
  """

  def __init__(self, source: TokenSource, length: int, limit: int = 0):
    if length < 1:
      raise ConfigError(f'chunk length must be positive, got {length}')
    self.source, self.length = source, int(length)
    self.num_tokens = len(source)
    count = -(-self.num_tokens // self.length)
    self._count = min(count, limit) if limit > 0 else count

  def __len__(self) -> int:
    return self._count

  def __getitem__(self, i: int) -> np.ndarray:
    i = int(i)
    if not 0 <= i < self._count:
      raise IndexError(f'chunk {i} of {self._count}')
    start = i * self.length
    return np.asarray(self.source.tokens(start, min(start + self.length, self.num_tokens)),
                      np.int32)

  def __iter__(self) -> Iterator[np.ndarray]:
    return (self[i] for i in range(self._count))


class SpanCorruptionSteps(batches.StepIndexedBatches):
  """Training batches of span-corrupted chunks of a token stream read on demand; the position is
  {'step'}: batch s is a pure function of (seed, s), so nothing is planned per epoch and nothing
  grows with the corpus but one permutation of the chunk numbers (8 bytes a chunk).

  Global batch s holds global rows [s * B, (s + 1) * B) (B = `global_rows[0]`). Row k is chunk
  `permutation(seed, epoch)[k % num_chunks]` with epoch = k // num_chunks: every epoch visits
  every chunk once, in an order of its own. Its noise mask comes from a Generator of its own,
  np.random.default_rng((seed, epoch, chunk)): new masks each epoch, the same for any process
  count or batch split. Each process builds only its own contiguous rows.

  Every batch has one shape: 'inputs' int32[B, max_len] and 'targets' int32[B,
  targets_length(max_len)], padded with PAD (only the last, shorter chunk's pairs leave any),
  and 'index' (the chunk numbers of the rows; not fed to the model). B is
  batch_tokens // max_len rounded down to a multiple of `multiple_of`, at least `multiple_of`.
  """

  def __init__(self, source: TokenSource, *, max_len: int, batch_tokens: int, seed: int,
               vocab_size: int, num_sentinels: int = NUM_SENTINELS,
               noise_density: float = NOISE_DENSITY,
               mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH, max_chunks: int = 0,
               multiple_of: int = 1, process_index: int = 0, process_count: int = 1):
    """`max_chunks` > 0 trains on the stream's first `max_chunks` chunks only."""
    if batch_tokens < 1 or multiple_of < 1:
      raise ConfigError(f'batch_tokens and multiple_of must be positive, got {batch_tokens} '
                        f'and {multiple_of}')
    if seed < 0:
      raise ConfigError(f'seed must be non-negative, got {seed}')
    if not 0 <= process_index < process_count:
      raise ConfigError(f'process_index must be in [0, {process_count}), got {process_index}')
    self.max_len, self.seed = int(max_len), int(seed)
    noise = dict(noise_density=noise_density, mean_noise_span_length=mean_noise_span_length)
    self.chunks = StreamChunks(source, chunk_length(max_len, **noise), max_chunks)
    if not len(self.chunks):
      raise DataError('there is no text to corrupt: the training split has no tokens')
    self.targets_length = targets_length(max_len, **noise)
    self._corrupt = dict(vocab_size=vocab_size, num_sentinels=num_sentinels, **noise)
    rows = max(multiple_of, (batch_tokens // self.max_len) // multiple_of * multiple_of)
    if rows % process_count:
      raise ConfigError(f'a batch of {rows} rows cannot be split evenly over {process_count} '
                        f'processes; make multiple_of a multiple of {process_count}')
    self._init_rows(rows, process_index, process_count)
    self._order_epoch, self._order = None, None

  @property
  def num_examples(self) -> int:
    """Chunks per epoch."""
    return len(self.chunks)

  @property
  def num_batches_per_epoch(self) -> float:
    """Batches an epoch's rows fill (epochs need not end at a batch's end)."""
    return len(self.chunks) / self.batch_size

  def order(self, epoch: int) -> np.ndarray:
    """The chunk numbers in epoch `epoch`'s order (the last epoch's is kept)."""
    if self._order_epoch != epoch:
      self._order = np.random.default_rng((self.seed, epoch)).permutation(len(self.chunks))
      self._order_epoch = epoch
    return self._order

  def row(self, k: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(chunk number, inputs, targets) of global row `k`."""
    epoch, position = divmod(int(k), len(self.chunks))
    chunk = int(self.order(epoch)[position])
    rng = np.random.default_rng((self.seed, epoch, chunk))
    return (chunk, *span_corruption(self.chunks[chunk], rng, **self._corrupt))

  def batch(self, step: int) -> dict[str, np.ndarray]:
    rows = range(step * self.batch_size, (step + 1) * self.batch_size)[self._rows]
    inputs = np.full((len(rows), self.max_len), PAD_ID, np.int32)
    targets = np.full((len(rows), self.targets_length), PAD_ID, np.int32)
    index = np.empty(len(rows), np.int64)
    for r, k in enumerate(rows):
      index[r], source, target = self.row(k)
      inputs[r, :len(source)] = source
      targets[r, :len(target)] = target
    return {'inputs': inputs, 'targets': targets, 'index': index}

  def restore(self, state: dict[str, int]) -> None:
    try:
      step = int(state['step'])
    except (KeyError, TypeError, ValueError):
      raise ConfigError(f"data position must look like {{'step': 0}}, got {state!r}: it was "
                        'saved by another batcher (span corruption from data.text_path saves '
                        "{'epoch', 'position'}); resume with the data settings it was saved "
                        'with') from None
    if step < 0:
      raise ConfigError(f'saved data position {state!r} has a negative step')
    self.step = step
