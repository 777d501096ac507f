"""The model FLOPs of a run's batches and the peak its MFU divides by (the trainer's progress
line): a task's `model_flops` formula, cached per batch shape, against the devices' peak
(transformer_jax/flops.py; a CPU's is the best matmul rate seen on the machine, measured again
once if a window runs faster than it)."""

import flax.linen as nn
import jax
import numpy as np
from absl import logging

from transformer_jax import flops


class ModelFlops:
  """The task's model FLOPs per batch (cached per batch shape) and the peak FLOP/s of the run's
  devices (transformer_jax/flops.py): what the progress line's MFU divides."""

  def __init__(self, task, abstract_params, mesh):
    self.formula = getattr(task, 'model_flops', None)
    self.params = nn.meta.unbox(abstract_params)
    self.cache, self.peak, self.cpu_peak = {}, None, None
    if self.formula is None:
      return
    device = mesh.devices.flat[0]
    matmul_dtype = task.cfg.matmul_dtype or task.cfg.dtype
    per_device, source = flops.peak_flops_per_device(device, matmul_dtype)
    # A CPU's figure is the whole host's, measured on each process.
    self.devices = jax.process_count() if device.platform == 'cpu' else mesh.size
    if per_device:
      self.peak = per_device * self.devices
    if device.platform == 'cpu':
      self.cpu_peak = flops.CpuPeak.of(matmul_dtype)
    self.remeasured = False
    logging.info('MFU: model FLOPs (%s) against %s', flops.FORMULA, source)

  def utilisation(self, model_flops_per_s: float) -> tuple[float | None, str]:
    """(MFU or None, the progress line's text for it) of a window's model FLOP/s.

    A CPU window faster than the peak means the peak is stale (measured under load, with no
    quiet figure cached yet): the matmul is measured again, once per run, and the line says so
    instead of showing a figure above 100%.
    """
    if not self.peak:
      return None, ''
    mfu = model_flops_per_s / self.peak
    if mfu <= 1.0:
      return mfu, f' | MFU {100 * mfu:.1f}%'
    if self.cpu_peak is None:
      return None, ' | MFU n/a (above the nominal peak)'
    if not self.remeasured:
      self.remeasured = True
      self.peak = self.cpu_peak.measure() * self.devices
      logging.info(
          'MFU: this window ran at %s GFLOP/s of model FLOPs, above the peak; measured '
          'the matmul again: %s', f'{model_flops_per_s / 1e9:,.0f}', self.cpu_peak.describe())
      if model_flops_per_s <= self.peak:
        return self.utilisation(model_flops_per_s)
    return None, f' | MFU n/a (peak {self.peak / 1e9:,.0f} GFLOP/s is stale)'

  def of(self, batch) -> float:
    if self.formula is None:
      return 0.0
    shapes = tuple(sorted((key, np.shape(value)) for key, value in batch.items()))
    if shapes not in self.cache:
      self.cache[shapes] = float(self.formula(self.params, batch))
    return self.cache[shapes]
