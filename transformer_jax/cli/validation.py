"""The checks a run makes once, before anything is written: required keys, the model config,
the training switches, the mesh against the devices and the batch, the attention kernel
against the backend.

Each workflow (`workflows/*.py`) calls these from its own `validate(config)` as its first
step, so a wrong config leaves the workdir untouched and fails in seconds with one line.

jax, the mesh and the trainer's modules are imported inside the functions that use them:
cli/workdir.py imports this module, and experiments.visualize checks its flags with it before
anything needs jax (its --help: 0.15 s, and 2.5 s with those imports at the top, measured).
"""

from transformer_jax.errors import ConfigError
from transformer_jax.sections import ModelChoices, RunSections, Train

TRAIN_KEYS = ('num_steps', 'eval_every', 'checkpoint_every', 'log_every')


def require_keys(config, section: str, keys: tuple[str, ...]):
  """Names a missing config key up front instead of failing deep inside training."""
  node = config
  for part in section.split('.'):
    if part not in node:
      raise ConfigError(f'config has no section {section!r}')
    node = node[part]
  missing = [k for k in keys if k not in node]
  if missing:
    raise ConfigError(f'config section {section!r} is missing {missing}')


def check_training(config, global_batch: int | None = None, *, num_devices: int | None = None,
                   platform: str | None = None):
  """The sections every run has (sections.RunSections: train.* switches, mesh, distributed,
  optimizer), the profile window, the mesh against the devices, `global_batch` rows (when the
  config fixes them) against data x fsdp and the accumulation steps, and a named attention
  kernel against the platform.

  By default the run is this job's: multi-host jobs are started first
  (`distributed.initialize`), so the device count is global, and the platform is jax's backend.
  `num_devices` and `platform` ('cpu', 'gpu', 'tpu') describe another target instead, e.g. a TPU
  topology a planner compiles for from a CPU host; with `num_devices` nothing is started.
  """
  require_keys(config, 'train', TRAIN_KEYS)
  run = RunSections.of(config)
  check_profile_steps(run.train)
  from transformer_jax.parallel import sharding  # lazy: jax (the module docstring)
  if num_devices is None:
    # lazy: jax (the module docstring)
    import jax
    from transformer_jax.parallel import distributed
    distributed.initialize(config)
    num_devices = jax.device_count()
  data, fsdp, _ = sharding.mesh_shape(run.mesh.as_dict(), num_devices)
  accumulation = run.train.accumulation_steps
  if global_batch is not None and global_batch % (data * fsdp):
    raise ConfigError(f'batch of {global_batch} rows is not divisible by the data-parallel size '
                      f'{data * fsdp} (mesh data={data} x fsdp={fsdp} over {num_devices} '
                      'devices); change data.batch_size or mesh.data/mesh.fsdp')
  if global_batch is not None and accumulation > 1 and global_batch % (data * fsdp * accumulation):
    raise ConfigError(f'batch of {global_batch} rows cannot be cut into train.accumulation_steps='
                      f'{accumulation} micro-batches over {data * fsdp} data-parallel devices; '
                      f'make data.batch_size a multiple of {data * fsdp * accumulation}')
  unavailable = attention_kernel_unavailable(config, platform)
  if unavailable:
    raise ConfigError(f"{unavailable}: use 'auto' (the best kernel per backend), 'chunked', "
                      "'xla' or 'reference'")


def check_profile_steps(train: Train):
  """train.profile_steps ('' or 'START:END', step indices) is well formed and inside the run's
  train.num_steps steps, so a profile asked for is not silently never taken."""
  from transformer_jax.training.profiling import profile_window  # lazy: the trainer (docstring)
  window = profile_window(train.profile_steps)
  if window and window[1] > train.num_steps:
    raise ConfigError(f'train.profile_steps={train.profile_steps!r} ends after the run: END must '
                      f'be <= train.num_steps={train.num_steps} (steps are numbered '
                      f'0..{train.num_steps - 1})')


def attention_kernel_unavailable(config, platform: str | None = None) -> str | None:
  """Why config.model.attention_implementation (a fused kernel) can't run on `platform`
  ('cpu', 'gpu', 'tpu'; by default jax's backend here), or None."""
  # lazy: jax (the module docstring)
  from transformer_jax.kernels.scaled_dot_product import KERNEL_BACKENDS
  model = ModelChoices.of(config)
  implementation = model.attention_implementation
  needs = KERNEL_BACKENDS.get(implementation)
  if needs is None:
    return None  # (asks for no backend, so jax's backend is not started here)
  if platform is None:
    import jax  # lazy: the module docstring
    platform = jax.default_backend()
  if platform != needs:
    return (f'model.attention_implementation={implementation!r} runs on {needs.upper()} only, '
            f'and this run is on {platform.upper()}')
  if implementation == 'cudnn' and model.dtype not in ('bfloat16', 'float16'):
    return (f"model.attention_implementation='cudnn' needs model.dtype bfloat16 or float16 "
            f"(cuDNN's fused attention has no {model.dtype})")
  return None
