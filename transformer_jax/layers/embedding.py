"""Token embedding, usable in reverse (`attend`) as a tied output projection."""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from jax import lax


def whole_rows(table: jnp.ndarray) -> jnp.ndarray:
  """A [vocab, features] table constrained to whole feature rows (only 'vocab' may stay split),
  for row lookups and row scatter-adds (`Embed.__call__` says why)."""
  return nn.with_logical_constraint(table, ('vocab', None))


class Embed(nn.Module):
  """A (vocab, embed) table: `__call__` looks tokens up, `attend` scores vectors against it."""
  num_embeddings: int
  features: int
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  # std 1/sqrt(d): with the sqrt(d) input scaling of the original Transformer the embedded
  # tokens have unit scale, and the tied output logits start near unit scale too.
  stddev: float | None = None

  def setup(self):
    stddev = self.stddev if self.stddev is not None else self.features**-0.5
    self.embedding = self.param(
        'embedding',
        nn.with_logical_partitioning(nn.initializers.normal(stddev=stddev), ('vocab', 'embed')),
        (self.num_embeddings, self.features), self.param_dtype)

  def __call__(self, tokens: jnp.ndarray) -> jnp.ndarray:
    # A gather, not a one-hot matmul: cheaper on CPU/GPU. The table's 'embed' axis is gathered
    # first (as FSDP does for every weight): a lookup from a table split over 'fsdp' comes out
    # split on its features, and XLA cannot move that split to the batch axis of the
    # activations without replicating the whole result (its 'involuntary full
    # rematerialization' warning on data x fsdp x tensor meshes).
    return jnp.take(whole_rows(self.embedding), tokens, axis=0).astype(self.dtype)

  def attend(self, x: jnp.ndarray) -> jnp.ndarray:
    """Logits x @ E^T over the vocabulary, as one 2-D matmul.

    Written as a contraction over both operands' feature axes, not as a matmul with E.T: with one
    row per step (decoding), XLA:CPU copied the transposed table (154 MB for GPT-2) at every
    step, which made the projection 4x slower than reading E in place.
    """
    flat = x.reshape(-1, x.shape[-1]).astype(self.dtype)
    logits = lax.dot_general(flat, self.embedding.astype(self.dtype), (((1,), (1,)), ((), ())))
    return logits.reshape(x.shape[:-1] + (self.num_embeddings,))
