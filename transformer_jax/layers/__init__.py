"""The Flax modules every model is built from: dense projections, embeddings, norms,
feed-forward variants, positions, multi-head attention, the residual block and stack, and the
output projection's loss."""

from transformer_jax.layers.attention import MultiHeadAttention
from transformer_jax.layers.blocks import InputEmbedding, TransformerBlock, TransformerStack
from transformer_jax.layers.feedforward import FeedForward
from transformer_jax.layers.normalization import make_norm

__all__ = [
    'FeedForward', 'InputEmbedding', 'MultiHeadAttention', 'TransformerBlock', 'TransformerStack',
    'make_norm'
]
