"""Process setup for the entry points: the memory allocator (before JAX is imported), XLA's
persistent compilation cache and synchronous dispatch on CPU.

XLA:CPU allocates large scratch buffers every step. glibc returns blocks over 32 MB to the
kernel on free, so each step page-faults them in again (measured: ~1.3 s of kernel time per
step of a 6-layer 384-wide GPT). An allocator told to keep what it frees avoids that: the
system's jemalloc where it is installed, else oneTBB's scalable allocator, which the `tbb` wheel
from PyPI (a dependency on Linux x86-64) ships. glibc kept from trimming (the last resort) does
not fault, but it cannot reuse a freed step's scratch once small blocks have been carved from
it, and holds two sets from the second step on (a 6-layer 384-wide GPT under the bf16 policy:
peak RSS 2.6 GB against 1.8 GB; docs/performance.md).
"""

import importlib.metadata
import os
import sys

from transformer_jax import files  # imports no jax: this module runs before jax starts

JEMALLOC_PATHS = ('/usr/lib/x86_64-linux-gnu/libjemalloc.so.2',
                  '/usr/lib/aarch64-linux-gnu/libjemalloc.so.2', '/usr/lib/libjemalloc.so.2',
                  '/usr/local/lib/libjemalloc.so.2')
# Keep freed pages (no decay) and serve large requests from the regular per-thread arenas too.
# (With jemalloc's dedicated arena for requests over 8 MiB, 3 of 13 benchmark processes had
# ~100k faults per timed step, none of 13 without it; those faults are one fresh ~1.5 GB set of
# buffers touched once, in one step whose position varies, which still happens now and then:
# see benchmarks/train_step.py and docs/performance.md.)
JEMALLOC_CONF = 'retain:true,dirty_decay_ms:-1,muzzy_decay_ms:-1,oversize_threshold:0'
# oneTBB's allocator, replacing malloc through its proxy library. Blocks of 1 MiB and more are
# "huge" and kept when freed instead of given back after a while (without this: ~255k page
# faults per step of the GPT above).
TBBMALLOC_LIBRARIES = ('libtbbmalloc.so.2', 'libtbbmalloc_proxy.so.2')  # the proxy needs the first
TBBMALLOC_ENV = {'TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD': str(1 << 20)}
GLIBC_TUNABLES = ('glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1:'
                  'glibc.malloc.trim_threshold=17179869184')
_MARKER = 'TRANSFORMER_JAX_ALLOCATOR'
_CACHE_VARIABLE = 'TRANSFORMER_JAX_COMPILATION_CACHE'


def find_jemalloc() -> str | None:
  return next((p for p in JEMALLOC_PATHS if os.path.exists(p)), None)


def find_tbbmalloc() -> list[str] | None:
  """The paths of oneTBB's allocator and its malloc proxy from the installed `tbb` wheel, which
  puts them in the environment's lib/ (sys.prefix, or the user base for `pip install --user`)."""
  try:
    distribution = importlib.metadata.distribution('tbb')
  except importlib.metadata.PackageNotFoundError:
    return None
  found = {}
  for file in distribution.files or ():
    if file.name in TBBMALLOC_LIBRARIES:
      found[file.name] = os.path.normpath(distribution.locate_file(file))
  paths = [found.get(name) for name in TBBMALLOC_LIBRARIES]
  return paths if all(path and os.path.exists(path) for path in paths) else None


def setup_allocator() -> None:
  """Re-executes this process under jemalloc (or oneTBB's allocator, or glibc tunables) once;
  no-op if already done.

  Call it first thing in an entry point, before importing jax. Set
  TRANSFORMER_JAX_ALLOCATOR=system to keep the default allocator.
  """
  choice = os.environ.get(_MARKER)
  if choice:  # already re-executed, or the user chose
    return
  jemalloc, tbbmalloc = find_jemalloc(), None
  if not jemalloc:
    tbbmalloc = find_tbbmalloc()
  env = dict(os.environ)
  if jemalloc:
    env['LD_PRELOAD'] = ':'.join(filter(None, [jemalloc, env.get('LD_PRELOAD')]))
    env['MALLOC_CONF'] = env.get('MALLOC_CONF', JEMALLOC_CONF)
    env[_MARKER] = 'jemalloc'
  elif tbbmalloc:
    env['LD_PRELOAD'] = ':'.join(filter(None, tbbmalloc + [env.get('LD_PRELOAD')]))
    for name, value in TBBMALLOC_ENV.items():
      env[name] = env.get(name, value)
    env[_MARKER] = 'tbbmalloc'
  else:
    env['GLIBC_TUNABLES'] = env.get('GLIBC_TUNABLES', GLIBC_TUNABLES)
    env[_MARKER] = 'glibc-tunables'
  sys.stdout.flush()
  sys.stderr.flush()
  try:
    os.execve(sys.executable, [sys.executable] + _original_argv(), env)
  except OSError:
    os.environ[_MARKER] = 'system'


def _original_argv() -> list[str]:
  # `python -m pkg.mod args` arrives as sys.argv[0] = path of mod; re-run it as a module so
  # relative imports and __main__ behave the same.
  main = sys.modules.get('__main__')
  spec = getattr(main, '__spec__', None)
  if spec is not None and spec.name:
    return ['-m', spec.name] + sys.argv[1:]
  return sys.argv


def allocator_description() -> str:
  choice = os.environ.get(_MARKER, 'system')
  return {
      'jemalloc': f'jemalloc ({find_jemalloc()}, MALLOC_CONF={os.environ.get("MALLOC_CONF")})',
      'tbbmalloc': 'oneTBB scalable malloc (the tbb package; '
                   f'TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD='
                   f'{os.environ.get("TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD")})',
      'glibc-tunables': 'glibc malloc with GLIBC_TUNABLES (neither jemalloc nor the tbb package '
                        'found; pip install tbb, or apt-get install libjemalloc2)',
  }.get(choice, 'system malloc (TRANSFORMER_JAX_ALLOCATOR=system)')


def default_compilation_cache_dir() -> str:
  return files.cache_path('xla')


def enable_compilation_cache() -> str:
  """Turns on XLA's persistent compilation cache; returns a line saying where (for the log).

  A rerun, a resumed job or a new run of the same shapes then loads its compiled steps instead of
  compiling them (a 20-step baby GPT run: 30 s cold, 20 s warm). JAX caches programs that took
  over a second to compile, keyed on the program, jax version, flags and devices. Directory:
  $TRANSFORMER_JAX_COMPILATION_CACHE (`off` disables it), default ~/.cache/transformer_jax/xla;
  a cache the user configured for JAX itself (JAX_COMPILATION_CACHE_DIR) is kept. On a
  multi-host job only process 0 writes; point every host at one shared path to share it.
  """
  import jax  # lazy: not before setup_allocator has re-executed the entry point
  configured = jax.config.jax_compilation_cache_dir
  if configured:
    return f'XLA compilation cache: {configured} (jax_compilation_cache_dir)'
  directory = os.environ.get(_CACHE_VARIABLE, default_compilation_cache_dir())
  if directory.lower() in ('', 'off', 'none', '0'):
    return f'XLA compilation cache: off ({_CACHE_VARIABLE}={directory})'
  directory = os.path.expanduser(directory)
  if '://' not in directory:  # a local path; cloud paths (gs://...) are JAX's to handle
    try:
      os.makedirs(directory, exist_ok=True)
    except OSError as error:
      return f'XLA compilation cache: off (cannot create {directory}: {error.strerror})'
  jax.config.update('jax_compilation_cache_dir', directory)
  return f'XLA compilation cache: {directory} ({_CACHE_VARIABLE}=off disables it)'


def synchronous_cpu_dispatch() -> str:
  """Runs CPU computations in the calling thread (`jax_cpu_enable_async_dispatch=False`); returns
  a line for the log.

  With asynchronous dispatch a step's outputs are ready before its scratch buffers are freed, so
  now and then the next step allocates its own set while the last one's is still held: from
  then on the process keeps two (a 6-layer 384-wide GPT under the bf16 policy: 1.0 GB of scratch,
  peak RSS 1.8 GB, then 2.8 GB from a step that varies; 0 jumps in 4 runs of 12 steps with
  synchronous dispatch, docs/performance.md). A CPU step uses every core itself, so there is no
  host work to overlap with it. Accelerators are not affected. The CPU client reads the option
  when it is created: call this before the first computation, as `entrypoint.run` does.
  """
  # lazy: not before setup_allocator has re-executed the entry point
  import jax
  from jax._src import xla_bridge
  started = getattr(xla_bridge, 'backends_are_initialized', lambda: False)()
  try:
    jax.config.update('jax_cpu_enable_async_dispatch', False)
  except AttributeError:  # a jax without the option
    return 'CPU dispatch: asynchronous (this jax cannot make it synchronous)'
  if started:
    return 'CPU dispatch: asynchronous (set up after the first computation; too late to change)'
  return 'CPU dispatch: synchronous (one set of step buffers; jax_cpu_enable_async_dispatch=False)'
