"""Programs compiled with XLA:CPU's oneDNN fusions live until the process ends.

Why (a workaround for a bug in XLA:CPU, jaxlib 0.11.2 through 0.12.1, the newest checked;
docs/performance.md has the upstream report): freeing such a program can abort the whole process
with `object_pool.h:120] Check failed: available_.size() == num_created_`. A oneDNN fusion
borrows a runtime from a pool held by the program and gives it back in a callback that runs on an
XLA worker thread *after* the results are marked ready. A caller that reads the results and drops
the program at once (the MFU probe's matmul, a Trainer's steps when the Trainer is dropped)
destroys the pool while the runtime is still out. Under load (more busy threads than cores) the
worker is often preempted inside that window: 4 of 9 processes aborted that created and dropped
six such programs each, 3 processes at a time, on 2 cores (tests/test_onednn_lifetime.py).

So every `jax.jit` whose compiler options turn oneDNN on goes through `jit` here, which keeps the
jitted function (and so its compiled programs) referenced until the process exits. The exit needs
one more step: jax's own exit hook frees every program at once, and a process that exits right
after a oneDNN call aborts there just the same (1 process in 30 under the load above). So the
first `jit` that keeps a program also registers an exit hook, which runs before jax's (atexit
runs the last registered first) and waits until the process's other threads are all asleep: the
callbacks run on busy worker threads, so once none is running or runnable, every borrowed runtime
is back in its pool. The cost is the memory of programs that would have been freed (the probe's
matmul, the steps of Trainers dropped before the process ends) and the wait at exit, both
measured in docs/performance.md.

To drop the workaround once a fixed jaxlib is the oldest supported: set FIXED_IN, run
tests/test_onednn_lifetime.py against it, then replace `onednn_lifetime.jit` by `jax.jit`.
"""

import atexit
import os
import threading
import time

import jax

from transformer_jax import xla_options

# The first jaxlib that takes the oneDNN options (0.10.2 dies of an illegal instruction on them,
# so the precision policy never sets them there), and the first release checked to be fixed
# (None: none yet; 0.12.1 was checked to abort).
AFFECTED_SINCE = '0.11.2'
FIXED_IN: str | None = None

_KEPT: list = []  # the jitted functions kept alive, in the order they were made
# The exit hook's wait: this many reads in a row, this far apart, that find every other thread
# asleep; at most EXIT_WAIT_LIMIT_S in all (a daemon thread busy with its own work at exit).
QUIET_READS, READ_INTERVAL_S, EXIT_WAIT_LIMIT_S = 3, 0.001, 2.0


def affected(version: str | None = None) -> bool:
  """Whether jaxlib `version` (default: the installed one) can abort when freeing a oneDNN
  program."""
  current = xla_options.version_tuple(version or xla_options.jaxlib_version())
  if current < xla_options.version_tuple(AFFECTED_SINCE):
    return False
  return FIXED_IN is None or current < xla_options.version_tuple(FIXED_IN)


def uses_onednn(compiler_options: dict | None) -> bool:
  """Whether `jax.jit(..., compiler_options=...)` hands work to oneDNN fusions."""
  return bool(compiler_options and compiler_options.get('xla_cpu_use_onednn'))


def jit(fun, *, compiler_options: dict | None = None, **jit_kwargs):
  """`jax.jit(fun, compiler_options=..., **jit_kwargs)`; kept alive until the process ends when
  the options turn oneDNN on and the installed jaxlib has the bug."""
  jitted = jax.jit(fun, compiler_options=compiler_options, **jit_kwargs)
  if uses_onednn(compiler_options) and affected():
    if not _KEPT:
      atexit.register(wait_for_worker_threads)  # after jax's own hook, so it runs before
    _KEPT.append(jitted)
  return jitted


def kept() -> int:
  """How many jitted functions this process keeps alive."""
  return len(_KEPT)


def busy_threads() -> list[int] | None:
  """The ids of this process's other threads that are running or runnable (Linux: state R in
  /proc/self/task/*/stat); None where the system does not say."""
  me = threading.get_native_id()
  try:
    tids = os.listdir('/proc/self/task')
  except OSError:
    return None
  busy = []
  for tid in tids:
    try:
      with open(f'/proc/self/task/{tid}/stat') as f:
        stat = f.read()
    except OSError:
      continue  # the thread ended
    # "tid (comm) S ...": the state follows the last ')' (a name may hold one).
    if int(tid) != me and stat[stat.rindex(')') + 2:][:1] == 'R':
      busy.append(int(tid))
  return busy


def wait_for_worker_threads(limit_s: float = EXIT_WAIT_LIMIT_S) -> float:
  """Waits until every other thread of the process has been asleep for QUIET_READS reads in a
  row (at most `limit_s`; a fixed READ_INTERVAL_S x QUIET_READS where /proc is missing); returns
  the seconds waited."""
  start = time.perf_counter()
  quiet = 0
  while quiet < QUIET_READS and time.perf_counter() - start < limit_s:
    busy = busy_threads()
    quiet = 0 if busy else quiet + 1
    time.sleep(READ_INTERVAL_S)
  return time.perf_counter() - start
