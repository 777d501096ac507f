"""A `jax.profiler` trace of a window of training steps (train.profile_steps = 'START:END').

The trace goes to WORKDIR/profile/plugins/profile/<time>/: <host>.xplane.pb for TensorBoard's
profile plugin, perfetto_trace.json.gz for https://ui.perfetto.dev. Any backend.
"""

import re

import jax
from absl import logging

from transformer_jax.errors import ConfigError


def profile_window(value: str) -> tuple[int, int] | None:
  """train.profile_steps 'START:END' -> (START, END); '' -> None (no profiling).

  The window is a range of step indices, as in Python: the steps that start at state.step =
  START, START+1, ..., END-1, i.e. the ones the progress line numbers START+1..END ('0:2'
  traces the first two steps, compilation included). ConfigError (one line) when malformed.
  """
  value = str(value or '').strip()
  if not value:
    return None
  match = re.fullmatch(r'(\d+):(\d+)', value, re.ASCII)
  if not match or int(match[1]) >= int(match[2]):
    raise ConfigError(f"train.profile_steps={value!r} must be 'START:END' with 0 <= START < END "
                      "(step indices: '10:15' traces the 11th to the 15th step), or '' for none")
  return int(match[1]), int(match[2])


class ProfileWindow:
  """A jax.profiler trace of the steps in train.profile_steps (see `profile_window`).

  The trace starts before the first step of the window this run reaches (a run resumed inside
  the window traces the rest of it; one resumed past it traces nothing) and stops once step END
  has finished on the device, or when the loop ends early (time budget, preemption, an error).
  Every process traces its own host into WORKDIR/profile/plugins/profile/<time>/:
  <host>.xplane.pb for TensorBoard's profile plugin (xprof), perfetto_trace.json.gz for
  https://ui.perfetto.dev.
  """

  def __init__(self, window: tuple[int, int] | None, directory: str, start_step: int):
    self.window, self.directory, self.active = window, directory, False
    if window and start_step >= window[1]:
      logging.info(
          'train.profile_steps=%d:%d: this run starts at step %d, after the window; '
          'not profiling', *window, start_step)
      self.window = None

  def before_step(self, step: int):
    """Called with the step index (state.step) of the step about to run."""
    if self.window and not self.active and self.window[0] <= step < self.window[1]:
      logging.info('profiling steps %d..%d into %s', step + 1, self.window[1], self.directory)
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
      self.active = True

  def after_step(self, step: int, metrics):
    """Called with state.step after a step; the trace ends when that is the window's END."""
    if self.active and step >= self.window[1]:
      jax.block_until_ready(metrics)  # the last step's device work belongs in the trace
      self.stop()

  def stop(self):
    if not self.active:
      return
    self.active, self.window = False, None
    try:
      jax.profiler.stop_trace()
    except Exception as e:  # pylint: disable=broad-except  # a lost profile must not end a run
      logging.warning('the profile could not be written to %s: %s', self.directory, e)
    else:
      logging.info('profile written to %s', self.directory)
