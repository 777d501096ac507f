"""Tests for encoding sentence pairs and the bucketed, resumable batcher."""

import itertools

import numpy as np
import pytest

from transformer_jax.data import batching
from transformer_jax.data import numbers
from transformer_jax.data import tokenizer as tok_lib
from transformer_jax.special_tokens import EOS_ID, PAD_ID
from transformer_jax.errors import ConfigError, DataError

BUCKETS = [8, 16, 32, 64]


class WordTokenizer:
  """Stand-in tokenizer: one id per word, id = 10 + word length."""

  def encode_batch(self, texts):
    return [[10 + len(word) for word in t.split()] for t in texts]


def make_examples(num_examples: int, seed: int = 0, max_len: int = 60):
  """Random id sequences that end with EOS and contain no PAD."""
  rng = np.random.default_rng(seed)

  def sequence():
    ids = rng.integers(4, 100, size=rng.integers(1, max_len + 1)).astype(np.int32)
    ids[-1] = EOS_ID
    return ids

  src = [sequence() for _ in range(num_examples)]
  tgt = [sequence() for _ in range(num_examples)]
  return src, tgt


def take(batcher, n):
  return list(itertools.islice(iter(batcher), n))


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(x[key], y[key])


def test_default_buckets():
  assert batching.default_buckets(256) == [8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
  assert batching.default_buckets(100) == [8, 16, 24, 32, 48, 64, 96, 104]
  assert batching.default_buckets(30) == [8, 16, 24, 32]
  assert batching.default_buckets(8) == [8]
  assert batching.default_buckets(3) == [8]
  buckets = batching.default_buckets(1000)
  assert buckets[-1] == 1000 and all(b % 8 == 0 for b in buckets)
  assert buckets == sorted(set(buckets))


def test_configured_buckets_replace_the_defaults_and_one_bucket_gives_one_shape():
  assert batching.bucket_lengths(30, ()) == batching.default_buckets(30)
  assert batching.bucket_lengths(30, (16, 40)) == [16, 40]
  src, tgt = make_examples(200, max_len=30)
  batcher = batching.BucketedBatcher(src, tgt, batch_tokens=256,
                                     buckets=batching.bucket_lengths(30, (32,)), seed=0)
  shapes = {(b['inputs'].shape, b['targets'].shape) for b in take(batcher, 20)}
  assert shapes == {((8, 32), (8, 32))}
  with pytest.raises(ConfigError, match=r'must end at data.max_len \(32\).*\(16, 24\)'):
    batching.bucket_lengths(32, (16, 24))  # 32-token examples would fit no bucket


def test_encode_pairs_filter():
  src = ['a b c', 'a b c d e f g', 'a', 'a b']
  tgt = ['x y', 'x', 'x y z w v u t s', 'x y z']
  src_ids, tgt_ids, stats = batching.encode_pairs(WordTokenizer(), WordTokenizer(), src, tgt,
                                                  max_len=5)
  assert stats == {'total': 4, 'filtered': 2, 'truncated': 0}
  assert [s.tolist() for s in src_ids] == [[11, 11, 11, EOS_ID], [11, 11, EOS_ID]]
  assert [t.tolist() for t in tgt_ids] == [[11, 11, EOS_ID], [11, 11, 11, EOS_ID]]
  assert all(s.dtype == np.int32 for s in src_ids + tgt_ids)


def test_encode_pairs_exact_fit_is_kept():
  # 4 words + EOS = 5 = max_len fits; 5 words + EOS does not.
  _, _, stats = batching.encode_pairs(WordTokenizer(), WordTokenizer(), ['a b c d', 'a b c d e'],
                                      ['x', 'x'], max_len=5)
  assert stats['filtered'] == 1


def test_encode_pairs_truncate():
  src = ['a b c d e f g', 'abc']
  tgt = ['x', 'x y z w v u t s']
  src_ids, tgt_ids, stats = batching.encode_pairs(WordTokenizer(), WordTokenizer(), src, tgt,
                                                  max_len=4, overflow='truncate')
  assert stats == {'total': 2, 'filtered': 0, 'truncated': 2}
  assert [s.tolist() for s in src_ids] == [[11, 11, 11, EOS_ID], [13, EOS_ID]]
  assert [t.tolist() for t in tgt_ids] == [[11, EOS_ID], [11, 11, 11, EOS_ID]]


def test_encode_pairs_errors():
  tok = WordTokenizer()
  with pytest.raises(ConfigError, match='overflow'):
    batching.encode_pairs(tok, tok, ['a'], ['b'], max_len=8, overflow='wrap')
  with pytest.raises(DataError, match='max_len=3'):
    batching.encode_pairs(tok, tok, ['a b c', 'a b c d'], ['b', 'b'], max_len=3)


def test_encode_pairs_with_sentencepiece_on_numbers(tmp_path):
  english, german = numbers.make_numbers_corpus(2000, seed=0)
  tokenizer = tok_lib.train_tokenizer(english + german, str(tmp_path / 'spm.model'), 120)
  src, tgt, stats = batching.encode_pairs(tokenizer, tokenizer, english, german, max_len=32)
  assert stats['filtered'] == 0 and len(src) == 2000
  assert tokenizer.decode(src[0]) == english[0] and tokenizer.decode(tgt[0]) == german[0]
  assert all(s[-1] == EOS_ID and EOS_ID not in s[:-1] for s in src + tgt)
  # The toy task keeps sentences short, so a small model and max_len suffice.
  assert np.mean([len(t) for t in tgt]) < 16


def test_shapes_padding_and_exactly_once_per_epoch():
  src, tgt = make_examples(300)
  batcher = batching.BucketedBatcher(src, tgt, batch_tokens=256, buckets=BUCKETS, seed=0,
                                     multiple_of=4)
  assert batcher.num_examples == 300
  shapes = {}
  seen = []
  for batch in take(batcher, batcher.num_batches_per_epoch):
    assert set(batch) == {'inputs', 'targets', 'index'}
    assert batch['inputs'].dtype == batch['targets'].dtype == batch['index'].dtype == np.int32
    rows, length = batch['inputs'].shape
    assert batch['targets'].shape == (rows, length) and batch['index'].shape == (rows,)
    assert shapes.setdefault(length, rows) == rows  # One static shape per bucket.
    assert rows % 4 == 0
    assert rows * length <= max(256, 4 * length)
    for row, i in enumerate(batch['index']):
      if i < 0:
        assert (batch['inputs'][row] == PAD_ID).all() and (batch['targets'][row] == PAD_ID).all()
        continue
      seen.append(i)
      longest = max(len(src[i]), len(tgt[i]))
      # The smallest bucket that fits.
      assert length == min(b for b in BUCKETS if b >= longest)
      for sequence, padded in ((src[i], batch['inputs'][row]), (tgt[i], batch['targets'][row])):
        np.testing.assert_array_equal(padded[:len(sequence)], sequence)
        assert (padded[len(sequence):] == PAD_ID).all()
  assert sorted(seen) == list(range(300))
  assert shapes == {8: 32, 16: 16, 32: 8, 64: 4}


def test_rows_rounding_and_max_rows():
  src, tgt = make_examples(200)
  batcher = batching.BucketedBatcher(src, tgt, batch_tokens=1000, buckets=BUCKETS, seed=0,
                                     multiple_of=8, max_rows=60)
  rows = {
      b['inputs'].shape[1]: b['inputs'].shape[0]
      for b in take(batcher, batcher.num_batches_per_epoch)
  }
  # 1000 // L rounded down to a multiple of 8, at least 8, at most 60 -> 56.
  assert rows == {8: 56, 16: 56, 32: 24, 64: 8}


def test_order_depends_only_on_seed_and_epoch():
  src, tgt = make_examples(300)

  def first_batches(seed):
    batcher = batching.BucketedBatcher(src, tgt, batch_tokens=256, buckets=BUCKETS, seed=seed)
    return take(batcher, 2 * batcher.num_batches_per_epoch), batcher.num_batches_per_epoch

  run, per_epoch = first_batches(seed=1)
  assert_batches_equal(run, first_batches(seed=1)[0])
  other, _ = first_batches(seed=2)
  assert any(not np.array_equal(a['index'], b['index']) for a, b in zip(run, other))
  epoch0, epoch1 = run[:per_epoch], run[per_epoch:]
  assert any(not np.array_equal(a['index'], b['index']) for a, b in zip(epoch0, epoch1))
  # Shuffling mixes the buckets: the lengths do not come sorted.
  lengths = [b['inputs'].shape[1] for b in epoch0]
  assert lengths != sorted(lengths)


def test_restore_at_end_of_epoch_and_invalid_states():
  src, tgt = make_examples(120)
  batcher = batching.BucketedBatcher(src, tgt, batch_tokens=256, buckets=BUCKETS, seed=0)
  per_epoch = batcher.num_batches_per_epoch
  batcher.restore({'epoch': 2, 'position': per_epoch})
  assert batcher.state() == {'epoch': 3, 'position': 0}
  for bad in [{'epoch': 0, 'position': per_epoch + 1}, {'epoch': -1, 'position': 0},
              {'position': 3}]:
    with pytest.raises(ConfigError):
      batcher.restore(bad)


def test_eval_batcher_is_one_ordered_pass():
  src, tgt = make_examples(150)
  batcher = batching.BucketedBatcher(src, tgt, batch_tokens=256, buckets=BUCKETS, seed=0,
                                     shuffle=False)
  first = list(batcher)
  assert len(first) == batcher.num_batches_per_epoch
  assert_batches_equal(first, list(batcher))  # Re-iterable and deterministic.
  indices = np.concatenate([b['index'] for b in first])
  indices = indices[indices >= 0]
  assert sorted(indices.tolist()) == list(range(150))
  # Fixed order: buckets from short to long, original order inside each.
  lengths = [b['inputs'].shape[1] for b in first]
  assert lengths == sorted(lengths)
  for length in set(lengths):
    in_bucket = np.concatenate([b['index'] for b in first if b['inputs'].shape[1] == length])
    in_bucket = in_bucket[in_bucket >= 0]
    assert (np.diff(in_bucket) > 0).all()


def test_single_sequence_data():
  src, _ = make_examples(100)
  batcher = batching.BucketedBatcher(src, None, batch_tokens=128, buckets=BUCKETS, seed=0)
  batches = take(batcher, batcher.num_batches_per_epoch)
  assert all(set(b) == {'inputs', 'index'} for b in batches)
  for batch in batches:
    for i in batch['index']:
      if i >= 0:
        assert batch['inputs'].shape[1] == min(b for b in BUCKETS if b >= len(src[i]))


def test_processes_get_contiguous_slices_of_the_global_batch():
  src, tgt = make_examples(200)
  kwargs = dict(batch_tokens=256, buckets=BUCKETS, seed=3, multiple_of=2)
  whole = take(batching.BucketedBatcher(src, tgt, **kwargs), 30)
  parts = [
      take(batching.BucketedBatcher(src, tgt, process_index=p, process_count=2, **kwargs), 30)
      for p in range(2)
  ]
  for full, first, second in zip(whole, *parts):
    assert first['inputs'].shape[0] == full['inputs'].shape[0] // 2
    for key in full:
      np.testing.assert_array_equal(np.concatenate([first[key], second[key]]), full[key])


def test_config_errors():
  src, tgt = make_examples(50)
  with pytest.raises(ConfigError, match='processes'):
    # Rows are 32, 16, 8 and 4 for the four buckets: none splits over 3 processes.
    batching.BucketedBatcher(src, tgt, batch_tokens=256, buckets=BUCKETS, seed=0, process_count=3)
  with pytest.raises(ConfigError, match='buckets'):
    batching.BucketedBatcher(src, tgt, batch_tokens=256, buckets=[16, 8, 64], seed=0)
  with pytest.raises(ConfigError, match='max_rows'):
    batching.BucketedBatcher(src, tgt, batch_tokens=256, buckets=BUCKETS, seed=0, multiple_of=8,
                             max_rows=4)
  with pytest.raises(DataError, match='largest bucket is 32'):
    batching.BucketedBatcher(src, tgt, batch_tokens=256, buckets=[8, 16, 32], seed=0)
  with pytest.raises(DataError, match='no examples'):
    batching.BucketedBatcher([], [], batch_tokens=256, buckets=BUCKETS, seed=0)
