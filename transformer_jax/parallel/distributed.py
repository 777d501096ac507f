"""Multi-process (multi-host) start-up: `jax.distributed.initialize()` when a job asks for it.

One process runs per host (TPU VM worker, SLURM task, or a local CPU process); together they see
one global device list, and every jitted step runs on all of them at once. Each process feeds
only its own rows of every global batch (`Trainer.to_global` builds the global arrays with
`jax.make_array_from_process_local_data`) and writes/reads only its own shards of a checkpoint.

When to initialise, in order (config section `distributed`, all keys optional):
  mode 'off'                         never (one process; the default behaviour is unchanged)
  an explicit coordinator            config.distributed.coordinator_address / num_processes /
                                     process_id, else the JAX_COORDINATOR_ADDRESS,
                                     JAX_NUM_PROCESSES and JAX_PROCESS_ID environment variables
  mode 'auto' (default)              a SLURM step with more than one task, or a multi-host Cloud
                                     TPU VM: jax detects coordinator, count and id by itself
  mode 'on'                          always, leaving the rest to jax's cluster detection
It must run before anything touches the devices (`jax.devices()`); `Trainer` calls it first.
"""

import os

import jax
from absl import logging

from transformer_jax.errors import ConfigError
from transformer_jax.sections import Distributed, section_of


def _setting(section: Distributed, key: str, env: str, cast):
  """config.distributed.<key> if set (non-empty, non-negative), else $env, else None."""
  value = getattr(section, key)
  if value == '' or (isinstance(value, int) and value < 0):
    value = os.environ.get(env) or None
  if value is None:
    return None
  try:
    return cast(value)
  except ValueError as error:
    raise ConfigError(f'distributed.{key} (or ${env}) must be a {cast.__name__}, '
                      f'got {value!r}') from error


def detected_cluster() -> str | None:
  """'slurm' or 'tpu_vm' when this process is one of several in a job jax can auto-detect."""
  if os.environ.get('SLURM_STEP_NODELIST') and int(os.environ.get('SLURM_NTASKS', '1')) > 1:
    return 'slurm'
  hosts = os.environ.get('TPU_WORKER_HOSTNAMES', '')
  if os.environ.get('TPU_WORKER_ID') is not None and len(hosts.split(',')) > 1:
    return 'tpu_vm'
  return None


def initialize(config=None) -> bool:
  """Starts jax.distributed if the config or environment asks; True if it is running.

  Idempotent: a second call (or one after the job is already initialised) does nothing.
  """
  if jax.distributed.is_initialized():
    return True
  section = section_of(config, 'distributed', Distributed) if config is not None else Distributed()
  mode = section.mode  # one of auto, on, off (checked by the section)
  if mode == 'off':
    return False
  address = _setting(section, 'coordinator_address', 'JAX_COORDINATOR_ADDRESS', str)
  num_processes = _setting(section, 'num_processes', 'JAX_NUM_PROCESSES', int)
  process_id = _setting(section, 'process_id', 'JAX_PROCESS_ID', int)
  cluster = detected_cluster()
  if mode == 'auto' and address is None and cluster is None:
    return False
  if address is not None and (num_processes is None or process_id is None) and cluster is None:
    raise ConfigError(f'distributed: coordinator {address} is set but not the process count and '
                      'id; set distributed.num_processes and distributed.process_id (or '
                      '$JAX_NUM_PROCESSES and $JAX_PROCESS_ID)')
  logging.info('jax.distributed.initialize(coordinator=%s, processes=%s, id=%s; detected %s)',
               address, num_processes, process_id, cluster)
  try:
    jax.distributed.initialize(coordinator_address=address, num_processes=num_processes,
                               process_id=process_id)
  except RuntimeError as error:
    if 'before' in str(error) and 'initialize' in str(error):
      raise ConfigError(
          'distributed: jax.distributed.initialize() must run before anything '
          'uses the devices; call transformer_jax.parallel.distributed.initialize(config) '
          'first in the entry point') from error
    raise
  logging.info('process %d of %d; %d local and %d global devices', jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
  if jax.default_backend() == 'cpu' and jax.config.jax_enable_compilation_cache:
    # On jax 0.12.1 a multi-process CPU job whose steps come from the persistent compilation
    # cache deadlocks in its first step (2 local processes, 2 runs in 2, tests/test_multihost.py);
    # compiled afresh it runs. CPU jobs of several processes are small: compile them.
    jax.config.update('jax_enable_compilation_cache', False)
    logging.info('XLA compilation cache: off for a multi-process CPU job (a cached step '
                 'deadlocks its collectives on jax 0.12.1)')
  return True
