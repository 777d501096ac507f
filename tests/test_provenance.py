"""Run provenance: WORKDIR/provenance.jsonl gets one complete record per run start (fresh or
resumed), also written as TensorBoard text; git trouble becomes a reason, never a failed run."""

import datetime
import glob
import json
import os
import platform
import re
import socket
import struct
import subprocess
import sys

import jax
import pytest
from tensorboardX.proto import event_pb2

from test_trainer import ScriptedData, ToyTask, read_metrics, toy_trainer_config
from transformer_jax.training import provenance
from transformer_jax.training.trainer import Trainer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = {
    'time_utc', 'hostname', 'start_step', 'command_line', 'git', 'python', 'versions', 'devices',
    'mesh', 'config', 'matmul_dtype', 'layout', 'resumed_from'
}
GIT_FIELDS = {'commit', 'dirty', 'diff', 'diff_truncated', 'error'}


def read_provenance(workdir) -> list[dict]:
  with open(os.path.join(workdir, provenance.FILE_NAME)) as f:
    return [json.loads(line) for line in f]


def tensorboard_texts(workdir) -> list[tuple[int, str, str]]:
  """(step, tag, text) of every text summary in WORKDIR/tensorboard (TFRecord event files)."""
  found = []
  for path in sorted(glob.glob(os.path.join(workdir, 'tensorboard', 'events.out.tfevents.*'))):
    with open(path, 'rb') as f:
      data = f.read()
    offset = 0
    while offset < len(data):  # record: length (8 bytes), its crc (4), payload, payload crc (4)
      (length,) = struct.unpack('<Q', data[offset:offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      offset += 12 + length + 4
      for value in event.summary.value:
        if value.metadata.plugin_data.plugin_name == 'text':
          found.append((event.step, value.tag, value.tensor.string_val[0].decode()))
  return found


def fit(config, workdir, num_steps):
  config.train.num_steps = num_steps
  trainer = Trainer(config, ToyTask(), str(workdir))
  try:
    return trainer.fit(ScriptedData(poison_from=10**6)), trainer
  finally:
    trainer.close()


def test_fresh_and_resumed_runs_each_append_a_complete_record(tmp_path):
  """Steps 0..4, then a resumed run to 6: two lines, the first kept as it was, the second
  starting at step 4; every field present and checked against what this process sees."""
  config = toy_trainer_config(checkpoint_every=2)
  _, trainer = fit(config, tmp_path, 4)
  [first] = read_provenance(tmp_path)
  # ToyTask's model config sets no matmul_dtype, nor does the toy config: float32, and why.
  assert first['matmul_dtype'] == {
      'dtype': 'float32', 'reason': 'model.matmul_dtype=none: the matmuls run in model.dtype'
  }
  with open(tmp_path / provenance.FILE_NAME, 'rb') as f:
    first_line = f.read()
  results, _ = fit(config, tmp_path, 6)
  assert results['step'] == 6
  records = read_provenance(tmp_path)
  with open(tmp_path / provenance.FILE_NAME, 'rb') as f:
    assert f.read().startswith(first_line)  # appended, not rewritten differently

  assert len(records) == 2 and records[0] == first
  assert [r['start_step'] for r in records] == [0, 4]
  for record in records:
    assert set(record) == FIELDS and set(record['git']) == GIT_FIELDS
  record = records[1]
  head = subprocess.run(['git', '-C', REPO_ROOT, 'rev-parse', 'HEAD'], capture_output=True,
                        text=True, check=True).stdout.strip()
  git = record['git']
  assert re.fullmatch('[0-9a-f]{40}', git['commit']) and git['commit'] == head
  assert git['error'] is None and isinstance(git['dirty'], bool)
  assert git['dirty'] == bool(git['diff'])  # this shared checkout may or may not be edited now
  assert not git['diff_truncated'] or len(git['diff'].encode()) <= provenance.MAX_DIFF_BYTES
  assert record['python'] == platform.python_version()
  assert record['versions']['jax'] == jax.__version__
  assert all(record['versions'][name] for name in provenance.PACKAGES)
  assert record['devices'] == {
      'platform': jax.devices()[0].platform, 'kind': jax.devices()[0].device_kind,
      'count': jax.device_count(), 'local_count': jax.local_device_count(), 'process_count': 1
  }
  assert record['mesh'] == dict(trainer.mesh.shape) and list(record['mesh']) == list(
      trainer.mesh.axis_names)
  assert record['command_line'] == sys.argv
  # The layout of this start and of the checkpoint it resumes (the same devices here).
  assert first['resumed_from'] is None
  assert record['resumed_from'] == record['layout'] == {
      'devices': jax.device_count(), 'processes': 1, 'mesh': record['mesh'],
      'accumulation_steps': 1, 'batch_multiple': record['mesh']['data'] * record['mesh']['fsdp']
  }
  assert record['hostname'] == socket.gethostname()
  started = datetime.datetime.fromisoformat(record['time_utc'])
  assert started.utcoffset() == datetime.timedelta(0)
  assert abs(datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() < 600
  assert record['config'] == json.loads(config.to_json_best_effort())
  assert [r['config']['train']['num_steps'] for r in records] == [4, 6]

  texts = [(step, text)
           for step, tag, text in tensorboard_texts(tmp_path)
           if tag == 'provenance/text_summary']  # tensorboardX's name for text 'provenance'
  assert [step for step, _ in texts] == [0, 4]
  assert texts[1][1].startswith(f'step 4, code {head}')
  assert json.dumps(record['config']['train']['num_steps']) in texts[1][1]


@pytest.mark.parametrize('case', ['not_a_checkout', 'git_missing'])
def test_without_git_the_commit_is_none_with_a_reason_and_the_run_trains(
    tmp_path, monkeypatch, case):
  """Code outside a git checkout, or no git program: commit None, the reason recorded, and
  training goes on as usual."""
  if case == 'not_a_checkout':
    code = tmp_path / 'code'
    code.mkdir()
    monkeypatch.setattr(provenance, 'CODE_DIRECTORY', str(code))
    monkeypatch.setenv('GIT_CEILING_DIRECTORIES', str(tmp_path))  # no repository above it
    reason = 'not a git repository'
  else:
    monkeypatch.setenv('PATH', str(tmp_path / 'empty'))
    reason = 'git is not installed'
  workdir = tmp_path / 'work'
  results, _ = fit(toy_trainer_config(), workdir, 3)
  assert results['step'] == 3
  assert [r['step'] for r in read_metrics(workdir)] == [1, 2, 3]
  [record] = read_provenance(workdir)
  assert record['git']['commit'] is None and record['git']['dirty'] is None
  assert reason in record['git']['error'], record['git']['error']
  assert set(record) == FIELDS and record['versions']['jax'] == jax.__version__


def git(directory, *args) -> str:
  return subprocess.run(
      ['git', '-C', str(directory), '-c', 'user.name=t', '-c', 'user.email=t@t', *args],
      capture_output=True, text=True, check=True).stdout


def test_git_state_reports_commit_dirtiness_and_a_capped_diff(tmp_path, monkeypatch):
  """A repository built here: clean, then edited (the diff shows the edit), then a diff over
  the cap is cut and flagged; a folder of untracked files inside it, and a git that hangs,
  give no commit but a reason."""
  repo = tmp_path / 'repo'
  (repo / 'pkg').mkdir(parents=True)
  (repo / 'pkg' / 'code.py').write_text('x = 1\n')
  git(repo, 'init', '-q')
  git(repo, 'add', '.')
  git(repo, 'commit', '-qm', 'first')
  head = git(repo, 'rev-parse', 'HEAD').strip()
  package = str(repo / 'pkg')

  assert provenance.git_state(package) == {
      'commit': head, 'dirty': False, 'diff': '', 'diff_truncated': False, 'error': None
  }
  (repo / 'pkg' / 'code.py').write_text('x = 2\n')
  state = provenance.git_state(package)
  assert state['commit'] == head and state['dirty'] and not state['diff_truncated']
  assert '-x = 1\n+x = 2\n' in state['diff'] and 'diff --git a/pkg/code.py' in state['diff']
  full_diff = state['diff']

  monkeypatch.setattr(provenance, 'MAX_DIFF_BYTES', 30)
  state = provenance.git_state(package)
  assert state['dirty'] and state['diff_truncated'] and state['diff'] == full_diff[:30]
  assert len(full_diff) > 30 and full_diff[:30] == 'diff --git a/pkg/code.py b/pkg'

  (repo / 'venv').mkdir()
  (repo / 'venv' / 'site.py').write_text('')
  state = provenance.git_state(str(repo / 'venv'))
  assert state['commit'] is None and 'is not tracked by the git repository' in state['error']

  monkeypatch.setattr(provenance, 'GIT_TIMEOUT_S', 1e-6)
  state = provenance.git_state(package)
  assert state['commit'] is None and state['error'] == 'git rev-parse took over 1e-06 s'


def test_append_keeps_earlier_lines_and_leaves_no_temporary_files(tmp_path):
  """Each append adds one complete line after the old ones; only the file remains."""
  for step in range(3):
    provenance.append(str(tmp_path), {'start_step': step, 'text': 'a\nb'})
  assert [r['start_step'] for r in read_provenance(tmp_path)] == [0, 1, 2]
  assert os.listdir(tmp_path) == [provenance.FILE_NAME]
