"""Converters between Hugging Face checkpoints and this library's configs and parameter trees.

    model = families.of_directory(d).load(d)     # HFModel: config, params (tokenizer, heads)

Per family (convert/families.py lists them, with the module of each) an importer (Hugging
Face -> ours: `*_config_from_hf`, `convert_*_state_dict` and `load(directory) -> HFModel`, the
one return type of every family) and an exporter (ours -> Hugging Face: `*_config_to_hf`,
`export_*_state_dict`), and `write_hf_directory`, which writes an exported model as a directory
transformers loads. Exporting a trained workdir reads the workflows' configs and tokenizers, so
it lives above them: workflows/export.export_workdir.
"""

from transformer_jax.convert.hf_files import HFModel, read_state_dict

from transformer_jax.convert.hf_gpt2 import (convert_gpt2_state_dict, export_gpt2_state_dict,
                                             gpt2_config_from_hf, gpt2_config_to_hf)

from transformer_jax.convert.hf_bert import (bert_config_from_hf, bert_config_to_hf, bert_heads,
                                             convert_bert_state_dict, export_bert_state_dict)

from transformer_jax.convert.hf_llama import (convert_llama_state_dict, export_llama_state_dict,
                                              llama_config_from_hf, llama_config_to_hf)

from transformer_jax.convert.hf_t5 import (convert_t5_state_dict, export_t5_state_dict,
                                           t5_config_from_hf, t5_config_to_hf)

from transformer_jax.convert.hf_albert import (albert_config_from_hf, albert_config_to_hf,
                                               convert_albert_state_dict, export_albert_state_dict)

from transformer_jax.convert.hf_roberta import (convert_roberta_state_dict,
                                                export_roberta_state_dict, roberta_config_from_hf,
                                                roberta_config_to_hf)

from transformer_jax.convert.export import write_hf_directory

__all__ = [
    'HFModel', 'albert_config_from_hf', 'albert_config_to_hf', 'bert_config_from_hf',
    'bert_config_to_hf', 'bert_heads', 'convert_albert_state_dict', 'convert_bert_state_dict',
    'convert_gpt2_state_dict', 'convert_llama_state_dict', 'convert_roberta_state_dict',
    'convert_t5_state_dict', 'export_albert_state_dict', 'export_bert_state_dict',
    'export_gpt2_state_dict', 'export_llama_state_dict', 'export_roberta_state_dict',
    'export_t5_state_dict', 'gpt2_config_from_hf', 'gpt2_config_to_hf', 'llama_config_from_hf',
    'llama_config_to_hf', 'read_state_dict', 'roberta_config_from_hf', 'roberta_config_to_hf',
    't5_config_from_hf', 't5_config_to_hf', 'write_hf_directory'
]
