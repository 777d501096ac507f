"""A linear layer that always runs as one 2-D matmul, with named logical axes.

`DenseGeneral` maps the trailing `len(in_axes)` input axes to `features` (a tuple, so one layer
can produce `(heads, head_dim)` directly, or consume it). Internally the input is flattened to
`(tokens, in)` and the kernel to `(in, out)`: on XLA:CPU a dot that contracts the batch *and*
length axes in the weight gradient gets transposing copies fused into its neighbours, which cost
a third of a small GPT step; a plain 2-D matmul does not. The reshapes are free (bitcasts).
"""

import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp

from jax import lax

default_kernel_init = nn.initializers.lecun_normal()


class DenseGeneral(nn.Module):
  """y = x @ W (+ b) over the trailing `num_in_axes` axes of x.

  Attributes:
    features: output feature shape, e.g. (mlp_dim,) or (num_heads, head_dim).
    kernel_axes: logical axis names for the kernel, input axes first then output axes.
    num_in_axes: how many trailing input axes are contracted.
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

  @nn.compact
  def __call__(self, x):
    features = tuple(self.features)
    in_shape = x.shape[-self.num_in_axes:]
    batch_shape = x.shape[:-self.num_in_axes]
    fan_in, fan_out = math.prod(in_shape), math.prod(features)

    def init_kernel(key, shape, dtype):
      # Initialise as the equivalent 2-D matrix so the scale depends on true fan-in/fan-out.
      return self.kernel_init(key, (fan_in, fan_out), dtype).reshape(shape)

    kernel = self.param('kernel', nn.with_logical_partitioning(init_kernel,
                                                               tuple(self.kernel_axes)),
                        in_shape + features, self.param_dtype)
    x2d = x.reshape(-1, fan_in).astype(self.dtype)
    kernel2d = kernel.reshape(fan_in, fan_out)
    if self.matmul_dtype is None or jnp.dtype(self.matmul_dtype) == jnp.dtype(self.dtype):
      y = x2d @ kernel2d.astype(self.dtype)
    else:
      y = lax.dot(x2d.astype(self.matmul_dtype), kernel2d.astype(self.matmul_dtype))
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
