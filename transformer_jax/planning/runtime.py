"""The TPU and GPU compilers on a host without either: where they are, and a quiet environment.

libtpu (the `tpu` extra: `pip install -e ".[tpu]"`, which is `jax[tpu]`, or a folder of its own
with `pip install --no-deps --target DIR "$(python -m transformer_jax.planning.runtime)"` and
TRANSFORMER_JAX_LIBTPU_DIR=DIR) holds XLA's TPU compiler. Each jax release pins the libtpu it
works with (jax 0.10.2: 0.0.42, jax 0.12.0.1: 0.0.50); `libtpu_requirement()` reads that pin
from the installed jax's metadata, so the two always move together. jax loads libtpu when a TPU
topology is first asked for, and it describes compile-only devices that programs can be
compiled for but never run on.

XLA's GPU compiler is jax's CUDA plugin (the `gpu-plan` extra: `pip install -e ".[gpu-plan]"`,
which is `jax[cuda13-local]`: the plugin without CUDA's own libraries, or a folder of its own with
`pip install --no-deps --target DIR $(python -m transformer_jax.planning.runtime --gpu)` and
TRANSFORMER_JAX_CUDA_PLUGIN_DIR=DIR). Given a chip's `target_config`, it describes compile-only
GPUs on a host with no GPU and no driver (jax >= 0.11). cuDNN's fused attention does not compile
so (`compile.py` says why, and plans with XLA's attention).

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
CUDA_PLUGIN_DIR_VARIABLE = 'TRANSFORMER_JAX_CUDA_PLUGIN_DIR'
CUDA_PLUGIN = 'jax_plugins.xla_cuda13'  # the module jax discovers the plugin by
MIN_GPU_JAX = (0, 11)  # compile-only GPU topologies (openxla/xla#41021)


def libtpu_requirement() -> str:
  """The libtpu the installed jax pins for its `tpu` extra, e.g. 'libtpu==0.0.50.*'."""
  for requirement in importlib.metadata.requires('jax') or ():
    name, _, marker = requirement.partition(';')
    if re.match(r'\s*libtpu\b', name) and re.search(r'extra\s*==\s*["\']tpu["\']', marker):
      return name.strip().replace(' ', '')
  raise ConfigError(f'jax {importlib.metadata.version("jax")} names no libtpu for its tpu extra')


def libtpu_fallback(requirement: str) -> str:
  """The newest libtpu no newer than `requirement`'s pin ('libtpu==0.0.53.*' ->
  'libtpu<0.0.54'): for an index that has not published the pinned libtpu yet (jax 0.12.1 pins
  0.0.53; on 2026-12-06 the index had 0.0.52, which compiles its programs)."""
  numbers = [int(n) for n in re.findall(r'\d+', requirement.partition('==')[2])[:3]]
  numbers[-1] += 1
  return f'libtpu<{".".join(map(str, numbers))}'


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


def _jax_version() -> tuple[int, ...]:
  return tuple(int(part) for part in re.findall(r'\d+', importlib.metadata.version('jax'))[:3])


def cuda_plugin_requirements() -> list[str]:
  """The CUDA plugin the installed jax works with: its `cuda13-local` extra's plugin and the
  PJRT library under it, pinned to jax's own version, e.g. ['jax-cuda13-plugin==0.12.1',
  'jax-cuda13-pjrt==0.12.1']."""
  version = importlib.metadata.version('jax')
  if _jax_version()[:2] < MIN_GPU_JAX:
    raise ConfigError(f'planning for a GPU needs jax >= {".".join(map(str, MIN_GPU_JAX))} (Python '
                      f'>= 3.12); this is jax {version}')
  return [f'jax-cuda13-plugin=={version}', f'jax-cuda13-pjrt=={version}']


def gpu_install_hint() -> str:
  requirements = ' '.join(cuda_plugin_requirements())
  return (f'pip install -e ".[gpu-plan]" (or pip install --no-deps --target DIR {requirements} '
          f'and set {CUDA_PLUGIN_DIR_VARIABLE}=DIR)')


def _cuda_plugin_dir() -> str | None:
  """The folder named by TRANSFORMER_JAX_CUDA_PLUGIN_DIR; a ConfigError if it holds no plugin."""
  directory = os.environ.get(CUDA_PLUGIN_DIR_VARIABLE)
  if not directory:
    return None
  if not os.path.isdir(os.path.join(directory, *CUDA_PLUGIN.split('.'))):
    raise ConfigError(f'{CUDA_PLUGIN_DIR_VARIABLE}={directory} holds no CUDA plugin '
                      f'({CUDA_PLUGIN}); install it there with pip install --no-deps --target '
                      f'{directory} {" ".join(cuda_plugin_requirements())}')
  return directory


def cuda_plugin_installed() -> bool:
  """Whether jax will find its CUDA plugin (installed, or in the folder `prepare()` puts on
  sys.path)."""
  try:
    return importlib.util.find_spec(CUDA_PLUGIN) is not None
  except ImportError:
    return False


def prepare() -> str | None:
  """Sets the quiet environment and TPU_LIBRARY_PATH (jax's own variable for libtpu), and puts
  TRANSFORMER_JAX_CUDA_PLUGIN_DIR on sys.path (where jax looks for plugins); returns libtpu's
  path, or None when it is not installed (planning for a TPU then fails with `require()`).
  Call it before importing jax."""
  try:
    directory = _cuda_plugin_dir()
  except ConfigError:
    directory = None  # require('gpu') names the problem
  if directory and directory not in sys.path:
    sys.path.insert(0, directory)
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


def require(platform: str = 'tpu') -> str | None:
  """The compiler for `platform` ('tpu': libtpu's path; 'gpu': the CUDA plugin, None), or a
  ConfigError saying how to install it when it is missing."""
  if platform == 'gpu':
    _cuda_plugin_dir()
    if not cuda_plugin_installed():
      raise ConfigError('planning for a GPU needs XLA:GPU (jax\'s CUDA plugin), which is not '
                        f'installed: {gpu_install_hint()}')
    return None
  path = libtpu_path()
  if path is None:
    raise ConfigError(f'planning for a TPU needs the TPU compiler (libtpu), which is not '
                      f'installed: {install_hint()}')
  return path


if __name__ == '__main__':
  # .ci/run: pip install --no-deps --target DIR "$(python -m transformer_jax.planning.runtime)"
  # and, for the GPU compiler, $(python -m transformer_jax.planning.runtime --gpu)
  # (--fallback: the newest libtpu before the pin, for an index that lacks the pinned one).
  if sys.argv[1:] == ['--gpu']:
    try:
      sys.stdout.write(' '.join(cuda_plugin_requirements()) + '\n')
    except ConfigError as error:  # jax < 0.11: no GPU planning
      sys.exit(f'{error}')
  elif sys.argv[1:] == ['--fallback']:
    sys.stdout.write(libtpu_fallback(libtpu_requirement()) + '\n')
  else:
    sys.stdout.write(libtpu_requirement() + '\n')
