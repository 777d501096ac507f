"""The three models, composed from the shared blocks."""
from transformer_jax.models.encoder_decoder import EncoderDecoder, shift_right
