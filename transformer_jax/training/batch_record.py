"""A fingerprint of every global batch a run trains on: proof of its data order.

With `train.record_batches=True` the trainer appends one line per step to
WORKDIR/batches.jsonl: {"step": s, "sha256": ...}, the SHA-256 of the global batch of step s
(every array the devices receive, by key, with its shape and dtype). Two runs trained on the
same batches in the same order have the same lines, whatever their devices, mesh or process
count; so a run resumed on another layout can be checked token for token against an
uninterrupted one (tests/test_elastic_resume.py, benchmarks/resume.py --elastic). A step run
again after a resume appends its line again: the last line of a step is the one that counts.

Each process holds only its own rows of the global batch, so with several processes the rows
are gathered (every process takes part; the chief writes). It costs a host gather and a hash per
step: a check to switch on, not a default.
"""

import hashlib
import json
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

FILE_NAME = 'batches.jsonl'


def digest(batch: dict[str, np.ndarray]) -> str:
  """SHA-256 of a global batch: its keys in order, each array's dtype, shape and bytes."""
  sha = hashlib.sha256()
  for key in sorted(batch):
    value = np.ascontiguousarray(batch[key])
    sha.update(f'{key}:{value.dtype.str}:{value.shape};'.encode())
    sha.update(value.tobytes())
  return sha.hexdigest()


def global_batch(local: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The global batch from this process's rows (processes hold contiguous rows, in order)."""
  if jax.process_count() == 1:
    return local
  return multihost_utils.process_allgather(local, tiled=True)


class BatchRecord:
  """Appends each step's global batch digest to WORKDIR/batches.jsonl when enabled."""

  def __init__(self, workdir: str, enabled: bool, is_chief: bool):
    self.path = os.path.join(workdir, FILE_NAME)
    self.enabled, self.is_chief = enabled, is_chief

  def add(self, step: int, local: dict[str, np.ndarray]):
    """Records the batch of `step` (1-based: the step it trains); all processes call this."""
    if not self.enabled:
      return
    batch = global_batch({k: np.asarray(v) for k, v in local.items() if k != 'index'})
    if self.is_chief:
      with open(self.path, 'a') as f:
        f.write(json.dumps({'step': int(step), 'sha256': digest(batch)}) + '\n')


def read(workdir: str) -> dict[int, str]:
  """{step: sha256} of WORKDIR/batches.jsonl, the last line of each step."""
  out = {}
  with open(os.path.join(workdir, FILE_NAME)) as f:
    for line in f:
      record = json.loads(line)
      out[int(record['step'])] = record['sha256']
  return out
