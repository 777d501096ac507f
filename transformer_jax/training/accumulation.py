"""Gradient accumulation: one optimizer step from k micro-batches, as if they were one batch.

The global batch is cut into k micro-batches and a `lax.scan` runs forward and backward on one
at a time, so activation memory is that of a 1/k batch while the update is the full batch's.
Micro-batch i takes rows i, i+k, i+2k, ...: a device's rows of the global batch contain its share
of every micro-batch, so the cut moves no data between devices.

Each micro-batch's mean loss and gradient are weighted by its metric 'weight' (the number of
scored tokens), so for a loss that is a mean over scored tokens (every task here) the result
equals the one-batch loss and gradient, padding included. The dropout key of micro-batch i is
fold_in(step key, i).
"""

from typing import Callable

import jax
import jax.numpy as jnp


def split_micro_batches(batch: dict, k: int) -> dict:
  """[B, ...] arrays -> [k, B/k, ...]; micro-batch i is rows i, i+k, ... of the batch."""

  def split(x):
    return x.reshape((x.shape[0] // k, k) + x.shape[1:]).swapaxes(0, 1)

  return jax.tree.map(split, batch)


def accumulated_value_and_grad(loss_fn: Callable, params, batch: dict, rng, k: int):
  """((loss, metric sums), grads) of `loss_fn(params, batch, rng, False)` over k micro-batches.

  Metrics are summed (they are sums already); loss and gradients are weight-averaged.
  """
  grad_fn = jax.value_and_grad(lambda p, b, r: loss_fn(p, b, r, False), has_aux=True)
  micro = split_micro_batches(batch, k)
  first = jax.tree.map(lambda x: x[0], micro)
  (loss_shape, metric_shapes), grad_shapes = jax.eval_shape(grad_fn, params, first, rng)
  zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)

  def body(carry, inputs):
    loss_sum, weight_sum, metric_sums, grad_sums = carry
    index, micro_batch = inputs
    (loss, metrics), grads = grad_fn(params, micro_batch, jax.random.fold_in(rng, index))
    weight = jnp.asarray(metrics.get('weight', 1.0), jnp.float32)
    carry = (loss_sum + loss.astype(jnp.float32) * weight, weight_sum + weight,
             jax.tree.map(jnp.add, metric_sums, metrics),
             jax.tree.map(lambda s, g: s + g * weight.astype(g.dtype), grad_sums, grads))
    return carry, None

  init = (jnp.zeros((), jnp.float32), jnp.zeros(
      (), jnp.float32), zeros(metric_shapes), zeros(grad_shapes))
  (loss_sum, weight_sum, metric_sums, grad_sums), _ = jax.lax.scan(body, init,
                                                                   (jnp.arange(k), micro))
  scale = jnp.where(weight_sum > 0, 1.0 / jnp.where(weight_sum > 0, weight_sum, 1.0), 0.0)
  grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grad_sums)
  return ((loss_sum * scale).astype(loss_shape.dtype), metric_sums), grads
