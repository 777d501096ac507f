"""Where a run's numbers go: TensorBoard event files and a metrics.jsonl, on the chief only.

The trainer hands scalars, text and images to a `MetricsWriter` and knows nothing of the
formats; other processes of a multi-host job get a writer that drops everything.
"""

import itertools
import json
import os
import sys

import numpy as np

_WRITER_NUMBERS = itertools.count()


def _summary_writer(logdir: str):
  """A tensorboardX SummaryWriter, imported without PyTorch.

  tensorboardX imports torch whenever it is installed (only to accept torch tensors), which cost
  every run 2-3 s and ~300 MB here. A None entry in sys.modules makes that import fail at once,
  and is removed straight after, so torch stays importable.
  """
  # lazy: with torch blocked, as said above; and only a chief that writes pays its 0.16 s (measured)
  if 'torch' in sys.modules or 'tensorboardX' in sys.modules:
    from tensorboardX import SummaryWriter  # lazy: as above
  else:
    sys.modules['torch'] = None
    try:
      from tensorboardX import SummaryWriter  # lazy: as above
    finally:
      del sys.modules['torch']
  # The event file is named by the second it was created and the host: a run resumed within the
  # same second (tests, a quick restart) would otherwise overwrite the earlier run's file.
  return SummaryWriter(logdir, filename_suffix=f'.{os.getpid()}.{next(_WRITER_NUMBERS)}')


class MetricsWriter:
  """WORKDIR/tensorboard/ and WORKDIR/metrics.jsonl; created on the first write, so a run that
  only restores for inference writes nothing."""

  def __init__(self, workdir: str, is_chief: bool):
    self.workdir = workdir
    self.is_chief = is_chief
    self._tensorboard = None

  @property
  def tensorboard(self):
    if self._tensorboard is None:
      self._tensorboard = _summary_writer(os.path.join(self.workdir, 'tensorboard'))
    return self._tensorboard

  def scalars(self, step: int, scalars: dict[str, float], prefix: str):
    """`prefix/name` scalars to TensorBoard and one JSON line {'step': s, 'prefix/name': v}."""
    if not self.is_chief:
      return
    for key, value in scalars.items():
      self.tensorboard.add_scalar(f'{prefix}/{key}', value, step)
    record = {'step': step, **{f'{prefix}/{k}': v for k, v in scalars.items()}}
    with open(os.path.join(self.workdir, 'metrics.jsonl'), 'a') as f:
      f.write(json.dumps(record) + '\n')

  def text(self, step: int, tag: str, text: str):
    if self.is_chief:
      self.tensorboard.add_text(tag, text, step)

  def images(self, step: int, images: dict[str, np.ndarray]):
    """uint8 [H, W, 3] pictures by tag."""
    if self.is_chief:
      for tag, image in images.items():
        self.tensorboard.add_image(tag, image, step, dataformats='HWC')

  def flush(self):
    if self._tensorboard is not None:
      self._tensorboard.flush()

  def close(self):
    if self._tensorboard is not None:
      self._tensorboard.close()
