"""Any supported Hugging Face causal LM folder -> `GPT` config and params, by its model_type.

    family, cfg, params = load_hf_causal_lm('/path/to/model')
    logits = GPT(cfg).apply({'params': params}, tokens)

config.json's model_type names the family, as transformers' AutoModelForCausalLM reads it;
convert/families.py knows which families are causal LMs and which module converts each.
"""

from transformer_jax.convert import families
from transformer_jax.model_config import TransformerConfig


def causal_lm_family(directory: str) -> str:
  """config.json's family if it is a supported causal LM, else one ConfigError naming it.

  Reads only config.json: a caller can refuse a folder before reading its weights.
  """
  return families.of_directory(directory, families.CAUSAL_LM).name


def load_hf_causal_lm(directory: str, **overrides) -> tuple[str, TransformerConfig, dict]:
  """(family, config, params) of the HF causal LM in `directory`; `overrides` go to the config.

  The family is config.json's model_type; any other than the supported ones is one ConfigError.
  """
  family = families.of_directory(directory, families.CAUSAL_LM)
  model = family.load(directory, **overrides)
  return family.name, model.config, model.params
