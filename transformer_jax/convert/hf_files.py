"""What every Hugging Face converter reads and refuses the same way: one model folder's files.

- `read_hf_config`: config.json as a dict, or one DataError naming the folder and what a model
  folder of that family holds.
- `read_state_dict`: name -> array from model.safetensors (one file or sharded by an index), else
  the legacy pytorch_model.bin. Safetensors are read here (a JSON header and the raw bytes,
  memory-mapped), bfloat16 included, which `safetensors.numpy` cannot give; no code runs on load.
  pytorch_model.bin goes through `torch.load(weights_only=True)`, which refuses pickled code;
  torch is needed only then.
- `config_values`: our config fields read from config.json by a family's key table, one
  ConfigError naming a missing key; `hf_activation`: an activation name read by a family's
  table of names, one ConfigError naming an unknown one.
- `refuse_switches`: one ConfigError naming the first switch of a config that a family has no
  equivalent for.
- `HFModel`: what importing a folder gives, the same for every family.
"""

import dataclasses
import json
import os
import struct
from typing import Any, Mapping

import ml_dtypes
import numpy as np
from absl import logging

from transformer_jax.errors import ConfigError, DataError
from transformer_jax.files import read_json_object
from transformer_jax.model_config import TransformerConfig


@dataclasses.dataclass(frozen=True)
class HFModel:
  """An imported Hugging Face model: its config and params, the tokenizer a family reads with
  them (None where the caller loads its own) and, for encoders, the `Bert` heads the weights hold
  ({'type_vocab_size', 'mlm', 'sentence_classes', 'num_labels'}; None for other kinds)."""
  config: TransformerConfig
  params: dict
  tokenizer: Any = None
  heads: dict | None = None


def read_hf_config(directory: str, holds: str) -> dict:
  """config.json of the model folder `directory` (`holds`: what such a folder has, for the
  error line when there is none)."""
  path = os.path.join(directory, 'config.json')
  if not os.path.exists(path):
    raise DataError(f'{path} does not exist: expected a Hugging Face model folder ({holds})')
  return read_json_object(path)


# safetensors dtype names -> numpy; bfloat16 comes from ml_dtypes.
_SAFETENSORS_DTYPES = {
    'F64': np.float64, 'F32': np.float32, 'F16': np.float16, 'I64': np.int64, 'I32': np.int32,
    'I16': np.int16, 'I8': np.int8, 'U8': np.uint8, 'BOOL': np.bool_
}


def load_safetensors(path: str) -> dict[str, np.ndarray]:
  """name -> array of one .safetensors file, bfloat16 included (read-only views of a memory map).

  The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
  data_offsets}} and the raw little-endian tensor bytes.
  """
  dtypes = dict(_SAFETENSORS_DTYPES, BF16=ml_dtypes.bfloat16)
  try:
    with open(path, 'rb') as f:
      (length,) = struct.unpack('<Q', f.read(8))
      header = json.loads(f.read(length))
    data = np.memmap(path, dtype=np.uint8, mode='r', offset=8 + length)
    state = {}
    for name, info in header.items():
      if name == '__metadata__':
        continue
      if info['dtype'] not in dtypes:
        raise DataError(f'{path}: tensor {name} has dtype {info["dtype"]}, which is not supported')
      start, end = info['data_offsets']
      state[name] = data[start:end].view(dtypes[info['dtype']]).reshape(info['shape'])
    return state
  except (OSError, ValueError, KeyError, struct.error) as e:
    raise DataError(f'{path} is not a readable safetensors file ({e})') from None


def read_state_dict(directory: str) -> dict[str, np.ndarray]:
  """name -> array from model.safetensors (single or sharded), else pytorch_model.bin."""
  single = os.path.join(directory, 'model.safetensors')
  index = os.path.join(directory, 'model.safetensors.index.json')
  legacy = os.path.join(directory, 'pytorch_model.bin')
  if os.path.exists(single):
    return load_safetensors(single)
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)['weight_map'].values()))
    state = {}
    for name in files:
      state.update(load_safetensors(os.path.join(directory, name)))
    return state
  if os.path.exists(legacy):
    logging.warning(
        '%s has no model.safetensors: reading the legacy pytorch_model.bin with '
        'torch.load(weights_only=True)', directory)
    import torch  # lazy: torch is optional (the parity extra), read only for this legacy file
    loaded = torch.load(legacy, weights_only=True, map_location='cpu')
    # numpy has no bfloat16: widen floating tensors to float32 (the params' dtype anyway).
    return {
        k: (v.detach().float() if v.is_floating_point() else v.detach()).numpy()
        for k, v in loaded.items()
    }
  raise DataError(f'{directory} holds no model.safetensors, model.safetensors.index.json or '
                  'pytorch_model.bin')


# A key table: our config field -> (config.json key, type) for a key the family needs, or
# (config.json key, type, default) for one it may leave out.
KeyTable = Mapping[str, tuple]


def config_values(hf_config: Mapping[str, Any], keys: KeyTable, family: str) -> dict:
  """{our field: value} of the config.json dict `hf_config` by the key table `keys`; one
  ConfigError naming the first key that `family` needs and the file lacks."""
  values = {}
  for field, (key, kind, *default) in keys.items():
    if key not in hf_config and not default:
      article = 'an' if family[0] in 'AEIOU' else 'a'
      raise ConfigError(f'config.json lacks {key!r}, needed for {article} {family} model')
    values[field] = kind(hf_config[key] if key in hf_config else default[0])
  return values


def hf_activation(hf_config: Mapping[str, Any], key: str, default: str,
                  activations: Mapping[str, str]) -> str:
  """Our name of config.json's activation `key` (`default` when absent) by the family's table
  {HF name: ours}; one ConfigError listing the supported names otherwise."""
  name = hf_config.get(key, default)
  if name not in activations:
    raise ConfigError(f'config.json {key}={name!r} is not supported; supported: '
                      f'{sorted(activations)}')
  return activations[name]


def refuse_switches(family: str, cfg: TransformerConfig, needed: Mapping[str, Any]) -> None:
  """One ConfigError naming the first switch of `cfg` that differs from what `family` needs."""
  for name, want in needed.items():
    have = getattr(cfg, name, want)  # a switch this version lacks has its neutral value
    ok = have in want if isinstance(want, tuple) else have == want
    if not ok:
      shown = ' or '.join(map(repr, want)) if isinstance(want, tuple) else repr(want)
      raise ConfigError(f'{family} cannot express {name}={have!r} (it needs {shown}): no Hugging '
                        f'Face {family} model computes what this one does')
