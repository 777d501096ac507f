"""Shared fixtures: a tiny translation config, a runner for the command line, the real corpora."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # the tests import `experiments.configs` and `transformer_jax`
  sys.path.insert(0, REPO_ROOT)

from transformer_jax import precision, xla_options  # import no jax

import deprecations  # tests/deprecations.py

# TensorFlow (the tfds tests load it) and triton (torch loads it when transformers imports its
# generation code) both carry native LLVM code: loading triton into a process that holds
# TensorFlow 2.21 segfaults, so an xdist worker that ran a tfds test died in the next parity
# test. Loaded in the other order, both work; triton comes with torch (the parity extra).
try:
  import triton  # noqa: F401
except ImportError:
  pass

deprecations.install()  # before jax, flax and optax are imported

# Tests compile hundreds of tiny programs and run each for a few steps, so compiling fast beats
# running fast: at LLVM level 0 a tiny translation train step compiles in 4.8 s instead of 13.6 s,
# and on jax 0.10.2 XLA:CPU's older (non-MLIR) fusion emitters take another ~30% off compilation
# (a tiny translation model trained on 1 and 8 devices: 15 -> 10 s of compiling; later jaxlibs
# have no such flag, and `xla_options` leaves it out there). Set before jax is imported; CLI
# subprocesses inherit them. Benchmarks and real runs keep XLA's defaults.
xla_options.add_flags(xla_backend_optimization_level=0, xla_cpu_use_fusion_emitters=False)
# model.matmul_dtype='auto' (the experiment configs' default) picks bf16 matmuls on CPUs with bf16
# units; the suite pins float32 so its results do not depend on the CPU it runs on
# (tests/test_precision.py tests the choice itself, and the policy, explicitly).
os.environ.setdefault(precision.AUTO_VARIABLE, 'float32')


@pytest.fixture(autouse=True)
def no_deprecated_calls():
  """Fails a test in which the project called a deprecated API (tests/deprecations.py)."""
  deprecations.take()
  yield
  found = deprecations.take()
  if found:
    pytest.fail('the project called deprecated APIs:\n' + '\n'.join(sorted(set(found))),
                pytrace=False)


def pytest_xdist_auto_num_workers(config):
  """Workers for `-n auto` (setup.cfg's default): one per core, at most 4.

  Most of the suite's time is single-threaded XLA compilation, so two workers on two cores run
  it ~1.6x faster; each worker holds its own JAX and TensorFlow (~1 GB), hence the cap.
  """
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  return max(1, min(4, cores or 1))


# The real corpora (Multi30k, Tiny Shakespeare, SST-2; ../shared/README.md lists them) sit in the
# shared/ folder beside the checkout, here and in CI. Tests reach them through `shared_data` or
# `corpus`, never through a path of their own.
DEFAULT_SHARED_DATA = pathlib.Path(REPO_ROOT).parent / 'shared' / 'data'
SHARED_DATA_ENV = 'TRANSFORMER_JAX_SHARED_DATA'


def _require_data(path: pathlib.Path) -> pathlib.Path:
  """`path` if it exists; else skips the test, or fails it where CI=true (CI has the corpora)."""
  if not path.exists():
    message = f'needs the corpus folder {path} (the shared/ folder beside the checkout)'
    if os.environ.get('CI') == 'true':
      pytest.fail(message, pytrace=False)
    pytest.skip(message)
  return path


@pytest.fixture(scope='session')
def shared_data() -> pathlib.Path:
  """The folder of real corpora: ../shared/data beside the checkout.

  TRANSFORMER_JAX_SHARED_DATA=/some/folder reads them from elsewhere (set it to a missing
  folder to see what a machine without them does). When the folder is absent the test is
  skipped with one line naming it; with CI=true it fails instead.
  """
  return _require_data(pathlib.Path(os.environ.get(SHARED_DATA_ENV) or DEFAULT_SHARED_DATA))


@pytest.fixture(scope='session')
def corpus(shared_data):
  """corpus('multi30k') -> shared_data / 'multi30k', skipped (or, with CI=true, failed) like
  `shared_data` when that corpus is absent."""
  return lambda name: _require_data(shared_data / name)


@pytest.fixture(scope='session')
def tiny_shakespeare(corpus) -> str:
  """Tiny Shakespeare's input.txt, for the tests that train the character GPT (skipped or, with
  CI=true, failed like `corpus` when it is absent)."""
  return str(corpus('tinyshakespeare') / 'input.txt')


@pytest.fixture(scope='session')
def tpu_runtime() -> str:
  """The folder holding libtpu, to put on a subprocess's PYTHONPATH ('' when it is installed).

  Without libtpu the test is skipped with one line saying how to install it; with CI=true it
  fails instead. Compile for a TPU in a subprocess: libtpu's settings (planning/runtime.py) must
  be made before jax starts.
  """
  # The planner's own lookup: installed (the `tpu` extra), or in the folder named by
  # TRANSFORMER_JAX_LIBTPU_DIR (.ci/run makes one).
  from transformer_jax.errors import ConfigError
  from transformer_jax.planning import runtime
  directory = os.environ.get(runtime.LIBTPU_DIR_VARIABLE, '')
  try:
    if runtime.libtpu_path() is not None:
      return directory
  except ConfigError:  # the variable names a folder without libtpu
    pass
  message = (f'needs the TPU compiler libtpu: pip install -e ".[tpu]" (or '
             f'{runtime.LIBTPU_DIR_VARIABLE}=a folder holding libtpu; now {directory or "unset"})')
  if os.environ.get('CI') == 'true':
    pytest.fail(message, pytrace=False)
  pytest.skip(message)


@pytest.fixture(scope='session')
def gpu_runtime() -> str:
  """The folder holding jax's CUDA plugin, to put in a planner subprocess's
  TRANSFORMER_JAX_CUDA_PLUGIN_DIR ('' when it is installed).

  Skipped on a jax that cannot compile for a GPU without one (< 0.11: Python 3.11's 0.10.2),
  whatever CI says; without the plugin skipped with the line that installs it, and failed with
  CI=true. Compile for a GPU in a subprocess: the plugin is found when jax starts.
  """
  from transformer_jax.errors import ConfigError
  from transformer_jax.planning import runtime
  try:
    hint = runtime.gpu_install_hint()
  except ConfigError as error:
    pytest.skip(str(error))
  directory = os.environ.get(runtime.CUDA_PLUGIN_DIR_VARIABLE, '')
  found = runtime.cuda_plugin_installed() or bool(
      directory and os.path.isdir(os.path.join(directory, *runtime.CUDA_PLUGIN.split('.'))))
  if found:
    return directory
  message = (f'needs XLA:GPU (jax\'s CUDA plugin): {hint}; {runtime.CUDA_PLUGIN_DIR_VARIABLE} is '
             f'{directory or "unset"}')
  if os.environ.get('CI') == 'true':
    pytest.fail(message, pytrace=False)
  pytest.skip(message)


QUICKSTART = os.path.join('experiments', 'configs', 'translate_quickstart.py')
# JAX_* variables naming the test run's compilation cache, for CLI subprocesses.
_CACHE_ENV: dict[str, str] = {}

# Shrinks translate_quickstart.py to a model that trains in seconds on a CPU. Used both for
# in-process configs and as `--config.KEY=VALUE` flags, so both paths train the same thing.
TINY_OVERRIDES = {
    'model.emb_dim': 32,
    'model.num_heads': 2,
    'model.mlp_dim': 64,
    'model.num_encoder_layers': 1,
    'model.num_decoder_layers': 1,
    'data.max_len': 32,
    'data.batch_tokens': 512,
    'data.buckets': (32,),  # one batch shape, so each step compiles once, not per bucket
    'data.max_train_examples': 2000,
    'optimizer.learning_rate': 5e-3,
    'optimizer.warmup_steps': 10,
    'train.num_steps': 40,
    'train.log_every': 5,
    'train.eval_every': 0,
    'train.checkpoint_every': 0,
    'train.eval_max_batches': 2,
    'eval.bleu_sentences': 8,
    'eval.decode_rows': 256,
    'eval.test_prefix': '',
}


def set_path(config, dotted_key: str, value):
  """config['a']['b'] = value for dotted_key 'a.b' (the key must already exist)."""
  *parents, leaf = dotted_key.split('.')
  node = config
  for part in parents:
    node = node[part]
  if leaf not in node:
    raise KeyError(f'config has no key {dotted_key!r}')
  node[leaf] = value


def tiny_translate_config(**overrides):
  """translate_quickstart.get_config() shrunk by TINY_OVERRIDES, then `overrides`.

  Keyword names use '__' for '.', e.g. train__num_steps=10.
  """
  from experiments.configs import translate_quickstart
  config = translate_quickstart.get_config()
  for key, value in TINY_OVERRIDES.items():
    set_path(config, key, value)
  for key, value in overrides.items():
    set_path(config, key.replace('__', '.'), value)
  return config


class TranslateCli:
  """Runs `python -m experiments.translate` from the repo root in a subprocess."""

  @staticmethod
  def tiny_flags(overrides: dict | None = None) -> list[str]:
    """--config=quickstart plus `--config.KEY=VALUE` for TINY_OVERRIDES updated by `overrides`."""
    values = dict(TINY_OVERRIDES, **(overrides or {}))
    return [f'--config={QUICKSTART}'] + [f'--config.{k}={v}' for k, v in values.items()]

  @staticmethod
  def env() -> dict[str, str]:
    """No allocator re-exec (so the child's pid is the trainer's), CPU only, repo importable,
    the test run's compilation cache."""
    env = dict(os.environ)
    env['TRANSFORMER_JAX_ALLOCATOR'] = 'system'
    env['JAX_PLATFORMS'] = 'cpu'
    env['TF_CPP_MIN_LOG_LEVEL'] = '2'
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [REPO_ROOT, env.get('PYTHONPATH')]))
    env.update(_CACHE_ENV)
    return env

  @staticmethod
  def command(*args: str) -> list[str]:
    return [sys.executable, '-m', 'experiments.translate', *args]

  def run(self, *args: str, stdin: str | None = None,
          timeout: float = 900.0) -> subprocess.CompletedProcess:
    """Runs to completion; stdout and stderr are captured as text."""
    return subprocess.run(self.command(*args), cwd=REPO_ROOT, env=self.env(), input=stdin,
                          capture_output=True, text=True, timeout=timeout, check=False)

  def popen(self, *args: str) -> subprocess.Popen:
    """Starts it with stderr (where absl logs) piped, line-buffered text."""
    return subprocess.Popen(self.command(*args), cwd=REPO_ROOT, env=self.env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)

  @staticmethod
  def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith('error:')]


@pytest.fixture(scope='session', autouse=True)
def compilation_cache(tmp_path_factory):
  """A persistent XLA compilation cache shared by this test run and its CLI subprocesses.

  Several tests train the same tiny model in fresh Trainers or processes; with the cache,
  each distinct program is compiled once per test run (the directory is new every run).
  """
  import jax
  directory = str(tmp_path_factory.mktemp('jax_compilation_cache'))
  options = {
      'jax_compilation_cache_dir': directory, 'jax_persistent_cache_min_compile_time_secs': 0.0,
      'jax_persistent_cache_min_entry_size_bytes': 0
  }
  previous = {name: getattr(jax.config, name) for name in options}
  for name, value in options.items():
    jax.config.update(name, value)
    _CACHE_ENV[name.upper()] = str(value)
  with pytest.MonkeyPatch.context() as patch:
    # Entry points started without _CACHE_ENV use it too, never the user's cache.
    patch.setenv('TRANSFORMER_JAX_COMPILATION_CACHE', directory)
    yield directory
  _CACHE_ENV.clear()
  for name, value in previous.items():
    jax.config.update(name, value)


@pytest.fixture(scope='session')
def tiny_config():
  """Factory: tiny_config(train__num_steps=10, ...) -> a fresh tiny quickstart ConfigDict."""
  return tiny_translate_config


@pytest.fixture(scope='session')
def translate_cli() -> TranslateCli:
  return TranslateCli()
