"""An experiment's real train step, compiled ahead of time for a TPU slice or GPU host.

    plan(config, target) -> {bytes per device, FLOPs, collectives, predicted step time, MFU}

1. The experiment of the config (`workflows/experiment_kinds.py`: a language model, translation or a
   BERT-family encoder) builds the task and the shapes of one global batch from the config alone
   (its workflow's `abstract_task`): no data, no tokenizer.
2. The mesh of `config.mesh` is made over the compile-only devices of the target's topology
   (libtpu, or jax's CUDA plugin given the chip's `target_config`, describes them; `runtime.py`),
   and the trainer's own step builder
   (`training.train_step.build_train_step`: state shardings from the logical axis names, the
   jitted step with donated state) gives the step and its abstract state.
3. The step is lowered inside the mesh and its rules, as `Trainer.fit` runs it, and compiled by
   XLA:TPU or XLA:GPU. Nothing is allocated and nothing runs.
4. What the compiled program says: XLA's memory analysis (the peak bytes of a device),
   its cost analysis (FLOPs and bytes accessed per device) and its optimised HLO text (the
   collectives, `collectives.py`).

The predicted step time is a roofline per device, the slower of compute and memory traffic:

    time = max(flops / peak_flops, bytes_accessed / hbm_bandwidth)
    MFU  = model_flops / (time * peak_flops)

with flops and bytes_accessed XLA's counts for one device's program, the chip's nominal figures
(`chips.py`), and model_flops the task's own count divided by the chips (`Task.model_flops`,
`flops.py`: 6 per matmul parameter per token, attention's two products, causal attention at
half: the training log's MFU uses the same). XLA:GPU gives no cost analysis for a device it
cannot see: there flops are XLA's count for the program before optimisation (`program_cost`)
and bytes_accessed the operands and results of the optimised program's kernels (`traffic.py`),
and the plan says so. The prediction leaves out
the time of the collectives (listed, not timed) and of the host, so it is an upper bound on
speed: a real step is slower.

On a GPU, jax's memory pool is a fraction of the device's memory (XLA_PYTHON_CLIENT_MEM_FRACTION,
0.75 unless set), and a step fits when its peak fits in the pool.
"""

import copy
import math
import os
import re
import time
from collections.abc import Callable

import jax
from flax import linen as nn
from jax._src.lib import xla_client
from jax.experimental import topologies

from transformer_jax import flops
from transformer_jax.cli import validation
from transformer_jax.errors import ConfigError
from transformer_jax.parallel import sharding
from transformer_jax.planning import collectives, runtime, traffic
from transformer_jax.planning.targets import GIB, Target
from transformer_jax.sections import Mesh, ModelChoices, RunSections, section_of
from transformer_jax.training.optimizer import make_optimizer
from transformer_jax.training.train_step import build_train_step
from transformer_jax.workflows import experiment_kinds

FORMULA = ('time = max(flops / peak_flops, bytes_accessed / hbm_bandwidth) per device; '
           'MFU = model_flops / (time * peak_flops)')
REMAT_HINT = 'nothing_saveable'
GPU_MEMORY_FRACTION = 0.75  # jax's GPU memory pool unless XLA_PYTHON_CLIENT_MEM_FRACTION is set


class DoesNotFitError(ConfigError):
  """The step needs more HBM per device than the target's chips have."""


def mesh_shape(config, target: Target) -> tuple[int, ...]:
  """config.mesh over the target's chips; one ConfigError line naming the target otherwise."""
  try:
    return sharding.mesh_shape(section_of(config, 'mesh', Mesh).as_dict(), target.chips)
  except ConfigError as error:
    raise ConfigError(f'{target.name} has {target.chips} chips: {error}') from None


def check_config(config, target: Target, global_batch: int):
  """The run's own checks (`cli/validation.check_training`: train.*, the mesh and the batch,
  the attention kernel) against the target's chips and platform, not this host's devices; no
  jax.distributed is started."""
  mesh_shape(config, target)
  validation.check_training(config, global_batch, num_devices=target.chips,
                            platform=target.platform)


def topology_devices(target: Target) -> list:
  """The target's compile-only devices, described by libtpu or jax's CUDA plugin (a fraction
  of a second)."""
  runtime.require(target.platform)
  if target.platform == 'gpu':
    description = topologies.get_topology_desc(platform='cuda', topology=target.topology,
                                               target_config=target.chip.target_config())
  else:
    description = topologies.get_topology_desc(topology_name=target.topology, platform='tpu',
                                               **dict(target.topology_kwargs))
  devices = list(description.devices)
  if len(devices) != target.chips:
    raise ConfigError(f'the compiler describes {target.topology} as {len(devices)} devices, not '
                      f'the {target.chips} chips of {target.name}')
  return devices


def memory_fraction(target: Target) -> float:
  """The fraction of a chip's memory a run may use: jax's GPU memory pool, all of a TPU's HBM."""
  if target.platform != 'gpu':
    return 1.0
  value = os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', '')
  try:
    fraction = float(value) if value else GPU_MEMORY_FRACTION
  except ValueError:
    raise ConfigError(f'XLA_PYTHON_CLIENT_MEM_FRACTION={value!r} is not a number') from None
  if not 0.0 < fraction <= 1.0:
    raise ConfigError(f'XLA_PYTHON_CLIENT_MEM_FRACTION={value} must be in (0, 1]')
  return fraction


def shard_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded jax.ShapeDtypeStructs (the largest shard)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += math.prod(shape) * leaf.dtype.itemsize
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
  target's chips); DoesNotFitError when the program does not fit in the chip's memory (after the
  figures are known: `error.plan` holds them), or when the TPU compiler refuses it as too big.
  """
  experiment = experiment_kinds.of_config(config)
  mesh_axes = dict(zip(sharding.MESH_AXES, mesh_shape(config, target)))  # before the task:
  # translation sizes its batch by the mesh
  usable = int(target.chip.hbm_bytes * memory_fraction(target))
  task, batch_shapes = experiment.abstract_task(config, num_devices=target.chips)
  global_batch = next(iter(batch_shapes.values())).shape[0]
  check_config(config, target, global_batch)
  run = RunSections.of(config)
  mesh = sharding.make_mesh(run.mesh.as_dict(), devices=topology_devices(target))
  tx, _ = make_optimizer(run.optimizer)
  accumulation = run.train.accumulation_steps
  sharded = build_train_step(task, tx, mesh, seed=run.seed, accumulation_steps=accumulation)
  state_bytes = shard_bytes(sharded.abstract_state)
  if state_bytes > usable:  # no need to compile to know
    raise DoesNotFitError(f'{target.name}: the parameters and optimizer state alone need '
                          f'{_gib(state_bytes)} per device but a {target.chip.name} chip has '
                          f'{_gib(usable)} {memory_name(target)}; to fit: shard them over more '
                          f'chips (mesh.fsdp, now {mesh_axes["fsdp"]}; or mesh.tensor, now '
                          f'{mesh_axes["tensor"]}) or choose a larger slice or chip')
  batch = {
      k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharded.batch_sharding)
      for k, v in batch_shapes.items()
  }
  model = ModelChoices.of(config)
  attention = model.attention_implementation
  fit_advice = lambda activations_first: _fit_advice(experiment, config, model, mesh_axes,
                                                     activations_first, target)
  attention_note = ''
  try:
    lowered, compiled, lower_s, compile_s = _compile(sharded, batch, mesh, fit_advice, target)
  except Exception as error:  # cuDNN's fused attention needs a GPU to compile (runtime.py)
    if target.platform != 'gpu' or 'cuDNN' not in str(error) or attention not in ('auto', 'cudnn'):
      raise
    reason = ' '.join(str(error).split()).split(';')[0][:160]
    attention_note = (f'cuDNN attention cannot be compiled without a GPU ({reason}): planned '
                      "with XLA's attention ('xla'), whose memory and FLOPs it approximates")
    config = copy.deepcopy(config)
    config.model.attention_implementation = 'xla'
    task, _ = experiment.abstract_task(config, num_devices=target.chips)
    sharded = build_train_step(task, tx, mesh, seed=run.seed, accumulation_steps=accumulation)
    lowered, compiled, lower_s, compile_s = _compile(sharded, batch, mesh, fit_advice, target)
  tokens = math.prod(batch_shapes['inputs'].shape)
  params = sharded.abstract_state.params
  parameters = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  model_flops = task.model_flops(nn.meta.unbox(params), batch_shapes) / target.chips
  result = analyse(compiled, sharded.abstract_state, batch, target, model_flops,
                   lambda: program_cost(lowered, target.chips))
  result.update(
      predict(result['flops_per_device'], result['bytes_accessed_per_device'], model_flops, target))
  compiled_model = ModelChoices.of(config)
  result.update(target=target.name, platform=target.platform, chip=target.chip.name,
                device_kind=target.chip.device_kind, chips=target.chips, topology=target.topology)
  result.update(family=experiment.workflow_name, mesh=dict(mesh.shape), parameters=int(parameters),
                tokens_per_step=int(tokens))
  step_s = result['step_time_s']
  result.update(tokens_per_s=tokens / step_s if step_s else 0.0,
                batch={k: list(v.shape) for k, v in batch_shapes.items()})
  result.update(attention_implementation=attention, attention_note=attention_note,
                attention_compiled=compiled_model.attention_implementation)
  result.update(remat_policy=model.remat_policy, dtype=model.dtype, lower_s=round(lower_s, 2),
                compile_s=round(compile_s, 2), formula=FORMULA, model_flops_formula=flops.FORMULA)
  if not result['fits']:
    advice = fit_advice(result['activation_bytes'] > state_bytes)
    error = DoesNotFitError(f'{target.name}: the train step needs {_gib(result["peak_bytes"])} '
                            f'per device but a {target.chip.name} chip has {_gib(usable)} '
                            f'{memory_name(target)} (parameters {_gib(result["parameter_bytes"])}'
                            f', optimizer state {_gib(result["optimizer_state_bytes"])}, '
                            f'activations and temporaries {_gib(result["activation_bytes"])}); '
                            f'{advice}')
    error.plan = result
    raise error
  return result


def memory_name(target: Target) -> str:
  """How the usable memory of a chip is named in an error line."""
  if target.platform == 'gpu':
    return (f'in jax\'s memory pool ({100 * memory_fraction(target):.0f}% of '
            f'{_gib(target.chip.hbm_bytes)}, XLA_PYTHON_CLIENT_MEM_FRACTION)')
  return 'of HBM'


def _compile(sharded, batch, mesh, fit_advice, target):
  """`lower_and_compile` of the train step, as `Trainer.fit` runs it (the trainer's logical-axis
  rules active); a refusal advises `fit_advice(activations_first=True)`."""
  return lower_and_compile(sharded.step, (sharded.abstract_state, batch), mesh, target,
                           lambda: fit_advice(True))


def lower_and_compile(step, args: tuple, mesh, target: Target, advice: Callable[[], str],
                      rules=None):
  """(lowered step, compiled step, lower seconds, compile seconds) of the jitted `step` on the
  abstract `args`, lowered inside `mesh` and the logical-axis `rules` (the trainer's unless
  given); a TPU compiler's out-of-memory refusal as DoesNotFitError ending with `advice()`."""
  start = time.time()
  with sharding.use_mesh(mesh, rules or sharding.LOGICAL_AXIS_RULES):
    lowered = step.lower(*args)
  lower_s = time.time() - start
  start = time.time()
  try:
    compiled = lowered.compile()
  except Exception as error:  # XLA reports a program too big for HBM as a runtime error
    message = _compiler_out_of_memory(error, target)
    if message is None:
      raise
    raise DoesNotFitError(f'{target.name}: {message}; {advice()}') from None
  return lowered, compiled, lower_s, time.time() - start


def program_cost(lowered, chips: int) -> dict:
  """XLA's cost analysis of the lowered program (the whole step before partitioning and the
  target's optimisations), run by this host's CPU client, per chip: {'flops', 'bytes
  accessed'}. For a target whose compiler gives none. The FLOPs are what the program computes
  (masked attention blocks, recomputation and the optimizer included): 4% under XLA:TPU's count
  per device for the tiny GPT of the tests. (Its bytes are counted before fusion: many times the
  real traffic, so `traffic.py` counts those.) XLA counts a loop body once, whatever its trip
  count, so a program with loops (scanned layers, the sliced loss) raises LookupError: the
  model's count is then nearer."""
  module = lowered.compiler_ir('hlo').get_hlo_module()
  if re.search(r'\bwhile\(', module.to_string()):
    raise LookupError('the program has loops, whose bodies XLA counts once')
  cost = xla_client._xla.hlo_module_cost_analysis(jax.devices('cpu')[0].client, module)
  return {key: float(cost[key]) / chips for key in ('flops', 'bytes accessed')}


def analyse(compiled, abstract_state, batch, target: Target, model_flops: float,
            program=None) -> dict:
  """Bytes per device (state, batch, the rest at XLA's peak), FLOPs, collectives. Where the
  compiled program has no cost analysis (XLA:GPU without a device): the FLOPs of `program()` (the
  lowered program's, `program_cost`; else the model's) and the bytes its kernels read and write
  (`traffic.py`); `flops_source` and `bytes_accessed_source` say which."""
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  text = compiled.as_text()
  parameter_bytes = shard_bytes(abstract_state.params)
  optimizer_bytes = shard_bytes((abstract_state.opt_state, abstract_state.step))
  batch_bytes = shard_bytes(batch)
  peak, xla_memory = memory_figures(compiled)
  hbm, usable = target.chip.hbm_bytes, int(target.chip.hbm_bytes * memory_fraction(target))
  activations = max(peak - parameter_bytes - optimizer_bytes - batch_bytes, 0)
  flops_source = bytes_source = 'XLA cost analysis'
  if 'flops' in cost:
    flops_count, bytes_accessed = float(cost['flops']), float(cost['bytes accessed'])
  else:  # XLA:GPU without a device
    try:
      if program is None:
        raise LookupError('no lowered program')
      flops_count = program()['flops']
      flops_source = 'XLA cost analysis of the program before optimisation, / chips'
    except Exception as error:  # loops, or a private jaxlib function another jax lacks
      why = str(error) if type(error) is LookupError else 'XLA gives no cost analysis here'
      flops_count, flops_source = model_flops, f'model formula ({why})'
    bytes_accessed = traffic.bytes_accessed(text)
    bytes_source = 'operands and results of each kernel of the optimised program (traffic.py)'
  fits = peak <= usable
  result = dict(parameter_bytes=parameter_bytes, optimizer_state_bytes=optimizer_bytes,
                batch_bytes=batch_bytes, activation_bytes=activations, peak_bytes=peak)
  result.update(hbm_bytes=hbm, usable_bytes=usable, memory_fraction=usable / hbm,
                hbm_fraction=peak / hbm, fits=fits, xla_memory=xla_memory)
  result.update(flops_per_device=flops_count, flops_source=flops_source,
                bytes_accessed_per_device=bytes_accessed, bytes_accessed_source=bytes_source)
  result.update(collectives=collectives.summary(text),
                mosaic_kernels=text.count('custom_call_target="tpu_custom_call"'),
                cudnn_calls=len(re.findall(r'custom_call_target="__cudnn', text)))
  return result


def memory_figures(compiled) -> tuple[int, dict]:
  """(XLA's peak bytes of one device, its memory analysis as a dict) of a compiled program."""
  memory = compiled.memory_analysis()
  peak = int(getattr(memory, 'peak_memory_in_bytes', 0) or 0)
  if not peak:  # (older runtimes and XLA:GPU report no peak): everything live at once
    peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes -
            memory.alias_size_in_bytes + memory.temp_size_in_bytes)
  return peak, {
      'argument': memory.argument_size_in_bytes, 'output': memory.output_size_in_bytes,
      'alias': memory.alias_size_in_bytes, 'temp': memory.temp_size_in_bytes,
      'generated_code': memory.generated_code_size_in_bytes
  }


def predict(flops_count: float, bytes_accessed: float, model_flops: float, target: Target) -> dict:
  """The roofline step time of one device and the MFU it implies (module docstring)."""
  chip = target.chip
  compute_s, memory_s = flops_count / chip.peak_flops, bytes_accessed / chip.hbm_bandwidth
  step_s = max(compute_s, memory_s)
  return dict(compute_time_s=compute_s, memory_time_s=memory_s, step_time_s=step_s,
              bound='compute' if compute_s >= memory_s else 'memory',
              model_flops_per_device=model_flops,
              mfu=model_flops / (step_s * chip.peak_flops) if step_s else 0.0)


def _gib(n: float) -> str:
  return f'{n / GIB:.2f} GiB'


def _fit_advice(experiment, config, model: ModelChoices, mesh_axes: dict,
                activations_first: bool = False, target: Target | None = None) -> str:
  """What to change: the state's sharding first, or the activations' when they dominate; on a
  GPU, a larger memory pool too. `experiment`: the config's (workflows/experiment_kinds.py), whose
  batch option is named."""
  batch_option = experiment.batch_option
  state = (f'shard the parameters and optimizer state over more chips (mesh.fsdp, now '
           f'{mesh_axes["fsdp"]}; or mesh.tensor)')
  remat = (f'recompute activations in the backward pass (model.remat_policy={REMAT_HINT}, now '
           f'{model.remat_policy!r})')
  batch = (f'lower {batch_option} (now {experiment.batch_setting(config)}) or split '
           'it with train.accumulation_steps')
  options = [state, remat, batch]
  if activations_first:
    options = [remat, batch, state]
  if target is not None and target.platform == 'gpu' and memory_fraction(target) < 0.95:
    options.append('let jax use more of the GPU (XLA_PYTHON_CLIENT_MEM_FRACTION=0.95, now '
                   f'{memory_fraction(target):.2f})')
  return 'to fit: ' + ', '.join(options[:-1]) + ' or ' + options[-1]


def format_plan(result: dict) -> str:
  """The human-readable report (the JSON line follows it)."""
  gib = lambda key: f'{result[key] / GIB:10.3f} GiB'
  moved = ', '.join(f'{kind} x{c["count"]} {c["bytes"] / 2**20:.2f} MiB'
                    for kind, c in result['collectives'].items()) or 'none'
  gpu = result.get('platform') == 'gpu'
  memory = f'{result["hbm_bytes"] / GIB:.1f} GiB {"memory" if gpu else "HBM"}'
  if gpu:
    kernels = f'{result["cudnn_calls"]} cuDNN calls'
    room = (f'{100 * result["peak_bytes"] / result["usable_bytes"]:.1f}% of jax\'s pool, '
            f'{result["usable_bytes"] / GIB:.1f} GiB ({100 * result["memory_fraction"]:.0f}% of '
            f'{memory})')
  else:
    kernels = f'{result["mosaic_kernels"]} Pallas kernel calls'
    room = f'{100 * result["hbm_fraction"]:.1f}% of {memory}'
  attention = repr(result['attention_implementation'])
  if result['attention_compiled'] != result['attention_implementation']:
    attention += f' compiled as {result["attention_compiled"]!r}'
  lines = [
      f'target      {result["target"]}: {result["chips"]} x {result["device_kind"]} '
      f'({memory} per chip), topology {result["topology"]}',
      f'step        {result["family"]}, mesh {result["mesh"]}, batch '
      f'{ {k: tuple(v) for k, v in result["batch"].items()} }',
      f'            {result["parameters"]:,} parameters, {result["dtype"]}, attention '
      f'{attention} ({kernels}), remat {result["remat_policy"]!r}; lowered in '
      f'{result["lower_s"]:.1f} s, compiled in {result["compile_s"]:.1f} s',
  ]
  if result['attention_note']:
    lines.append(f'note        {result["attention_note"]}')
  lines += [
      'per device:',
      f'  parameters                  {gib("parameter_bytes")}',
      f'  optimizer state             {gib("optimizer_state_bytes")}',
      f'  batch                       {gib("batch_bytes")}',
      f'  activations and temporaries {gib("activation_bytes")}',
      f'  total (XLA peak)            {gib("peak_bytes")}  = {room}: '
      f'{"fits" if result["fits"] else "DOES NOT FIT"}',
      f'  FLOPs per step              {result["flops_per_device"]:.4g} '
      f'({result["flops_source"]}), model {result["model_flops_per_device"]:.4g} '
      f'({result["model_flops_formula"]}, / chips)',
      f'  bytes accessed per step     {result["bytes_accessed_per_device"]:.4g} '
      f'({result["bytes_accessed_source"]})',
      f'  collectives                 {moved}',
      f'predicted   {1e3 * result["step_time_s"]:.3f} ms per step ({result["bound"]}-bound: '
      f'compute {1e3 * result["compute_time_s"]:.3f} ms, memory '
      f'{1e3 * result["memory_time_s"]:.3f} ms), {result["tokens_per_s"]:,.0f} tokens/s, MFU '
      f'{100 * result["mfu"]:.1f}%',
      f'            {FORMULA}; collectives and the host are not timed',
  ]
  return '\n'.join(lines)
