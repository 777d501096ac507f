"""Stopping on SIGTERM/SIGINT at a step every process agrees on (preemption).

A preempted TPU VM or a cancelled SLURM job gets SIGTERM and a short grace period. The trainer
finishes the current step, writes a checkpoint and exits cleanly. With one process the signal
handler's flag is enough. With several, the signal may reach one host only, or the hosts at
different steps, yet all of them must take part in the same checkpoint and stop after the same
step, or the others hang in the next collective. JAX's preemption service (started by
`jax.distributed.initialize`) does exactly that: it catches SIGTERM in C++, tells every
process, and `reached_preemption_sync_point(step)` turns True on all of them at the same step.
So with several processes SIGTERM is left to it (a Python handler would replace its handler),
and SIGINT is forwarded to it as a SIGTERM. Without the service, every process all-gathers
its flag each step instead.
"""

import signal

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils


def _preemption_service_running() -> bool:
  try:
    multihost_utils.reached_preemption_sync_point(0)  # False: no notice yet (step 0 never trains)
  except RuntimeError:  # jax_enable_preemption_service is off
    return False
  return True


def any_process(flag: bool) -> bool:
  """True on every process if `flag` is True on any; all processes must call it together."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.any(multihost_utils.process_allgather(np.int32(bool(flag)))))


class StopSignal:
  """`with StopSignal() as stop:` ... `reason = stop.check(step)` after every train step.

  `check` returns None to go on, or why to stop (e.g. 'SIGTERM'); with several processes it
  returns the same answer on all of them at the same step.
  """

  def __init__(self):
    self.received: str | None = None  # the signal this process got, if any
    self.multi_process = jax.process_count() > 1
    self.synced = self.multi_process and _preemption_service_running()
    self._previous = {}

  def _handler(self, signum, frame):
    self.received = signal.Signals(signum).name
    if self.synced:  # let the preemption service see it and tell the other processes
      signal.raise_signal(signal.SIGTERM)

  def __enter__(self) -> 'StopSignal':
    signals = [signal.SIGINT] if self.synced else [signal.SIGTERM, signal.SIGINT]
    self._previous = {s: signal.signal(s, self._handler) for s in signals}
    if self.multi_process:
      logging.info(
          '%d processes: a SIGTERM/SIGINT to any of them stops all at the same step '
          '(%s)', jax.process_count(),
          'JAX preemption service' if self.synced else 'stop flag all-gathered each step')
    return self

  def __exit__(self, *exc):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def check(self, step: int) -> str | None:
    if not self.multi_process:
      return self.received
    if self.synced:
      agreed = multihost_utils.reached_preemption_sync_point(step)
    else:
      agreed = any_process(self.received is not None)
    if not agreed:
      return None
    reason = self.received or 'SIGTERM'  # possibly sent to another process
    logging.warning('preemption: all %d processes agreed to stop after step %d (%s)',
                    jax.process_count(), step, reason)
    return reason
