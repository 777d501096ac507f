"""The three models, composed from the shared blocks, and the presets of their families."""
from transformer_jax.models.bert import (ALBERT_ARCHITECTURE, BERT_ARCHITECTURE,
                                         ROBERTA_ARCHITECTURE, Bert, albert_config, bert_config,
                                         roberta_config)
from transformer_jax.models.encoder_decoder import (T5_V1_0_ARCHITECTURE, T5_V1_1_ARCHITECTURE,
                                                    EncoderDecoder, shift_right, t5_config)
from transformer_jax.models.gpt import (GPT, GPT2_ARCHITECTURE, LLAMA_ARCHITECTURE,
                                        OPT_ARCHITECTURE, gpt2_config, llama_config, opt_config)

__all__ = [
    'ALBERT_ARCHITECTURE', 'BERT_ARCHITECTURE', 'Bert', 'EncoderDecoder', 'GPT',
    'GPT2_ARCHITECTURE', 'LLAMA_ARCHITECTURE', 'OPT_ARCHITECTURE', 'ROBERTA_ARCHITECTURE',
    'T5_V1_0_ARCHITECTURE', 'T5_V1_1_ARCHITECTURE', 'albert_config', 'bert_config', 'gpt2_config',
    'llama_config', 'opt_config', 'roberta_config', 'shift_right', 't5_config'
]
