"""Continuing prompts with a causal language model over a KV cache: a batch of prompts of any
lengths, one schedule for whole and streamed generation.

The model is seen through four functions (the task binds them to its model, as
`search.TokensToLogits` does for beam search):

  apply_fn(params, cache, tokens: int32[B, n]) -> (logits: float[B, n, V], new_cache)
  new_cache(batch, slots) -> an empty cache of `slots` positions per row
  set_positions(cache, positions: int32[B]) -> the cache with row i's next token going to slot
      positions[i] (and attending to slots 0..positions[i]); a row's slot is its token's position
  prepare_params(params, kernel_layout) -> the params `apply_fn` takes (e.g. scanned layers
      unstacked, dense kernels in `kernel_layout`, 'in_out' or 'out_in': layers/dense.py)

A batch of prompts of different lengths (`Sampler.generate`): the prompts are right-padded to a
common length P (rounded up to a multiple of `LENGTH_BUCKET`, so batches of similar lengths share
one compiled program); the first P - 1 columns of every row are prefilled in one call; then every
row's position goes back to its own last prompt token, which the first decode step feeds. From
there each row writes its own slots, so what a short prompt's padding wrote is overwritten before
the causal mask ever shows it: every row computes what its prompt computes alone (its positions,
learned, rotary or T5's relative bias, are its own), and greedy ids are the same in a batch as
alone. Each row also has its own budget of new tokens, its own EOS point and, where asked, its
own sampling settings and PRNG key.

Schedule (`Sampler._schedule`): each prompt, cropped to its last max_len tokens, is continued
until its budget or its EOS. A model never sees more than max_len positions, so the cache never
holds more: once a row's cache is full, generation goes on in segments that re-read the row's last
max_len // 2 tokens into a fresh cache. Segment s draws with fold_in(key, s), step t of it with
fold_in of that, t (`search.sample`). Rows share the segments: a row whose first segment ends
earlier (a longer prompt) waits for the others before the next one starts.

Keys: one key for the batch (the draws of all rows come from it together: what the batch gets,
as it always did), or one key per row, int keys[B] (row i draws from its key alone: what its prompt
gets alone with that key, whatever else is in the batch).

`Sampler.generate` runs each segment as one jitted `lax.while_loop` (`search.sample`);
`Sampler.stream` runs the same steps (`search.decode_step`) one jitted call per token and hands
each token back as soon as it is drawn. Both go through the one schedule, so the same keys give
the same tokens.
"""

from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.errors import ConfigError
from transformer_jax.inference import search
from transformer_jax.special_tokens import PAD_ID

PyTree = Any
ApplyFn = Callable[[PyTree, PyTree, jnp.ndarray], tuple[jnp.ndarray, PyTree]]
NewCache = Callable[[int, int], PyTree]
SetPositions = Callable[[PyTree, jnp.ndarray], PyTree]
PrepareParams = Callable[[PyTree, str], PyTree]
# (contexts int32[B, P], lengths int32[B], budgets int32[B], segment keys, num_new) -> the
# segment's tokens, int32[B, n] chunks in order.
SegmentRunner = Callable[[np.ndarray, np.ndarray, np.ndarray, jax.Array, int], Iterator[np.ndarray]]
# Prompt lengths are rounded up to a multiple of this: fewer shapes, fewer compilations.
LENGTH_BUCKET = 32


def _padded_length(length: int, limit: int) -> int:
  """`length` rounded up to a multiple of LENGTH_BUCKET, at most `limit` (and at least
  `length`)."""
  return max(length, min(limit, -(-length // LENGTH_BUCKET) * LENGTH_BUCKET))


def prompt_rows(prompt_tokens) -> list[np.ndarray]:
  """The prompts as int32 rows: from an int array [B, P] (every row P long) or a sequence of
  sequences of ids (any lengths); one line naming the first empty or malformed prompt."""
  if isinstance(prompt_tokens, np.ndarray) or isinstance(prompt_tokens, jax.Array):
    array = np.asarray(prompt_tokens)
    if array.ndim != 2 or array.shape[1] < 1:
      raise ConfigError(f'prompt tokens must be [batch, length >= 1], got shape {array.shape}')
    return list(array.astype(np.int32))
  rows = [np.asarray(row) for row in prompt_tokens]
  if not rows:
    raise ConfigError('no prompts to continue: the batch is empty')
  for i, row in enumerate(rows):
    if row.ndim != 1 or row.size < 1 or not np.issubdtype(row.dtype, np.integer):
      raise ConfigError(f'prompt {i} must be a non-empty sequence of token ids, got shape '
                        f'{row.shape} of {row.dtype}')
  return [row.astype(np.int32) for row in rows]


def cache_slots(width: int, num_new: int) -> int:
  """Slots of a KV cache for prompts padded to `width` and `num_new` new tokens: width + num_new
  - 1 (the last new token is never fed back), rounded up to a multiple of LENGTH_BUCKET.

  Rounded because the cached attention step sums over the slots by halving them
  (`kernels/cached_attention.py`): an odd count carries its last slot through every halving,
  which made the step's attention ~30% slower (GPT-2 small, batch 32, 287 slots against 288).
  Multiples of 256 are skipped: 256 and 512 slots were slower than 288 and 544 (GPT-2 small's
  12 layers at batch 8, three interleaved runs on machine G: 16-21 ms against 12-15 ms, 24-28
  against 19-23), the halves then falling on addresses that compete for the same cache sets.
  Slots past a row's position are masked, so their number changes no result."""
  slots = -(-(width + num_new - 1) // LENGTH_BUCKET) * LENGTH_BUCKET
  return slots + LENGTH_BUCKET if slots % 256 == 0 else slots


def pad_prompts(rows: list[np.ndarray], limit: int) -> tuple[np.ndarray, np.ndarray]:
  """(int32[B, P] the rows right-padded with PAD to a common length P (the longest, rounded up
  to a multiple of LENGTH_BUCKET, at most `limit`), int32[B] their lengths): the input of
  `Sampler.filled_cache`."""
  lengths = np.asarray([len(row) for row in rows], np.int32)
  padded = np.full((len(rows), _padded_length(int(lengths.max()), limit)), PAD_ID, np.int32)
  for i, row in enumerate(rows):
    padded[i, :len(row)] = row
  return padded, lengths


def per_row(value, batch: int, name: str, dtype) -> np.ndarray:
  """A setting given once for the batch or once per row, as an array [batch]."""
  array = np.asarray(value, dtype)
  if array.ndim == 0:
    return np.full(batch, array, dtype)
  if array.shape != (batch,):
    raise ConfigError(f'{name}: one value or one per prompt ({batch}), got shape {array.shape}')
  return array


class Knobs:
  """Per-row sampling settings, and the static choice of the cheapest rule that serves them:
  'greedy' (every temperature 0: argmax, no draw), 'sample' (no top-k or top-p: no sort of the
  vocabulary) or 'filtered'."""

  def __init__(self, batch: int, temperature, top_k, top_p):
    self.temperature = per_row(temperature, batch, 'temperature', np.float32)
    self.top_k = per_row(top_k, batch, 'top_k', np.int32)
    self.top_p = per_row(top_p, batch, 'top_p', np.float32)
    top_p_ok = ((self.top_p > 0) & (self.top_p <= 1)).all()
    if (self.temperature < 0).any() or (self.top_k < 0).any() or not top_p_ok:
      raise ConfigError('sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1')
    if (self.temperature == 0).all():
      self.rule = 'greedy'
    elif (self.top_k == 0).all() and (self.top_p >= 1).all():
      self.rule = 'sample'
    else:
      self.rule = 'filtered'

  def arrays(self) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    return jnp.asarray(self.temperature), jnp.asarray(self.top_k), jnp.asarray(self.top_p)


def select_fn(keys: jax.Array, temperature, top_k, top_p, *, rule: str) -> search.SelectFn:
  """`search.sampling_select_fn` for `Knobs.rule`, with the settings per row."""
  if rule == 'greedy':
    return search.sampling_select_fn(keys, 0.0)
  if rule == 'sample':
    return search.sampling_select_fn(keys, temperature)
  return search.sampling_select_fn(keys, temperature, top_k, top_p)


def _keys_for(rng: jax.Array, batch: int) -> jax.Array:
  """`rng` checked: one key, or one per row (a key array [batch])."""
  if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    raise ConfigError('rng must be a jax.random.key (or an array of one per prompt)')
  if rng.ndim not in (0, 1) or (rng.ndim == 1 and rng.shape[0] != batch):
    raise ConfigError(f'rng: one key or one per prompt ({batch}), got shape {rng.shape}')
  return rng


def _fold_in(keys: jax.Array, data: int | jnp.ndarray) -> jax.Array:
  """fold_in of one key, or of each of a row's keys."""
  if keys.ndim == 0:
    return jax.random.fold_in(keys, data)
  return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, data)


class Sampler:
  """Samples continuations of a batch of prompts (any lengths) from a model with a KV cache of
  max_len positions."""

  def __init__(self, apply_fn: ApplyFn, new_cache: NewCache, set_positions: SetPositions, *,
               max_len: int, prepare_params: PrepareParams = lambda params, layout: params):
    self.apply_fn, self.new_cache, self.set_positions = apply_fn, new_cache, set_positions
    self.prepare_params = prepare_params
    self.max_len = max_len
    # A segment is two jitted calls: the prefill, compiled with XLA's defaults (matrix products
    # of many rows), and the decoding loop, with `search.decode_compiler_options()` (matrix-
    # vector products); one program for both ran one of them slower. jit retraces them only for
    # a new (shape, num_new, eos, rule).
    self._prefill_fn = jax.jit(self.filled_cache, static_argnames=('cache_len',))
    self._loop_fn = jax.jit(self._decode_loop, static_argnames=('num_new', 'eos_id', 'rule'),
                            compiler_options=search.decode_compiler_options())
    # Streaming: the same prefill, then one jitted call per token.
    self._step_fn = jax.jit(self._decode_step, static_argnames=('eos_id', 'rule'),
                            compiler_options=search.decode_compiler_options())

  # -- on the device --------------------------------------------------------------------------

  def filled_cache(self, params, contexts, lengths, cache_len: int):
    """(a cache of `cache_len` slots holding all but the last token of each row of `contexts`
    [B, P] (row i is lengths[i] long, then padding), the first tokens to feed: each row's last
    one). `params`: prepared (`prepare_params`)."""
    cache = self.new_cache(contexts.shape[0], cache_len)
    if contexts.shape[1] > 1:  # Prefill: the first P - 1 columns of every row in one call.
      _, cache = self.apply_fn(params, cache, contexts[:, :-1])
    cache = self.set_positions(cache, lengths - 1)
    last = jnp.take_along_axis(contexts, (lengths - 1)[:, None], axis=1)[:, 0]
    return cache, last

  def _last_logits(self, params):
    """`search.TokensToLogits` of the model: the logits of each row's last position."""

    def tokens_to_logits(tokens, cache):
      logits, cache = self.apply_fn(params, cache, tokens)
      return logits[:, -1, :], cache

    return tokens_to_logits

  def _decode_loop(self, params, cache, last, budgets, keys, temperature, top_k, top_p, *,
                   num_new: int, eos_id: int | None, rule: str):
    """Up to `num_new` tokens after the prefilled `cache` (`filled_cache`), feeding `last` first
    (row i: budgets[i] of them). The cache has at least P + num_new - 1 slots (the last sampled
    token is never fed back; `cache_slots`)."""
    return search.sample(self._last_logits(params), cache, keys, first_tokens=last, max_len=num_new,
                         budgets=budgets, eos_id=eos_id,
                         select=select_fn(keys, temperature, top_k, top_p, rule=rule))

  def _decode_step(self, params, cache, tokens, finished, budgets, keys, step, temperature, top_k,
                   top_p, *, eos_id: int | None, rule: str):
    """One step of `search.sample`'s loop: feed `tokens` [B], pick the next ones with the same
    rule and keys; finished rows give PAD. Returns (next, finished, cache)."""
    select = select_fn(keys, temperature, top_k, top_p, rule=rule)
    tokens, finished, cache = search.decode_step(self._last_logits(params), select, cache,
                                                 tokens[:, None], finished, step,
                                                 eos_id=search.loop_eos_id(eos_id))
    return tokens, finished | (step + 1 >= budgets), cache

  # -- on the host ----------------------------------------------------------------------------

  def prepared_params(self, params, batch: int):
    """`params` as the decoding calls of a batch of `batch` rows take them: `prepare_params`
    with the kernel layout `search.decode_kernel_layout` picks for that many rows.

    Run eagerly, once per call of `generate` or `stream`, outside the programs that decode:
    inside one, XLA folds a transposition of the weights back into the dots, which then read
    them in their old layout (tests/test_hlo.py). Transposing GPT-2 small's kernels takes ~70 ms
    on 2 cores; a batch of 8 rows and 64 new tokens takes seconds."""
    return self.prepare_params(params, search.decode_kernel_layout(batch))

  def _schedule(self, rows: list[np.ndarray], budgets: np.ndarray, keys: jax.Array,
                eos_id: int | None, run_segment: SegmentRunner) -> Iterator[np.ndarray]:
    """Yields the new tokens as int32[B] columns: column t holds every row's t-th new token (PAD
    after the row's EOS or budget), as soon as every row has drawn (or ended) that far."""
    batch = len(rows)
    keep = max(1, self.max_len // 2)
    drawn: list[list[int]] = [[] for _ in rows]
    done = budgets <= 0
    emitted, segment = 0, 0
    while not done.all():
      if segment == 0:
        contexts = [row[-self.max_len:] for row in rows]
      else:  # rows that ended only need a placeholder: their budget here is 0
        contexts = [
            np.asarray([PAD_ID], np.int32)
            if done[i] else np.concatenate([rows[i], np.asarray(drawn[i], np.int32)])[-keep:]
            for i in range(batch)
        ]
      padded, lengths = pad_prompts(contexts, self.max_len)
      remaining = budgets - np.asarray([len(d) for d in drawn])
      # Fill each row's cache at most up to max_len positions (L + n - 1 <= max_len).
      wanted = np.where(done, 0, np.minimum(self.max_len + 1 - lengths, remaining))
      taken = np.zeros(batch, int)  # columns of this segment consumed per row
      for chunk in run_segment(padded, lengths, wanted.astype(np.int32), _fold_in(keys, segment),
                               int(wanted.max())):
        for i in range(batch):
          if done[i]:
            continue
          for token in chunk[i, :max(0, wanted[i] - taken[i])]:
            drawn[i].append(int(token))
            if (eos_id is not None and token == eos_id) or len(drawn[i]) == budgets[i]:
              done[i] = True
              break
          taken[i] += chunk.shape[1]
        ready = min([len(d) for d, ended in zip(drawn, done) if not ended] or
                    [max(len(d) for d in drawn)])
        for column in range(emitted, ready):
          yield np.asarray([d[column] if column < len(d) else PAD_ID for d in drawn], np.int32)
        emitted = ready
        if done.all():
          return
      segment += 1

  def _prepare(self, prompt_tokens, max_new_tokens, rng, temperature, top_k, top_p):
    """(rows, budgets, keys, knobs) from the caller's arguments, each checked."""
    rows = prompt_rows(prompt_tokens)
    budgets = per_row(max_new_tokens, len(rows), 'max_new_tokens', np.int64)
    if (budgets < 1).any():
      raise ConfigError(f'max_new_tokens must be positive, got {max_new_tokens}')
    return rows, budgets, _keys_for(rng, len(rows)), Knobs(len(rows), temperature, top_k, top_p)

  def generate(self, params, prompt_tokens: np.ndarray | Sequence[Sequence[int]],
               max_new_tokens: int | Sequence[int], rng: jax.Array, *,
               temperature: float | Sequence[float] = 1.0, top_k: int | Sequence[int] = 0,
               top_p: float | Sequence[float] = 1.0, eos_id: int | None = None) -> np.ndarray:
    """int32[B, max(max_new_tokens)]: the schedule with each segment drawn in one jitted loop;
    PAD after a row's EOS and after its own budget.

    `prompt_tokens`: an int array [B, P] or B sequences of ids of any lengths. `max_new_tokens`
    and the sampling settings: one value, or one per row; `rng`: one key or one per row.
    """
    rows, budgets, keys, knobs = self._prepare(prompt_tokens, max_new_tokens, rng, temperature,
                                               top_k, top_p)
    params = self.prepared_params(params, len(rows))

    def whole_segment(contexts, lengths, wanted, seg_keys, num_new):
      cache, last = self._prefill_fn(params, jnp.asarray(contexts), jnp.asarray(lengths),
                                     cache_len=cache_slots(contexts.shape[1], num_new))
      yield np.asarray(
          jax.device_get(
              self._loop_fn(params, cache, last, jnp.asarray(wanted), seg_keys, *knobs.arrays(),
                            num_new=num_new, eos_id=eos_id, rule=knobs.rule)))

    out = np.full((len(rows), int(budgets.max())), PAD_ID, np.int32)
    for t, column in enumerate(self._schedule(rows, budgets, keys, eos_id, whole_segment)):
      out[:, t] = column
    return out

  def stream(self, params, prompt_tokens: np.ndarray | Sequence[Sequence[int]],
             max_new_tokens: int | Sequence[int], rng: jax.Array, *,
             temperature: float | Sequence[float] = 1.0, top_k: int | Sequence[int] = 0,
             top_p: float | Sequence[float] = 1.0,
             eos_id: int | None = None) -> Iterator[np.ndarray]:
    """Yields int32[B] per new token: the columns of `generate`, each as soon as every row has
    drawn it; stops once every row has ended."""
    rows, budgets, keys, knobs = self._prepare(prompt_tokens, max_new_tokens, rng, temperature,
                                               top_k, top_p)
    params = self.prepared_params(params, len(rows))

    def token_by_token(contexts, lengths, wanted, seg_keys, num_new):
      cache, feed = self._prefill_fn(params, jnp.asarray(contexts), jnp.asarray(lengths),
                                     cache_len=cache_slots(contexts.shape[1], num_new))
      wanted = jnp.asarray(wanted)
      finished = wanted <= 0  # `search.sample`'s, per segment
      for step in range(num_new):
        feed, finished, cache = self._step_fn(params, cache, feed, finished, wanted, seg_keys,
                                              jnp.int32(step), *knobs.arrays(), eos_id=eos_id,
                                              rule=knobs.rule)
        yield np.asarray(jax.device_get(feed))[:, None]
        if bool(jax.device_get(jnp.all(finished))):  # `search.sample` stops here
          return

    yield from self._schedule(rows, budgets, keys, eos_id, token_by_token)
