"""A linear layer that always runs as one 2-D matmul, with named logical axes.

`DenseGeneral` maps the trailing `len(in_axes)` input axes to `features` (a tuple, so one layer
can produce `(heads, head_dim)` directly, or consume it). Internally the input is flattened to
`(tokens, in)` and the kernel to `(in, out)`: on XLA:CPU a dot that contracts the batch *and*
length axes in the weight gradient gets transposing copies fused into its neighbours, which cost
a third of a small GPT step; a plain 2-D matmul does not. The reshapes are free (bitcasts).

`kernel_layout='out_in'` declares the same kernel transposed, [out..., in...] (PyTorch's
`Linear`), and contracts it as x @ W.T. Models train in 'in_out'; a decoding loop of many rows on
XLA:CPU runs faster on weights laid out 'out_in' (`inference/search.decode_kernel_layout`), and
`layers/kernel_layout.py` converts one layout's params into the other's.
"""

import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp

from jax import lax

from transformer_jax.model_config import KERNEL_LAYOUTS

default_kernel_init = nn.initializers.lecun_normal()


class DenseGeneral(nn.Module):
  """y = x @ W (+ b) over the trailing `num_in_axes` axes of x.

  Attributes:
    features: output feature shape, e.g. (mlp_dim,) or (num_heads, head_dim).
    kernel_axes: logical axis names for the kernel, input axes first then output axes (in the
      'in_out' layout; 'out_in' declares the kernel and these names output axes first).
    num_in_axes: how many trailing input axes are contracted.
    kernel_layout: 'in_out' (kernel [in..., out...]) or 'out_in' ([out..., in...]).
  """
  features: Sequence[int]
  kernel_axes: Sequence[str | None]
  num_in_axes: int = 1
  use_bias: bool = True
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  kernel_init: Callable = default_kernel_init
  # The matmul's dtype when it differs from `dtype` (the CPU precision policy, precision.py):
  # operands cast to it and the product rounded to it, as PyTorch's autocast does; the result is
  # read back in `dtype`. None: `dtype`.
  matmul_dtype: Any = None
  kernel_layout: str = 'in_out'

  @nn.compact
  def __call__(self, x):
    features = tuple(self.features)
    in_shape = x.shape[-self.num_in_axes:]
    batch_shape = x.shape[:-self.num_in_axes]
    fan_in, fan_out = math.prod(in_shape), math.prod(features)

    if self.kernel_layout not in KERNEL_LAYOUTS:
      raise ValueError(f'kernel_layout must be one of {KERNEL_LAYOUTS}, got {self.kernel_layout!r}')
    out_in = self.kernel_layout == 'out_in'

    def init_kernel(key, shape, dtype):
      # Initialise as the equivalent 2-D [in, out] matrix, so the scale depends on the true
      # fan-in/fan-out and both layouts draw the same weights from one key.
      matrix = self.kernel_init(key, (fan_in, fan_out), dtype)
      return (matrix.T if out_in else matrix).reshape(shape)

    axes, shape = tuple(self.kernel_axes), in_shape + features
    if out_in:
      axes, shape = axes[self.num_in_axes:] + axes[:self.num_in_axes], features + in_shape
    kernel = self.param('kernel', nn.with_logical_partitioning(init_kernel, axes), shape,
                        self.param_dtype)
    kernel2d = kernel.reshape((fan_out, fan_in) if out_in else (fan_in, fan_out))
    x2d = x.reshape(-1, fan_in).astype(self.dtype)
    # x [tokens, in] against the kernel's `in` axis: its first (in_out) or its last (out_in).
    contract = (((1,), (1 if out_in else 0,)), ((), ()))
    if self.matmul_dtype is None or jnp.dtype(self.matmul_dtype) == jnp.dtype(self.dtype):
      y = lax.dot_general(x2d, kernel2d.astype(self.dtype), contract)
    else:
      y = lax.dot_general(x2d.astype(self.matmul_dtype), kernel2d.astype(self.matmul_dtype),
                          contract)
      # The barrier keeps the bias add and what follows out of the dot's fusion: XLA:CPU's oneDNN
      # dot fusion, which the policy's steps use (precision.py), computes wrong gradients when it
      # fuses them (benchmarks/cpu_bf16_paths.py checks it).
      y = lax.optimization_barrier(y).astype(self.dtype)
    if self.use_bias:
      bias = self.param(
          'bias',
          nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                       tuple(self.kernel_axes[self.num_in_axes:])), features,
          self.param_dtype)
      y = y + bias.astype(self.dtype).reshape(fan_out)
    return y.reshape(batch_shape + features)
