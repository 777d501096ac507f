"""Token-level cross-entropy with label smoothing, as sums so batches and hosts add up exactly."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from transformer_jax.kernels.scaled_dot_product import target_platform
from transformer_jax.layers.embedding import whole_rows


def _is_top(scores, target_score):
  """1.0 where the target's score is the row's maximum (its prediction is right), else 0.0.

  Compared against the max rather than via argmax: XLA:CPU runs argmax's (value, index)
  reduction element by element, the slowest op of a large-vocabulary loss. A tie at the top
  counts as right (argmax would pick the lower index); with float scores ties are rare.
  """
  return (target_score >= jnp.max(scores, axis=-1)).astype(jnp.float32)


def _smoothing_constants(label_smoothing: float, vocab: int):
  """(confidence, low, normalizer) of `cross_entropy_sums`; (1, 0, 0) without smoothing."""
  if label_smoothing <= 0.0:
    return 1.0, 0.0, 0.0
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab - 1)
  normalizer = -(confidence * math.log(confidence) + (vocab - 1) * low * math.log(low + 1e-20))
  return confidence, low, normalizer


def cross_entropy_sums(logits, targets, weights, label_smoothing: float = 0.0):
  """Returns (smoothed loss sum, NLL sum, correct count, weight sum) over scored tokens.

  Label smoothing (Szegedy et al. 2016) trains against (1 - eps) on the target and eps spread
  over the other tokens. The constant entropy of that distribution is subtracted, so a model
  that predicts it exactly scores 0 and the number stays comparable across eps. The plain NLL
  is what gets reported (it is what perplexity means).
  """
  vocab = logits.shape[-1]
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  weights = weights.astype(jnp.float32)
  confidence, low, normalizer = _smoothing_constants(label_smoothing, vocab)
  smooth = nll
  if label_smoothing > 0.0:
    smooth = (confidence - low) * nll - low * jnp.sum(log_probs, axis=-1) - normalizer
  correct = _is_top(log_probs, -nll)
  return (jnp.sum(smooth * weights), jnp.sum(nll * weights), jnp.sum(correct * weights),
          jnp.sum(weights))


# ---------------------------------------------------------------------------------------------
# The same sums straight from the features: logits = features @ embedding^T, never stored whole.
#
# The logits of a large vocabulary dominate a small model's step on CPU: [B*T, V] floats (131 MB
# for the Multi30k model's 4,096 tokens x 8,000 words) do not fit in any cache, so the softmax,
# the loss and their gradients each stream them through DRAM several times. Here they are made a
# slice of time steps at a time (a few MB, cache-resident), and the gradient is prepared in the
# same pass: for one row, d(loss)/d(logits) = w * (a * p - b * onehot(target) - c), with p the
# softmax and a, b, c scalars fixed by the output cotangents (below). So the forward pass keeps
# only (w p) @ E and x^T (w p), two matmuls it would have run in the backward pass anyway, and
# the backward pass is a handful of cheap [B, T, D] and [V, D] operations.

_CHUNK_BYTES = 16 << 20  # logits per slice: half a 32 MB L3 (Multi30k step ~2% faster than 8 MB)
_TABLE_BYTES = 16 << 20  # the largest [V, D] table worth slicing for (`_slicing_pays`)


def _slicing_pays(vocab: int, dim: int) -> bool:
  """Whether to slice, on the platform the step is compiled for (`target_platform`).

  CPU: only while the [V, D] table (read twice per slice, and its gradient accumulated per
  slice) stays cache-sized too. Measured on CPU, loss forward + backward: 8 MB table (Multi30k)
  sliced 141 ms vs whole 145 ms; 45 MB (BERT) 147 vs 137 ms; 147 MB (GPT-2, 4 x 1024 tokens)
  3.4 s vs 2.4 s. GPU and TPU: never. They hold whole logits easily and stream them at HBM
  speed, while every slice reads the table and adds to its gradient again: GPT-2 small's step
  compiled for 8 H100s moves 412 GB per GPU sliced against 79 GB whole (docs/scaling.md,
  "Defaults per platform")."""
  if target_platform() != 'cpu':
    return False
  return 4 * vocab * dim <= _TABLE_BYTES


def _slice_length(batch: int, length: int, vocab: int) -> int:
  """The largest divisor of `length` whose [batch, slice, vocab] float32 logits fit the budget."""
  fitting = max(1, _CHUNK_BYTES // max(1, 4 * batch * vocab))
  return max(c for c in range(1, length + 1) if length % c == 0 and c <= fitting)


def projected_cross_entropy_sums(features, embedding, targets, weights,
                                 label_smoothing: float = 0.0, bias=None):
  """`cross_entropy_sums(features @ embedding.T + bias, targets, weights, label_smoothing)`,
  computed a few time steps at a time so the [B, T, V] logits never exist whole (see above),
  when that pays (`_slicing_pays`: a cache-sized table), else from the whole logits.

  features [B, T, D] (any float dtype; logits and softmax are float32), embedding [V, D] (a
  tied embedding table, or an output kernel transposed), bias [V] or None (BERT's MLM head has
  one). Equal to the unfused computation up to float rounding, value and gradient
  (tests/test_losses.py).
  """
  batch, length, dim = features.shape
  vocab = embedding.shape[0]
  if not _slicing_pays(vocab, dim):
    logits = lax.dot_general(features.reshape(-1, dim), embedding.astype(features.dtype),
                             (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    logits = logits.reshape(batch, length, vocab)
    if bias is not None:
      logits = logits + bias.astype(jnp.float32)
    return cross_entropy_sums(logits, targets, weights, label_smoothing)
  steps = _slice_length(batch, length, vocab)
  return _projected_sums(float(label_smoothing), steps, features, embedding, bias, targets,
                         weights.astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _projected_sums(label_smoothing, steps, features, embedding, bias, targets, weights):
  return _projected_forward(label_smoothing, steps, features, embedding, bias, targets, weights)[0]


def _projected_forward(label_smoothing, steps, features, embedding, bias, targets, weights):
  """((smooth, nll, correct, weight) sums, residuals for the gradient)."""
  batch, length, dim = features.shape
  vocab = embedding.shape[0]
  count = length // steps
  confidence, low, normalizer = _smoothing_constants(label_smoothing, vocab)
  # [count, batch, steps, ...]: time slices, the batch axis (the data-parallel one) kept whole.
  by_slice = lambda a: jnp.swapaxes(a.reshape((batch, count, steps) + a.shape[2:]), 0, 1)

  def one_slice(carry, xs):
    x, target, w = xs
    x, target, w = x.reshape(-1, dim), target.reshape(-1), w.reshape(-1)
    contract = lambda a, b, axis: lax.dot_general(a, b.astype(x.dtype), ((axis, axis), (
        (), ())), preferred_element_type=jnp.float32)
    logits = contract(x, embedding, 1)  # x @ E^T
    if bias is not None:
      logits = logits + bias.astype(jnp.float32)
    top = jnp.max(logits, axis=-1)
    lse = top + jnp.log(jnp.sum(jnp.exp(logits - top[:, None]), axis=-1))
    target_logit = jnp.take_along_axis(logits, target[:, None], axis=-1)[:, 0]
    nll = lse - target_logit
    sum_log_probs = jnp.sum(logits, axis=-1) - vocab * lse
    smooth = (confidence - low) * nll - low * sum_log_probs - normalizer
    correct = (target_logit >= top).astype(jnp.float32)  # as `_is_top`
    weighted_probs32 = w[:, None] * jnp.exp(logits - lse[:, None])
    weighted_probs = weighted_probs32.astype(x.dtype)
    probs_embedding = jnp.dot(weighted_probs, embedding.astype(x.dtype),
                              preferred_element_type=jnp.float32)
    probs_features = carry[0] + contract(weighted_probs, x, 0)  # (w p)^T x
    probs_sum = carry[1]  # sum of the rows of w p: the bias gradient's share
    if bias is not None:
      probs_sum = probs_sum + jnp.sum(weighted_probs32, axis=0)
    sums = carry[2] + jnp.stack([jnp.sum(w * smooth), jnp.sum(w * nll), jnp.sum(w * correct)])
    return (probs_features, probs_sum, sums), probs_embedding

  init = (jnp.zeros((vocab, dim), jnp.float32), jnp.zeros(
      (vocab,), jnp.float32), jnp.zeros((3,), jnp.float32))
  (probs_features, probs_sum,
   sums), probs_embedding = lax.scan(one_slice, init,
                                     (by_slice(features), by_slice(targets), by_slice(weights)))
  probs_embedding = jnp.swapaxes(probs_embedding.reshape(count, batch, steps, dim), 0, 1)
  out = (sums[0], sums[1], sums[2], jnp.sum(weights))
  return out, (features, embedding, bias, targets, weights,
               probs_embedding.reshape(batch, length, dim), probs_features, probs_sum)


def _projected_bwd(label_smoothing, steps, residuals, cotangents):
  del steps
  features, embedding, bias, targets, weights, probs_embedding, probs_features, probs_sum = (
      residuals)
  g_smooth, g_nll = cotangents[0], cotangents[1]  # correct and weight counts have no gradient
  vocab, dim = embedding.shape
  confidence, low, _ = _smoothing_constants(label_smoothing, vocab)
  # d(w * (g_smooth * smooth + g_nll * nll)) / d(logits) = w * (a p - b onehot - c).
  a = g_smooth * (confidence - low + low * vocab) + g_nll
  b = g_smooth * (confidence - low) + g_nll
  c = g_smooth * low
  w = weights[..., None]
  weighted_features = (w * features.astype(jnp.float32)).reshape(-1, dim)
  embedding32 = embedding.astype(jnp.float32)
  # The row lookup and the row scatter-add on whole feature rows (`Embed.__call__` says why).
  target_rows = jnp.take(whole_rows(embedding32), targets, axis=0)
  d_features = (a * probs_embedding - b * w * target_rows - c * w * jnp.sum(embedding32, axis=0))
  target_sums = whole_rows(jnp.zeros((vocab, dim),
                                     jnp.float32)).at[targets.reshape(-1)].add(weighted_features)
  d_embedding = (a * probs_features - b * whole_rows(target_sums) -
                 c * jnp.sum(weighted_features, axis=0))
  d_bias = None
  if bias is not None:  # the same rows summed: d(loss)/d(logits) summed over positions
    d_bias = (a * probs_sum - b * jnp.zeros(
        (vocab,), jnp.float32).at[targets.reshape(-1)].add(weights.reshape(-1)) -
              c * jnp.sum(weights)).astype(bias.dtype)
  return (d_features.astype(features.dtype), d_embedding.astype(embedding.dtype), d_bias,
          np.zeros(targets.shape, jax.dtypes.float0), jnp.zeros_like(weights))


_projected_sums.defvjp(_projected_forward, _projected_bwd)
