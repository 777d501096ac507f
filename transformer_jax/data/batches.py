"""What a training batcher is (`Batches`), and the two simplest ways of keeping its position.

Every training batcher of `data/` is a `Batches`: the trainer iterates it, saves `state()` with
each checkpoint (as JSON, under the checkpoint's 'data' item) and calls `restore(state)` on a
fresh batcher when it resumes, after which the batcher yields exactly the batches that would
have come next. Batches are cut from a stream of *global* batches that does not depend on the
process count: each process yields its own contiguous rows of global batch k, and the state
names a position in that stream, so a run resumed on another number of processes goes on with
the same global batches.

The state is a small dict of ints whose keys say how the batcher keeps its place; they are the
format of checkpoints already written, so they never change:
  {'step'}:              batch s is a pure function of (seed, s) (`StepIndexedBatches`: random
                         language-model windows, BERT pretraining rows);
  {'epoch', 'index'}:    epoch e visits the examples in an order drawn from (seed, e),
                         `batch_size` at a time (`ShuffledEpochBatches`: classification,
                         tagging);
  {'epoch', 'position'}: the batches planned for epoch e from (seed, e), by length bucket or
                         packed rows (`batching.BucketedBatcher`, `packing.PackedBatcher`,
                         `span_corruption.SpanCorruptionBatcher`).
"""

import abc
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import numpy as np

from transformer_jax.errors import DataError

Batch = dict[str, np.ndarray]


@runtime_checkable
class Batches(Protocol):
  """An endless training batcher whose position can be saved and restored."""

  @property
  def global_rows(self) -> list[int]:
    """Rows of the global batches, one count per batch shape: what the device layout has to
    split (`trainer.check_batch_rows`)."""

  def __iter__(self) -> Iterator[Batch]:
    """Endless: this process's rows of the next global batch, as numpy arrays keyed by name.
    Iterators share the batcher's position, so `state()` after taking k batches from one points
    at batch k + 1."""

  def state(self) -> dict[str, int]:
    """The position to save with a checkpoint (JSON-able ints; the module docstring)."""

  def restore(self, state: dict[str, int]) -> None:
    """Goes back to a position from `state()`: the next batch is the one that was next then."""


def process_rows(batch_size: int, process_index: int, process_count: int) -> slice:
  """This process's contiguous rows of a global batch of `batch_size` rows."""
  if batch_size % process_count:
    raise DataError(f'batch size {batch_size} is not divisible by the {process_count} processes')
  local = batch_size // process_count
  return slice(process_index * local, (process_index + 1) * local)


class StepIndexedBatches(abc.ABC):
  """Endless batches where batch `step` is a pure function of (seed, step): the position to
  save is the step alone. Subclasses define `batch(step)` and call `_init_rows` so that with
  several processes each yields its own contiguous slice of the same global batch (the global
  batch does not depend on the process count)."""

  step = 0

  def _init_rows(self, batch_size: int, process_index: int, process_count: int):
    self.batch_size = batch_size
    self._rows = process_rows(batch_size, process_index, process_count)

  @abc.abstractmethod
  def batch(self, step: int) -> Batch:
    """The rows of global batch `step` that this process feeds."""

  @property
  def global_rows(self) -> list[int]:
    return [self.batch_size]

  def __iter__(self) -> Iterator[Batch]:
    while True:
      batch = self.batch(self.step)
      self.step += 1
      yield batch

  def state(self) -> dict[str, int]:
    return {'step': self.step}

  def restore(self, state: dict[str, int]) -> None:
    self.step = int(state['step'])


class ShuffledEpochBatches(abc.ABC):
  """Endless batches of `batch_size` examples: epoch e takes the examples in the order
  np.random.default_rng((seed, e)).permutation(num_examples), `batch_size` at a time, and leaves
  out the last few that do not fill a batch. The position is {'epoch', 'index'} (batches taken
  from the epoch). Subclasses define `make_batch`."""

  def __init__(self, num_examples: int, *, batch_size: int, seed: int, process_index: int = 0,
               process_count: int = 1, what: str = 'training examples'):
    """`what` names the examples in the error for too few of them."""
    if num_examples < batch_size:
      raise DataError(f'{num_examples} {what} are fewer than one batch of {batch_size}')
    self.num_examples, self.batch_size, self.seed = num_examples, batch_size, seed
    self._local = process_rows(batch_size, process_index, process_count)
    self.batches_per_epoch = num_examples // batch_size
    self.epoch, self.index = 0, 0

  @abc.abstractmethod
  def make_batch(self, chosen: np.ndarray) -> Batch:
    """The batch of the examples numbered `chosen` (this process's rows, in order)."""

  @property
  def global_rows(self) -> list[int]:
    return [self.batch_size]

  def batch(self, epoch: int, index: int) -> Batch:
    """This process's rows of batch `index` of epoch `epoch`."""
    order = np.random.default_rng((self.seed, epoch)).permutation(self.num_examples)
    return self.make_batch(order[index * self.batch_size:(index + 1) *
                                 self.batch_size][self._local])

  def __iter__(self) -> Iterator[Batch]:
    while True:
      if self.index >= self.batches_per_epoch:
        self.epoch, self.index = self.epoch + 1, 0
      batch = self.batch(self.epoch, self.index)
      self.index += 1
      yield batch

  def state(self) -> dict[str, int]:
    return {'epoch': self.epoch, 'index': self.index}

  def restore(self, state: dict[str, int]) -> None:
    self.epoch, self.index = int(state['epoch']), int(state['index'])
