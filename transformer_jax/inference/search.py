"""Model-agnostic autoregressive decoding over a KV cache: greedy, beam search and sampling.

The model is seen only through one function,

  tokens_to_logits(tokens: int32[N, 1], cache) -> (logits: float[N, V], new_cache),

which consumes the last token of every row and returns the next-token logits plus the updated
cache. The cache is any pytree whose structure, shapes and dtypes the model keeps from call to
call (it is a while_loop carry). Its leaves carry the row dimension N first, except scalar
(ndim 0) leaves such as a flax `cache_index`: those are shared by all rows, so the beam helpers
below pass them through untouched.

Everything is jit-compatible: loops are `lax.while_loop`s over fixed-size buffers, so the output
shapes depend only on the static `batch_size`, `beam_size` and `max_len`. The loops stop early
once no row can change any more, but that only saves work; the results are the same.

Token conventions: PAD_ID = 0 fills every position after EOS_ID = 1. The first decoder input is
`start_id` (default 0: the target shifted right by one PAD, as models are trained).
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from transformer_jax.special_tokens import EOS_ID, PAD_ID
from transformer_jax import xla_options

PyTree = Any
TokensToLogits = Callable[[jnp.ndarray, PyTree], tuple[jnp.ndarray, PyTree]]
# Picks the next token of every row from its logits; `step` lets a sampler fold it into its
# PRNG key, so the loop itself needs no randomness.
SelectFn = Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray]

# ---------------------------------------------------------------------------------------------
# Beam helpers. A "beam" tensor is [B, beam, ...]; the model sees it flattened to [B*beam, ...]
# with row b*beam + k holding beam k of batch element b. All helpers map over pytrees and leave
# scalar leaves alone (they have no row dimension).


def _map_batched(fn: Callable[[jnp.ndarray], jnp.ndarray], tree: PyTree) -> PyTree:
  """Applies `fn` to the leaves that have a leading row dimension (ndim >= 1)."""
  return jax.tree.map(lambda x: fn(x) if jnp.ndim(x) > 0 else x, tree)


def expand_to_beams(tree: PyTree, beam_size: int) -> PyTree:
  """[B, ...] -> [B*beam, ...]: each row repeated `beam_size` times (row b*beam + k is b)."""
  return _map_batched(lambda x: jnp.repeat(x, beam_size, axis=0), tree)


def flatten_beams(tree: PyTree) -> PyTree:
  """[B, beam, ...] -> [B*beam, ...], the layout the model works in."""
  return _map_batched(lambda x: x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), tree)


def unflatten_beams(tree: PyTree, beam_size: int) -> PyTree:
  """[B*beam, ...] -> [B, beam, ...], the inverse of `flatten_beams`."""
  return _map_batched(lambda x: x.reshape((x.shape[0] // beam_size, beam_size) + x.shape[1:]), tree)


def gather_beams(tree: PyTree, beam_indices: jnp.ndarray, batch_size: int,
                 new_beam_size: int) -> PyTree:
  """Picks beams within each batch element: out[b, j] = x[b, beam_indices[b, j]].

  Leaves are [B, old_beam, ...]; `beam_indices` is int[B, new_beam] and the result is
  [B, new_beam, ...]. Beams never move between batch elements.
  """
  if beam_indices.shape != (batch_size, new_beam_size):
    raise ValueError(f'beam_indices has shape {beam_indices.shape}, expected '
                     f'{(batch_size, new_beam_size)}')
  batch_indices = jnp.arange(batch_size)[:, None]  # Broadcasts against [B, new_beam].
  return _map_batched(lambda x: x[batch_indices, beam_indices], tree)


# ---------------------------------------------------------------------------------------------
# Greedy search (and, through `select_fn`, any one-token-at-a-time decoder such as sampling).


def decode_compiler_options() -> dict[str, str] | None:
  """Compiler options for a jitted decode loop: `jax.jit(fn, compiler_options=...)`.

  A decoding step is matrix-vector products (bound by reading the weights) and a few tiny
  reductions per layer (`kernels.decode_step_attention`). XLA:CPU's own emitter runs a
  matrix-vector product on one thread; its YNNPACK library fusion spreads it over the cores and
  read GPT-2 small's weights 1.5-1.8x faster (ms per step at batch 1 / 8: 37-46 / 91-94 -> 22-24
  / 49-60, 2 cores, jax 0.12.1, docs/performance.md). YNNPACK's reductions, on the other hand,
  cost more per call than XLA's loop fusions: with them too (XLA's default) small models decode
  up to 1.3x slower. So dots go to YNNPACK and nothing else. The option exists only on CPU (None
  elsewhere); a prefill (many rows) is faster with XLA's defaults.
  """
  if jax.default_backend() != 'cpu':
    return None
  return xla_options.compiler_options(
      xla_cpu_experimental_ynn_fusion_type='LIBRARY_FUSION_TYPE_DOT') or None


# From this many rows a decoding loop on CPU reads the dense kernels faster [out, in] than [in,
# out] (`benchmarks/decode_dense_layout.py`, GPT-2 small's layers, ms per step in_out / out_in:
# 0.69 at 1 row, 0.79 at 2, 0.83 or 1.17 at 4 by run, 1.28-1.34 at 8, 1.27 at 32, 2-core Xeon;
# docs/performance.md).
OUT_IN_ROWS = 8


def decode_kernel_layout(batch: int) -> str:
  """The dense-kernel layout (`TransformerConfig.kernel_layout`) a decoding loop of `batch` rows
  runs fastest in: 'out_in' on CPU from `OUT_IN_ROWS` rows up, 'in_out' otherwise.

  With a few rows, YNNPACK (`decode_compiler_options`) reads [in, out] kernels faster; with more,
  it repacks every [in, out] kernel at every call, and [out, in] saves that. Elsewhere the
  compiler picks its own layouts, and a converted copy of the weights would only cost memory.
  """
  if jax.default_backend() != 'cpu' or batch < OUT_IN_ROWS:
    return 'in_out'
  return 'out_in'


def decode_step(tokens_to_logits: TokensToLogits, select_fn: SelectFn, cache: PyTree,
                tokens: jnp.ndarray, finished: jnp.ndarray, step: int | jnp.ndarray, *,
                eos_id: int) -> tuple[jnp.ndarray, jnp.ndarray, PyTree]:
  """One step of the decoding loop: feeds `tokens` int32[B, 1] and picks the next token per row.

  Returns (next_tokens int32[B], finished bool[B], new cache). A row already `finished` gets PAD;
  a row whose next token is `eos_id` is finished from now on. `_decode_loop` runs this inside
  its while_loop; a streaming decoder runs it once per jitted call, so both pick the same tokens.
  """
  logits, cache = tokens_to_logits(tokens, cache)
  next_tokens = select_fn(logits, step).astype(jnp.int32)
  next_tokens = jnp.where(finished, PAD_ID, next_tokens)
  return next_tokens, finished | (next_tokens == eos_id), cache


def _decode_loop(tokens_to_logits: TokensToLogits, cache: PyTree, select_fn: SelectFn, *,
                 batch_size: int, max_len: int, start_id: int | jnp.ndarray, eos_id: int,
                 budgets: jnp.ndarray | None = None) -> jnp.ndarray:
  """Feeds back one token per row per step until every row has emitted EOS or max_len is hit.

  Returns int32[B, max_len]. Rows that have finished keep running (shapes are static) but
  their outputs are forced to PAD, so everything after EOS is PAD. `start_id` is one id for
  every row or int32[B] (a language model continues each row from its own last prompt token).
  `budgets` int32[B]: row i ends after budgets[i] tokens (PAD after; default max_len).
  """
  # Column 0 holds the start token so that step i always reads its input from column i.
  sequences = jnp.full((batch_size, max_len + 1), PAD_ID, jnp.int32).at[:, 0].set(start_id)
  budgets = jnp.full((batch_size,), max_len, jnp.int32) if budgets is None else budgets
  finished = budgets <= 0

  def cond_fn(state):
    step, _, finished, _ = state
    return (step < max_len) & ~jnp.all(finished)

  def body_fn(state):
    step, sequences, finished, cache = state
    tokens = lax.dynamic_slice_in_dim(sequences, step, 1, axis=1)
    next_tokens, finished, cache = decode_step(tokens_to_logits, select_fn, cache, tokens, finished,
                                               step, eos_id=eos_id)
    finished = finished | (step + 1 >= budgets)
    sequences = lax.dynamic_update_slice_in_dim(sequences, next_tokens[:, None], step + 1, axis=1)
    return step + 1, sequences, finished, cache

  state = (jnp.array(0, jnp.int32), sequences, finished, cache)
  _, sequences, _, _ = lax.while_loop(cond_fn, body_fn, state)
  return sequences[:, 1:]


def greedy_search(tokens_to_logits: TokensToLogits, cache: PyTree, *, batch_size: int, max_len: int,
                  start_id: int = 0, eos_id: int = EOS_ID) -> jnp.ndarray:
  """Decodes the most likely next token at every step; returns int32[B, max_len].

  The output excludes the start token, and every position after a row's EOS is PAD. Ties go
  to the lowest token id.
  """

  def select_fn(logits, step):
    del step  # Greedy choice does not depend on the step.
    return jnp.argmax(logits, axis=-1)

  return _decode_loop(tokens_to_logits, cache, select_fn, batch_size=batch_size, max_len=max_len,
                      start_id=start_id, eos_id=eos_id)


# ---------------------------------------------------------------------------------------------
# Beam search


def length_penalty(length: jnp.ndarray | int, alpha: float) -> jnp.ndarray:
  """GNMT length penalty ((5 + length) / 6) ** alpha; scores are log_prob / penalty.

  Log-probs only fall as a hypothesis grows, so without it beam search prefers short outputs;
  alpha > 0 compensates (alpha = 0 turns it off).
  """
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0)**alpha


def beam_search(tokens_to_logits: TokensToLogits, cache: PyTree, *, batch_size: int, beam_size: int,
                max_len: int, alpha: float = 0.6, start_id: int = 0,
                eos_id: int = EOS_ID) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Beam search; returns (sequences int32[B, beam, max_len], scores float32[B, beam]).

  Each step extends every alive hypothesis by every token and keeps the `beam_size` best of
  these candidates by log-prob. Candidates that end in EOS leave the beam and join the
  finished set (the `beam_size` best by length-penalised score, `length_penalty`); the rest
  stay alive. A hypothesis is finished only if it is among the beam's best, so with
  beam_size == 1 this is exactly greedy search, for any alpha (barring float-rounding ties).

  The result is the finished set, best first; hypothesis lengths count the EOS. A batch element
  with no finished hypothesis at max_len falls back to its alive ones, scored the same way at
  length max_len. Slots that hold no hypothesis (fewer than `beam_size` finished) have score
  -inf and all-PAD tokens. As in greedy search, positions after EOS are PAD.

  `cache` has batch dimension B; it is expanded here to B*beam rows (`expand_to_beams`).
  """
  neg_inf = jnp.array(-jnp.inf, jnp.float32)

  # Buffers hold the start token in column 0, so step i reads its input from column i.
  alive_seqs = jnp.full((batch_size, beam_size, max_len + 1), PAD_ID, jnp.int32)
  alive_seqs = alive_seqs.at[:, :, 0].set(start_id)
  # All beams start identical; only beam 0 is live, or the first step would pick the same
  # candidate beam_size times. Dead beams carry -inf and never win against a live candidate.
  alive_log_probs = jnp.full((batch_size, beam_size), neg_inf).at[:, 0].set(0.0)
  finished_seqs = jnp.full((batch_size, beam_size, max_len + 1), PAD_ID, jnp.int32)
  finished_scores = jnp.full((batch_size, beam_size), neg_inf)  # -inf marks an empty slot.
  cache = expand_to_beams(cache, beam_size)

  def cond_fn(state):
    step, _, alive_log_probs, _, finished_scores, _ = state
    # A row is done when none of its alive hypotheses can still beat its worst finished one.
    # Log-probs only fall, so the best an alive hypothesis can reach is its current log-prob
    # over the largest penalty of the lengths still reachable (step + 1 .. max_len; the
    # penalty is monotonic in length, so that is at one of the two ends).
    best_penalty = jnp.maximum(length_penalty(step + 1, alpha), length_penalty(max_len, alpha))
    best_reachable = jnp.max(alive_log_probs, axis=1) / best_penalty
    worst_finished = jnp.min(finished_scores, axis=1)  # -inf until all slots are filled.
    # Strict >: a row with no alive beam (-inf) is done. A done row that keeps decoding while
    # other rows finish only produces candidates that cannot displace its finished ones.
    can_improve = best_reachable > worst_finished
    return (step < max_len) & jnp.any(can_improve)

  def body_fn(state):
    step, alive_seqs, alive_log_probs, finished_seqs, finished_scores, cache = state

    # Score every one-token extension of every alive beam.
    tokens = lax.dynamic_slice_in_dim(alive_seqs, step, 1, axis=2)  # [B, beam, 1]
    logits, cache = tokens_to_logits(flatten_beams(tokens), cache)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    vocab = log_probs.shape[-1]
    log_probs = unflatten_beams(log_probs, beam_size)  # [B, beam, V]
    candidate_log_probs = (alive_log_probs[:, :, None] + log_probs).reshape(batch_size, -1)

    # Keep the beam_size best candidates; ties go to the lower (beam, token) index, matching
    # argmax in greedy search.
    top_log_probs, top_indices = lax.top_k(candidate_log_probs, beam_size)  # [B, beam]
    parent_beams = top_indices // vocab
    top_tokens = (top_indices % vocab).astype(jnp.int32)
    top_seqs = gather_beams(alive_seqs, parent_beams, batch_size, beam_size)
    top_seqs = lax.dynamic_update_slice_in_dim(top_seqs, top_tokens[:, :, None], step + 1, axis=2)
    # The cache rows follow their hypotheses (scalar leaves are shared and stay as they are).
    cache = flatten_beams(
        gather_beams(unflatten_beams(cache, beam_size), parent_beams, batch_size, beam_size))

    # Candidates ending in EOS move to the finished set; their alive slots die (-inf).
    ends = top_tokens == eos_id
    new_scores = jnp.where(ends, top_log_probs / length_penalty(step + 1, alpha), neg_inf)
    alive_log_probs = jnp.where(ends, neg_inf, top_log_probs)
    # Merge old and new finished hypotheses, keep the best. Old ones come first so that ties
    # keep them (a done row stays unchanged while other rows decode on).
    merged_scores = jnp.concatenate([finished_scores, new_scores], axis=1)
    merged_seqs = jnp.concatenate([finished_seqs, top_seqs], axis=1)
    finished_scores, keep = lax.top_k(merged_scores, beam_size)
    finished_seqs = gather_beams(merged_seqs, keep, batch_size, beam_size)
    return step + 1, top_seqs, alive_log_probs, finished_seqs, finished_scores, cache

  state = (jnp.array(0,
                     jnp.int32), alive_seqs, alive_log_probs, finished_seqs, finished_scores, cache)
  step, alive_seqs, alive_log_probs, finished_seqs, finished_scores, _ = lax.while_loop(
      cond_fn, body_fn, state)

  # Fallback for rows with nothing finished: their alive beams, scored and sorted like
  # finished ones. (Such a row never stops early, so its alive beams have length max_len.)
  alive_scores, order = lax.top_k(alive_log_probs / length_penalty(step, alpha), beam_size)
  alive_seqs = gather_beams(alive_seqs, order, batch_size, beam_size)
  has_finished = jnp.any(finished_scores > neg_inf, axis=1)
  sequences = jnp.where(has_finished[:, None, None], finished_seqs, alive_seqs)
  scores = jnp.where(has_finished[:, None], finished_scores, alive_scores)

  # Empty slots may hold leftovers of dead beams; make them plainly empty.
  sequences = jnp.where((scores > neg_inf)[:, :, None], sequences, PAD_ID)
  return sequences[:, :, 1:], scores


# ---------------------------------------------------------------------------------------------
# Sampling: temperature, then top-k, then top-p (nucleus), one token per step.


def filter_logits(logits: jnp.ndarray, top_k: int | jnp.ndarray = 0,
                  top_p: float | jnp.ndarray = 1.0) -> jnp.ndarray:
  """Sets every token outside the top-k, then outside the nucleus, to -inf; float32 [..., V].

  top_k: keep the k most likely tokens (0 = all). Ties go to the lower token id, as argmax.
  top_p: of what top-k kept (renormalised), keep the smallest set of most likely tokens whose
    probability mass reaches p (Holtzman et al. 2019); 1.0 = all. The most likely token always
    survives, so something can always be sampled.
  Both may be traced values, so changing them does not recompile a jitted sampler.
  """
  logits = jnp.asarray(logits, jnp.float32)
  if isinstance(top_k, int) and top_k <= 0 and isinstance(top_p, (int, float)) and top_p >= 1.0:
    return logits  # Nothing to filter: skip the sort.
  vocab = logits.shape[-1]
  # Work in rank order (most likely first); a stable sort breaks ties by token id.
  order = jnp.argsort(-logits, axis=-1, stable=True)
  sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
  rank = jnp.arange(vocab)
  top_k = jnp.asarray(top_k)
  keep = rank < jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  # Nucleus: keep a token while the mass of the more likely kept tokens is still below p.
  probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
  cumulative = jnp.cumsum(probs, axis=-1)
  mass_before = jnp.concatenate([jnp.zeros_like(cumulative[..., :1]), cumulative[..., :-1]],
                                axis=-1)
  keep = keep & ((mass_before < top_p) | (jnp.asarray(top_p) >= 1.0) | (rank == 0))
  filtered = jnp.where(keep, sorted_logits, -jnp.inf)
  # Back to token order: position `order[i]` holds sorted entry i.
  return jnp.take_along_axis(filtered, jnp.argsort(order, axis=-1), axis=-1)


def sampling_distribution(logits: jnp.ndarray, temperature: float | jnp.ndarray = 1.0,
                          top_k: int | jnp.ndarray = 0,
                          top_p: float | jnp.ndarray = 1.0) -> jnp.ndarray:
  """The probabilities `sample` draws from: softmax(filter_logits(logits / T)); one-hot argmax
  at temperature 0. For inspection and tests."""
  logits = jnp.asarray(logits, jnp.float32)
  greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1])
  scaled = logits / jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
  probs = jax.nn.softmax(filter_logits(scaled, top_k, top_p), axis=-1)
  return jnp.where(jnp.asarray(temperature) > 0, probs, greedy)


def sample(tokens_to_logits: TokensToLogits, cache: PyTree, rng: jax.Array, *,
           first_tokens: jnp.ndarray, max_len: int, temperature: float | jnp.ndarray = 1.0,
           top_k: int | jnp.ndarray = 0, top_p: float | jnp.ndarray = 1.0,
           eos_id: int | None = None, budgets: jnp.ndarray | None = None,
           select: SelectFn | None = None) -> jnp.ndarray:
  """Draws `max_len` tokens per row; returns int32[B, max_len].

  `first_tokens` int32[B] is fed first (for a language model: the last prompt token, the rest
  of the prompt being already in `cache`). Each step scales the logits by 1/temperature, keeps
  the top-k and then the top-p tokens (`filter_logits`) and draws from what is left;
  temperature 0 is greedy (argmax, exactly as `greedy_search`). With `eos_id`, a row stops
  at its EOS and is PAD afterwards; without it every row runs its full budget (`budgets`
  int32[B], default max_len). `select`: a `sampling_select_fn` made by the caller (then
  `rng` and the settings here are not read).

  The draw at step s uses fold_in(rng, s), so the same rng gives the same tokens, whatever
  the loop's early stopping. `rng` is one key or one per row (keys[B]: row i draws from its
  key alone). `temperature`, `top_k` and `top_p` may be traced values, one or one per row.
  """
  first_tokens = jnp.asarray(first_tokens, jnp.int32)
  select = select or sampling_select_fn(rng, temperature, top_k, top_p)
  return _decode_loop(tokens_to_logits, cache, select, batch_size=first_tokens.shape[0],
                      max_len=max_len, start_id=first_tokens, eos_id=loop_eos_id(eos_id),
                      budgets=budgets)


def _row_column(x):
  """A per-row setting [B] as [B, 1], to broadcast against logits [B, V]; others unchanged."""
  return x[:, None] if jnp.ndim(x) == 1 else x


def sampling_select_fn(rng: jax.Array, temperature: float | jnp.ndarray = 1.0,
                       top_k: int | jnp.ndarray = 0, top_p: float | jnp.ndarray = 1.0) -> SelectFn:
  """The rule `sample` picks each token by, as a `SelectFn` (the draw at step s uses
  fold_in(rng, s)); for a decoder that runs `decode_step` itself.

  `rng`: one key (the draws of all rows come from it together) or keys[B] (row i draws from
  keys[i] alone, so a row draws the same tokens whatever else is in the batch). The settings:
  one value or one per row [B]. Python values 0 for temperature (greedy), 0 for top_k and 1
  for top_p (no filter) are seen at trace time, and skip the draw or the sort.
  """

  def select_fn(logits, step):
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    if isinstance(temperature, (int, float)) and temperature == 0:
      return greedy  # Static greedy: no sort, no random draw.
    scaled = logits / jnp.maximum(_row_column(jnp.asarray(temperature, jnp.float32)), 1e-6)
    filtered = filter_logits(scaled, _row_column(top_k), _row_column(top_p))
    if jnp.ndim(rng) == 0:
      drawn = jax.random.categorical(jax.random.fold_in(rng, step), filtered, axis=-1)
    else:  # one key per row; a row's draw is what the row alone would draw
      drawn = jax.vmap(lambda key, row: jax.random.categorical(jax.random.fold_in(key, step), row))(
          rng, filtered)
    return jnp.where(jnp.asarray(temperature) > 0, drawn, greedy)

  return select_fn


def loop_eos_id(eos_id: int | None) -> int:
  """The id `decode_step` ends a row at: `eos_id`, or -1 (no token id, so without an EOS no row
  ever finishes early)."""
  return -1 if eos_id is None else eos_id
