"""The process set-up of the entry points: one re-exec under jemalloc with our MALLOC_CONF (or
oneTBB's allocator from the tbb wheel, or glibc tunables), and XLA's persistent compilation cache
in the user's cache directory unless told otherwise."""

import os
import platform
import subprocess
import sys

import pytest

from transformer_jax.cli import process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = ('from transformer_jax.cli import process\nprocess.setup_allocator()\nimport os\n'
          'maps = open("/proc/self/maps").read()\n'
          'print(os.getpid(), os.environ.get("LD_PRELOAD", ""), os.environ.get("MALLOC_CONF"), '
          'os.environ.get("GLIBC_TUNABLES"), process.allocator_description(), '
          '"libtbbmalloc_proxy" in maps, sep="|")')
# Prepended to a script: the machine has no jemalloc (and, for the glibc case, no tbb wheel).
NO_JEMALLOC = 'from transformer_jax.cli import process\nprocess.find_jemalloc = lambda: None\n'
NO_TBB = NO_JEMALLOC + 'process.find_tbbmalloc = lambda: None\n'
ALLOCATOR_VARIABLES = ('TRANSFORMER_JAX_ALLOCATOR', 'MALLOC_CONF', 'LD_PRELOAD', 'GLIBC_TUNABLES',
                       *process.TBBMALLOC_ENV)
# The tbb wheel is a dependency where PyPI has it (setup.cfg): Linux on x86-64.
TBB_WHEEL_PLATFORM = sys.platform == 'linux' and platform.machine() == 'x86_64'


def run_script(tmp_path, script=SCRIPT, prefix='', **env_overrides):
  env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}
  env.update(env_overrides, PYTHONPATH=REPO)
  path = tmp_path / 'entry.py'  # a script, as entry points are (`-c` cannot be re-executed)
  path.write_text(prefix + script)
  out = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True,
                       check=True, timeout=60).stdout.strip()
  return out.splitlines()[-1].split('|')


def test_entry_point_reexecs_under_the_best_allocator_found(tmp_path):
  _, preload, malloc_conf, tunables, description, tbb_loaded = run_script(tmp_path)
  if process.find_jemalloc():
    assert preload.startswith(process.find_jemalloc())
    assert malloc_conf == process.JEMALLOC_CONF
    assert 'oversize_threshold:0' in malloc_conf and description.startswith('jemalloc')
  elif TBB_WHEEL_PLATFORM:  # the README's install on a machine without jemalloc
    assert description.startswith('oneTBB') and tbb_loaded == 'True'
  else:
    assert tunables == process.GLIBC_TUNABLES and description.startswith('glibc')


def test_without_jemalloc_the_tbb_wheel_allocator_replaces_malloc(tmp_path):
  """The path of the README's install (no system jemalloc), forced on any machine."""
  tbb = process.find_tbbmalloc()
  assert (tbb is not None) == TBB_WHEEL_PLATFORM  # installed with the package where it exists
  _, preload, _, _, description, tbb_loaded = run_script(tmp_path, prefix=NO_JEMALLOC)
  if TBB_WHEEL_PLATFORM:
    assert preload.split(':')[:2] == tbb and tbb_loaded == 'True'
    assert description.startswith('oneTBB') and 'HUGE_SIZE_THRESHOLD=1048576' in description
  else:
    assert description.startswith('glibc') and tbb_loaded == 'False'


def test_without_jemalloc_or_tbb_glibc_is_kept_from_trimming(tmp_path):
  _, preload, _, tunables, description, tbb_loaded = run_script(tmp_path, prefix=NO_TBB)
  assert tunables == process.GLIBC_TUNABLES and description.startswith('glibc')
  assert tbb_loaded == 'False' and 'tbbmalloc' not in preload


# A step's pattern: large scratch blocks held while other large objects come and go (which ages
# the allocator's cache of freed blocks), then all freed; minor page faults of steps 2 to 6.
STEP_FAULTS_SCRIPT = """
process.setup_allocator()
import resource
import numpy as np
def step():
  scratch = [np.ones(n << 20, np.uint8) for n in (300, 40, 8, 100, 130)]
  for i in range(3000):
    np.ones((64 + i % 64) << 10, np.uint8)
  del scratch
step()
faults = []
for _ in range(5):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  step()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(max(faults), process.allocator_description(), sep='|')
"""


@pytest.mark.skipif(not TBB_WHEEL_PLATFORM, reason='the tbb wheel exists for Linux x86-64 only')
def test_tbb_keeps_freed_step_buffers_instead_of_faulting_them_in_again(tmp_path):
  """Without TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD oneTBB gives large freed blocks back to the kernel
  after a while, and every step faults its scratch in again (a mid GPT bf16 step: ~255k faults;
  with the setting ~1). Here the same mechanism at a small scale."""
  preload = ':'.join(process.find_tbbmalloc())
  ours, description = run_script(tmp_path, STEP_FAULTS_SCRIPT, NO_JEMALLOC)
  without, _ = run_script(tmp_path, STEP_FAULTS_SCRIPT, 'from transformer_jax.cli import process\n',
                          TRANSFORMER_JAX_ALLOCATOR='tbbmalloc', LD_PRELOAD=preload)
  assert description.startswith('oneTBB')
  assert int(ours) * 4 < int(without), (ours, without)


def test_user_choices_are_kept(tmp_path):
  assert run_script(tmp_path, TRANSFORMER_JAX_ALLOCATOR='system')[4].startswith('system malloc')
  if process.find_jemalloc():
    assert run_script(tmp_path, MALLOC_CONF='retain:true')[2] == 'retain:true'
  else:
    assert run_script(tmp_path,
                      GLIBC_TUNABLES='glibc.malloc.arena_max=2')[3] == ('glibc.malloc.arena_max=2')


CACHE_SCRIPT = ('from transformer_jax.cli import process\n'
                'print(process.enable_compilation_cache(), flush=True)\n'
                'import jax\njax.config.update("jax_persistent_cache_min_compile_time_secs", 0)\n'
                'print(int(jax.jit(lambda x: x * 3 + 1)(2)))')


def run_cache_script(tmp_path, **env_overrides) -> list[str]:
  env = {
      k: v
      for k, v in os.environ.items()
      if not k.startswith('JAX_') and k != 'TRANSFORMER_JAX_COMPILATION_CACHE'
  }
  env.update(env_overrides, PYTHONPATH=REPO, JAX_PLATFORMS='cpu', XDG_CACHE_HOME=str(tmp_path))
  return subprocess.run([sys.executable, '-c', CACHE_SCRIPT], env=env, capture_output=True,
                        text=True, check=True, timeout=120).stdout.splitlines()


def test_compilation_cache_defaults_to_the_user_cache_dir_and_really_stores_programs(tmp_path):
  line, result = run_cache_script(tmp_path)
  directory = tmp_path / 'transformer_jax' / 'xla'
  assert result == '7' and str(directory) in line
  assert any(name.startswith('jit__lambda') for name in os.listdir(directory))


@pytest.mark.slow
def test_compilation_cache_can_be_moved_or_turned_off_and_jax_own_setting_wins(tmp_path):
  elsewhere = tmp_path / 'elsewhere'
  line, _ = run_cache_script(tmp_path, TRANSFORMER_JAX_COMPILATION_CACHE=str(elsewhere))
  assert str(elsewhere) in line and os.listdir(elsewhere)
  line, _ = run_cache_script(tmp_path, TRANSFORMER_JAX_COMPILATION_CACHE='off')
  assert 'off' in line and not (tmp_path / 'transformer_jax').exists()
  jax_own = tmp_path / 'jax_own'
  line, _ = run_cache_script(tmp_path, JAX_COMPILATION_CACHE_DIR=str(jax_own),
                             TRANSFORMER_JAX_COMPILATION_CACHE=str(elsewhere / 'unused'))
  assert str(jax_own) in line and os.listdir(jax_own) and not (elsewhere / 'unused').exists()


def test_cpu_steps_run_synchronously_after_the_entry_point_setup():
  """After `synchronous_cpu_dispatch` a CPU computation has finished when its call returns (its
  scratch buffers freed before the next step allocates its own), where jax's default returns at
  once with the result still being computed. Too late (after a computation), it says so."""

  def run(setup_first: bool) -> list[str]:
    setup = 'line = process.synchronous_cpu_dispatch()\n'
    script = ('import jax, jax.numpy as jnp\n'
              'from transformer_jax.cli import process\n' + (setup if setup_first else '') +
              'f = jax.jit(lambda x: jax.lax.fori_loop(0, 40, lambda i, y: jnp.tanh(y @ y), x))\n'
              'x = jnp.ones((512, 512)) / 512\n'
              'f(x).block_until_ready()\n'
              'ready = all(f(x).is_ready() for _ in range(3))\n' + ('' if setup_first else setup) +
              'print(ready, line, sep="|")')
    out = subprocess.run([sys.executable, '-c', script], env=dict(os.environ, PYTHONPATH=REPO),
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return out.strip().splitlines()[-1].split('|')

  ready, line = run(setup_first=True)
  assert ready == 'True' and line.startswith('CPU dispatch: synchronous')
  ready, line = run(setup_first=False)  # jax's default: the call returns before the loop ends
  assert ready == 'False' and 'too late' in line
