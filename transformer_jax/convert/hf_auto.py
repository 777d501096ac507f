"""Any supported Hugging Face causal LM folder -> `GPT` config and params, by its model_type.

    family, cfg, params = load_hf_causal_lm('/path/to/model')    # 'gpt2' or 'llama'
    logits = GPT(cfg).apply({'params': params}, tokens)

config.json's model_type names the family, as transformers' AutoModelForCausalLM reads it; each
family has its own converter module here (hf_gpt2.py, hf_llama.py).
"""

import json
import os

from transformer_jax.errors import ConfigError, DataError
from transformer_jax.model_config import TransformerConfig

# The model_types read here, each by its own converter module.
CAUSAL_LM_FAMILIES = ('gpt2', 'llama')


def read_model_type(directory: str) -> str:
  """config.json's model_type of an HF model folder ('' when it names none)."""
  path = os.path.join(directory, 'config.json')
  if not os.path.exists(path):
    raise DataError(f'{path} does not exist: expected a Hugging Face model folder (config.json '
                    'and model.safetensors)')
  try:
    with open(path, encoding='utf-8') as f:
      config = json.load(f)
  except (OSError, ValueError) as e:
    raise DataError(f'cannot read {path}: {e}') from None
  if not isinstance(config, dict):
    raise DataError(f'{path} is not a JSON object')
  return str(config.get('model_type') or '')


def causal_lm_family(directory: str) -> str:
  """config.json's model_type if it is a supported causal LM, else one ConfigError naming it.

  Reads only config.json: a caller can refuse a folder before reading its weights.
  """
  model_type = read_model_type(directory)
  if model_type not in CAUSAL_LM_FAMILIES:
    found = f'model_type={model_type!r}' if model_type else 'no model_type'
    raise ConfigError(f'{os.path.join(directory, "config.json")} has {found}; supported causal '
                      f'language models: {", ".join(CAUSAL_LM_FAMILIES)}')
  return model_type


def load_hf_causal_lm(directory: str, **overrides) -> tuple[str, TransformerConfig, dict]:
  """(family, config, params) of the HF causal LM in `directory`; `overrides` go to the config.

  The family is config.json's model_type; any other than the supported ones is one ConfigError.
  """
  model_type = causal_lm_family(directory)
  # Imported when used: a family's converter is only needed for its own folders.
  if model_type == 'gpt2':
    from transformer_jax.convert.hf_gpt2 import load_hf_gpt2 as load
  else:
    from transformer_jax.convert.hf_llama import load_hf_llama as load
  cfg, params = load(directory, **overrides)
  return model_type, cfg, params
