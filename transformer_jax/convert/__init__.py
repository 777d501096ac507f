"""Importers of other libraries' checkpoints into this library's parameter trees."""

from transformer_jax.convert.hf_gpt2 import (convert_gpt2_state_dict, gpt2_config_from_hf,
                                             load_hf_gpt2, read_state_dict)

__all__ = ['convert_gpt2_state_dict', 'gpt2_config_from_hf', 'load_hf_gpt2', 'read_state_dict']
