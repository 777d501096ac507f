"""The allocator set-up of the entry points: one re-exec under jemalloc with our MALLOC_CONF."""

import os
import subprocess
import sys

from transformer_jax import runtime

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = ('from transformer_jax import runtime\nruntime.setup_allocator()\nimport os\n'
          'print(os.getpid(), os.environ.get("LD_PRELOAD", ""), os.environ.get("MALLOC_CONF"), '
          'os.environ.get("GLIBC_TUNABLES"), runtime.allocator_description(), sep="|")')


def run_script(tmp_path, **env_overrides):
  env = {k: v for k, v in os.environ.items()
         if k not in ('TRANSFORMER_JAX_ALLOCATOR', 'MALLOC_CONF', 'LD_PRELOAD', 'GLIBC_TUNABLES')}
  env.update(env_overrides, PYTHONPATH=REPO)
  script = tmp_path / 'entry.py'  # a script, as entry points are (`-c` cannot be re-executed)
  script.write_text(SCRIPT)
  out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       check=True, timeout=60).stdout.strip()
  return out.split('|')


def test_entry_point_reexecs_under_jemalloc_with_our_conf(tmp_path):
  _, preload, malloc_conf, tunables, description = run_script(tmp_path)
  if runtime.find_jemalloc():
    assert preload.startswith(runtime.find_jemalloc())
    assert malloc_conf == runtime.JEMALLOC_CONF
    assert 'oversize_threshold:0' in malloc_conf and description.startswith('jemalloc')
  else:
    assert tunables == runtime.GLIBC_TUNABLES and description.startswith('glibc')


def test_user_choices_are_kept(tmp_path):
  assert run_script(tmp_path, TRANSFORMER_JAX_ALLOCATOR='system')[4].startswith('system malloc')
  if runtime.find_jemalloc():
    assert run_script(tmp_path, MALLOC_CONF='retain:true')[2] == 'retain:true'
  else:
    assert run_script(tmp_path, GLIBC_TUNABLES='glibc.malloc.arena_max=2')[3] == (
        'glibc.malloc.arena_max=2')
