"""Atomic file writes (readers see the old file or the new one, never half of one), JSON
objects read with one error line, and the folder of facts measured on this machine."""

import json
import os
import tempfile

from transformer_jax.errors import DataError


def read_json_object(path: str) -> dict:
  """The JSON object in `path`; one DataError line if it cannot be read or is not an object."""
  try:
    with open(path, encoding='utf-8') as f:
      data = json.load(f)
  except (OSError, ValueError) as e:
    text = str(e).strip()
    raise DataError(
        f'cannot read {path}: {text.splitlines()[0] if text else type(e).__name__}') from None
  if not isinstance(data, dict):
    raise DataError(f'{path} is not a JSON object')
  return data


def write_atomically(path: str, data: bytes | str) -> None:
  """Writes `data` (str as UTF-8) to `path` through a uniquely named temporary file.

  Matters when a run is killed mid-write, and when several processes of one job write the same
  (deterministic) file at once: each has its own temporary file, so none renames another's.
  """
  if isinstance(data, str):
    data = data.encode('utf-8')
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + '.tmp-')
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp_path, 0o644)  # mkstemp makes owner-only files; this is a normal one.
    os.replace(tmp_path, path)
  except BaseException:
    if os.path.exists(tmp_path):
      os.remove(tmp_path)
    raise


def cache_path(name: str) -> str:
  """$XDG_CACHE_HOME/transformer_jax/`name` (~/.cache by default): what this machine measured
  or compiled once and keeps across runs."""
  cache_home = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return os.path.join(cache_home, 'transformer_jax', name)
