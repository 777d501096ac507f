"""A language model's generation decode step, compiled ahead of time for a TPU slice or GPU host.

    plan_decode(config, target, batch=B, slots=S) -> {bytes per device, KV cache, tokens/s}

What is compiled is one call of the decode model that generation runs once per new token
(`tasks/lm.LanguageModelTask`: `_run_decode` on `_decode_params`): tokens int32[B, 1] against
a KV cache of S slots per row, returning the logits and the updated cache (donated, so it is
written in place).

1. The task comes from the config alone (the lm workflow's `abstract_task`); the cache's shapes
   from `_empty_cache(B, S)` under `jax.eval_shape`: nothing is allocated.
2. The parameters are placed as training places them (`train_step.abstract_params`: the
   logical axis names over the mesh of `config.mesh`, on the target's compile-only devices,
   `compile.topology_devices`). The cache's rows (its first axis; scalar leaves such as a
   shared position counter are replicated) are split over the mesh's batch axes (data x fsdp)
   when B divides by their size, else every device holds the whole cache; the plan says which.
3. The step is lowered inside the mesh and compiled by XLA:TPU or XLA:GPU; XLA's memory
   analysis gives the peak bytes of a device.

The KV cache bytes per device are counted from the cache's shapes and shardings (its keys and
values: the leaves of rank >= 2; position counters are the rest) and checked against

    2 * layers * B * S * kv_heads * head_dim * bytes of model.dtype   (/ the ways rows are split)

Each decode step reads every parameter and the whole cache once, so the predicted time of a
step is a memory-bound roofline per device, and a step gives one token to each of the B rows:

    time = (parameter bytes + cache bytes) / hbm_bandwidth;   tokens/s = B / time

It leaves out compute, the collectives and the host (sampling, the loop): an upper bound on
speed. A generation never holds more than the model's context (model max_len, data.block_size
for a language model) in its cache (`inference/generation.py`), so S is at most that.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from transformer_jax.errors import ConfigError
from transformer_jax.parallel import sharding
from transformer_jax.planning import collectives
from transformer_jax.planning.compile import (DoesNotFitError, lower_and_compile, memory_figures,
                                              memory_fraction, memory_name, mesh_shape, shard_bytes,
                                              topology_devices)
from transformer_jax.planning.targets import GIB, Target
from transformer_jax.sections import RunSections
from transformer_jax.training import train_step
from transformer_jax.workflows import experiment_kinds

FORMULA = ('time = (parameter bytes + cache bytes) / hbm_bandwidth per device; '
           'tokens/s = batch / time')
KV_CACHE_FORMULA = '2 * layers * batch * slots * kv_heads * head_dim * bytes of model.dtype'
BATCH_AXES = ('data', 'fsdp')  # the mesh axes a batch's rows are split over (sharding.py)


def check_request(config, batch: int, slots: int):
  """The experiment and the sizes asked for: one ConfigError line unless a language model's."""
  experiment = experiment_kinds.of_config(config)
  if experiment.name != experiment_kinds.LM:
    raise ConfigError(
        f'--decode_batch and --decode_length plan the generation step of a '
        f"language model (config.experiment '{experiment_kinds.LM}'), but this config's "
        f"experiment is '{experiment.name}'; plan its train step without them")
  for flag, value in (('--decode_batch', batch), ('--decode_length', slots)):
    if value < 1:
      raise ConfigError(f'{flag} must be a positive number, got {value}')
  return experiment


def cache_shardings(cache, mesh):
  """(a NamedSharding per leaf of `cache`, whether its rows are split): the leaves' first axis
  (rows) over the mesh's batch axes when there are several and every such axis divides by
  their size, else replicated; scalar leaves are replicated."""
  ways = math.prod(mesh.shape[axis] for axis in BATCH_AXES)
  rows = {leaf.shape[0] for leaf in jax.tree.leaves(cache) if leaf.ndim}
  split = ways > 1 and all(r % ways == 0 for r in rows)
  row_spec = P(BATCH_AXES) if split else P()
  shardings = jax.tree.map(lambda leaf: NamedSharding(mesh, row_spec if leaf.ndim else P()), cache)
  return shardings, split


def kv_cache_bytes(cache) -> int:
  """Bytes one device holds of the keys and values of a cache of sharded ShapeDtypeStructs
  (its leaves of rank >= 2: a position counter is a scalar or one int per row)."""
  return shard_bytes([leaf for leaf in jax.tree.leaves(cache) if leaf.ndim >= 2])


def analytic_kv_cache_bytes(cfg, batch: int, slots: int) -> int:
  """Bytes of the whole KV cache of a decoder of `cfg` (keys and values of every layer)."""
  itemsize = np.dtype(cfg.dtype).itemsize
  return 2 * cfg.num_decoder_layers * batch * slots * cfg.num_kv_heads * cfg.head_dim * itemsize


def _decode_rules(rows_split: bool):
  """The logical axis rules the step is traced with.

  `LanguageModelTask.generate` traces with no rules (replicated activations) because its
  sampling batches are a prompt or two, too few rows to split. A planned decode batch is a
  serving batch whose cache, the largest array, is split by rows: the activations follow the
  rows as in training (the trainer's rules), so each device computes its own rows against its
  own part of the cache instead of gathering it. Rows that do not divide stay whole ('batch'
  unsplit), as the cache does.
  """
  if rows_split:
    return sharding.LOGICAL_AXIS_RULES
  return tuple(
      (name, None if name == 'batch' else axes) for name, axes in sharding.LOGICAL_AXIS_RULES)


def plan_decode(config, target: Target, batch: int, slots: int) -> dict:
  """Compiles the decode step of `config`'s language model for `target`; the figures of
  `format_decode_plan` as a dict.

  ConfigError for another experiment, sizes out of range or a mesh that does not match the
  target's chips; DoesNotFitError when the step does not fit in the chip's memory (after the
  figures are known: `error.plan` holds them), or before compiling when the parameters and the
  cache alone do not.
  """
  experiment = check_request(config, batch, slots)
  mesh_axes = dict(zip(sharding.MESH_AXES, mesh_shape(config, target)))
  task, _ = experiment.abstract_task(config, num_devices=target.chips)
  cfg = task.decode_model.cfg
  if slots > cfg.max_len:
    raise ConfigError(f'--decode_length={slots} is more than the model\'s context ({cfg.max_len}'
                      ' tokens, data.block_size): a generation never holds more in its cache')
  mesh = sharding.make_mesh(RunSections.of(config).mesh.as_dict(), devices=topology_devices(target))
  params = train_step.abstract_params(task, mesh)
  cache_shapes = jax.eval_shape(lambda: task._empty_cache(batch, slots))
  cache_placement, rows_split = cache_shardings(cache_shapes, mesh)
  cache = jax.tree.map(lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=p),
                       cache_shapes, cache_placement)
  row_placement = sharding.batch_sharding(mesh) if rows_split else sharding.replicated(mesh)
  tokens = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=row_placement)
  ways = math.prod(mesh_axes[axis] for axis in BATCH_AXES) if rows_split else 1

  parameter_bytes, cache_bytes = shard_bytes(params), shard_bytes(cache)
  tokens_bytes = shard_bytes(tokens)
  kv_bytes, analytic_total = kv_cache_bytes(cache), analytic_kv_cache_bytes(cfg, batch, slots)
  usable = int(target.chip.hbm_bytes * memory_fraction(target))
  advice = _fit_advice(batch, slots, mesh_axes, rows_split)
  if parameter_bytes + cache_bytes > usable:  # no need to compile to know
    raise DoesNotFitError(f'{target.name}: the parameters ({_gib(parameter_bytes)}) and KV cache '
                          f'({_gib(cache_bytes)}) alone need {_gib(parameter_bytes + cache_bytes)}'
                          f' per device but a {target.chip.name} chip has {_gib(usable)} '
                          f'{memory_name(target)}; {advice}')

  def decode_step(params, cache, tokens):
    return task._run_decode(task._decode_params(params), cache, tokens)

  step = jax.jit(decode_step, out_shardings=(None, cache_placement), donate_argnums=(1,))
  _, compiled, lower_s, compile_s = lower_and_compile(step, (params, cache, tokens), mesh, target,
                                                      lambda: advice, _decode_rules(rows_split))

  peak, xla_memory = memory_figures(compiled)
  activations = max(peak - parameter_bytes - cache_bytes - tokens_bytes, 0)
  hbm = target.chip.hbm_bytes
  step_s = (parameter_bytes + cache_bytes) / target.chip.hbm_bandwidth
  result = dict(target=target.name, platform=target.platform, chip=target.chip.name,
                device_kind=target.chip.device_kind, chips=target.chips, topology=target.topology,
                family=experiment.workflow_name, step='decode', mesh=dict(mesh.shape))
  result.update(parameters=int(sum(math.prod(x.shape) for x in jax.tree.leaves(params))),
                dtype=str(jnp.dtype(cfg.dtype)), layers=cfg.num_decoder_layers,
                kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, decode_batch=batch,
                decode_length=slots, cache_rows_split=rows_split, cache_row_ways=ways)
  result.update(parameter_bytes=parameter_bytes, cache_bytes=cache_bytes, kv_cache_bytes=kv_bytes,
                kv_cache_bytes_analytic=analytic_total // ways, kv_cache_bytes_total=analytic_total,
                kv_cache_formula=KV_CACHE_FORMULA, tokens_bytes=tokens_bytes,
                activation_bytes=activations, peak_bytes=peak)
  result.update(hbm_bytes=hbm, usable_bytes=usable, memory_fraction=usable / hbm,
                hbm_fraction=peak / hbm, fits=peak <= usable, xla_memory=xla_memory,
                collectives=collectives.summary(compiled.as_text()))
  result.update(step_time_s=step_s, tokens_per_s=batch / step_s, formula=FORMULA,
                lower_s=round(lower_s, 2), compile_s=round(compile_s, 2))
  if not result['fits']:
    error = DoesNotFitError(f'{target.name}: the decode step needs {_gib(peak)} per device but a '
                            f'{target.chip.name} chip has {_gib(usable)} {memory_name(target)} '
                            f'(parameters {_gib(parameter_bytes)}, KV cache {_gib(cache_bytes)}, '
                            f'activations and temporaries {_gib(activations)}); '
                            f'{advice}')
    error.plan = result
    raise error
  return result


def _fit_advice(batch: int, slots: int, mesh_axes: dict, rows_split: bool) -> str:
  """What to change: fewer rows or slots, the rows or the parameters over more chips."""
  rows = (f'split the cache\'s rows over more chips (mesh.data x mesh.fsdp, now '
          f'{mesh_axes["data"]} x {mesh_axes["fsdp"]})')
  if not rows_split and mesh_axes['data'] * mesh_axes['fsdp'] > 1:
    rows = (f'make --decode_batch a multiple of mesh.data x mesh.fsdp '
            f'({mesh_axes["data"]} x {mesh_axes["fsdp"]}) so that the cache\'s rows are split')
  return (f'to fit: lower --decode_batch (now {batch}) or --decode_length (now {slots}), {rows}, '
          f'or shard the parameters (mesh.fsdp or mesh.tensor, now {mesh_axes["tensor"]}) or '
          'choose a larger slice or chip')


def _gib(n: float) -> str:
  return f'{n / GIB:.2f} GiB'


def format_decode_plan(result: dict) -> str:
  """The human-readable report (the JSON line follows it)."""
  size = lambda key: f'{result[key] / GIB:10.3f} GiB  ({result[key]:,} bytes)'
  gpu = result['platform'] == 'gpu'
  memory = f'{result["hbm_bytes"] / GIB:.1f} GiB {"memory" if gpu else "HBM"}'
  if gpu:
    room = (f'{100 * result["peak_bytes"] / result["usable_bytes"]:.1f}% of jax\'s pool, '
            f'{result["usable_bytes"] / GIB:.1f} GiB ({100 * result["memory_fraction"]:.0f}% of '
            f'{memory})')
  else:
    room = f'{100 * result["hbm_fraction"]:.1f}% of {memory}'
  if result['cache_rows_split']:
    rows = f'rows split over data x fsdp, {result["cache_row_ways"]} ways'
  else:
    rows = 'replicated: the rows do not divide over data x fsdp'
    if result['mesh']['data'] * result['mesh']['fsdp'] == 1:
      rows = 'whole on every device: the mesh has no data or fsdp axis'
  moved = ', '.join(f'{kind} x{c["count"]} {c["bytes"] / 2**20:.2f} MiB'
                    for kind, c in result['collectives'].items()) or 'none'
  analytic = (f'{result["layers"]} layers x batch {result["decode_batch"]} x '
              f'{result["decode_length"]} slots x {result["kv_heads"]} kv heads x '
              f'{result["head_dim"]} x 2 (keys, values) in {result["dtype"]}')
  if result['cache_row_ways'] > 1:
    analytic += f' / {result["cache_row_ways"]}'
  check = 'equal' if result['kv_cache_bytes'] == result['kv_cache_bytes_analytic'] else 'DIFFERS'
  lines = [
      f'target      {result["target"]}: {result["chips"]} x {result["device_kind"]} '
      f'({memory} per chip), topology {result["topology"]}',
      f'decode      {result["family"]}, mesh {result["mesh"]}, tokens ({result["decode_batch"]}, '
      f'1) against a KV cache of {result["decode_length"]} slots per row ({rows})',
      f'            {result["parameters"]:,} parameters, {result["dtype"]}; lowered in '
      f'{result["lower_s"]:.1f} s, compiled in {result["compile_s"]:.1f} s',
      'per device:',
      f'  parameters                  {size("parameter_bytes")}',
      f'  KV cache                    {size("cache_bytes")}',
      f'    keys and values           {size("kv_cache_bytes")}',
      f'    analytic                  {size("kv_cache_bytes_analytic")}: {check}, {analytic}',
      f'  activations and temporaries {size("activation_bytes")}',
      f'  total (XLA peak)            {size("peak_bytes")} = {room}: '
      f'{"fits" if result["fits"] else "DOES NOT FIT"}',
      f'  collectives                 {moved}',
      f'predicted   {1e3 * result["step_time_s"]:.4g} ms per decode step (memory-bound), '
      f'{result["tokens_per_s"]:,.0f} tokens/s over the {result["decode_batch"]} rows',
      f'            {FORMULA}; compute, collectives and the host are not timed',
  ]
  return '\n'.join(lines)
