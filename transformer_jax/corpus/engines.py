"""Where the units of a preparation run: worker processes on this machine, or tasks on Ray.

  local  a pool of `workers` processes (default: the usable cores), started with 'spawn' (a
         fork of a process whose tokenizer has started its threads can deadlock), each encoding
         on one thread (ONE_THREAD); with one worker the units run in this process, with the
         tokenizer's own threads. At most two units per worker are in flight,
         so memory is bounded by the workers, not the corpus.
  ray    one Ray task per unit on the cluster at `ray_address` (a local one is started when
         none is given), `pip install -e ".[ray]"`. Every task needs the output folder and the
         sources at the same paths on every node: a shared filesystem or gs://.

`run` yields (task, result) as units finish, in any order; the caller orders the results.
A failed unit stops the run with its error (the other workers' shards stay, for the rerun).
"""

import concurrent.futures
import multiprocessing
import os
from collections.abc import Callable, Iterator

from transformer_jax.errors import ConfigError, DataError

ENGINES = ('local', 'ray')


def check(engine: str):
  if engine not in ENGINES:
    raise ConfigError(f'engine must be one of {ENGINES}, got {engine!r}')


def usable_cores() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1


def run(fn: Callable, tasks: list, *, engine: str = 'local', workers: int = 0,
        ray_address: str = '') -> Iterator[tuple]:
  """(task, fn(task)) for every task, as they finish."""
  check(engine)
  if not tasks:
    return
  if engine == 'ray':
    yield from _run_ray(fn, tasks, ray_address)
    return
  workers = min(workers or usable_cores(), len(tasks))
  if workers <= 1:
    for task in tasks:
      yield task, fn(task)
    return
  context = multiprocessing.get_context('spawn')
  with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context,
                                              initializer=_one_tokenizer_thread) as pool:
    pending, queue = {}, list(reversed(tasks))
    try:
      while queue or pending:
        while queue and len(pending) < 2 * workers:
          task = queue.pop()
          pending[pool.submit(fn, task)] = task
        done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in done:
          task = pending.pop(future)
          yield task, future.result()
    except BaseException:
      for future in pending:
        future.cancel()
      raise


# A worker per core, each encoding on one thread: Hugging Face tokenizers would start a thread
# per core in every worker (rayon), and a worker's Python work (ids to arrays, reading, writing)
# then left its core idle while the other worker's threads fought over both. Measured on 2 cores,
# 200 MiB, byte-level BPE: 1.27M tokens/s with one thread a worker, 1.08M with rayon's default.
ONE_THREAD = {'RAYON_NUM_THREADS': '1'}


def _one_tokenizer_thread():
  """Pool initializer: before the worker loads a tokenizer (rayon reads it once)."""
  os.environ.update(ONE_THREAD)


def _run_ray(fn: Callable, tasks: list, address: str) -> Iterator[tuple]:
  try:
    import ray  # lazy: Ray is optional (the ray extra) and only --engine=ray needs it
  except ImportError:
    raise ConfigError('--engine=ray needs Ray: pip install -e ".[ray]"') from None
  started = not ray.is_initialized()
  if started:
    ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
             ignore_reinit_error=True)
  try:
    remote = ray.remote(fn).options(runtime_env={'env_vars': ONE_THREAD})
    refs = {remote.remote(task): task for task in tasks}
    while refs:
      done, _ = ray.wait(list(refs), num_returns=1)
      for ref in done:
        task = refs.pop(ref)
        try:
          yield task, ray.get(ref)
        except ray.exceptions.RayTaskError as e:
          cause = e.cause if getattr(e, 'cause', None) is not None else e
          if isinstance(cause, (DataError, ConfigError)):
            raise cause from None
          raise
  finally:
    if started:
      ray.shutdown()
