"""Importers of other libraries' checkpoints into this library's parameter trees."""

from transformer_jax.convert.hf_gpt2 import (convert_gpt2_state_dict, gpt2_config_from_hf,
                                             load_hf_gpt2, read_state_dict)

from transformer_jax.convert.hf_bert import (bert_config_from_hf, convert_bert_state_dict,
                                             load_hf_bert)

__all__ = [
    'bert_config_from_hf', 'convert_bert_state_dict', 'load_hf_bert', 'convert_gpt2_state_dict',
    'gpt2_config_from_hf', 'load_hf_gpt2', 'read_state_dict'
]
