"""Attention kernels (reference, chunked, XLA/cuDNN, Pallas flash), the one-token KV-cache
attention, and masks: the arithmetic below the Flax layers, with no parameters."""

from transformer_jax.kernels.cached_attention import decode_step_attention, halving_dot, halving_sum
from transformer_jax.kernels.masks import as_4d, combine_masks, make_causal_mask, make_padding_mask
from transformer_jax.kernels.scaled_dot_product import (KERNEL_BACKENDS, auto_implementation,
                                                        chunked_attention, default_chunk_size,
                                                        dot_product_attention, reference_attention)

__all__ = [
    'KERNEL_BACKENDS', 'as_4d', 'auto_implementation', 'chunked_attention', 'combine_masks',
    'decode_step_attention', 'default_chunk_size', 'dot_product_attention', 'halving_dot',
    'halving_sum', 'make_causal_mask', 'make_padding_mask', 'reference_attention'
]
