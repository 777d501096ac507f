"""The TPU compiler on a host without TPUs: where libtpu is, and a quiet environment for it.

libtpu (the `tpu` extra: `pip install -e ".[tpu]"`, which is `jax[tpu]`, or a folder of its own
with `pip install --no-deps --target DIR "$(python -m transformer_jax.planning.runtime)"` and
TRANSFORMER_JAX_LIBTPU_DIR=DIR) holds XLA's TPU compiler. Each jax release pins the libtpu it
works with (jax 0.10.2: 0.0.42, jax 0.12.0.1: 0.0.50); `libtpu_requirement()` reads that pin
from the installed jax's metadata, so the two always move together. jax loads libtpu when a TPU
topology is first asked for, and it describes compile-only devices that programs can be
compiled for but never run on.

`prepare()` must run before jax is imported (jax reads JAX_PLATFORMS then): it keeps jax's
own devices on the CPU, so nothing probes for TPU chips, and sets the variables that keep
libtpu quiet on a machine that is no TPU VM and let several planners run at once. None of them
changes CPU work. This module does not import jax.
"""

import importlib.metadata
import importlib.util
import os
import re
import sys
import tempfile

from transformer_jax.errors import ConfigError

LIBTPU_DIR_VARIABLE = 'TRANSFORMER_JAX_LIBTPU_DIR'


def libtpu_requirement() -> str:
  """The libtpu the installed jax pins for its `tpu` extra, e.g. 'libtpu==0.0.50.*'."""
  for requirement in importlib.metadata.requires('jax') or ():
    name, _, marker = requirement.partition(';')
    if re.match(r'\s*libtpu\b', name) and re.search(r'extra\s*==\s*["\']tpu["\']', marker):
      return name.strip().replace(' ', '')
  raise ConfigError(f'jax {importlib.metadata.version("jax")} names no libtpu for its tpu extra')


def install_hint() -> str:
  requirement = libtpu_requirement()
  return (f'pip install -e ".[tpu]" (or pip install --no-deps --target DIR "{requirement}" and '
          f'set {LIBTPU_DIR_VARIABLE}=DIR)')


# setdefault: a value the user set wins.
QUIET_ENVIRONMENT = {
    'JAX_PLATFORMS': 'cpu',  # jax's devices stay the CPU: no TPU probe, no fallback warnings
    'TPU_SKIP_MDS_QUERY': '1',  # no query of the GCE metadata server (jax sets it too, no chips)
    'TPU_ACCELERATOR_TYPE': 'v5litepod-4',  # any valid name: silences "Failed to find host
    # bounds"; the topology asked for decides the target
    'TPU_WORKER_HOSTNAMES': 'localhost',  # silences the worker-hostname error line; without a
    # TPU_WORKER_ID, parallel/distributed.py still sees no cluster
    'ALLOW_MULTIPLE_LIBTPU_LOAD': '1',  # libtpu otherwise takes /tmp/libtpu_lockfile, and a
    # second planner (a test worker, a benchmark) fails "when accessing libtpu multi-process
    # lockfile"; compile-only devices touch no chip
}


def libtpu_path() -> str | None:
  """libtpu.so from TRANSFORMER_JAX_LIBTPU_DIR (a folder holding the `libtpu` package) or the
  installed `libtpu` package; None if neither. A variable naming no libtpu is a ConfigError."""
  directory = os.environ.get(LIBTPU_DIR_VARIABLE)
  if directory:
    path = os.path.join(directory, 'libtpu', 'libtpu.so')
    if not os.path.isfile(path):
      raise ConfigError(f'{LIBTPU_DIR_VARIABLE}={directory} holds no libtpu/libtpu.so; install '
                        f'it there with pip install --no-deps --target {directory} '
                        f'"{libtpu_requirement()}"')
    return path
  spec = importlib.util.find_spec('libtpu')
  if spec is None or not spec.origin:
    return None
  path = os.path.join(os.path.dirname(spec.origin), 'libtpu.so')
  return path if os.path.isfile(path) else None


def prepare() -> str | None:
  """Sets the quiet environment and TPU_LIBRARY_PATH (jax's own variable for libtpu); returns
  libtpu's path, or None when it is not installed (planning then fails with `require()`).
  Call it before importing jax."""
  for name, value in QUIET_ENVIRONMENT.items():
    os.environ.setdefault(name, value)
  # A TPU program in the compilation cache of training runs is never read back (not on a CPU
  # host); planning keeps out of it (cli/process.enable_compilation_cache reads this).
  os.environ.setdefault('TRANSFORMER_JAX_COMPILATION_CACHE', 'off')
  # libtpu writes a log file per process (default /tmp/tpu_logs); keep them in one folder.
  os.environ.setdefault('TPU_LOG_DIR',
                        os.path.join(tempfile.gettempdir(), 'transformer_jax_tpu_logs'))
  try:
    path = libtpu_path()
  except ConfigError:
    return None  # require() names the problem
  if path:
    os.environ.setdefault('TPU_LIBRARY_PATH', path)
  return path


def require() -> str:
  """libtpu's path; a ConfigError saying how to install it when it is missing."""
  path = libtpu_path()
  if path is None:
    raise ConfigError(f'planning for a TPU needs the TPU compiler (libtpu), which is not '
                      f'installed: {install_hint()}')
  return path


if __name__ == '__main__':
  # .ci/run: pip install --no-deps --target DIR "$(python -m transformer_jax.planning.runtime)"
  sys.stdout.write(libtpu_requirement() + '\n')
