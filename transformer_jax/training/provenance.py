"""Run provenance: which code, libraries, devices, command and config produced a run's numbers.

Each start of a run (fresh or resumed) appends one JSON object to WORKDIR/provenance.jsonl:

  time_utc, hostname, start_step      when and where, and the step it starts from (0 = fresh)
  command_line                        sys.argv
  git                                 commit, dirty, diff (of tracked files, capped), error
  python, versions                    python, jax, jaxlib, flax, optax, orbax-checkpoint
  devices, mesh                       platform, kind and counts; mesh axis -> size
  layout, resumed_from                devices, processes, mesh and accumulation steps of this
                                      start and of the checkpoint it resumes (training/elastic.py)
  config                              the resolved config

A researcher comparing runs weeks later reads which code and setup made each number; a resumed
run adds a line, so a run whose code changed between restarts says so. Collecting never fails a
run: git that is missing, slow or not looking at a checkout becomes `git.error`, saying why.
"""

import datetime
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys

import jax

from transformer_jax.files import write_atomically

FILE_NAME = 'provenance.jsonl'
PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint')
MAX_DIFF_BYTES = 1 << 20  # a larger diff is cut here (git.diff_truncated): the file stays small
GIT_TIMEOUT_S = 5.0  # per git command; a hung network filesystem must not hold up training
# The code that runs: the folder of the transformer_jax package, wherever it was imported from.
CODE_DIRECTORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _GitUnavailable(Exception):
  """Why git could not say which commit the code is (the message goes into the record)."""


def _git(directory: str, *args: str) -> bytes:
  """stdout of `git -C directory args`; _GitUnavailable with the reason on any failure."""
  # No optional locks: `git diff` would otherwise refresh (write) the index of the checkout.
  env = dict(os.environ, GIT_OPTIONAL_LOCKS='0', GIT_TERMINAL_PROMPT='0', LC_ALL='C')
  try:
    result = subprocess.run(['git', '-C', directory, *args], capture_output=True, env=env,
                            timeout=GIT_TIMEOUT_S, check=False)
  except FileNotFoundError:
    raise _GitUnavailable('git is not installed (not on PATH)') from None
  except subprocess.TimeoutExpired:
    raise _GitUnavailable(f'git {args[0]} took over {GIT_TIMEOUT_S:g} s') from None
  except OSError as e:
    raise _GitUnavailable(f'git could not run: {e}') from None
  if result.returncode != 0:
    message = result.stderr.decode('utf-8', 'replace').strip().splitlines()
    raise _GitUnavailable(message[0] if message else f'git {args[0]} exited {result.returncode}')
  return result.stdout


def git_state(directory: str) -> dict:
  """{'commit', 'dirty', 'diff', 'diff_truncated', 'error'} of the checkout holding `directory`.

  The commit is only reported when `directory` holds files tracked by that repository: a
  package installed into a virtual environment inside some other checkout is not that
  checkout's code. `dirty` and `diff` cover tracked files only (`git diff HEAD`).
  """
  try:
    commit = _git(directory, 'rev-parse', 'HEAD').decode().strip()
    try:
      _git(directory, 'ls-files', '--error-unmatch', '.')
    except _GitUnavailable:
      raise _GitUnavailable(f'{directory} is not tracked by the git repository around it') from None
    diff = _git(directory, 'diff', 'HEAD', '--no-ext-diff', '--no-color')
  except _GitUnavailable as e:
    return {'commit': None, 'dirty': None, 'diff': None, 'diff_truncated': False, 'error': str(e)}
  truncated = len(diff) > MAX_DIFF_BYTES
  return {
      'commit': commit,
      'dirty': bool(diff),
      # 'ignore': a cut through a multi-byte character drops it instead of garbling the text.
      'diff': diff[:MAX_DIFF_BYTES].decode('utf-8', 'ignore' if truncated else 'replace'),
      'diff_truncated': truncated,
      'error': None,
  }


def _config_dict(config) -> dict:
  """The config as plain JSON values (what config.json holds), whatever types it carries."""
  if hasattr(config, 'to_json_best_effort'):
    return json.loads(config.to_json_best_effort(sort_keys=True))
  return json.loads(json.dumps(config, default=str, sort_keys=True))


def collect(config, mesh: jax.sharding.Mesh, start_step: int, matmul_dtype: dict | None = None,
            layout: dict | None = None, resumed_from: dict | None = None) -> dict:
  """The provenance record of a run starting (or resuming) at `start_step`; `matmul_dtype`: the
  dtype the model's matmuls run in and why (precision.py), where the caller knows it; `layout`
  and `resumed_from`: this start's layout and that of the checkpoint it resumes (None: fresh)."""
  devices = jax.devices()
  return {
      'time_utc': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
      'hostname': socket.gethostname(),
      'start_step': int(start_step),
      'command_line': list(sys.argv),
      'git': git_state(CODE_DIRECTORY),
      'python': platform.python_version(),
      'versions': {name: _version(name) for name in PACKAGES},
      'devices': {
          'platform': devices[0].platform,
          'kind': devices[0].device_kind,
          'count': jax.device_count(),
          'local_count': jax.local_device_count(),
          'process_count': jax.process_count(),
      },
      'mesh': {str(name): int(size) for name, size in mesh.shape.items()},
      'config': _config_dict(config),
      'matmul_dtype': matmul_dtype,
      'layout': layout,
      'resumed_from': resumed_from,
  }


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def append(workdir: str, record: dict) -> str:
  """Adds `record` as one line of WORKDIR/provenance.jsonl; returns the file's path.

  The whole file is rewritten through a temporary file and renamed, so a crash leaves the old
  file or the new one, never half a line. Chief process only (one writer).
  """
  path = os.path.join(workdir, FILE_NAME)
  old = b''
  if os.path.exists(path):
    with open(path, 'rb') as f:
      old = f.read()
    if old and not old.endswith(b'\n'):
      old += b'\n'
  write_atomically(path, old + (json.dumps(record, sort_keys=True) + '\n').encode('utf-8'))
  return path


def as_markdown(record: dict) -> str:
  """The record for TensorBoard's text tab: a one-line summary, the JSON (less the diff) and
  the diff, as code blocks.

  Indented (not fenced) code, so backticks inside a diff cannot end a block.
  """
  git = record['git']
  code = git['commit'] or f"unknown ({git['error']})"
  if git['dirty']:
    code += ' + uncommitted changes'
  devices = record['devices']
  summary = (f"step {record['start_step']}, code {code}, {devices['count']} x {devices['kind']}, "
             f"jax {record['versions']['jax']}")
  resumed_from = record.get('resumed_from')
  if resumed_from and resumed_from != record.get('layout'):
    summary += (f", resumed from a layout of {resumed_from['devices']} devices, "
                f"mesh {resumed_from['mesh']}")
  without_diff = {**record, 'git': {k: v for k, v in git.items() if k != 'diff'}}
  parts = [summary, _code_block(json.dumps(without_diff, indent=2, sort_keys=True))]
  if git['diff']:
    cut = ' (cut)' if git['diff_truncated'] else ''
    parts += [f'git diff HEAD{cut}:', _code_block(git['diff'])]
  return '\n\n'.join(parts)


def _code_block(text: str) -> str:
  return '\n'.join('    ' + line for line in text.splitlines())
