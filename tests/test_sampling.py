"""Tests for sampling in transformer_jax.inference.search: temperature, top-k, top-p, EOS,
determinism.

The toy models return fixed logits (one row per batch element), so every draw of a long
batch is an independent sample of a known distribution.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.inference import search
from transformer_jax.special_tokens import EOS_ID, PAD_ID

PAD, EOS = PAD_ID, EOS_ID


def fixed_model(logits):
  """tokens_to_logits returning the same logits [V] for every row and step."""
  logits = jnp.asarray(logits, jnp.float32)

  def tokens_to_logits(tokens, cache):
    return jnp.broadcast_to(logits, (tokens.shape[0], logits.shape[0])), cache

  return tokens_to_logits


def table_model(table, tokens, cache):
  """Logits = table[step, last token]: a model whose greedy path is easy to compute."""
  logits = table[cache['step'], tokens[:, 0]]
  return logits, {'step': cache['step'] + 1}


def draw(logits, rows, steps, seed=0, **kwargs):
  out = search.sample(fixed_model(logits), {}, jax.random.key(seed), first_tokens=jnp.zeros(
      (rows,), jnp.int32), max_len=steps, **kwargs)
  return np.asarray(out)


# Hand-made distribution, deliberately not in id order: probabilities by rank are
# 0.5, 0.25, 0.15, 0.07, 0.03 at ids 3, 0, 4, 1, 2.
PROBS = np.array([0.25, 0.07, 0.03, 0.5, 0.15])
LOGITS = np.log(PROBS)


def test_top_k_never_leaves_the_k_most_likely():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=40) * 2.0
  for k in (1, 3, 7):
    allowed = set(np.argsort(-logits)[:k].tolist())
    tokens = draw(logits, rows=1000, steps=4, top_k=k)
    seen = set(tokens.ravel().tolist())
    assert seen <= allowed, f'top_k={k} drew {sorted(seen - allowed)}'
    if k > 1:  # and it really samples among them rather than always the best
      assert len(seen) > 1


@pytest.mark.parametrize(
    'top_p, kept_ids',
    [
        (0.3, [3]),  # 0.5 alone reaches 0.3
        (0.6, [3, 0]),  # 0.5 < 0.6 <= 0.75
        (0.8, [3, 0, 4]),  # 0.75 < 0.8 <= 0.9
        (0.95, [3, 0, 4, 1]),  # 0.9 < 0.95 <= 0.97
        (0.99, [3, 0, 4, 1, 2]),
        (1.0, [3, 0, 4, 1, 2]),
    ])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept_ids):
  probs = np.asarray(search.sampling_distribution(LOGITS, 1.0, 0, top_p))
  expected = np.zeros_like(PROBS)
  expected[kept_ids] = PROBS[kept_ids] / PROBS[kept_ids].sum()
  np.testing.assert_allclose(probs, expected, atol=1e-6)


def test_top_k_applies_before_top_p():
  # top-k 3 renormalises to 0.556, 0.278, 0.167: the first two already reach 0.8. Applied the
  # other way round (top-p on the full distribution) three tokens would survive.
  probs = np.asarray(search.sampling_distribution(LOGITS, 1.0, 3, 0.8))
  expected = np.zeros_like(PROBS)
  expected[[3, 0]] = PROBS[[3, 0]] / PROBS[[3, 0]].sum()
  np.testing.assert_allclose(probs, expected, atol=1e-6)


def test_filter_logits_is_exact_on_ties_and_traced_values():
  logits = jnp.array([[1.0, 2.0, 2.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
  out = np.asarray(search.filter_logits(logits, 2))
  # Ties go to the lower id, as argmax: exactly k survive.
  assert np.isfinite(out).sum(axis=-1).tolist() == [2, 2]
  assert np.isfinite(out[0]).tolist() == [False, True, True, False]
  assert np.isfinite(out[1]).tolist() == [True, True, False, False]
  jitted = jax.jit(search.filter_logits)(logits, jnp.int32(2), jnp.float32(1.0))
  np.testing.assert_array_equal(np.asarray(jitted), out)
  unfiltered = search.filter_logits(logits, jnp.int32(0), jnp.float32(1.0))
  np.testing.assert_array_equal(np.asarray(unfiltered), np.asarray(logits))


def test_sampled_frequencies_match_the_filtered_distribution():
  tokens = draw(LOGITS, rows=4000, steps=5, top_k=3, temperature=1.0)
  freq = np.bincount(tokens.ravel(), minlength=5) / tokens.size
  expected = np.asarray(search.sampling_distribution(LOGITS, 1.0, 3, 1.0))
  np.testing.assert_allclose(freq, expected, atol=0.01)
  # Temperature 2 flattens the distribution: the rarest kept token becomes more frequent.
  hot = draw(LOGITS, rows=4000, steps=5, top_k=3, temperature=2.0)
  assert np.mean(hot == 4) > np.mean(tokens == 4) + 0.03


def _greedy_path(table, first):
  """The argmax path of `table_model`, computed in NumPy."""
  tokens, last = [], np.asarray(first)
  for step in range(table.shape[0]):
    last = np.argmax(np.asarray(table)[step, last], axis=-1)
    tokens.append(last)
  return np.stack(tokens, axis=1)


@pytest.mark.parametrize('temperature', [0.0, 1e-4])
def test_low_temperature_is_greedy(temperature):
  rng = np.random.default_rng(1)
  table = jnp.asarray(rng.normal(size=(6, 9, 9)), jnp.float32)
  first = jnp.array([0, 2, 5, 7], jnp.int32)
  cache = {'step': jnp.array(0, jnp.int32)}
  model = lambda t, c: table_model(table, t, c)
  sampled = search.sample(model, cache, jax.random.key(3), first_tokens=first, max_len=6,
                          temperature=temperature, eos_id=None)
  np.testing.assert_array_equal(np.asarray(sampled), _greedy_path(table, first))
  # The same with temperature traced under jit (no Python-level shortcut).
  jitted = jax.jit(lambda t: search.sample(model, cache, jax.random.key(3), first_tokens=first,
                                           max_len=6, temperature=t))(jnp.float32(temperature))
  np.testing.assert_array_equal(np.asarray(jitted), _greedy_path(table, first))
  # And greedy_search agrees when every row starts from the same token.
  same = jnp.zeros((4,), jnp.int32)
  greedy = search.greedy_search(model, cache, batch_size=4, max_len=6, start_id=0, eos_id=-1)
  sampled = search.sample(model, cache, jax.random.key(0), first_tokens=same, max_len=6,
                          temperature=temperature)
  np.testing.assert_array_equal(np.asarray(sampled), np.asarray(greedy))


def test_same_rng_same_samples_different_rng_different():
  logits = np.zeros(50)  # uniform: two different keys essentially never agree on 64 tokens
  a = draw(logits, rows=4, steps=16, seed=7)
  b = draw(logits, rows=4, steps=16, seed=7)
  c = draw(logits, rows=4, steps=16, seed=8)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  # Rows are independent draws, not copies of one another.
  assert len({tuple(r) for r in a.tolist()}) == 4
  jitted = jax.jit(lambda key: search.sample(fixed_model(logits), {}, key, first_tokens=jnp.zeros(
      (4,), jnp.int32), max_len=16))
  np.testing.assert_array_equal(np.asarray(jitted(jax.random.key(7))), a)


def test_eos_stops_a_row_and_pads_the_rest():
  # EOS has about a third of the mass: rows end at different steps.
  logits = np.log(np.array([0.1, 0.35, 0.2, 0.15, 0.2]))
  tokens = draw(logits, rows=64, steps=12, eos_id=EOS)
  ended = 0
  for row in tokens:
    eos_at = np.flatnonzero(row == EOS)
    if eos_at.size:
      ended += 1
      assert np.all(row[eos_at[0] + 1:] == PAD), row
  assert ended > 0
  assert len({int(np.flatnonzero(r == EOS)[0]) for r in tokens if EOS in r}) > 1
  # Without an EOS id the same token is ordinary: nothing is padded after it.
  free = draw(logits, rows=64, steps=12, eos_id=None)
  after_first_eos = [row[np.flatnonzero(row == EOS)[0] + 1:] for row in free if EOS in row[:-1]]
  assert any(np.any(rest != PAD) for rest in after_first_eos)


def test_sampling_stops_early_when_every_row_has_ended():
  # EOS is certain at the first step: after it the loop must not call the model again.
  logits = jnp.full((4,), -1e9).at[EOS].set(0.0)
  calls = []

  def counting_model(tokens, cache):
    jax.debug.callback(lambda: calls.append(1))
    return jnp.broadcast_to(logits, (tokens.shape[0], 4)), cache

  out = jax.jit(lambda key: search.sample(counting_model, {}, key, first_tokens=jnp.zeros(
      (3,), jnp.int32), max_len=10, eos_id=EOS))(jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(out), [[EOS] + [PAD] * 9] * 3)
  jax.effects_barrier()
  assert len(calls) == 1
