"""Converts parameters between the unrolled layout and the `scan_layers` layout.

Unrolled, a stack holds one subtree per layer ('layer_0', 'layer_1', ...); scanned, it holds one
subtree 'layers' whose leaves have a leading axis of length num_layers. Everything else (the
final norm, a relative-bias table, embeddings) is the same in both, so a checkpoint trained one
way can be run or decoded the other way.
"""

import re

import jax
import jax.numpy as jnp

_LAYER = re.compile(r'layer_(\d+)$')


def _layer_keys(tree: dict) -> list[str]:
  keys = sorted((k for k in tree if _LAYER.match(k)), key=lambda k: int(_LAYER.match(k)[1]))
  if keys and [int(_LAYER.match(k)[1]) for k in keys] != list(range(len(keys))):
    raise ValueError(f'layer subtrees are not numbered 0..{len(keys) - 1}: {keys}')
  return keys


def stack_layers(params):
  """Unrolled params -> scan_layers params (leaves of 'layer_i' stacked under 'layers').

  Stacked params come back as they are.
  """
  if not isinstance(params, dict):
    return params
  keys = _layer_keys(params)
  out = {k: stack_layers(v) for k, v in params.items() if k not in keys}
  if keys:
    out['layers'] = jax.tree.map(lambda *xs: jnp.stack(xs), *[params[k] for k in keys])
  return out


def unstack_layers(params):
  """scan_layers params -> unrolled params ('layers' split into 'layer_0', 'layer_1', ...).

  Unrolled params come back as they are.
  """
  if not isinstance(params, dict):
    return params
  out = {k: unstack_layers(v) for k, v in params.items() if k != 'layers'}
  if 'layers' in params:
    num_layers = jax.tree.leaves(params['layers'])[0].shape[0]
    for i in range(num_layers):
      out[f'layer_{i}'] = jax.tree.map(lambda x, i=i: x[i], params['layers'])
  return out


def for_layout(params, scan_layers: bool):
  """`params` (either layout) in the layout a model with `scan_layers` declares."""
  return stack_layers(params) if scan_layers else unstack_layers(params)
