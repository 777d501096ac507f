"""Checkpoints through orbax: train state (sharded arrays) plus the data pipeline's position.

Orbax writes each step to a temporary directory and renames it when complete, so a crash
mid-write never leaves a checkpoint that looks finished; `max_to_keep` only deletes old steps
after a newer one is committed. On restore, a checkpoint that fails to load (truncated or
corrupted files) is reported in one line and the previous one is tried.
"""

import os

import jax
import orbax.checkpoint as ocp
from absl import logging


class Checkpointer:
  """Saves {'state': pytree, 'data': json dict} every `save_every` steps, keeping `max_to_keep`."""

  def __init__(self, directory: str, *, max_to_keep: int = 3, save_every: int = 1000):
    self.directory = os.path.abspath(directory)
    self.save_every = save_every
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=('state', 'data'))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def maybe_save(self, step: int, state, data_state: dict, *, force: bool = False) -> bool:
    if not force and (self.save_every <= 0 or step % self.save_every):
      return False
    if step in self.manager.all_steps():
      return False
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=True)
    return True

  def restore(self, abstract_state, step: int | None = None):
    """Restores the latest good checkpoint (or `step`): (state, data_state, step), or None.

    `abstract_state` is a pytree of jax.ShapeDtypeStruct with shardings: arrays come back
    already placed on the mesh, each process reading only its shards.
    """
    steps = [step] if step is not None else sorted(self.manager.all_steps(), reverse=True)
    for candidate in steps:
      try:
        restored = self.manager.restore(candidate, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
      except Exception as error:  # pylint: disable=broad-except
        # Shape mismatches are a config problem, not corruption: let the caller explain them.
        if 'shape' in str(error).lower() and 'mismatch' in str(error).lower():
          raise
        logging.error('checkpoint at step %d in %s could not be restored (%s: %s); '
                      'trying an older one', candidate, self.directory, type(error).__name__,
                      str(error).splitlines()[0][:200] if str(error) else '')
        continue
      return restored['state'], restored['data'], candidate
    return None

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(tree):
  """ShapeDtypeStructs (with shardings) describing a pytree of arrays."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, 'sharding', None)), tree)


def average_params(checkpointer: Checkpointer, abstract_state, steps: list[int]):
  """The mean of the parameters saved at `steps` (checkpoint averaging, Vaswani et al. 2017).

  Averaging the last few checkpoints of a run smooths out the noise of the final updates and
  usually gains a little BLEU for free.
  """
  total = None
  for step in steps:
    restored = checkpointer.restore(abstract_state, step=step)
    if restored is None:
      raise ValueError(f'checkpoint {step} could not be restored for averaging')
    params = restored[0].params
    total = params if total is None else jax.tree.map(lambda a, b: a + b, total, params)
  return jax.tree.map(lambda x: x / len(steps), total)
