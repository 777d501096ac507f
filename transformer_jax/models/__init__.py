"""The three models, composed from the shared blocks."""
from transformer_jax.models.bert import Bert, bert_config
from transformer_jax.models.encoder_decoder import EncoderDecoder, shift_right
from transformer_jax.models.gpt import GPT, gpt2_config, llama_config

__all__ = [
    'Bert', 'EncoderDecoder', 'GPT', 'bert_config', 'gpt2_config', 'llama_config', 'shift_right'
]
