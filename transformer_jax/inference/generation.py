"""Continuing prompts with a causal language model over a KV cache: one schedule, whole or streamed.

The model is seen through three functions (the task binds them to its model, as
`search.TokensToLogits` does for beam search):

  apply_fn(params, cache, tokens: int32[B, n]) -> (logits: float[B, n, V], new_cache)
  new_cache(batch, slots) -> an empty cache of `slots` positions per row
  prepare_params(params) -> the params `apply_fn` takes (e.g. scanned layers unstacked)

Schedule (`Sampler._schedule`): the prompt, cropped to its last max_len tokens, is fed once
(prefill: all but its last token), then one token per step through the cache. A model never sees
more than max_len positions, so the cache never holds more: once it is full, generation goes on
in segments that re-read the last max_len // 2 tokens into a fresh cache. Segment s draws with
fold_in(rng, s), step t of it with fold_in of that, t (`search.sample`).

`Sampler.generate` runs each segment as one jitted `lax.while_loop` (`search.sample`);
`Sampler.stream` runs the same steps (`search.decode_step`) one jitted call per token and hands
each token back as soon as it is drawn. Both go through the one schedule, so the same rng gives
the same tokens.
"""

from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.errors import ConfigError
from transformer_jax.inference import search
from transformer_jax.special_tokens import PAD_ID

PyTree = Any
ApplyFn = Callable[[PyTree, PyTree, jnp.ndarray], tuple[jnp.ndarray, PyTree]]
NewCache = Callable[[int, int], PyTree]
# (context int32[B, L], segment rng, num_new) -> the segment's tokens, int32[B, n] chunks in order.
SegmentRunner = Callable[[np.ndarray, jax.Array, int], Iterator[np.ndarray]]


class Sampler:
  """Samples continuations of prompts [B, P] from a model with a KV cache of max_len positions."""

  def __init__(self, apply_fn: ApplyFn, new_cache: NewCache, *, max_len: int,
               prepare_params: Callable[[PyTree], PyTree] = lambda params: params):
    self.apply_fn, self.new_cache, self.prepare_params = apply_fn, new_cache, prepare_params
    self.max_len = max_len
    # One jitted segment sampler; jit retraces it only for a new (shape, num_new, eos_id).
    self._segment_fn = jax.jit(self._sample_segment, static_argnames=('num_new', 'eos_id'),
                               compiler_options=search.decode_compiler_options())
    # Streaming: the same segments, one jitted call per token.
    self._prefill_fn = jax.jit(self._prefill, static_argnames=('cache_len',))
    self._step_fn = jax.jit(self._decode_step, static_argnames=('eos_id',),
                            compiler_options=search.decode_compiler_options())

  # -- on the device --------------------------------------------------------------------------

  def _filled_cache(self, params, context, cache_len: int):
    """(prepared params, a cache of `cache_len` slots holding all but the last token of
    `context` [B, L])."""
    cache = self.new_cache(context.shape[0], cache_len)
    params = self.prepare_params(params)
    if context.shape[1] > 1:  # Prefill: all but the last prompt token in one call.
      _, cache = self.apply_fn(params, cache, context[:, :-1])
    return params, cache

  def _last_logits(self, params):
    """`search.TokensToLogits` of the model: the logits of each row's last position."""

    def tokens_to_logits(tokens, cache):
      logits, cache = self.apply_fn(params, cache, tokens)
      return logits[:, -1, :], cache

    return tokens_to_logits

  def _sample_segment(self, params, context, rng, temperature, top_k, top_p, *, num_new: int,
                      eos_id: int | None):
    """`num_new` tokens after `context` [B, L], with a cache of exactly L + num_new - 1 slots
    (the last sampled token is never fed back)."""
    params, cache = self._filled_cache(params, context, context.shape[1] + num_new - 1)
    return search.sample(self._last_logits(params), cache, rng, first_tokens=context[:, -1],
                         max_len=num_new, temperature=temperature, top_k=top_k, top_p=top_p,
                         eos_id=eos_id)

  def _prefill(self, params, context, *, cache_len: int):
    return self._filled_cache(params, context, cache_len)[1]

  def _decode_step(self, params, cache, tokens, finished, rng, step, temperature, top_k, top_p, *,
                   eos_id: int | None):
    """One step of `search.sample`'s loop: feed `tokens` [B], pick the next ones with the same
    rule and key; finished rows give PAD. Returns (next, finished, cache)."""
    select_fn = search.sampling_select_fn(rng, temperature, top_k, top_p)
    return search.decode_step(self._last_logits(self.prepare_params(params)), select_fn, cache,
                              tokens[:, None], finished, step, eos_id=search.loop_eos_id(eos_id))

  # -- on the host ----------------------------------------------------------------------------

  def _schedule(self, prompt_tokens, max_new_tokens: int, rng: jax.Array, eos_id: int | None,
                run_segment: SegmentRunner) -> Iterator[np.ndarray]:
    """Yields the new tokens as int32[B, n] chunks (as `run_segment` draws them), at most
    `max_new_tokens` columns in all; a row is PAD after its EOS, and the schedule stops once
    every row has ended."""
    if max_new_tokens < 1:
      raise ConfigError(f'max_new_tokens must be positive, got {max_new_tokens}')
    prompt = np.asarray(prompt_tokens, np.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
      raise ConfigError(f'prompt tokens must be [batch, length >= 1], got shape {prompt.shape}')
    keep = max(1, self.max_len // 2)
    tokens = prompt[:, -self.max_len:]
    ended = np.zeros(prompt.shape[0], bool)  # rows past their EOS, over all segments
    produced, segment = 0, 0
    while produced < max_new_tokens:
      context = tokens if segment == 0 else tokens[:, -keep:]
      # Fill the cache (L + n - 1 == max_len); the first segment stops at the budget so a
      # generation that fits is exactly one segment. Later ones keep one shape (one compile).
      num_new = self.max_len + 1 - context.shape[1]
      if segment == 0:
        num_new = min(num_new, max_new_tokens)
      drawn = []
      for chunk in run_segment(context, jax.random.fold_in(rng, segment), num_new):
        # Later segments go on from every row's tokens, also past its EOS (shapes are static).
        drawn.append(chunk)
        chunk = chunk[:, :max_new_tokens - produced]
        is_eos = (chunk == eos_id) if eos_id is not None else np.zeros(chunk.shape, bool)
        after_eos = ended[:, None] | (np.cumsum(is_eos, axis=1) - is_eos > 0)
        ended |= is_eos.any(axis=1)
        produced += chunk.shape[1]
        yield np.where(after_eos, PAD_ID, chunk)
        if produced == max_new_tokens or np.all(ended):
          return
      tokens = np.concatenate([tokens, *drawn], axis=1)
      segment += 1

  def generate(self, params, prompt_tokens, max_new_tokens: int, rng: jax.Array, *,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
               eos_id: int | None = None) -> np.ndarray:
    """int32[B, max_new_tokens]: the schedule with each segment drawn in one jitted loop; PAD
    after a row's EOS (and where every row ended early)."""
    knobs = (jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))

    def whole_segment(context, seg_rng, num_new):
      yield np.asarray(
          jax.device_get(
              self._segment_fn(params, jnp.asarray(context), seg_rng, *knobs, num_new=num_new,
                               eos_id=eos_id)))

    out = np.concatenate(
        list(self._schedule(prompt_tokens, max_new_tokens, rng, eos_id, whole_segment)), axis=1)
    return np.pad(out, ((0, 0), (0, max_new_tokens - out.shape[1])), constant_values=PAD_ID)

  def stream(self, params, prompt_tokens, max_new_tokens: int, rng: jax.Array, *,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             eos_id: int | None = None) -> Iterator[np.ndarray]:
    """Yields int32[B] per new token: the columns of `generate`, each as soon as it is drawn;
    stops once every row has ended or after `max_new_tokens`."""
    knobs = (jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))

    def token_by_token(context, seg_rng, num_new):
      cache = self._prefill_fn(params, jnp.asarray(context),
                               cache_len=context.shape[1] + num_new - 1)
      feed = jnp.asarray(context[:, -1])
      finished = jnp.zeros(context.shape[0], jnp.bool_)  # `search.sample`'s, per segment
      for step in range(num_new):
        feed, finished, cache = self._step_fn(params, cache, feed, finished, seg_rng,
                                              jnp.int32(step), *knobs, eos_id=eos_id)
        yield np.asarray(jax.device_get(feed))[:, None]
        if bool(jax.device_get(jnp.all(finished))):  # `search.sample` stops here
          return

    for chunk in self._schedule(prompt_tokens, max_new_tokens, rng, eos_id, token_by_token):
      yield chunk[:, 0]
