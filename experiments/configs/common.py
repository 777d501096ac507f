"""Keys every experiment shares, so scripts and users can rely on them.

  experiment ('lm', 'translation' or 'encoder': which workflow trains the config and what the
  planner and export make of it; set by {lm,translate,bert}_common.py,
  transformer_jax/workflows/experiment_kinds.py),
  seed, mesh.{data,fsdp,tensor}, train.{num_steps, log_every, eval_every, checkpoint_every,
  keep_checkpoints, max_minutes, max_nonfinite, eval_max_batches, accumulation_steps,
  elastic_accumulation, record_batches, profile_steps},
  distributed.{mode, coordinator_address, num_processes, process_id}, optimizer.*, model.*, data.*
"""

import ml_collections


def base_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  # Device mesh: -1 = all remaining devices. Data parallelism by default.
  config.mesh = ml_collections.ConfigDict({'data': -1, 'fsdp': 1, 'tensor': 1})

  config.train = ml_collections.ConfigDict()
  config.train.num_steps = 10_000
  config.train.log_every = 100
  config.train.eval_every = 1_000
  config.train.checkpoint_every = 1_000
  config.train.keep_checkpoints = 3
  config.train.max_minutes = 0.0  # stop (and evaluate) after this wall time; 0 = no limit
  config.train.max_nonfinite = 10  # consecutive skipped non-finite steps before giving up
  config.train.eval_max_batches = 0  # 0 = the whole validation set
  config.train.accumulation_steps = 1  # >1: one update from k micro-batches (1/k the activations)
  # Resumed on fewer (or more) data-parallel devices, keep each device's batch and change the
  # accumulation steps so the global batch stays the same (else the devices' shares change).
  config.train.elastic_accumulation = False
  # Append the SHA-256 of every global batch to WORKDIR/batches.jsonl: a proof of the data order
  # (e.g. across a resume on another mesh); costs a host gather per step with several processes.
  config.train.record_batches = False
  # 'START:END' writes a jax.profiler trace of the steps with indices START..END-1 (the progress
  # line's steps START+1..END) to WORKDIR/profile, for TensorBoard's profile plugin or Perfetto;
  # '' = no profiling.
  config.train.profile_steps = ''

  # Multi-host jobs (transformer_jax/parallel/distributed.py): 'auto' starts jax.distributed
  # when the environment names a coordinator (JAX_COORDINATOR_ADDRESS, ...) or a SLURM/TPU job;
  # 'on' always (e.g. on Cloud TPU VMs), 'off' never. Empty/-1 = take it from the environment or
  # jax.
  config.distributed = ml_collections.ConfigDict(
      {'mode': 'auto', 'coordinator_address': '', 'num_processes': -1, 'process_id': -1})

  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.learning_rate = 1e-3
  config.optimizer.schedule = 'rsqrt'
  config.optimizer.warmup_steps = 1_000
  config.optimizer.decay_steps = 10_000
  config.optimizer.end_learning_rate = 0.0
  config.optimizer.cooldown_steps = 0  # rsqrt/constant: linear fall to end_lr before decay_steps
  config.optimizer.b1 = 0.9
  config.optimizer.b2 = 0.98
  config.optimizer.eps = 1e-9
  config.optimizer.weight_decay = 0.0
  config.optimizer.grad_clip_norm = 1.0
  return config
