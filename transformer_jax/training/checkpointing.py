"""Checkpoints through orbax: train state (sharded arrays), the data pipeline's position and the
run's layout (devices, processes, mesh, accumulation steps, the rows global batches are rounded to).

Orbax writes each step to a temporary directory and renames it when complete, so a crash
mid-write never leaves a checkpoint that looks finished; old steps beyond the `keep` latest are
only deleted after a newer one is committed. Arrays are restored straight into the shardings of
the abstract state given, whatever mesh or process count saved them: each process reads only
the shards it holds (elastic resume: elastic.py, docs/reliability.md). On restore, a checkpoint
that fails to load (truncated or corrupted files) is reported in one line and the previous one is
tried. A checkpoint whose shapes do not match the config is not corruption: it is a ConfigError
naming the parameter (falling back would silently start again from scratch next to the old
checkpoints).
"""

import contextlib
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from transformer_jax.errors import ConfigError, DataError

# How storage failures read in orbax/TensorStore errors (which are not always OSErrors).
_STORAGE_ERRORS = ('No space left on device', 'RESOURCE_EXHAUSTED', 'Disk quota exceeded',
                   'Read-only file system', 'Permission denied', 'PERMISSION_DENIED')

# The run's layout is its own item, so checkpoints written before it existed still restore.
RUN_ITEM = 'run'


def _item_handlers() -> dict:
  """The items of every step: the train state, the data pipeline's position and the run's
  layout (json). Named up front so that a fresh manager can read a step's metadata (shapes)."""
  return {
      'state': ocp.StandardCheckpointHandler(), 'data': ocp.JsonCheckpointHandler(),
      RUN_ITEM: ocp.JsonCheckpointHandler()
  }


def _retention(keep: int) -> dict:
  """CheckpointManagerOptions arguments keeping the `keep` latest steps: orbax's
  `preservation_policy` where the installed orbax has it (`max_to_keep` is deprecated since
  0.12), else the older `max_to_keep`."""
  managers = getattr(ocp, 'checkpoint_managers', None)
  if managers is not None and hasattr(managers, 'LatestN'):
    return {'preservation_policy': managers.LatestN(n=keep)}
  return {'max_to_keep': keep}


class Checkpointer:
  """Saves {'state': pytree, 'data': json, 'run': json} every `save_every` steps, keeping the
  `keep` latest."""

  def __init__(self, directory: str, *, keep: int = 3, save_every: int = 1000):
    self.directory = os.path.abspath(directory)
    self.save_every = save_every
    options = ocp.CheckpointManagerOptions(create=True, **_retention(keep))
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_handlers=_item_handlers())

  def all_steps(self) -> list[int]:
    """Steps of the checkpoints kept, oldest first."""
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def maybe_save(self, step: int, state, data_state: dict, run: dict | None = None, *,
                 force: bool = False) -> bool:
    """Saves at every `save_every`-th step (or `force`): the state, the data position and the
    run's layout `run` (what a resume on another mesh needs to keep the same global batches)."""
    if not force and (self.save_every <= 0 or step % self.save_every):
      return False
    if step in self.manager.all_steps():
      return False
    items = dict(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state))
    if run is not None:
      items[RUN_ITEM] = ocp.args.JsonSave(run)
    with self._storage_errors():  # also reports a failure of the previous (async) save
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    return True

  def run_layout(self) -> tuple[int, dict] | None:
    """(step, layout) saved with the latest checkpoint that has one: the devices, processes,
    mesh and accumulation steps of the run that wrote it; None for a fresh workdir (or one
    whose checkpoints predate the layout). Reads one small json file, nothing else."""
    for step in sorted(self.manager.all_steps(), reverse=True):
      path = os.path.join(self.directory, str(step), RUN_ITEM)
      if not os.path.isdir(path):
        continue
      try:
        restored = self.manager.restore(
            step, args=ocp.args.Composite(**{RUN_ITEM: ocp.args.JsonRestore()}))
      except Exception as error:  # unreadable: restore() reports it and falls back
        _log_unreadable(step, self.directory, error)
        continue
      return step, dict(restored[RUN_ITEM])
    return None

  @contextlib.contextmanager
  def _storage_errors(self):
    """A full disk, quota or permission problem while saving becomes one DataError line."""
    try:
      yield
    except Exception as error:
      text = f'{type(error).__name__}: {error}'
      if not isinstance(error, OSError) and not any(m in text for m in _STORAGE_ERRORS):
        raise
      committed = self.manager.all_steps()
      kept = f'step {max(committed)}' if committed else 'none yet'
      reason = next((m for m in _STORAGE_ERRORS if m in text), type(error).__name__)
      raise DataError(
          f'cannot write a checkpoint in {self.directory} ({reason}); free space or '
          f'choose another --workdir and rerun (last good checkpoint: {kept})') from None

  def check_fits(self, abstract_state):
    """ConfigError if the latest readable checkpoint's shapes differ from `abstract_state`.

    Reads metadata only; called before a run writes anything (config.json) to the workdir.
    """
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        stored = self.manager.item_metadata(step)['state']
      except Exception:
        continue  # unreadable: restore() reports it and falls back
      if stored is not None:
        _check_shapes(abstract_state, stored, step, self.directory)
        return

  def restore(self, abstract_state, step: int | None = None):
    """Restores the latest good checkpoint (or `step`): (state, data_state, step), or None.

    `abstract_state` is a pytree of jax.ShapeDtypeStruct with shardings: arrays come back
    already placed on the mesh, each process reading only its shards.
    """
    steps = [step] if step is not None else sorted(self.manager.all_steps(), reverse=True)
    for candidate in steps:
      try:
        stored = self.manager.item_metadata(candidate)['state']
      except Exception as error:
        _log_unreadable(candidate, self.directory, error)
        continue
      if stored is not None:
        _check_shapes(abstract_state, stored, candidate, self.directory)
      try:
        restored = self.manager.restore(
            candidate, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                               data=ocp.args.JsonRestore()))
      except Exception as error:
        # Shape mismatches are a config problem, not corruption: let the caller explain them.
        if 'shape' in str(error).lower() and 'mismatch' in str(error).lower():
          raise
        _log_unreadable(candidate, self.directory, error)
        continue
      return restored['state'], restored['data'], candidate
    return None

  def wait(self):
    with self._storage_errors():
      self.manager.wait_until_finished()

  def close(self):
    self.wait()
    self.manager.close()


def restore_params_only(directory: str, abstract_params=None) -> dict:
  """The params of the latest readable checkpoint a `Checkpointer` wrote in `directory`.

  Only the params are read, not the optimizer state or the data position, so nothing of
  training needs building (a checkpoint without optimizer state reads as well). With
  `abstract_params` (jax.ShapeDtypeStructs with shardings, `train_step.abstract_params`) the
  arrays come back placed on its mesh, each process reading only its shards, and a checkpoint
  of other shapes is a ConfigError naming the parameter (as `Checkpointer.restore`); without,
  numpy arrays on the host, each whole whatever mesh saved it (for export: no model or mesh).
  An unreadable checkpoint is logged and the one before it tried, as `Checkpointer.restore`
  does; nothing is written (no directory is created). ConfigError if no checkpoint can be read.
  """
  directory = os.path.abspath(directory)
  if not os.path.isdir(directory):
    raise ConfigError(f'no checkpoint in {directory}: train first')
  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False),
                                  item_handlers=_item_handlers())
  try:
    for step in sorted(manager.all_steps(), reverse=True):
      try:
        stored = {'params': manager.item_metadata(step)['state']['params']}
      except Exception as error:  # unreadable (truncated, corrupted): try the one before
        _log_unreadable(step, directory, error)
        continue
      if abstract_params is None:
        item = stored
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
      else:
        item = {'params': abstract_params}
        _check_shapes(item, stored, step, directory)
        args = ocp.checkpoint_utils.construct_restore_args(item)
      try:
        # The params subtree of the step's 'state' item alone (partial_restore), read with the
        # PyTree handler: StandardRestore would need the whole TrainState's structure.
        with ocp.PyTreeCheckpointer() as reader:
          restored = reader.restore(
              os.path.join(directory, str(step), 'state'),
              args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True))
      except Exception as error:
        _log_unreadable(step, directory, error)
        continue
      logging.info('read the params of the checkpoint at step %d in %s', step, directory)
      return restored['params']
  finally:
    manager.close()
  raise ConfigError(f'no readable checkpoint in {directory}: train first')


def _log_unreadable(step: int, directory: str, error: Exception):
  logging.error('checkpoint at step %d in %s could not be restored (%s: %s); trying an older one',
                step, directory,
                type(error).__name__,
                str(error).splitlines()[0][:200] if str(error) else '')


def _shapes_by_name(tree) -> dict[str, tuple]:
  """{'params.stack.layer_0.mlp.wi.kernel': shape} for arrays or orbax array metadata."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if hasattr(leaf, 'shape'):
      names = (getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k))) for k in path)
      out['.'.join(map(str, names))] = tuple(leaf.shape)
  return out


def _check_shapes(abstract_state, stored_metadata, step: int, directory: str):
  """ConfigError naming the first parameter whose shape (or presence) differs."""
  wanted, stored = _shapes_by_name(abstract_state), _shapes_by_name(stored_metadata)
  problems = [
      f'{name} has shape {stored[name]} in the checkpoint but {wanted[name]} in the '
      'config' for name in wanted if name in stored and stored[name] != wanted[name]
  ]
  problems += [
      f'{name} is in the config but not in the checkpoint' for name in wanted if name not in stored
  ]
  problems += [
      f'{name} is in the checkpoint but not in the config' for name in stored if name not in wanted
  ]
  if problems:
    problems.sort(key=lambda p: not p.startswith('params.'))  # parameters before Adam moments
    raise ConfigError(
        f'checkpoint at step {step} in {directory} does not fit the model of this config: '
        f'{problems[0]}{f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""}; '
        'resume with the config it was trained with (config.json in the workdir) or use a '
        'new --workdir')


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
