"""Params of a model with dense kernels [in..., out...] for the same model with [out..., in...],
and back (`TransformerConfig.kernel_layout`, layers/dense.py).

Every parameter carries its logical axis names in the order its model declares them, so a
kernel of one layout becomes the other's by permuting its axes until the names come in the
other's order. Names decide, not shapes: a square kernel [768, 768] has the same shape both ways.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

PyTree = Any


def _is_box(x) -> bool:
  return isinstance(x, nn.Partitioned)


def logical_axes(model: nn.Module, *inputs) -> PyTree:
  """The 'params' of `model.init(key, *inputs)` as shapes with their logical axis names
  (`nn.Partitioned` boxes; a param declared without names is a bare shape). Nothing is run."""
  return jax.eval_shape(model.init, jax.random.key(0), *inputs)['params']


def _permuted(x: jnp.ndarray, source, target) -> jnp.ndarray:
  names_from = tuple(source.names) if _is_box(source) else None
  names_to = tuple(target.names) if _is_box(target) else None
  if names_from == names_to:
    return x
  if (names_from is None or names_to is None or len(set(names_from)) != len(names_from) or
      sorted(names_from, key=str) != sorted(names_to, key=str)):
    raise ValueError(f'cannot convert a param with axes {names_from} to axes {names_to}: '
                     'the names must be the same, unique, in another order')
  return jnp.transpose(x, [names_from.index(name) for name in names_to])


def convert(params: PyTree, source_axes: PyTree, target_axes: PyTree) -> PyTree:
  """`params` (laid out as `source_axes`, from `logical_axes`) laid out as `target_axes`: each
  leaf whose names differ is transposed so they come in the target's order. Boxed params
  (`nn.Partitioned`, as `init` returns them) come back as plain arrays."""
  params = nn.meta.unbox(params)
  boxes_from = jax.tree.structure(source_axes, is_leaf=_is_box)
  boxes_to = jax.tree.structure(target_axes, is_leaf=_is_box)
  if boxes_from != boxes_to:
    raise ValueError('source and target models have different parameter trees')
  leaves = boxes_from.flatten_up_to(params)
  return boxes_from.unflatten([
      _permuted(x, source, target)
      for x, source, target in zip(leaves, jax.tree.leaves(source_axes, is_leaf=_is_box),
                                   jax.tree.leaves(target_axes, is_leaf=_is_box))
  ])
