"""An experiment's real train step, compiled ahead of time for a TPU slice; what it needs.

    plan(config, target) -> {bytes per device, FLOPs, collectives, predicted step time, MFU}

1. The workflow of the config (`workflows/{lm,translation,bert}.py`) builds the task and the
   shapes of one global batch from the config alone (`abstract_task`): no data, no tokenizer.
2. The mesh of `config.mesh` is made over the compile-only devices of the target's topology
   (libtpu describes them; `runtime.py`), and the trainer's own step builder
   (`training.train_step.build_train_step`: state shardings from the logical axis names, the
   jitted step with donated state) gives the step and its abstract state.
3. The step is lowered inside the mesh and its rules, as `Trainer.fit` runs it, and compiled by
   XLA:TPU. Nothing is allocated and nothing runs.
4. What the compiled program says: XLA's memory analysis (the peak bytes of a device),
   its cost analysis (FLOPs and bytes accessed per device) and its optimised HLO text (the
   collectives, `collectives.py`).

The predicted step time is a roofline per device, the slower of compute and memory traffic:

    time = max(flops / peak_flops, bytes_accessed / hbm_bandwidth)
    MFU  = model_flops / (time * peak_flops),  model_flops = 6 * N * tokens / chips

with flops and bytes_accessed XLA's counts for one device's program, the chip's nominal figures
(`targets.py`), and N the parameters in matmuls (`matmul_parameters`: embedding lookups left out,
a tied output projection counted; Kaplan et al. 2020's 6N per token, without attention's T^2
term). It leaves out the time of the collectives (listed, not timed) and of the host, so it is
an upper bound on speed: a real step is slower.
"""

import math
import re
import time

from transformer_jax.errors import ConfigError
from transformer_jax.planning import collectives, runtime
from transformer_jax.planning.targets import GIB, Target

FORMULA = ('time = max(flops / peak_flops, bytes_accessed / hbm_bandwidth) per device; '
           'MFU = model_flops / (time * peak_flops), model_flops = 6 * N * tokens / chips '
           '(N: parameters in matmuls)')
REMAT_HINT = 'nothing_saveable'


class DoesNotFitError(ConfigError):
  """The step needs more HBM per device than the target's chips have."""


def workflow_for(config):
  """The workflow module of `config`, told by the keys only its family has."""
  from transformer_jax.workflows import bert, lm, translation
  data = config.get('data', None) or {}
  if 'mode' in config:
    return bert
  if 'batch_tokens' in data:
    return translation
  if 'block_size' in data:
    return lm
  raise ConfigError('cannot tell the experiment of this config: expected config.mode (BERT), '
                    'data.batch_tokens (translation) or data.block_size (language model)')


def _batch_option(config) -> str:
  return 'data.batch_tokens' if 'batch_tokens' in config.data else 'data.batch_size'


def mesh_shape(config, target: Target) -> tuple[int, ...]:
  """config.mesh over the target's chips; one ConfigError line naming the target otherwise."""
  from transformer_jax.parallel import sharding
  try:
    return sharding.mesh_shape(dict(config.get('mesh', None) or {'data': -1}), target.chips)
  except ConfigError as error:
    raise ConfigError(f'{target.name} has {target.chips} chips: {error}') from None


def check_config(config, target: Target, global_batch: int):
  """The run's own checks (`cli/validation.check_training`: train.*, the mesh and the batch,
  the attention kernel) against the target's chips and platform, not this host's devices; no
  jax.distributed is started."""
  from transformer_jax.cli import validation
  mesh_shape(config, target)
  validation.check_training(config, global_batch, num_devices=target.chips,
                            platform=target.platform)


def topology_devices(target: Target) -> list:
  """The target's compile-only devices, described by libtpu (about 0.05 s)."""
  runtime.require()
  from jax.experimental import topologies
  devices = list(
      topologies.get_topology_desc(topology_name=target.topology, platform='tpu',
                                   **dict(target.topology_kwargs)).devices)
  if len(devices) != target.chips:
    raise ConfigError(f'libtpu describes {target.topology} as {len(devices)} devices, not the '
                      f'{target.chips} chips of {target.name}')
  return devices


def shard_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded jax.ShapeDtypeStructs (the largest shard)."""
  import jax
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += math.prod(shape) * leaf.dtype.itemsize
  return total


def matmul_parameters(params, tied_output: bool) -> int:
  """Parameters that multiply every token (6 FLOPs each per token, forward and backward):
  all but the tables only looked up (token, position and segment embeddings; a token table
  tied to the output is a matmul there, and counts)."""
  import jax
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = [str(getattr(key, 'key', key)) for key in path]
    lookup = names[-1] == 'embedding' or names[-1].endswith('_embedding')
    if lookup and not (tied_output and 'token_embed' in names):
      continue
    total += math.prod(leaf.shape)
  return total


def _compiler_out_of_memory(error: Exception, target: Target) -> str | None:
  """XLA:TPU refuses a program that cannot fit in HBM: its figures in one phrase, else None."""
  text = str(error)
  if 'RESOURCE_EXHAUSTED' not in text and 'Ran out of memory' not in text:
    return None
  size = r'([\d.]+[KMGT]?)'
  needed = re.search(rf'required for ([\w ]+?) \({size}\) exceeds available HBM \({size}\)', text)
  if needed:
    what, need, have = needed.groups()
    return (f'the TPU compiler needs {_binary(need)} per device for {what.replace("HLO ", "")} '
            f'(activations and the like) but a {target.chip.name} chip has {_binary(have)} of '
            'HBM free')
  used = re.search(rf'Used {size} of {size} hbm', text)
  if used:
    return (f'the TPU compiler needs {_binary(used.group(1))} of HBM per device but a '
            f'{target.chip.name} chip has {_binary(used.group(2))}')
  return 'the TPU compiler ran out of HBM: ' + ' '.join(text.split())[:300]


def _binary(size: str) -> str:
  """XLA's '50.57G' (binary units) as '50.57 GiB'."""
  return f'{size[:-1]} {size[-1]}iB' if size[-1:] in 'KMGT' else f'{size} bytes'


def plan(config, target: Target) -> dict:
  """Compiles `config`'s train step for `target`; the figures of `format_plan` as a dict.

  ConfigError for a config the run would refuse (and for a mesh that does not match the
  target's chips); DoesNotFitError when the program does not fit in HBM (after the figures are
  known: `error.plan` holds them), or when the TPU compiler refuses it as too big.
  """
  import jax
  from transformer_jax.parallel import sharding
  from transformer_jax.training.optimizer import make_optimizer
  from transformer_jax.training.train_step import build_train_step
  workflow = workflow_for(config)
  mesh_axes = dict(zip(sharding.MESH_AXES, mesh_shape(config, target)))  # before the task:
  # translation sizes its batch by the mesh
  task, batch_shapes = workflow.abstract_task(config, num_devices=target.chips)
  global_batch = next(iter(batch_shapes.values())).shape[0]
  check_config(config, target, global_batch)
  mesh = sharding.make_mesh(dict(config.get('mesh', None) or {'data': -1}),
                            devices=topology_devices(target))
  tx, _ = make_optimizer(config.optimizer)
  accumulation = int(config.train.get('accumulation_steps', 1))
  sharded = build_train_step(task, tx, mesh, seed=int(config.seed), accumulation_steps=accumulation)
  state_bytes = shard_bytes(sharded.abstract_state)
  if state_bytes > target.chip.hbm_bytes:  # no need to compile to know
    raise DoesNotFitError(f'{target.name}: the parameters and optimizer state alone need '
                          f'{_gib(state_bytes)} per device but a {target.chip.name} chip has '
                          f'{_gib(target.chip.hbm_bytes)} of HBM; to fit: shard them over more '
                          f'chips (mesh.fsdp, now {mesh_axes["fsdp"]}; or mesh.tensor, now '
                          f'{mesh_axes["tensor"]}) or choose a larger slice or chip')
  batch = {
      k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharded.batch_sharding)
      for k, v in batch_shapes.items()
  }
  start = time.time()
  with sharding.use_mesh(mesh):  # as Trainer.fit runs it: the logical-axis rules are active
    lowered = sharded.step.lower(sharded.abstract_state, batch)
  lower_s = time.time() - start
  start = time.time()
  try:
    compiled = lowered.compile()
  except Exception as error:  # XLA reports a program too big for HBM as a runtime error
    message = _compiler_out_of_memory(error, target)
    if message is None:
      raise
    raise DoesNotFitError(f'{target.name}: {message}; '
                          f'{_fit_advice(config, mesh_axes, activations_first=True)}') from None
  compile_s = time.time() - start
  result = analyse(compiled, sharded.abstract_state, batch, target)
  tokens = math.prod(batch_shapes['inputs'].shape)
  parameters = sum(math.prod(x.shape) for x in jax.tree.leaves(sharded.abstract_state.params))
  in_matmuls = matmul_parameters(sharded.abstract_state.params, bool(task.cfg.tie_output))
  result.update(
      predict(result['flops_per_device'], result['bytes_accessed_per_device'],
              6.0 * in_matmuls * tokens / target.chips, target))
  model = config.model
  result.update({
      'target': target.name, 'chip': target.chip.name, 'device_kind': target.chip.device_kind,
      'chips': target.chips, 'topology': target.topology,
      'family': workflow.__name__.rsplit('.', 1)
                [1], 'mesh': dict(mesh.shape
                                 ), 'parameters': int(parameters), 'tokens_per_step': int(tokens),
      'tokens_per_s': tokens / result['step_time_s'] if result['step_time_s'] else 0.0,
      'batch': {k: list(v.shape) for k, v in batch_shapes.items()
               }, 'attention_implementation': model.get('attention_implementation', 'auto'),
      'remat_policy': model.get('remat_policy', 'none'), 'dtype': str(model.get('dtype')),
      'lower_s': round(lower_s, 2), 'compile_s': round(compile_s, 2), 'formula': FORMULA
  })
  if not result['fits']:
    advice = _fit_advice(config, mesh_axes, result['activation_bytes'] > state_bytes)
    error = DoesNotFitError(f'{target.name}: the train step needs {_gib(result["peak_bytes"])} '
                            f'per device but a {target.chip.name} chip has '
                            f'{_gib(target.chip.hbm_bytes)} of HBM (parameters '
                            f'{_gib(result["parameter_bytes"])}, optimizer state '
                            f'{_gib(result["optimizer_state_bytes"])}, activations and temporaries '
                            f'{_gib(result["activation_bytes"])}); {advice}')
    error.plan = result
    raise error
  return result


def analyse(compiled, abstract_state, batch, target: Target) -> dict:
  """Bytes per device (state, batch, the rest at XLA's peak), FLOPs, collectives."""
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  text = compiled.as_text()
  parameter_bytes = shard_bytes(abstract_state.params)
  optimizer_bytes = shard_bytes((abstract_state.opt_state, abstract_state.step))
  batch_bytes = shard_bytes(batch)
  peak = int(getattr(memory, 'peak_memory_in_bytes', 0) or 0)
  if not peak:  # (older runtimes report no peak): everything live at once
    peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes -
            memory.alias_size_in_bytes + memory.temp_size_in_bytes)
  hbm = target.chip.hbm_bytes
  xla_memory = {
      'argument': memory.argument_size_in_bytes, 'output': memory.output_size_in_bytes,
      'alias': memory.alias_size_in_bytes, 'temp': memory.temp_size_in_bytes,
      'generated_code': memory.generated_code_size_in_bytes
  }
  activations = max(peak - parameter_bytes - optimizer_bytes - batch_bytes, 0)
  flops, bytes_accessed = float(cost.get('flops', 0.0)), float(cost.get('bytes accessed', 0.0))
  return {
      'parameter_bytes': parameter_bytes, 'optimizer_state_bytes': optimizer_bytes,
      'batch_bytes': batch_bytes, 'activation_bytes': activations, 'peak_bytes': peak,
      'hbm_bytes': hbm, 'hbm_fraction': peak / hbm, 'fits': peak <= hbm, 'xla_memory': xla_memory,
      'flops_per_device': flops, 'bytes_accessed_per_device': bytes_accessed,
      'collectives': collectives.summary(text),
      'mosaic_kernels': text.count('custom_call_target="tpu_custom_call"')
  }


def predict(flops: float, bytes_accessed: float, model_flops: float, target: Target) -> dict:
  """The roofline step time of one device and the MFU it implies (module docstring)."""
  chip = target.chip
  compute_s, memory_s = flops / chip.peak_flops, bytes_accessed / chip.hbm_bandwidth
  step_s = max(compute_s, memory_s)
  return dict(compute_time_s=compute_s, memory_time_s=memory_s, step_time_s=step_s,
              bound='compute' if compute_s >= memory_s else 'memory',
              model_flops_per_device=model_flops,
              mfu=model_flops / (step_s * chip.peak_flops) if step_s else 0.0)


def _gib(n: float) -> str:
  return f'{n / GIB:.2f} GiB'


def _fit_advice(config, mesh_axes: dict, activations_first: bool = False) -> str:
  """What to change: the state's sharding first, or the activations' when they dominate."""
  batch_option = _batch_option(config)
  state = (f'shard the parameters and optimizer state over more chips (mesh.fsdp, now '
           f'{mesh_axes["fsdp"]}; or mesh.tensor)')
  remat = (f'recompute activations in the backward pass (model.remat_policy={REMAT_HINT}, now '
           f'{config.model.get("remat_policy", "none")!r})')
  batch = (f'lower {batch_option} (now {config.data.get(batch_option.split(".")[1])}) or split '
           'it with train.accumulation_steps')
  options = [state, remat, batch]
  if activations_first:
    options = [remat, batch, state]
  return 'to fit: ' + ', '.join(options[:-1]) + ' or ' + options[-1]


def format_plan(result: dict) -> str:
  """The human-readable report (the JSON line follows it)."""
  gib = lambda key: f'{result[key] / GIB:10.3f} GiB'
  moved = ', '.join(f'{kind} x{c["count"]} {c["bytes"] / 2**20:.2f} MiB'
                    for kind, c in result['collectives'].items()) or 'none'
  lines = [
      f'target      {result["target"]}: {result["chips"]} x {result["device_kind"]} '
      f'({result["hbm_bytes"] / GIB:.0f} GiB HBM per chip), topology {result["topology"]}',
      f'step        {result["family"]}, mesh {result["mesh"]}, batch '
      f'{ {k: tuple(v) for k, v in result["batch"].items()} }',
      f'            {result["parameters"]:,} parameters, {result["dtype"]}, attention '
      f'{result["attention_implementation"]!r} ({result["mosaic_kernels"]} Pallas kernel calls), '
      f'remat {result["remat_policy"]!r}; lowered in '
      f'{result["lower_s"]:.1f} s, compiled in {result["compile_s"]:.1f} s',
      'per device:',
      f'  parameters                  {gib("parameter_bytes")}',
      f'  optimizer state             {gib("optimizer_state_bytes")}',
      f'  batch                       {gib("batch_bytes")}',
      f'  activations and temporaries {gib("activation_bytes")}',
      f'  total (XLA peak)            {gib("peak_bytes")}  = {100 * result["hbm_fraction"]:.1f}% '
      f'of {result["hbm_bytes"] / GIB:.0f} GiB HBM: {"fits" if result["fits"] else "DOES NOT FIT"}',
      f'  FLOPs per step              {result["flops_per_device"]:.4g} (XLA), model '
      f'{result["model_flops_per_device"]:.4g} (6 x matmul parameters x tokens / chips)',
      f'  bytes accessed per step     {result["bytes_accessed_per_device"]:.4g}',
      f'  collectives                 {moved}',
      f'predicted   {1e3 * result["step_time_s"]:.3f} ms per step ({result["bound"]}-bound: '
      f'compute {1e3 * result["compute_time_s"]:.3f} ms, memory '
      f'{1e3 * result["memory_time_s"]:.3f} ms), {result["tokens_per_s"]:,.0f} tokens/s, MFU '
      f'{100 * result["mfu"]:.1f}%',
      f'            {FORMULA}; collectives and the host are not timed',
  ]
  return '\n'.join(lines)
