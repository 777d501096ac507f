"""The device mesh and the one table mapping logical axis names to mesh axes.

Every parameter and activation is annotated with logical names ('batch', 'embed', 'heads', ...).
`LOGICAL_AXIS_RULES` says which mesh axis each is split over; changing parallelism means
changing the mesh shape in the config, never the model code.
  data:   batch split across devices, params replicated (classic data parallelism)
  fsdp:   batch split too, and params/optimizer state split along 'embed' (ZeRO-3 style)
  tensor: heads, MLP and vocabulary split (Megatron-style tensor parallelism)
"""

import contextlib
import math

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from transformer_jax.errors import ConfigError

MESH_AXES = ('data', 'fsdp', 'tensor')

# A mesh axis is used at most once per array: for an activation ('batch', 'length', 'embed'),
# 'batch' takes data+fsdp first, so 'embed' stays unsplit there while weights split over fsdp.
LOGICAL_AXIS_RULES = (
    ('batch', ('data', 'fsdp')),
    ('embed', 'fsdp'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('mlp', 'tensor'),
    ('vocab', 'tensor'),
    ('length', None),
    ('kv', None),
    ('position', None),
    ('relpos_buckets', None),
    ('layers', None),  # the stacked-layer axis of scan_layers params: every device holds all
)


def mesh_shape(mesh_config: dict, num_devices: int) -> tuple[int, ...]:
  """Resolves {'data': -1, 'fsdp': 1, 'tensor': 1} against the device count (-1 = the rest)."""
  unknown = set(mesh_config) - set(MESH_AXES)
  if unknown:
    raise ConfigError(f'mesh: unknown axes {sorted(unknown)}; use {MESH_AXES}')
  sizes = {axis: int(mesh_config.get(axis, 1)) for axis in MESH_AXES}
  free = [a for a, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ConfigError(f'mesh: at most one axis may be -1, got {free}')
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if any(s == 0 or s < -1 for s in sizes.values()) or num_devices % fixed:
    raise ConfigError(f'mesh {sizes} does not fit {num_devices} devices: the product of the axis '
                      'sizes must divide the device count (use -1 for "the rest")')
  if free:
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ConfigError(f'mesh {sizes} uses {fixed} devices but {num_devices} are present; '
                      'set one axis to -1 or make the product equal the device count')
  return tuple(sizes[a] for a in MESH_AXES)


def make_mesh(mesh_config: dict | None = None, devices=None) -> Mesh:
  devices = devices if devices is not None else jax.devices()
  shape = mesh_shape(dict(mesh_config or {'data': -1}), len(devices))
  # Auto axes: XLA's partitioner propagates shardings from the arguments and the logical
  # constraints (jax.make_mesh defaults to Explicit axes since jax 0.11; Mesh to Auto).
  return Mesh(
      np.asarray(devices).reshape(shape), MESH_AXES,
      axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def data_parallel_size(mesh: Mesh) -> int:
  """How many ways the batch is split: a global batch must be a multiple of this."""
  return mesh.shape['data'] * mesh.shape['fsdp']


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches are split along their leading axis over data x fsdp."""
  return NamedSharding(mesh, P(('data', 'fsdp')))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


# The config field that sizes a logically named dimension, for the error naming it.
_SIZED_BY = {
    'embed': 'model.emb_dim',
    'heads': 'model.num_heads',
    'kv_heads': 'model.num_kv_heads',
    'mlp': 'model.mlp_dim',
    'vocab': 'the vocabulary size',
}


def check_splits(boxed_abstract_tree, mesh_sizes: dict, rules=LOGICAL_AXIS_RULES) -> None:
  """One ConfigError naming the first array of `boxed_abstract_tree` (logically named boxes) that
  `mesh_sizes` ({axis: size}) cannot split evenly, e.g. 2 key/value heads over mesh.tensor=4
  (jax's own error is an IndivisibleError traceback where the array is first placed)."""

  def check(path, box):
    if not isinstance(box, nn.LogicallyPartitioned):
      return
    shape = box.value.shape
    for size, name, axes in zip(shape, box.names, nn.logical_to_mesh_axes(box.names, rules)):
      axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
      ways = math.prod(mesh_sizes.get(axis, 1) for axis in axes)
      if size % ways:
        mesh_axes = ' x '.join(f'mesh.{axis}' for axis in axes)
        what = f'{name!r} dimension' + (f' ({_SIZED_BY[name]})' if name in _SIZED_BY else '')
        array = jax.tree_util.keystr(path, simple=True, separator='/')
        change = f' or change {_SIZED_BY[name]}' if name in _SIZED_BY else ''
        raise ConfigError(f'{mesh_axes} = {ways} cannot split {array} {list(shape)}: its {what} '
                          f'is {size}, not a multiple of {ways}; make {mesh_axes} a divisor of '
                          f'{size}{change}')

  jax.tree_util.tree_map_with_path(check, boxed_abstract_tree,
                                   is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def tree_shardings(mesh: Mesh, boxed_abstract_tree, rules=LOGICAL_AXIS_RULES):
  """NamedShardings for a pytree whose leaves are (abstract) `nn.LogicallyPartitioned` boxes.

  Leaves without logical names (step counters, optimizer counts) are replicated. An array the
  mesh cannot split evenly is one ConfigError (`check_splits`).
  """
  check_splits(boxed_abstract_tree, dict(mesh.shape), rules)
  specs = nn.get_partition_spec(boxed_abstract_tree)
  return nn.logical_to_mesh_sharding(specs, mesh, rules)


def bytes_per_device(tree) -> dict:
  """{device: bytes of `tree`'s shards it holds}: what sharding saves in memory, per device."""
  totals = {}
  for leaf in jax.tree.leaves(tree):
    for shard in getattr(leaf, 'addressable_shards', ()):
      totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
  return totals


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules=LOGICAL_AXIS_RULES):
  """Activates `mesh` and the logical-axis rules for tracing and running jitted steps.

  Inside, `nn.with_logical_constraint` on activations becomes a real sharding constraint
  (under the legacy `with mesh:` flax silently skips them).
  """
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield
