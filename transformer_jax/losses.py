"""Token-level cross-entropy with label smoothing, as sums so batches and hosts add up exactly."""

import jax
import jax.numpy as jnp


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
  if label_smoothing > 0.0:
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab - 1)
    normalizer = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20))
    smooth = confidence * nll - low * (jnp.sum(log_probs, axis=-1) + nll) - normalizer
  else:
    smooth = nll
  correct = (jnp.argmax(log_probs, axis=-1) == targets).astype(jnp.float32)
  return (jnp.sum(smooth * weights), jnp.sum(nll * weights), jnp.sum(correct * weights),
          jnp.sum(weights))
