"""The process set-up of the entry points: one re-exec under jemalloc with our MALLOC_CONF, and
XLA's persistent compilation cache in the user's cache directory unless told otherwise."""

import os
import subprocess
import sys

import pytest

from transformer_jax.cli import process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = ('from transformer_jax.cli import process\nprocess.setup_allocator()\nimport os\n'
          'print(os.getpid(), os.environ.get("LD_PRELOAD", ""), os.environ.get("MALLOC_CONF"), '
          'os.environ.get("GLIBC_TUNABLES"), process.allocator_description(), sep="|")')


def run_script(tmp_path, **env_overrides):
  env = {
      k: v
      for k, v in os.environ.items()
      if k not in ('TRANSFORMER_JAX_ALLOCATOR', 'MALLOC_CONF', 'LD_PRELOAD', 'GLIBC_TUNABLES')
  }
  env.update(env_overrides, PYTHONPATH=REPO)
  script = tmp_path / 'entry.py'  # a script, as entry points are (`-c` cannot be re-executed)
  script.write_text(SCRIPT)
  out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       check=True, timeout=60).stdout.strip()
  return out.split('|')


def test_entry_point_reexecs_under_jemalloc_with_our_conf(tmp_path):
  _, preload, malloc_conf, tunables, description = run_script(tmp_path)
  if process.find_jemalloc():
    assert preload.startswith(process.find_jemalloc())
    assert malloc_conf == process.JEMALLOC_CONF
    assert 'oversize_threshold:0' in malloc_conf and description.startswith('jemalloc')
  else:
    assert tunables == process.GLIBC_TUNABLES and description.startswith('glibc')


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
