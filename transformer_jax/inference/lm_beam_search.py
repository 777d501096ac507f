"""Beam search for a causal language model, with the rules of Hugging Face transformers' `generate`.

`generate(input_ids, num_beams=k, do_sample=False, length_penalty=a, early_stopping=e)` in
transformers picks its hypotheses this way, and `transformers_beam_search` here picks the same
ones (`search.beam_search` is the other one: the GNMT length penalty, for translation):

- Every step ranks all one-token extensions of the k alive hypotheses by summed log-prob and
  keeps the 2k best candidates (so k of them are left to go on even if k end in EOS).
- A candidate ending in EOS joins the finished set only if it ranks among the first k of the
  2k; its score is sum_logprobs / length**a, where length counts the generated tokens, EOS
  included (not the prompt). Finished sets hold the k best scores. The k best candidates that
  do not end in EOS stay alive. At the last step (max_new_tokens generated) every candidate of
  the first k is finished, ending in EOS or not, so each row returns k hypotheses.
- A row stops changing once its finished set is full and the best alive hypothesis, at its
  current length, scores no better than the worst finished one (early_stopping False). With
  early_stopping True a full set is enough. With 'never' and a > 0 the alive hypothesis is
  scored at length max_new_tokens instead (the best a longer hypothesis could reach).

transformers' own `generate` with num_beams=1 is greedy search; this search with one beam is the
same (the alive hypothesis can never beat the EOS one it ranked below at the same length), except
with early_stopping 'never' and a > 0, which keeps searching for a longer, better-scored one.

The model is seen through `search.TokensToLogits`; the loop is a `lax.while_loop` over
fixed-size buffers, so shapes depend only on the batch, num_beams and max_new_tokens.
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from transformer_jax.errors import ConfigError
from transformer_jax.inference.search import (PyTree, TokensToLogits, expand_to_beams,
                                              flatten_beams, gather_beams, unflatten_beams)
from transformer_jax.special_tokens import PAD_ID

EarlyStopping = bool | Literal['never']


def transformers_beam_search(tokens_to_logits: TokensToLogits, cache: PyTree, *,
                             first_tokens: jnp.ndarray, num_beams: int, max_new_tokens: int,
                             length_penalty: float | jnp.ndarray = 1.0,
                             early_stopping: EarlyStopping = False,
                             eos_id: int | None = None) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Continues each row; returns (sequences int32[B, num_beams, max_new_tokens], scores
  float32[B, num_beams]), best first.

  `first_tokens` int32[B] is fed first: each row's last prompt token, the rest of the prompt
  being already in `cache` (rows first; expanded here to B*num_beams rows). Scores are the
  length-penalised ones above; a hypothesis is PAD after its EOS. Without `eos_id` every
  hypothesis runs the full max_new_tokens. `length_penalty` may be a traced value.
  """
  if early_stopping not in (False, True, 'never'):
    raise ConfigError(f"early_stopping must be False, True or 'never', got {early_stopping!r}")
  first_tokens = jnp.asarray(first_tokens, jnp.int32)
  batch_size, candidates = first_tokens.shape[0], 2 * num_beams
  neg_inf = jnp.array(-jnp.inf, jnp.float32)
  length_penalty = jnp.asarray(length_penalty, jnp.float32)

  def penalised(log_probs, length):
    return log_probs / jnp.asarray(length, jnp.float32)**length_penalty

  # Column 0 holds the first token, so step i reads its input from column i.
  alive_seqs = jnp.full((batch_size, num_beams, max_new_tokens + 1), PAD_ID, jnp.int32)
  alive_seqs = alive_seqs.at[:, :, 0].set(first_tokens[:, None])
  # Only beam 0 is live at first, or the first step would pick every candidate num_beams times.
  alive_log_probs = jnp.full((batch_size, num_beams), neg_inf).at[:, 0].set(0.0)
  finished_seqs = jnp.full((batch_size, num_beams, max_new_tokens + 1), PAD_ID, jnp.int32)
  finished_scores = jnp.full((batch_size, num_beams), neg_inf)  # -inf marks an empty slot
  done = jnp.zeros((batch_size,), jnp.bool_)  # rows whose finished set can no longer change
  cache = expand_to_beams(cache, num_beams)

  def cond_fn(state):
    step, done = state[0], state[5]
    return (step < max_new_tokens) & ~jnp.all(done)

  def body_fn(state):
    step, alive_seqs, alive_log_probs, finished_seqs, finished_scores, done, cache = state
    length = step + 1  # generated tokens once this step's is appended

    tokens = lax.dynamic_slice_in_dim(alive_seqs, step, 1, axis=2)  # [B, beam, 1]
    logits, cache = tokens_to_logits(flatten_beams(tokens), cache)
    log_probs = unflatten_beams(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), num_beams)
    vocab = log_probs.shape[-1]
    summed = (alive_log_probs[:, :, None] + log_probs).reshape(batch_size, -1)
    top_log_probs, top_indices = lax.top_k(summed, candidates)  # [B, 2k], best first
    parents = top_indices // vocab
    top_seqs = gather_beams(alive_seqs, parents, batch_size, candidates)
    top_seqs = lax.dynamic_update_slice_in_dim(top_seqs, (top_indices % vocab)[:, :, None], length,
                                               axis=2)
    ends = jnp.full(top_log_probs.shape, length == max_new_tokens)
    if eos_id is not None:
      ends |= top_seqs[:, :, length] == eos_id

    # The best k candidates that go on stay alive; their cache rows follow them.
    alive_log_probs, keep = lax.top_k(jnp.where(ends, neg_inf, top_log_probs), num_beams)
    alive_seqs = gather_beams(top_seqs, keep, batch_size, num_beams)
    cache_rows = jnp.take_along_axis(parents, keep, axis=1)
    cache = flatten_beams(
        gather_beams(unflatten_beams(cache, num_beams), cache_rows, batch_size, num_beams))

    # Ended candidates among the first k join the finished set of a row still searching. The old
    # ones come first in the merge, so a tie keeps them.
    joins = ends & (jnp.arange(candidates) < num_beams) & ~done[:, None]
    new_scores = jnp.where(joins, penalised(top_log_probs, length), neg_inf)
    finished_scores, keep = lax.top_k(jnp.concatenate([finished_scores, new_scores], axis=1),
                                      num_beams)
    finished_seqs = gather_beams(jnp.concatenate([finished_seqs, top_seqs], axis=1), keep,
                                 batch_size, num_beams)

    full = jnp.all(finished_scores > neg_inf, axis=1)
    hoped_length = length
    if early_stopping == 'never':
      hoped_length = jnp.where(length_penalty > 0, max_new_tokens, length)
    # transformers' estimate of the best an alive hypothesis can still score: with a > 0 a longer
    # one may score better, so it is not a bound (an empty slot is -inf, so a row that is not
    # full can always improve).
    can_improve = penalised(alive_log_probs[:, 0], hoped_length) > finished_scores.min(axis=1)
    done |= ~can_improve | (full & (early_stopping is True))
    return step + 1, alive_seqs, alive_log_probs, finished_seqs, finished_scores, done, cache

  state = (jnp.array(0, jnp.int32), alive_seqs, alive_log_probs, finished_seqs, finished_scores,
           done, cache)
  _, _, _, finished_seqs, finished_scores, _, _ = lax.while_loop(cond_fn, body_fn, state)
  # Every row ends with a full finished set unless the vocabulary is smaller than 2k (then some
  # candidates come from dead beams, -inf): keep such empty slots plainly PAD.
  finished_seqs = jnp.where((finished_scores > neg_inf)[:, :, None], finished_seqs, PAD_ID)
  return finished_seqs[:, :, 1:], finished_scores
