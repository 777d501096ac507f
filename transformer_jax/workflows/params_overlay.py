"""Pretrained params put into a fresh train state: where a run starts from a pretrained model.

BERT-family fine-tuning (workflows/bert_init.py's sources), continued pretraining of an imported
encoder (workflows/bert_continue.py) and a T5 run's init.* (workflows/t5_init.py) all build the
trainer's fresh state for their own model, then overlay the pretrained params on it at step 0.
"""

import flax
import jax
import numpy as np
from absl import logging

from transformer_jax.errors import ConfigError

# The `Bert` heads a pretrained model may hold that the model being trained lacks (dropped).
_HEADS = ('mlm_transform', 'mlm_norm', 'mlm_bias', 'sentence_head', 'classifier',
          'token_classifier')


def overlay_params(state, pretrained: dict):
  """`state` with its params replaced by `pretrained` wherever that names one (each leaf put
  on the device(s) of the leaf it replaces). Heads the model lacks are dropped; any other
  unknown or mis-shaped parameter is a ConfigError naming it."""
  target = flax.traverse_util.flatten_dict(state.params)
  replaced = 0
  for path, value in flax.traverse_util.flatten_dict(pretrained).items():
    name = '/'.join(path)
    if path not in target:
      if path[0] in _HEADS:
        continue
      raise ConfigError(f'pretrained parameter {name} has no place in the model')
    if tuple(np.shape(value)) != tuple(target[path].shape):
      raise ConfigError(f'pretrained parameter {name} has shape {tuple(np.shape(value))} but the '
                        f'model has {tuple(target[path].shape)}')
    target[path] = jax.device_put(np.asarray(value, target[path].dtype), target[path].sharding)
    replaced += 1
  logging.info('initialised %d of %d parameter arrays from the pretrained model', replaced,
               len(target))
  return state.replace(params=flax.traverse_util.unflatten_dict(target))


def require_same_parameters(model_params, loaded_params, source: str) -> None:
  """One ConfigError naming a parameter that the model (`model_params`: arrays or shapes) or the
  loaded params (read from `source`, e.g. "init.hf_dir DIR") lack, or whose shapes differ, so that
  none is left at its random initialisation."""
  want = flax.traverse_util.flatten_dict(model_params)
  have = flax.traverse_util.flatten_dict(loaded_params)
  for path in sorted(set(want) | set(have)):
    name = '/'.join(path)
    if path not in have:
      raise ConfigError(f'{source} has no parameter {name}, which the model needs')
    if path not in want:
      raise ConfigError(f'{source} has parameter {name}, which the model lacks')
    if tuple(np.shape(have[path])) != tuple(want[path].shape):
      raise ConfigError(f'{source} has {name} of shape {tuple(np.shape(have[path]))} but the '
                        f'model needs {tuple(want[path].shape)}')
