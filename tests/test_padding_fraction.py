"""train/padding_fraction = 1 - tokens / slots per log interval, from the task's count_tokens
and count_slots (by default: non-padding ids, and all positions, of 'inputs' and 'targets')."""

import logging

import numpy as np
import pytest

from test_trainer import ToyTask, read_metrics, toy_trainer_config
from transformer_jax.training.trainer import Trainer, count_slots, count_tokens


def batch(input_pads: int, target_pads: int) -> dict[str, np.ndarray]:
  """inputs [8, 4] (the toy task's least squares reads them) and targets [8, 2], with the given
  numbers of padding ids (0) at the end of each, as a bucketed batch pads its rows."""
  inputs = np.arange(1, 33, dtype=np.int32).reshape(8, 4) % 5 + 1
  targets = np.full((8, 2), 7, np.int32)
  inputs.reshape(-1)[32 - input_pads:] = 0
  targets.reshape(-1)[16 - target_pads:] = 0
  return {'inputs': inputs, 'targets': targets, 'index': np.arange(8)}


# Two log intervals of two steps: (input pads, target pads) per step.
BATCHES = [batch(8, 4), batch(0, 16), batch(0, 0), batch(32 - 3, 0)]


class FixedData:
  """BATCHES in order, then the last one forever; position saved in checkpoints."""

  def __init__(self):
    self.position = 0

  def __iter__(self):
    while True:
      yield BATCHES[min(self.position, len(BATCHES) - 1)]
      self.position += 1

  def state(self):
    return {'position': self.position}

  def restore(self, state):
    self.position = int(state['position'])


class InputsOnlyTask(ToyTask):
  """A task that trains on its inputs only (as LM and BERT count), with its own counters."""

  def count_tokens(self, batch):
    return int(np.count_nonzero(batch['inputs']))

  def count_slots(self, batch):
    return int(batch['inputs'].size)


def test_default_counters_cover_inputs_and_targets_only():
  example = batch(8, 4)
  assert count_tokens(example) == 24 + 12 and count_slots(example) == 32 + 16
  assert count_slots({'inputs': np.zeros((3, 5)), 'segments': np.zeros((3, 5))}) == 15


@pytest.mark.parametrize('task, expected', [
    (ToyTask(), [1 - (36 + 32) / (48 + 48), 1 - (48 + 19) / (48 + 48)]),
    (InputsOnlyTask(), [1 - (24 + 32) / (32 + 32), 1 - (32 + 3) / (32 + 32)]),
], ids=['default_counters', 'task_counters'])
def test_padding_fraction_per_log_interval_is_exact(tmp_path, caplog, task, expected):
  """Batches with known padding: the logged fraction of each 2-step interval is exactly
  1 - tokens / slots over both steps, in metrics.jsonl and in the progress line."""
  caplog.set_level(logging.INFO, logger='absl')
  trainer = Trainer(toy_trainer_config(num_steps=4, log_every=2), task, str(tmp_path))
  try:
    trainer.fit(FixedData())
  finally:
    trainer.close()
  logged = {r['step']: r['train/padding_fraction'] for r in read_metrics(tmp_path)}
  assert logged == {2: expected[0], 4: expected[1]}
  for step, fraction in zip((2, 4), expected):
    assert f'step {step}/4 |' in caplog.text
    assert f'tok/s | pad {100 * fraction:.1f}% |' in caplog.text
