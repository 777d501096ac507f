"""Tests for transformer_jax.inference.search on toy models whose exact answers can be computed.

The main toy model looks its logits up in a table indexed by (step, previous token, last
token). `last` is the fed-in token, `prev` lives in the cache with one entry per row and
`step` is a scalar cache leaf, so a search that mixes up cache rows between beams, or touches
the scalar leaf, decodes the wrong distribution and fails the brute-force comparisons.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.inference import search
from transformer_jax.special_tokens import EOS_ID, PAD_ID

PAD, EOS = PAD_ID, EOS_ID


def table_model(table, tokens, cache):
  """tokens_to_logits of the toy model: logits = table[step, prev, last]."""
  last = tokens[:, 0]
  logits = table[cache['step'], cache['prev'], last]
  return logits, {'prev': last, 'step': cache['step'] + 1}


def table_cache(prev):
  """Initial cache; different `prev` per row makes the rows decode differently."""
  return {'prev': jnp.asarray(prev, jnp.int32), 'step': jnp.array(0, jnp.int32)}


def random_table(seed, max_len, vocab, eos_bias=0.0):
  rng = np.random.default_rng(seed)
  table = rng.normal(size=(max_len, vocab, vocab, vocab)).astype(np.float32)
  table[..., EOS] += eos_bias
  return jnp.asarray(table)


def bigram_table(probs, max_len):
  """A pure bigram model (ignores step and prev) from next-token probabilities [V, V]."""
  logits = np.log(np.asarray(probs, np.float64)).astype(np.float32)
  vocab = logits.shape[0]
  return jnp.asarray(np.broadcast_to(logits[None, None], (max_len, vocab, vocab, vocab)))


def np_log_softmax(x):
  x = np.asarray(x, np.float64)
  m = np.max(x)
  return x - m - np.log(np.sum(np.exp(x - m)))


def penalty(length, alpha):
  return ((5.0 + length) / 6.0)**alpha


def brute_force(table, prev, max_len, alpha, start_id=0):
  """All hypotheses of one row, best first, as beam search defines the result.

  Candidates are the sequences that end at their first EOS (length <= max_len). Only if none
  has a finite log-prob are the EOS-free sequences of length max_len the candidates. Returns
  a list of (score, tokens padded with PAD to max_len).
  """
  table = np.asarray(table)
  finished, truncated = [], []

  def extend(step, prev, last, log_prob, seq):
    log_probs = np_log_softmax(table[step, prev, last])
    for token, lp in enumerate(log_probs):
      new_seq, new_lp = seq + (token,), log_prob + lp
      if not np.isfinite(new_lp):
        continue
      if token == EOS:
        finished.append((new_lp / penalty(len(new_seq), alpha), new_seq))
      elif len(new_seq) == max_len:
        truncated.append((new_lp / penalty(max_len, alpha), new_seq))
      else:
        extend(step + 1, last, token, new_lp, new_seq)

  extend(0, prev, start_id, 0.0, ())
  hyps = finished or truncated
  hyps.sort(key=lambda h: -h[0])
  return [(score, seq + (PAD,) * (max_len - len(seq))) for score, seq in hyps]


def seq_log_prob(table, prev, seq, start_id=0):
  """Log-prob of the tokens of `seq` up to and including its first EOS; also its length."""
  table = np.asarray(table)
  log_prob, last = 0.0, start_id
  for step, token in enumerate(seq):
    log_prob += np_log_softmax(table[step, prev, last])[token]
    prev, last = last, token
    if token == EOS:
      return log_prob, step + 1
  return log_prob, len(seq)


def assert_pad_after_eos(seqs):
  seqs = np.asarray(seqs).reshape(-1, seqs.shape[-1])
  for row in seqs:
    eos = np.flatnonzero(row == EOS)
    if eos.size:
      np.testing.assert_array_equal(row[eos[0] + 1:], PAD)


# ---------------------------------------------------------------------------------------------
# Beam helpers


def test_beam_helpers_layout_and_scalar_leaves():
  tree = {'x': jnp.arange(6).reshape(2, 3), 'index': jnp.array(7)}
  expanded = search.expand_to_beams(tree, 2)
  np.testing.assert_array_equal(expanded['x'], [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]])
  assert expanded['index'].shape == () and int(expanded['index']) == 7

  nested = search.unflatten_beams(expanded, 2)
  assert nested['x'].shape == (2, 2, 3) and nested['index'].shape == ()
  np.testing.assert_array_equal(search.flatten_beams(nested)['x'], expanded['x'])

  beams = {'x': jnp.array([[10, 11, 12], [20, 21, 22]]), 'index': jnp.array(7)}
  gathered = search.gather_beams(beams, jnp.array([[2, 2], [1, 0]]), 2, 2)
  np.testing.assert_array_equal(gathered['x'], [[12, 12], [21, 20]])
  assert int(gathered['index']) == 7
  with pytest.raises(ValueError):
    search.gather_beams(beams, jnp.array([[0, 1]]), 2, 2)


# ---------------------------------------------------------------------------------------------
# Greedy search


def test_greedy_follows_a_script_and_pads_after_eos():
  # The model emits row r's script[r, step] with near-certainty, whatever it is fed.
  script = jnp.array([
      [2, 3, 1, 4, 5, 2],  # EOS mid-way; tokens after it must become PAD.
      [1, 4, 4, 2, 3, 3],  # EOS at the very first step.
      [2, 2, 3, 4, 5, 2],  # Never EOS: runs to max_len.
      [3, 4, 5, 2, 3, 1]
  ])  # EOS at the last step.
  vocab, max_len = 6, script.shape[1]

  def script_model(tokens, cache):
    logits = 10.0 * jax.nn.one_hot(cache['script'][:, cache['step']], vocab)
    return logits, {'script': cache['script'], 'step': cache['step'] + 1}

  cache = {'script': script, 'step': jnp.array(0, jnp.int32)}
  expected = [[2, 3, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [2, 2, 3, 4, 5, 2], [3, 4, 5, 2, 3, 1]]
  out = search.greedy_search(script_model, cache, batch_size=4, max_len=max_len)
  assert out.dtype == jnp.int32 and out.shape == (4, max_len)
  np.testing.assert_array_equal(out, expected)

  seqs, scores = search.beam_search(script_model, cache, batch_size=4, beam_size=3, max_len=max_len)
  assert seqs.shape == (4, 3, max_len) and scores.shape == (4, 3)
  # Beam search prefers any finished hypothesis to an unfinished one, so for the EOS-free
  # row it returns the script with EOS forced at the last step (found within the beam).
  expected[2] = [2, 2, 3, 4, 5, 1]
  np.testing.assert_array_equal(seqs[:, 0], expected)
  assert_pad_after_eos(seqs)


def test_greedy_matches_stepwise_argmax_and_pads_after_eos():
  max_len, vocab, batch = 7, 6, 16
  table = random_table(0, max_len, vocab, eos_bias=-0.5)
  prev = np.arange(batch) % vocab
  out = np.asarray(
      search.greedy_search(functools.partial(table_model, table), table_cache(prev),
                           batch_size=batch, max_len=max_len))
  ended = (out == EOS).any(axis=1)
  assert ended.any() and not ended.all()  # Both kinds of rows are exercised.
  assert_pad_after_eos(out)
  for b in range(batch):  # Re-derive each row with plain numpy argmax.
    p, last = prev[b], 0
    for step in range(max_len):
      token = int(np.argmax(np.asarray(table)[step, p, last]))
      assert out[b, step] == token
      if token == EOS:
        break
      p, last = last, token


def test_greedy_stops_when_all_rows_have_ended():
  max_len, vocab = 10, 5
  calls = []

  def counting_model(tokens, cache):
    jax.debug.callback(lambda step: calls.append(int(step)), cache['step'])
    # EOS is the argmax from the second step on, so every row ends after two tokens.
    logits = jnp.where(cache['step'] >= 1, 5.0, -5.0) * jax.nn.one_hot(EOS, vocab)
    return jnp.broadcast_to(logits, (tokens.shape[0], vocab)), {'step': cache['step'] + 1}

  cache = {'step': jnp.array(0, jnp.int32)}
  out = search.greedy_search(counting_model, cache, batch_size=3, max_len=max_len)
  jax.effects_barrier()
  np.testing.assert_array_equal(out, [[0, 1] + [0] * 8] * 3)
  assert calls == [0, 1]


# ---------------------------------------------------------------------------------------------
# Beam search


@pytest.mark.parametrize('alpha', [0.0, 0.6])
@pytest.mark.parametrize('prev', [0, 3])
def test_large_beam_is_exhaustive_search(alpha, prev):
  # A beam of V**max_len hypotheses never drops a candidate, so its finished set must be the
  # full ranking of all EOS-terminated sequences.
  max_len, vocab = 4, 5
  table = random_table(1, max_len, vocab)
  beam = vocab**max_len
  seqs, scores = search.beam_search(functools.partial(table_model, table), table_cache([prev]),
                                    batch_size=1, beam_size=beam, max_len=max_len, alpha=alpha)
  expected = brute_force(table, prev, max_len, alpha)
  n = len(expected)
  assert n == 1 + 4 + 16 + 64
  np.testing.assert_allclose(scores[0, :n], [s for s, _ in expected], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(seqs[0, :n], [seq for _, seq in expected])
  assert np.all(np.isneginf(scores[0, n:])) and np.all(seqs[0, n:] == PAD)


def test_no_finished_hypothesis_falls_back_to_alive_beams():
  # EOS is impossible (-inf logit), so every hypothesis runs to max_len.
  max_len, vocab, prev = 4, 5, 2
  table = np.array(random_table(2, max_len, vocab))
  table[..., EOS] = -np.inf
  table = jnp.asarray(table)
  alpha = 0.6
  seqs, scores = search.beam_search(functools.partial(table_model,
                                                      table), table_cache([prev]), batch_size=1,
                                    beam_size=vocab**max_len, max_len=max_len, alpha=alpha)
  expected = brute_force(table, prev, max_len, alpha)
  n = len(expected)
  assert n == 4**max_len
  np.testing.assert_allclose(scores[0, :n], [s for s, _ in expected], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(seqs[0, :n], [seq for _, seq in expected])

  # A small beam still returns its alive hypotheses, sorted, with the max_len penalty.
  seqs, scores = search.beam_search(functools.partial(table_model, table), table_cache([prev]),
                                    batch_size=1, beam_size=3, max_len=max_len, alpha=alpha)
  assert np.all(np.diff(scores[0]) <= 0) and np.all(np.isfinite(scores))
  for k in range(3):
    log_prob, length = seq_log_prob(table, prev, np.asarray(seqs[0, k]))
    assert length == max_len and EOS not in np.asarray(seqs[0, k])
    np.testing.assert_allclose(scores[0, k], log_prob / penalty(max_len, alpha), rtol=1e-5)


@pytest.mark.parametrize('alpha', [0.0, 0.6, 2.0])
def test_beam_size_one_is_greedy(alpha):
  max_len, vocab, batch = 8, 6, 16
  table = random_table(3, max_len, vocab, eos_bias=-0.5)
  prev = np.arange(batch) % vocab
  model = functools.partial(table_model, table)
  greedy = np.asarray(
      search.greedy_search(model, table_cache(prev), batch_size=batch, max_len=max_len))
  seqs, scores = search.beam_search(model, table_cache(prev), batch_size=batch, beam_size=1,
                                    max_len=max_len, alpha=alpha)
  ended = (greedy == EOS).any(axis=1)
  assert ended.any() and not ended.all()  # EOS-terminated and fallback rows both occur.
  np.testing.assert_array_equal(seqs[:, 0], greedy)
  for b in range(batch):
    log_prob, length = seq_log_prob(table, prev[b], greedy[b])
    np.testing.assert_allclose(scores[b, 0], log_prob / penalty(length, alpha), rtol=1e-5)


def test_length_penalty_favours_longer_hypotheses():
  # From the start token: EOS with log-prob -1.0 (short hypothesis), or the chain 2 3 4 EOS
  # with total log-prob -1.4 (long hypothesis). Other tokens share the remaining mass.
  vocab, max_len = 6, 5
  probs = np.full((vocab, vocab), np.nan)
  probs[0, EOS], probs[0, 2] = np.exp(-1.0), np.exp(-1.1)
  probs[2, 3] = probs[3, 4] = probs[4, EOS] = np.exp(-0.1)
  for row in probs:
    unset = np.isnan(row)
    row[unset] = (1.0 - np.nansum(row)) / unset.sum()
  table = bigram_table(probs, max_len)
  model = functools.partial(table_model, table)
  short, long = [EOS, 0, 0, 0, 0], [2, 3, 4, EOS, 0]

  for alpha, best, other in [(0.0, short, long), (1.0, long, short)]:
    seqs, scores = search.beam_search(model, table_cache([0]), batch_size=1, beam_size=4,
                                      max_len=max_len, alpha=alpha)
    top = [list(map(int, s)) for s in np.asarray(seqs[0])]
    assert top[0] == best and other in top[1:]
    expected = {tuple(short): -1.0 / penalty(1, alpha), tuple(long): -1.4 / penalty(4, alpha)}
    np.testing.assert_allclose(scores[0, 0], expected[tuple(best)], rtol=1e-5)
    np.testing.assert_allclose(scores[0, top.index(other)], expected[tuple(other)], rtol=1e-5)
    assert brute_force(table, 0, max_len, alpha)[0][1] == tuple(best)


def test_beam_search_stops_once_no_alive_beam_can_win():
  max_len, vocab = 10, 5
  calls = []

  def counting_model(tokens, cache):
    jax.debug.callback(lambda step: calls.append(int(step)), cache['step'])
    # EOS is very likely everywhere: the two finished slots fill after two steps, and the
    # alive beams (log-prob about -10) cannot catch up with finished ones (about -5).
    logits = 5.0 * jax.nn.one_hot(EOS, vocab)
    return jnp.broadcast_to(logits, (tokens.shape[0], vocab)), {'step': cache['step'] + 1}

  cache = {'step': jnp.array(0, jnp.int32)}
  seqs, scores = search.beam_search(counting_model, cache, batch_size=2, beam_size=2,
                                    max_len=max_len, alpha=0.0)
  jax.effects_barrier()
  assert calls == [0, 1]
  np.testing.assert_array_equal(seqs[:, 0, :2], [[EOS, PAD]] * 2)
  assert np.all(np.isfinite(scores)) and np.all(scores[:, 0] > scores[:, 1])


def test_pad_after_eos_in_every_beam():
  max_len, vocab, batch, beam = 8, 6, 6, 4
  table = random_table(4, max_len, vocab, eos_bias=0.5)
  seqs, scores = search.beam_search(functools.partial(table_model, table),
                                    table_cache(np.arange(batch) % vocab), batch_size=batch,
                                    beam_size=beam, max_len=max_len)
  assert_pad_after_eos(seqs)
  assert np.all(np.diff(np.asarray(scores), axis=1) <= 0)  # Best first.


# ---------------------------------------------------------------------------------------------
# jit and batching


def test_decoders_run_under_jit():
  max_len, vocab, batch, beam = 6, 5, 3, 3
  table = random_table(5, max_len, vocab, eos_bias=0.5)
  cache = table_cache([0, 2, 4])

  @jax.jit
  def decode(table, cache):
    model = functools.partial(table_model, table)
    greedy = search.greedy_search(model, cache, batch_size=batch, max_len=max_len)
    seqs, scores = search.beam_search(model, cache, batch_size=batch, beam_size=beam,
                                      max_len=max_len)
    return greedy, seqs, scores

  greedy, seqs, scores = decode(table, cache)
  model = functools.partial(table_model, table)
  np.testing.assert_array_equal(
      greedy, search.greedy_search(model, cache, batch_size=batch, max_len=max_len))
  eager_seqs, eager_scores = search.beam_search(model, cache, batch_size=batch, beam_size=beam,
                                                max_len=max_len)
  np.testing.assert_array_equal(seqs, eager_seqs)
  np.testing.assert_allclose(scores, eager_scores, rtol=1e-6)

  # The public entry points jit directly once the model is bound with functools.partial.
  jit_beam = jax.jit(
      functools.partial(search.beam_search, model, batch_size=batch, beam_size=beam,
                        max_len=max_len))
  np.testing.assert_array_equal(jit_beam(cache)[0], eager_seqs)


def test_batch_rows_decode_independently():
  max_len, vocab, beam = 7, 6, 3
  prev = [0, 1, 3, 5, 2]
  table = random_table(6, max_len, vocab, eos_bias=1.0)

  # Jitted once per batch size, so decoding the rows one by one compiles only once.
  @functools.partial(jax.jit, static_argnames='batch')
  def decode(prev, batch):
    model = functools.partial(table_model, table)
    greedy = search.greedy_search(model, table_cache(prev), batch_size=batch, max_len=max_len)
    seqs, scores = search.beam_search(model, table_cache(prev), batch_size=batch, beam_size=beam,
                                      max_len=max_len)
    return greedy, seqs, scores

  greedy, seqs, scores = decode(jnp.array(prev), len(prev))
  assert len({tuple(np.asarray(s).ravel()) for s in seqs}) > 1  # Rows really differ.
  for b, p in enumerate(prev):
    alone_greedy, alone_seqs, alone_scores = decode(jnp.array([p]), 1)
    np.testing.assert_array_equal(greedy[b], alone_greedy[0])
    np.testing.assert_array_equal(seqs[b], alone_seqs[0])
    np.testing.assert_allclose(scores[b], alone_scores[0], rtol=1e-6)
