"""Attention kernels (reference, chunked, XLA/cuDNN, Pallas flash), the one-token KV-cache
attention, and masks: the arithmetic below the Flax layers, with no parameters."""
