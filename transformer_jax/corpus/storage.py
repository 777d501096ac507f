"""Where a prepared corpus lives: a local folder, or any fsspec path (gs://, s3://, memory://).

Local paths go through `os` (and `np.memmap` when reading shards); a path with a scheme goes
through fsspec (`pip install -e ".[gcs]"` for gs://, gcsfs), imported only then. What the
corpus code needs of a store is small: read a whole small file, read a byte range of a shard,
list a folder, and write a file so that it appears whole or not at all. On a local disk that is
a temporary file renamed into place; an object store makes an object visible only once its
upload has finished, so the same call is atomic there too.
"""

import os
import tempfile

from transformer_jax.errors import DataError


def is_remote(path: str) -> bool:
  """Whether `path` names an fsspec filesystem (a scheme such as gs://), not a local path."""
  return '://' in path and not path.startswith('file://')


def local_path(path: str) -> str:
  return path[len('file://'):] if path.startswith('file://') else path


def _filesystem(path: str):
  try:
    import fsspec  # lazy: fsspec is optional (the gcs extra), for remote paths only
  except ImportError:
    raise DataError(f'{path} is not a local path and fsspec is not installed: '
                    'pip install -e ".[gcs]" (fsspec and gcsfs)') from None
  try:
    fs, _, _ = fsspec.get_fs_token_paths(path)
  except (ImportError, ValueError) as e:
    raise DataError(f'cannot open {path}: {e}') from None
  return fs


def join(path: str, *parts: str) -> str:
  if is_remote(path):
    return '/'.join([path.rstrip('/')] + [p.strip('/') for p in parts])
  return os.path.join(local_path(path), *parts)


def exists(path: str) -> bool:
  if is_remote(path):
    return _filesystem(path).exists(path)
  return os.path.exists(local_path(path))


def size(path: str) -> int:
  """Bytes of the file at `path`; -1 where it does not exist."""
  try:
    if is_remote(path):
      return int(_filesystem(path).size(path))
    return os.path.getsize(local_path(path))
  except (FileNotFoundError, OSError):
    return -1


def read_bytes(path: str) -> bytes:
  try:
    if is_remote(path):
      return _filesystem(path).cat_file(path)
    with open(local_path(path), 'rb') as f:
      return f.read()
  except FileNotFoundError:
    raise DataError(f'{path} does not exist') from None
  except OSError as e:
    raise DataError(f'cannot read {path}: {e}') from None


def read_range(path: str, start: int, end: int) -> bytes:
  """Bytes [start, end) of the file at `path`."""
  if is_remote(path):
    return _filesystem(path).cat_file(path, start=start, end=end)
  with open(local_path(path), 'rb') as f:
    f.seek(start)
    return f.read(end - start)


def listdir(path: str) -> list[str]:
  """The names in the folder `path` (not their paths); [] where it does not exist."""
  if is_remote(path):
    fs = _filesystem(path)
    if not fs.exists(path):
      return []
    return sorted(entry.rstrip('/').rsplit('/', 1)[-1] for entry in fs.ls(path, detail=False))
  path = local_path(path)
  return sorted(os.listdir(path)) if os.path.isdir(path) else []


def makedirs(path: str):
  if is_remote(path):
    _filesystem(path).makedirs(path, exist_ok=True)
  else:
    os.makedirs(local_path(path), exist_ok=True)


def remove(path: str):
  try:
    if is_remote(path):
      _filesystem(path).rm(path)
    else:
      os.remove(local_path(path))
  except (FileNotFoundError, OSError):
    pass


def write_file_atomically(path: str, local_file: str):
  """Moves the finished local file `local_file` to `path`: a rename on a local disk (same
  folder), an upload elsewhere (an object appears only when its upload completes)."""
  if is_remote(path):
    try:
      _filesystem(path).put_file(local_file, path)
    finally:
      os.remove(local_file)
  else:
    os.replace(local_file, local_path(path))


def write_bytes_atomically(path: str, data: bytes):
  """`data` to `path`, whole or not at all."""
  staging = staging_file(path)
  try:
    with open(staging, 'wb') as f:
      f.write(data)
    write_file_atomically(path, staging)
  except BaseException:
    if os.path.exists(staging):
      os.remove(staging)
    raise


def staging_file(path: str) -> str:
  """A new local temporary file to write `path`'s content into: beside it on a local disk (so
  the rename stays on one filesystem), in the system's temporary folder for a remote path."""
  if is_remote(path):
    fd, name = tempfile.mkstemp(prefix='transformer_jax-')
  else:
    path = local_path(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, name = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                prefix='.' + os.path.basename(path) + '.tmp-')
  os.close(fd)
  return name


def is_staging_name(name: str) -> bool:
  """A temporary file `staging_file` made (left behind by a killed run)."""
  return name.startswith('.') and '.tmp-' in name
