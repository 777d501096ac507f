"""Tests for packed translation batches (data/packing.py) and the workflow's data.pack switch."""

import itertools
import json
import os

import ml_collections
import numpy as np
import pytest

from transformer_jax.data import batching, packing
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.special_tokens import EOS_ID, PAD_ID

KEYS = ('inputs', 'inputs_segment_ids', 'inputs_positions', 'targets', 'targets_segment_ids',
        'targets_positions', 'index')


def make_examples(num_examples: int, seed: int = 0, max_len: int = 24):
  """Random (source, target) id sequences of 1..max_len ids that end with EOS, no PAD."""
  rng = np.random.default_rng(seed)

  def sequence():
    ids = rng.integers(4, 100, size=rng.integers(1, max_len + 1)).astype(np.int32)
    ids[-1] = EOS_ID
    return ids

  return [sequence() for _ in range(num_examples)], [sequence() for _ in range(num_examples)]


def sequences(*lengths):
  """One sequence per length, ids 4, 5, ... then EOS (distinct enough to tell apart)."""
  return [np.array(list(range(4, 3 + n)) + [EOS_ID], np.int32) for n in lengths]


def take(batcher, n):
  return list(itertools.islice(iter(batcher), n))


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def unpack_row(batch, row: int, stream: str) -> list[np.ndarray]:
  """The examples of one row of one stream, read back from the segment ids alone, checking the
  segment ids (1..n in order, 0 only on trailing padding) and positions (0.. per segment)."""
  ids = batch[stream][row]
  segments = batch[f'{stream}_segment_ids'][row]
  positions = batch[f'{stream}_positions'][row]
  used = int(np.count_nonzero(segments))
  assert np.all(segments[:used] > 0) and np.all(segments[used:] == 0), segments
  assert np.all(ids[used:] == PAD_ID) and np.all(positions[used:] == 0)
  assert np.all(ids[:used] != PAD_ID)
  count = int(segments[used - 1]) if used else 0
  # In order along the row: each step either stays in the segment or goes to the next one.
  assert np.all(np.diff(segments[:used]) >= 0) and np.all(np.diff(segments[:used]) <= 1)
  out = []
  for k in range(1, count + 1):
    where = np.flatnonzero(segments == k)
    np.testing.assert_array_equal(positions[where], np.arange(len(where)))
    out.append(ids[where])
  return out


def batch_pairs(batch) -> list[tuple[int, tuple, tuple]]:
  """(example number from 'index', source, target) for every example of the batch, the pair
  read back as inputs segment k with targets segment k."""
  out = []
  for row in range(batch['inputs'].shape[0]):
    sources, targets = unpack_row(batch, row, 'inputs'), unpack_row(batch, row, 'targets')
    assert len(sources) == len(targets)
    index = batch['index'][row]
    assert np.all(index[len(sources):] == -1) and np.all(index[:len(sources)] >= 0)
    out += [(int(i), tuple(s), tuple(t)) for i, s, t in zip(index, sources, targets)]
  return out


def epoch(batcher):
  """The batches of the current training epoch (from position 0)."""
  return take(batcher, batcher.num_batches_per_epoch)


@pytest.mark.parametrize('window', [1, 4])
def test_every_pair_is_packed_exactly_once_per_epoch(window):
  src, tgt = make_examples(300)
  batcher = packing.PackedBatcher(src, tgt, batch_tokens=128, length=24, seed=0, window=window)
  for _ in range(2):  # two epochs, each complete
    pairs = [p for batch in epoch(batcher) for p in batch_pairs(batch)]
    assert sorted(i for i, _, _ in pairs) == list(range(300))
    for i, s, t in pairs:  # source segment k and target segment k are pair i, whole
      assert s == tuple(src[i]) and t == tuple(tgt[i]), i
  assert batcher.state() == {'epoch': 2, 'position': 0}


def test_every_batch_has_one_shape_and_the_last_is_topped_up_with_empty_rows():
  src, tgt = make_examples(101)
  batcher = packing.PackedBatcher(src, tgt, batch_tokens=100, length=24, seed=3)
  assert batcher.rows == 4 and batcher.max_per_row == 24
  batches = epoch(batcher) + take(batcher, 3)
  for batch in batches:
    assert set(batch) == set(KEYS)
    assert all(batch[k].dtype == np.int32 for k in KEYS)
    assert {batch[k].shape for k in KEYS if k != 'index'} == {(4, 24)}
    assert batch['index'].shape == (4, 24)
  stats = batcher.plan_stats(0)
  last = batches[stats['batches'] - 1]
  empty = stats['batches'] * 4 - stats['rows']
  assert 0 <= empty < 4 and stats['examples'] == 101
  if empty:
    for k in KEYS:
      assert np.all(last[k][-empty:] == (-1 if k == 'index' else 0)), k


def test_pack_rows_next_fit_and_first_fit_by_hand():
  # Source lengths / target lengths of 5 pairs; rows of 8 per stream.
  src = np.array([5, 3, 6, 2, 4])
  tgt = np.array([2, 6, 2, 2, 4])
  order = np.arange(5)
  # Next fit (the flax rule): 0 (5/2) + 1 (3/6) = 8/8 closes the row at its end exactly; 2 (6/2)
  # + 3 (2/2) = 8/4; 4 does not fit there (src 12): a row of its own.
  members, offsets = packing.pack_rows(src, tgt, order, 8, window=1)
  rows = [members[offsets[r]:offsets[r + 1]].tolist() for r in range(len(offsets) - 1)]
  assert rows == [[0, 1], [2, 3], [4]]
  # Order matters: 4 then 3 then 2, next fit: [4, 3] (6/6), [2] (6/2).
  members, offsets = packing.pack_rows(src, tgt, np.array([4, 3, 2]), 8, window=1)
  assert np.split(members, offsets[1:-1])[0].tolist() == [4, 3]
  # Only the target side blocks: 1 (tgt 6) + 4 (tgt 4) = 10 > 8 although sources fit (7).
  members, offsets = packing.pack_rows(src, tgt, np.array([1, 4]), 8, window=1)
  assert len(offsets) == 3
  # First fit over 2 open rows: 2 (6/2) opens a row, 4 (4/4) opens a second, 3 (2/2) goes back
  # to the first (8/4): 2 rows; next fit needs 2 as well, but closes [2] early: 3 joins 4.
  members, offsets = packing.pack_rows(src, tgt, np.array([2, 4, 3]), 8, window=2)
  assert np.split(members, offsets[1:-1])[0].tolist() == [2, 3]
  members, offsets = packing.pack_rows(src, tgt, np.array([2, 4, 3]), 8, window=1)
  assert [r.tolist() for r in np.split(members, offsets[1:-1])] == [[2], [4, 3]]


def test_full_rows_single_examples_and_examples_of_exactly_the_row_length():
  # Rows of 8: pair 0 fills a row alone on both sides (exactly L tokens); pairs 1 + 2 end
  # exactly at the row's end on the source side (5 + 3); pair 3 is alone (7 + the next's 3
  # would not fit); pair 4 is exactly L on the target side only, so pair 5 (1/1) is alone too.
  src = sequences(8, 5, 3, 7, 3, 1)
  tgt = sequences(8, 2, 2, 1, 8, 1)
  batcher = packing.PackedBatcher(src, tgt, batch_tokens=8 * 8, length=8, seed=0, shuffle=False,
                                  window=1)
  (batch,) = list(batcher)
  assert batch['inputs'].shape == (8, 8)
  expected_rows = [[0], [1, 2], [3], [4], [5]]
  for row, members in enumerate(expected_rows):
    assert batch['index'][row][:len(members)].tolist() == members
    got_src = unpack_row(batch, row, 'inputs')
    got_tgt = unpack_row(batch, row, 'targets')
    assert [s.tolist() for s in got_src] == [src[i].tolist() for i in members]
    assert [t.tolist() for t in got_tgt] == [tgt[i].tolist() for i in members]
  # Row 0 and row 1's source: full, no padding, and the last token is the example's EOS.
  assert np.all(batch['inputs_segment_ids'][0] == 1) and np.all(batch['targets_segment_ids'][0])
  np.testing.assert_array_equal(batch['inputs_segment_ids'][1], [1] * 5 + [2] * 3)
  np.testing.assert_array_equal(batch['inputs_positions'][1], [0, 1, 2, 3, 4, 0, 1, 2])
  assert batch['inputs'][1, -1] == EOS_ID and batch['inputs'][1, 4] == EOS_ID
  np.testing.assert_array_equal(batch['targets_segment_ids'][1], [1, 1, 2, 2, 0, 0, 0, 0])
  np.testing.assert_array_equal(batch['targets_positions'][1], [0, 1, 0, 1, 0, 0, 0, 0])
  assert np.all(batch['inputs_segment_ids'][5:] == 0) and np.all(batch['index'][5:] == -1)


def test_shuffle_is_a_function_of_seed_and_epoch():
  src, tgt = make_examples(200)
  kwargs = dict(batch_tokens=96, length=24)
  run = epoch(packing.PackedBatcher(src, tgt, seed=1, **kwargs))
  assert_batches_equal(run, epoch(packing.PackedBatcher(src, tgt, seed=1, **kwargs)))
  other_seed = epoch(packing.PackedBatcher(src, tgt, seed=2, **kwargs))
  assert not np.array_equal(run[0]['index'], other_seed[0]['index'])
  batcher = packing.PackedBatcher(src, tgt, seed=1, **kwargs)
  epoch(batcher)
  next_epoch = epoch(batcher)
  assert not np.array_equal(run[0]['index'], next_epoch[0]['index'])
  # Epoch 1 of a fresh batcher set to it: the same as epoch 1 reached by iterating.
  fresh = packing.PackedBatcher(src, tgt, seed=1, **kwargs)
  fresh.restore({'epoch': 1, 'position': 0})
  assert_batches_equal(next_epoch, epoch(fresh))


def test_the_end_of_an_epoch_is_the_start_of_the_next():
  """A position saved as the epoch's batch count restores as batch 0 of the next epoch."""
  src, tgt = make_examples(250, seed=5)
  kwargs = dict(batch_tokens=192, length=24, seed=7)
  per_epoch = packing.PackedBatcher(src, tgt, **kwargs).num_batches_per_epoch
  at_end = packing.PackedBatcher(src, tgt, **kwargs)
  at_end.restore({'epoch': 0, 'position': per_epoch})
  assert at_end.state() == {'epoch': 1, 'position': 0}


def test_evaluation_is_one_ordered_complete_pass():
  src, tgt = make_examples(150, seed=2)
  batcher = packing.PackedBatcher(src, tgt, batch_tokens=96, length=24, seed=0, shuffle=False,
                                  window=1)
  first, second = list(batcher), list(batcher)
  assert_batches_equal(first, second)
  pairs = [p for batch in first for p in batch_pairs(batch)]
  assert [i for i, _, _ in pairs] == list(range(150))  # next fit keeps the order
  assert all(s == tuple(src[i]) and t == tuple(tgt[i]) for i, s, t in pairs)
  # First fit (the default window) is complete and repeatable, but not in order.
  default = packing.PackedBatcher(src, tgt, batch_tokens=96, length=24, seed=0, shuffle=False)
  assert_batches_equal(list(default), list(default))
  assert sorted(i for batch in default for i, _, _ in batch_pairs(batch)) == list(range(150))
  assert len(list(default)) <= len(first)


def test_process_shares_concatenate_to_the_global_batch():
  src, tgt = make_examples(220, seed=4)
  kwargs = dict(batch_tokens=200, length=24, seed=0, multiple_of=2)
  whole = take(packing.PackedBatcher(src, tgt, **kwargs), 25)
  parts = [
      take(packing.PackedBatcher(src, tgt, process_index=p, process_count=2, **kwargs), 25)
      for p in range(2)
  ]
  assert whole[0]['inputs'].shape == (8, 24) and parts[0][0]['inputs'].shape == (4, 24)
  for step, batch in enumerate(whole):
    for key in KEYS:
      np.testing.assert_array_equal(np.concatenate([parts[0][step][key], parts[1][step][key]]),
                                    batch[key])
  with pytest.raises(ConfigError, match='cannot be split evenly over 3 processes'):
    packing.PackedBatcher(src, tgt, batch_tokens=200, length=24, seed=0, process_count=3)


def test_single_stream_data_has_only_the_input_keys():
  src, _ = make_examples(40)
  batcher = packing.PackedBatcher(src, None, batch_tokens=48, length=24, seed=0, shuffle=False)
  batches = list(batcher)
  assert set(batches[0]) == {'inputs', 'inputs_segment_ids', 'inputs_positions', 'index'}
  seen = []
  for batch in batches:
    for row in range(batch['inputs'].shape[0]):
      for i, ids in zip(batch['index'][row], unpack_row(batch, row, 'inputs')):
        np.testing.assert_array_equal(ids, src[i])
        seen.append(int(i))
  assert sorted(seen) == list(range(40))


def test_rows_and_length_helpers():
  assert [packing.row_length(n) for n in (1, 8, 9, 64, 100)] == [8, 8, 16, 64, 104]
  assert packing.rows_per_batch(4096, 64) == 64
  assert packing.rows_per_batch(4096, 64, 24) == 48
  assert packing.rows_per_batch(100, 64, 8) == 8  # at least multiple_of
  with pytest.raises(ConfigError, match='max_len must be positive'):
    packing.row_length(0)


@pytest.mark.parametrize(
    'kwargs, error, message',
    [
        (dict(batch_tokens=0), ConfigError, 'must be positive'),
        (dict(window=0), ConfigError, 'must be positive'),
        (dict(seed=-1), ConfigError, 'seed must be non-negative'),
        (dict(process_index=2, process_count=2), ConfigError, r'process_index must be in \[0, 2\)'),
        (dict(length=16), DataError, 'tokens but packed rows have 16; encode with max_len <= 16'),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs, error, message):
  src, tgt = sequences(3, 20), sequences(2, 4)
  arguments = dict(batch_tokens=64, length=24, seed=0)
  arguments.update(kwargs)
  with pytest.raises(error, match=message) as raised:
    packing.PackedBatcher(src, tgt, **arguments)
  assert '\n' not in str(raised.value)


def test_bad_saved_positions_are_one_line_errors():
  src, tgt = make_examples(50)
  batcher = packing.PackedBatcher(src, tgt, batch_tokens=96, length=24, seed=0)
  with pytest.raises(ConfigError, match="must look like"):
    batcher.restore({'step': 3})
  with pytest.raises(ConfigError, match='packed batches; the data or batch settings changed'):
    batcher.restore({'epoch': 0, 'position': 10_000})
  with pytest.raises(DataError, match='no examples'):
    packing.PackedBatcher([], [], batch_tokens=96, length=24, seed=0)


# -- the translation workflow -------------------------------------------------------------------


def test_workflow_validates_data_pack(tiny_config):
  from transformer_jax.workflows import translation
  config = tiny_config(data__pack=True)
  translation.validate(config)
  config.data = ml_collections.ConfigDict(dict(config.data.to_dict(), pack='yes'))  # as if read
  with pytest.raises(ConfigError, match="data.pack must be True or False, got 'yes'"):
    translation.validate(config)
  # Span corruption's chunks fill the rows already: the switch does not apply to it.
  from transformer_jax.workflows.translation_sections import Translation
  span = tiny_config(data__pack=True, data__task='span_corruption')
  assert Translation.of(span).data.packed is False
  legacy = tiny_config()
  del legacy.data['pack']  # a config saved before packing existed
  assert Translation.of(legacy).data.packed is False


def test_abstract_task_gives_the_packed_shape(tiny_config):
  from transformer_jax.workflows import translation
  config = tiny_config(data__pack=True, data__max_len=30, data__batch_tokens=1000)
  _, shapes = translation.abstract_task(config, num_devices=4)
  assert set(shapes) == set(KEYS) - {'index'}
  # Rows of 32 (30 rounded up to 8); 1000 // 32 = 31 rows, down to a multiple of 4.
  assert {s.shape for s in shapes.values()} == {(28, 32)}
  assert {s.dtype for s in shapes.values()} == {np.dtype(np.int32)}
  _, bucketed = translation.abstract_task(tiny_config(data__pack=False), num_devices=4)
  assert set(bucketed) == {'inputs', 'targets'}


@pytest.mark.parametrize('pack', [False, True])
def test_padding_fraction_of_the_workflow_batcher(tiny_config, pack):
  """The plan's padding share equals the one counted in the batches themselves."""
  from transformer_jax.workflows import translation
  src, tgt = make_examples(300, seed=9, max_len=30)
  config = tiny_config(data__pack=pack, data__buckets=(), data__batch_tokens=256)

  class Trainer:
    mesh, batch_multiple = None, 1

    def check_batch_rows(self, rows):
      assert all(r >= 1 for r in rows)

  class Tokenizer:

    def __init__(self, ids):
      self.ids = ids

    def encode_batch(self, numbers):
      return [self.ids[int(n)][:-1].tolist() for n in numbers]  # encode_pairs adds EOS

  names = [str(i) for i in range(300)]
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr('transformer_jax.parallel.sharding.data_parallel_size', lambda mesh: 1)
    batcher = translation.make_batcher(config, Trainer(), Tokenizer(src), Tokenizer(tgt),
                                       (names, names), train=True)
  assert isinstance(batcher, packing.PackedBatcher if pack else batching.BucketedBatcher)
  batches = take(batcher, batcher.num_batches_per_epoch)
  tokens = sum(int(np.count_nonzero(b['inputs']) + np.count_nonzero(b['targets'])) for b in batches)
  assert tokens == sum(len(s) + len(t) for s, t in zip(src, tgt))
  slots = sum(b['inputs'].size + b['targets'].size for b in batches)
  assert translation.padding_fraction(config, batcher) == pytest.approx(1 - tokens / slots)
  if pack:
    assert {b['inputs'].shape for b in batches} == {(8, 32)}


@pytest.mark.slow
def test_translate_cli_trains_packed(translate_cli, tmp_path):
  """experiments.translate with data.pack=True: packed train and eval batches, the loss
  falls, and the log says how the pairs were packed."""
  workdir = str(tmp_path / 'work')
  result = translate_cli.run(
      f'--workdir={workdir}',
      *translate_cli.tiny_flags({
          'data.pack': True, 'train.num_steps': 30, 'train.eval_every': 30,
          'train.eval_max_batches': 2, 'eval.bleu_sentences': 2
      }))
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'step 30/30 |' in result.stderr
  assert 'rows of 32 (padding' in result.stderr, result.stderr[-3000:]
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    records = [json.loads(line) for line in f]
  losses = [r['train/loss'] for r in records if 'train/loss' in r]
  assert len(losses) >= 2 and losses[-1] < losses[0], losses
  evals = [r for r in records if 'eval/loss' in r]
  assert evals and np.isfinite(evals[-1]['eval/loss'])


@pytest.mark.parametrize('overflow', ['filter', 'truncate'])
def test_pairs_longer_than_a_row_are_filtered_or_truncated_and_counted(overflow):
  """As with buckets: encode_pairs drops (or cuts to max_len) a pair longer than max_len on
  either side and counts it; the packed rows (L = max_len = 8) then hold every other pair whole
  and, truncated, the long one cut to L ids ending with EOS."""

  class Words:  # one id per word: 'w5' -> 5

    def encode_batch(self, texts):
      return [[int(w[1:]) for w in text.split()] for text in texts]

  src = ['w4 w5', 'w4 w5 w6 w7 w8 w9 w10 w11 w12', 'w6']  # the second: 9 ids + EOS > 8
  tgt = ['w7', 'w8 w9', 'w10 w11']
  src_ids, tgt_ids, stats = batching.encode_pairs(Words(), Words(), src, tgt, 8, overflow)
  assert stats == {
      'total': 3, 'filtered': int(overflow == 'filter'), 'truncated': int(overflow == 'truncate')
  }
  batcher = packing.PackedBatcher(src_ids, tgt_ids, length=packing.row_length(8), batch_tokens=32,
                                  seed=0, shuffle=False)
  pairs = sorted(p for batch in batcher for p in batch_pairs(batch))
  sources = [s for _, s, _ in pairs]
  assert (4, 5, EOS_ID) in sources and (6, EOS_ID) in sources
  if overflow == 'filter':
    assert len(pairs) == 2
  else:
    assert len(pairs) == 3 and (4, 5, 6, 7, 8, 9, 10, EOS_ID) in sources
