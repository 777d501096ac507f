"""T5's span corruption (data/span_corruption.py): the construction checked by hand, its
statistics on a real corpus, determinism, edge cases, and the sentinel/prefix tokenizers.

The reconstruction below is written independently of the module: walk the inputs, and at
sentinel i splice in what follows sentinel i in the targets. It must give back the original
tokens exactly, for every length and seed tried.
"""

import numpy as np
import pytest

from transformer_jax.data import span_corruption as sc
from transformer_jax.data import text, tokenizer as tok
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.special_tokens import EOS_ID

VOCAB, SENTINELS = 1000, 100  # model vocabulary: sentinel i is 999 - i


def sentinel(i: int) -> int:
  return VOCAB - 1 - i


def is_sentinel(token: int) -> bool:
  return VOCAB - SENTINELS <= token < VOCAB


def reconstruct(inputs, targets) -> list[int]:
  """The original tokens from (inputs, targets), both ending with EOS; asserts the sentinels
  run 0, 1, 2, ... in both."""
  inputs, targets = list(map(int, inputs)), list(map(int, targets))
  assert inputs[-1] == EOS_ID and targets[-1] == EOS_ID
  assert EOS_ID not in inputs[:-1] and EOS_ID not in targets[:-1]
  inputs, targets = inputs[:-1], targets[:-1]
  spans, current = {}, None
  for token in targets:
    if is_sentinel(token):
      current = VOCAB - 1 - token
      assert current == len(spans), f'targets sentinels out of order: {targets}'
      spans[current] = []
    else:
      assert current is not None, f'targets start with a non-sentinel: {targets}'
      spans[current].append(token)
  out, seen = [], 0
  for token in inputs:
    if is_sentinel(token):
      i = VOCAB - 1 - token
      assert i == seen, f'inputs sentinels out of order: {inputs}'
      assert spans.get(i), f'sentinel {i} stands for an empty span'
      out += spans[i]
      seen += 1
    else:
      out.append(token)
  # Only a final sentinel (standing for the kept tail) may be left over, with nothing after it.
  assert set(spans) - set(range(seen)) <= {seen} and not spans.get(seen)
  return out


def runs(mask: np.ndarray) -> list[tuple[bool, int]]:
  """[(is_noise, length)] of the mask's runs."""
  out = []
  for value in mask.tolist():
    if out and out[-1][0] == value:
      out[-1] = (value, out[-1][1] + 1)
    else:
      out.append((value, 1))
  return out


# -- the construction, by hand ------------------------------------------------------------------


def test_the_papers_example_by_hand():
  """Figure 2 of the T5 paper: 'for inviting' and 'last' dropped. Inputs: each span replaced by
  one sentinel, in order; targets: each sentinel followed by its span, then a final sentinel
  (the text ends with kept tokens), then EOS."""
  words = 'Thank you for inviting me to your party last week .'.split()
  ids = {w: 10 + i for i, w in enumerate(dict.fromkeys(words))}
  tokens = [ids[w] for w in words]
  mask = [w in ('for', 'inviting', 'last') for w in words]
  inputs, targets = sc.corrupt_spans(tokens, mask, vocab_size=VOCAB, num_sentinels=SENTINELS)
  x, y, z = sentinel(0), sentinel(1), sentinel(2)
  assert (x, y, z) == (999, 998, 997)
  expected_inputs = ['Thank', 'you', x, 'me', 'to', 'your', 'party', y, 'week', '.']
  assert inputs.tolist() == [ids.get(w, w) for w in expected_inputs] + [EOS_ID]
  assert targets.tolist() == [x, ids['for'], ids['inviting'], y, ids['last'], z, EOS_ID]
  assert inputs.dtype == targets.dtype == np.int32
  assert reconstruct(inputs, targets) == tokens


def test_text_ending_in_noise_has_no_final_sentinel():
  """T5's masks end with a noise span: then the targets end with that span and EOS."""
  tokens = np.arange(10, 18)
  mask = np.array([0, 1, 1, 0, 0, 0, 1, 1], bool)
  inputs, targets = sc.corrupt_spans(tokens, mask, vocab_size=VOCAB, num_sentinels=SENTINELS)
  assert inputs.tolist() == [10, sentinel(0), 13, 14, 15, sentinel(1), EOS_ID]
  assert targets.tolist() == [sentinel(0), 11, 12, sentinel(1), 16, 17, EOS_ID]


def test_noise_mask_has_t5s_counts_and_alternates_starting_with_kept_tokens():
  """100 tokens: round(15) = 15 noise tokens in round(15 / 3) = 5 spans, runs alternating
  kept/noise, the first kept and the last noise; 20 tokens: 3 noise tokens in 1 span."""
  for length, noise, spans in ((100, 15, 5), (20, 3, 1), (141, 21, 7), (10, 2, 1)):
    for seed in range(20):
      mask = sc.random_spans_noise_mask(length, np.random.default_rng(seed))
      assert mask.shape == (length,) and mask.dtype == bool
      assert mask.sum() == noise
      parts = runs(mask)
      assert [is_noise for is_noise, _ in parts] == [False, True] * spans
      assert sc.noise_counts(length) == (noise, spans)


def test_random_segmentation_is_uniform_over_the_splits():
  """4 items in 2 non-empty parts: (1, 3), (2, 2) and (3, 1) about equally often."""
  rng = np.random.default_rng(0)
  counts = {}
  for _ in range(3000):
    split = tuple(sc._random_segmentation(4, 2, rng).tolist())
    counts[split] = counts.get(split, 0) + 1
  assert set(counts) == {(1, 3), (2, 2), (3, 1)}
  assert all(abs(c - 1000) < 120 for c in counts.values()), counts


@pytest.mark.parametrize('length', [1, 2, 3, 4, 5, 7, 13, 64, 141, 568])
def test_inputs_and_targets_rebuild_the_text_exactly(length):
  """No token lost or duplicated: inputs' kept tokens with the targets' spans spliced in at
  the sentinels give back the tokens, for 30 masks per length; the lengths are those that
  `corrupted_lengths` predicts (so every chunk of one length has one shape)."""
  tokens = np.random.default_rng(length).integers(4, VOCAB - SENTINELS, size=length)
  for seed in range(30):
    inputs, targets = sc.span_corruption(tokens, np.random.default_rng(seed), vocab_size=VOCAB,
                                         num_sentinels=SENTINELS)
    assert reconstruct(inputs, targets) == tokens.tolist()
    assert (len(inputs), len(targets)) == sc.corrupted_lengths(length)


def test_rebuild_holds_for_any_mask_also_noise_first():
  """Hand-made masks, including ones the T5 mask never makes (noise first, all noise)."""
  rng = np.random.default_rng(1)
  for _ in range(200):
    length = int(rng.integers(1, 30))
    tokens = rng.integers(4, VOCAB - SENTINELS, size=length)
    mask = rng.random(length) < rng.random()
    inputs, targets = sc.corrupt_spans(tokens, mask, vocab_size=VOCAB, num_sentinels=SENTINELS)
    assert reconstruct(inputs, targets) == tokens.tolist()
  inputs, targets = sc.corrupt_spans([5, 6, 7], [1, 1, 1], vocab_size=VOCAB)
  assert inputs.tolist() == [sentinel(0), EOS_ID]
  assert targets.tolist() == [sentinel(0), 5, 6, 7, EOS_ID]


# -- edge cases -----------------------------------------------------------------------------------


def test_very_short_texts():
  """T5 treats a 1-token text as 2 tokens and crops: no noise, the token kept, the target a
  lone (final) sentinel. 2 tokens: the second is the noise. 0 tokens: just EOS."""
  one = sc.span_corruption([42], np.random.default_rng(0), vocab_size=VOCAB)
  assert [a.tolist() for a in one] == [[42, EOS_ID], [sentinel(0), EOS_ID]]
  for seed in range(5):
    two = sc.span_corruption([42, 43], np.random.default_rng(seed), vocab_size=VOCAB)
    assert [a.tolist() for a in two] == [[42, sentinel(0), EOS_ID], [sentinel(0), 43, EOS_ID]]
  three = sc.span_corruption([42, 43, 44], np.random.default_rng(0), vocab_size=VOCAB)
  assert [a.tolist() for a in three] == [[42, 43, sentinel(0), EOS_ID], [sentinel(0), 44, EOS_ID]]
  empty = sc.span_corruption([], np.random.default_rng(0), vocab_size=VOCAB)
  assert [a.tolist() for a in empty] == [[EOS_ID], [EOS_ID]]
  assert sc.corrupted_lengths(0) == (1, 1) and sc.corrupted_lengths(1) == (2, 2)


def test_chunk_length_fills_max_len_like_t5s_random_spans_helper():
  """max_len 128 (EOS included): 141-token chunks give 141 - 21 + 7 + 1 = 128 inputs and
  21 + 7 + 1 = 29 targets; 142 would give 129. T5's default 512 -> 568 (its inputs_length)."""
  assert sc.chunk_length(128) == 141
  assert sc.corrupted_lengths(141) == (128, 29)
  assert sc.corrupted_lengths(142)[0] == 129
  assert sc.chunk_length(512) == 568
  for max_len in (2, 3, 8, 33, 200):
    length = sc.chunk_length(max_len)
    assert max(sc.corrupted_lengths(length)) <= max_len < max(sc.corrupted_lengths(length + 1))


def test_bad_settings_are_named():
  with pytest.raises(ConfigError, match='noise_density must be in'):
    sc.random_spans_noise_mask(10, np.random.default_rng(0), noise_density=1.0)
  with pytest.raises(ConfigError, match='mean_noise_span_length must be at least 1'):
    sc.chunk_length(128, mean_noise_span_length=0.5)
  with pytest.raises(ConfigError, match='max_len must be at least 2'):
    sc.chunk_length(1)
  with pytest.raises(DataError, match=r'needs 2 sentinels \(2 noise spans\) but there are '
                     'only 1'):
    sc.corrupt_spans([5, 6, 7, 8], [0, 1, 0, 1], vocab_size=VOCAB, num_sentinels=1)
  with pytest.raises(DataError, match=r'needs 2 sentinels \(1 noise spans and a final one\)'):
    sc.corrupt_spans([5, 6, 7], [0, 1, 0], vocab_size=VOCAB, num_sentinels=1)


# -- determinism --------------------------------------------------------------------------------


def test_same_seed_same_corruption_other_seed_other():
  chunks = sc.pack_and_split([np.arange(4, 900)], 141)
  first = sc.corrupt_chunks(chunks, (0, 0), vocab_size=VOCAB)
  again = sc.corrupt_chunks(chunks, (0, 0), vocab_size=VOCAB)
  other = sc.corrupt_chunks(chunks, (0, 1), vocab_size=VOCAB)
  flat = lambda pairs: [a.tolist() for side in pairs for a in side]
  assert flat(first) == flat(again)
  assert flat(first) != flat(other)


def test_pack_and_split():
  """Documents are concatenated and cut into fixed lengths, the remainder last."""
  chunks = sc.pack_and_split([[1, 2, 3], [4, 5], [], [6, 7, 8, 9]], 4)
  assert [c.tolist() for c in chunks] == [[1, 2, 3, 4], [5, 6, 7, 8], [9]]
  assert sc.pack_and_split([], 4) == [] and sc.pack_and_split([[]], 4) == []
  assert [c.tolist() for c in sc.pack_and_split([range(8)], 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_batcher_draws_new_masks_each_epoch_and_resumes_exactly():
  """Epoch 1 corrupts the same chunks differently from epoch 0; the position after k batches,
  restored into a fresh batcher, gives the same next batches (across an epoch boundary)."""
  chunks = sc.pack_and_split([np.arange(4, 4 + 20 * 141) % 800 + 4], 141)
  make = lambda: sc.SpanCorruptionBatcher(chunks, seed=3, vocab_size=VOCAB, batch_tokens=4 * 128,
                                          buckets=[128])
  batcher = make()
  assert batcher.num_batches_per_epoch == 5 and batcher.num_examples == 20
  stream = iter(batcher)
  epoch0 = [next(stream) for _ in range(5)]
  epoch1 = [next(stream) for _ in range(5)]
  by_index = lambda batches: {
      int(i): (tuple(b['inputs'][r]), tuple(b['targets'][r])) for b in batches
      for r, i in enumerate(b['index'])
  }
  e0, e1 = by_index(epoch0), by_index(epoch1)
  assert set(e0) == set(e1) == set(range(20))
  assert sum(e0[i] != e1[i] for i in range(20)) >= 18  # new masks for (nearly) every chunk
  for pairs in (e0, e1):  # every pair still rebuilds its chunk
    for i, (inputs, targets) in pairs.items():
      cut = inputs.index(EOS_ID) + 1, targets.index(EOS_ID) + 1
      assert reconstruct(inputs[:cut[0]], targets[:cut[1]]) == chunks[i].tolist()

  # Targets cut to 32 columns (the longest is 29 + padding): the same batches, narrower.
  cropped = sc.SpanCorruptionBatcher(chunks, seed=3, vocab_size=VOCAB, batch_tokens=4 * 128,
                                     buckets=[128], targets_length=sc.targets_length(128))
  assert sc.targets_length(128) == 32
  for expected, got in zip(epoch0 + epoch1, iter(cropped)):
    assert got['targets'].shape == (4, 32) and got['inputs'].shape == (4, 128)
    assert np.array_equal(got['inputs'], expected['inputs'])
    assert np.array_equal(got['targets'], expected['targets'][:, :32])
    assert not expected['targets'][:, 32:].any()  # only padding was cut


# -- statistics on a real corpus ------------------------------------------------------------------


@pytest.fixture(scope='module')
def multi30k_ids(corpus, tmp_path_factory):
  """Every line of Multi30k's train.en (29,000) as ids of a 500-piece SentencePiece model."""
  lines = text.read_lines(str(corpus('multi30k') / 'train.en.gz'))
  path = str(tmp_path_factory.mktemp('spm') / 'en.model')
  tokenizer = tok.train_tokenizer(lines, path, 500)
  return tokenizer, tokenizer.encode_batch(lines)


def mask_statistics(sequences, seed: int = 0) -> tuple[float, float, np.ndarray]:
  """(noise density, mean noise span length, span lengths) over T5 masks of the sequences."""
  rng = np.random.default_rng(seed)
  noise = total = 0
  lengths = []
  for ids in sequences:
    mask = sc.random_spans_noise_mask(len(ids), rng)
    noise += int(mask.sum())
    total += len(mask)
    lengths += [n for is_noise, n in runs(mask) if is_noise]
  return noise / total, float(np.mean(lengths)), np.asarray(lengths)


def test_noise_density_and_span_length_on_multi30k(multi30k_ids):
  """Packed into the 141-token chunks of max_len 128 (as training does), Multi30k's English
  side gets 15% noise (within 0.01) in spans of mean length 3 (within 0.1), the lengths
  spread (1 to > 8); masked line by line (mostly 10-30 tokens), the density is still 15%."""
  _, ids = multi30k_ids
  chunks = sc.pack_and_split(ids, sc.chunk_length(128))
  density, mean_span, lengths = mask_statistics(chunks)
  print(f'packed ({len(chunks)} chunks): density {density:.4f}, mean span {mean_span:.3f}')
  assert abs(density - 0.15) < 0.01, density
  assert abs(mean_span - 3.0) < 0.1, mean_span
  assert lengths.min() == 1 and lengths.max() > 8
  density, mean_span, _ = mask_statistics(ids)
  print(f'per line ({len(ids)} lines): density {density:.4f}, mean span {mean_span:.3f}')
  assert abs(density - 0.15) < 0.01, density
  for i, chunk in enumerate(chunks[:300]):  # and every chunk rebuilds exactly
    pair = sc.span_corruption(chunk, np.random.default_rng(i), vocab_size=VOCAB)
    assert reconstruct(*pair) == chunk.tolist()


# -- tokenizers ---------------------------------------------------------------------------------


def test_sentinel_tokenizer_reads_and_writes_extra_ids(multi30k_ids):
  """500 pieces + 100 sentinels = 600 ids; '<extra_id_0>' is 599, '<extra_id_99>' 500; a
  corrupted pair decodes to text that encodes back to the same ids; '<extra_id_100>' is text."""
  base, _ = multi30k_ids
  tokenizer = sc.SentinelTokenizer(base, 100)
  assert tokenizer.vocab_size == 600
  assert tokenizer.encode('<extra_id_0>') == [599]
  assert tokenizer.encode('<extra_id_99>') == [500]
  ids = tokenizer.encode('A man <extra_id_0> a dog <extra_id_1>.')
  assert ids == base.encode('A man') + [599] + base.encode('a dog') + [598] + base.encode('.')
  assert tokenizer.decode(ids + [EOS_ID, 7]) == 'A man <extra_id_0> a dog <extra_id_1> .'
  assert tokenizer.encode('x <extra_id_100>') == base.encode('x <extra_id_100>')
  assert tokenizer.encode_batch(['A dog.', 'a <extra_id_2>'
                                ]) == [base.encode('A dog.'),
                                       base.encode('a') + [597]]
  # Whole words cut out ('young guys' and 'at'): the text round-trips to the same ids.
  words = [base.encode(w) for w in 'Two young guys with shaggy hair look at their hands.'.split()]
  ids = [i for word in words for i in word]
  mask = [n in (1, 2, 7) for n, word in enumerate(words) for _ in word]
  inputs, targets = sc.corrupt_spans(ids, mask, vocab_size=600, num_sentinels=100)
  source, target = tokenizer.decode(inputs), tokenizer.decode(targets)
  assert source == 'Two <extra_id_0> with shaggy hair look <extra_id_1> their hands.'
  assert target == '<extra_id_0> young guys <extra_id_1> at <extra_id_2>'  # + the final one
  assert tokenizer.encode(source) + [EOS_ID] == inputs.tolist()
  assert tokenizer.encode(target) + [EOS_ID] == targets.tolist()


def test_prefixed_tokenizer_puts_the_prefix_first(multi30k_ids):
  base, _ = multi30k_ids
  prefix = 'translate English to German: '
  tokenizer = sc.PrefixedTokenizer(sc.SentinelTokenizer(base, 100), prefix)
  prefix_ids = base.encode(prefix)
  assert len(prefix_ids) > 3 and tokenizer.vocab_size == 600
  for sentence in ('A dog runs.', 'Two men', ''):
    assert tokenizer.encode(sentence)[:len(prefix_ids)] == prefix_ids
  assert tokenizer.encode_batch(['A dog runs.'])[0] == base.encode(prefix + 'A dog runs.')
