"""train.profile_steps='START:END': a jax.profiler trace of the steps with indices START..END-1
(the progress line's steps START+1..END) in WORKDIR/profile; a malformed window, or one outside
the run, is one error line before anything is written."""

import glob
import gzip
import json
import logging
import os

import jax
import pytest

from experiments.configs.common import base_config
from test_bad_input import assert_untouched, cli, one_error_line, tiny_lm
from test_trainer import ScriptedData, ToyTask, toy_trainer_config
from transformer_jax.cli import validation
from transformer_jax.errors import ConfigError
from transformer_jax.training.profiling import profile_window
from transformer_jax.training.trainer import NonFiniteError, Trainer


def outermost_calls(events: list[dict], name: str) -> int:
  """Calls named `name` in a Chrome/Perfetto trace, not counting the events nested in them
  (the profiler records a jitted call as an event inside an event of the same name)."""
  calls, end = 0, -1.0
  for event in sorted((e for e in events if e.get('ph') == 'X' and e.get('name') == name),
                      key=lambda e: (e['ts'], -e['dur'])):
    if event['ts'] >= end:
      calls, end = calls + 1, event['ts'] + event['dur']
  return calls


def test_profile_window_writes_a_trace_of_exactly_its_steps(tmp_path, caplog):
  """'1:3' over a 4-step run: one trace under WORKDIR/profile, for TensorBoard (xplane.pb) and
  Perfetto, holding the 2nd and 3rd training steps: two calls of the jitted train step."""
  caplog.set_level(logging.INFO, logger='absl')
  trainer = Trainer(toy_trainer_config(num_steps=4, profile_steps='1:3'), ToyTask(), str(tmp_path))
  try:
    assert trainer.fit(ScriptedData(poison_from=10**6))['step'] == 4
  finally:
    trainer.close()
  [run] = glob.glob(str(tmp_path / 'profile' / 'plugins' / 'profile' / '*'))
  assert glob.glob(os.path.join(run, '*.xplane.pb'))
  with gzip.open(os.path.join(run, 'perfetto_trace.json.gz')) as f:
    events = json.load(f)['traceEvents']
  assert outermost_calls(events, 'PjitFunction(train_step)') == 2
  assert 'profiling steps 2..3 into' in caplog.text


class Recorder:
  """Stands in for jax.profiler's start/stop and the data: the order in which batches are
  fetched and the trace starts and stops."""

  def __init__(self, monkeypatch, data):
    self.events, self.data = [], data
    monkeypatch.setattr(jax.profiler, 'start_trace', lambda *a, **k: self.events.append('start'))
    monkeypatch.setattr(jax.profiler, 'stop_trace', lambda: self.events.append('stop'))

  def __iter__(self):
    for batch in self.data:
      self.events.append(f'batch {self.data.position - 1}')  # the batch of step index i is i
      yield batch

  def state(self):
    return self.data.state()

  def restore(self, state):
    self.data.restore(state)


def run(workdir, monkeypatch, poison_from=10**6, **train) -> tuple[list[str], dict | Exception]:
  config = toy_trainer_config(checkpoint_every=2, **train)
  trainer = Trainer(config, ToyTask(), str(workdir))
  data = Recorder(monkeypatch, ScriptedData(poison_from))
  try:
    results = trainer.fit(data)
  except NonFiniteError as e:
    results = e
  finally:
    trainer.close()
  return data.events, results


def test_trace_starts_before_step_start_and_stops_after_step_end(tmp_path, monkeypatch, caplog):
  """Fresh: started before step index 1, stopped after index 2. Resumed at step 2 (inside the
  window): traces the rest of it. Resumed at 4 (past it): no trace, one info line."""
  caplog.set_level(logging.INFO, logger='absl')
  events, _ = run(tmp_path / 'fresh', monkeypatch, num_steps=4, profile_steps='1:3')
  assert events == ['batch 0', 'batch 1', 'start', 'batch 2', 'stop', 'batch 3']

  workdir = tmp_path / 'resumed'
  assert run(workdir, monkeypatch, num_steps=2)[0] == ['batch 0', 'batch 1']
  events, _ = run(workdir, monkeypatch, num_steps=4, profile_steps='1:3')
  assert events == ['batch 2', 'start', 'stop', 'batch 3']
  events, results = run(workdir, monkeypatch, num_steps=6, profile_steps='1:3')
  assert events == ['batch 4', 'batch 5'] and results['step'] == 6
  assert 'train.profile_steps=1:3: this run starts at step 4, after the window' in caplog.text


def test_a_loop_ending_inside_the_window_still_stops_the_trace(tmp_path, monkeypatch):
  """The time budget ends the run after its first step, and an error (non-finite steps) ends
  another in the middle of its window: both traces are stopped, once."""
  events, results = run(tmp_path / 'budget', monkeypatch, num_steps=6, profile_steps='0:4',
                        max_minutes=1e-9)
  assert events == ['batch 0', 'start', 'stop'] and results['step'] == 1

  events, error = run(tmp_path / 'error', monkeypatch, poison_from=2, num_steps=6,
                      profile_steps='1:5', max_nonfinite=1)
  assert isinstance(error, NonFiniteError)
  assert events == ['batch 0', 'batch 1', 'start', 'batch 2', 'stop']


def config_with(profile_steps: str | None, num_steps: int = 10):
  config = base_config()
  config.train.num_steps = num_steps
  if profile_steps is None:
    del config.train['profile_steps']  # a config from before the key existed
  else:
    config.train.profile_steps = profile_steps
  return config


@pytest.mark.parametrize('value', ['5', 'a:b', '5:3', '-1:4', '3:3', ':3', '1:', '1:2:3', '1.5:3'])
def test_a_malformed_window_is_one_config_error_line(value):
  with pytest.raises(ConfigError) as raised:
    validation.check_training(config_with(value), num_devices=1)
  message = str(raised.value)
  assert message.startswith(f"train.profile_steps={value!r} must be 'START:END'"), message
  assert '\n' not in message


@pytest.mark.parametrize('value', ['3:11', '10:12', '50:60'])
def test_a_window_outside_the_run_is_one_config_error_line(value):
  with pytest.raises(ConfigError) as raised:
    validation.check_training(config_with(value), num_devices=1)
  message = str(raised.value)
  assert message == (f'train.profile_steps={value!r} ends after the run: END must be <= '
                     'train.num_steps=10 (steps are numbered 0..9)')


@pytest.mark.parametrize('value', ['', '0:1', '0:10', '9:10', ' 2:4 ', None])
def test_windows_inside_the_run_and_no_window_pass(value):
  validation.check_training(config_with(value), num_devices=1)
  assert profile_window(value or
                        '') == (None if not value else tuple(int(x) for x in value.split(':')))


def test_the_command_line_rejects_a_bad_window_before_writing_anything(tmp_path):
  """experiments.lm: a reversed window and one past train.num_steps, one line each, exit 1,
  the workdir untouched."""
  workdir = str(tmp_path / 'work')
  one_error_line(cli('experiments.lm', *tiny_lm(workdir, **{'train.profile_steps': '5:3'})),
                 "train.profile_steps='5:3' must be 'START:END'")
  one_error_line(cli('experiments.lm', *tiny_lm(workdir, **{'train.profile_steps': '2:9'})),
                 "train.profile_steps='2:9' ends after the run", 'train.num_steps=4')
  assert_untouched(workdir)
