"""Every training batcher of transformer_jax/data is a `data.batches.Batches`, and resumes exactly.

One test over all of them: the protocol's members, the keys of the saved position (the format
of checkpoints already written), and that a fresh batcher restored to the position saved after
k batches (through JSON, as a checkpoint holds it) yields exactly the batches that came next,
for k at the start, mid epoch and across epoch boundaries.
"""

import json

import numpy as np
import pytest

from transformer_jax.data import (batches, batching, bert_pretrain, classification, conll, lm,
                                  packing, span_corruption)
from transformer_jax.data.wordpiece import SPECIAL_TOKENS, WordPieceTokenizer
from transformer_jax.special_tokens import EOS_ID

NUM_BATCHES = 24  # batches compared in all; each batcher below has 3 to 8 batches an epoch


def _sequences(count: int, seed: int, longest: int = 20) -> list[np.ndarray]:
  """Random ids in [5, 60) ending with EOS, no PAD."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    ids = rng.integers(5, 60, size=int(rng.integers(2, longest + 1))).astype(np.int32)
    ids[-1] = EOS_ID
    out.append(ids)
  return out


def _wordpiece() -> WordPieceTokenizer:
  words = [f'w{i}' for i in range(60)]
  return WordPieceTokenizer({t: i for i, t in enumerate(list(SPECIAL_TOKENS) + words)})


def _documents(tokenizer) -> list[list[np.ndarray]]:
  """30 documents of 1 to 5 lines of 1 to 8 words."""
  rng = np.random.default_rng(7)
  docs = []
  for _ in range(30):
    lines = [rng.integers(0, 60, size=int(rng.integers(1, 9))) for _ in range(rng.integers(1, 6))]
    docs.append([' '.join(f'w{w}' for w in line) for line in lines])
  return bert_pretrain.tokenize_documents(tokenizer, docs)


def bucketed():
  return batching.BucketedBatcher(_sequences(40, 0), _sequences(40, 1), batch_tokens=128,
                                  buckets=[8, 16, 24], seed=3, multiple_of=2)


def packed():
  return packing.PackedBatcher(_sequences(60, 0), _sequences(60, 1), batch_tokens=96, length=24,
                               seed=3, multiple_of=2)


def span_corrupted():
  chunks = span_corruption.pack_and_split(_sequences(40, 2), 14)
  return span_corruption.SpanCorruptionBatcher(chunks, seed=3, vocab_size=200, batch_tokens=64,
                                               buckets=[16], targets_length=8)


def windows():
  tokens = np.random.default_rng(4).integers(0, 50, size=400)
  return lm.RandomWindows(tokens, block_size=8, batch_size=4, seed=3, pack_eos_id=0)


def pretrain(task, pack):

  def make():
    tokenizer = _wordpiece()
    options = bert_pretrain.PretrainOptions(max_len=24, max_predictions=4, sentence_task=task,
                                            pack=pack)
    return bert_pretrain.PretrainBatches(_documents(tokenizer), tokenizer, options, batch_size=4,
                                         seed=3)

  return make


def classified():
  rows = _sequences(30, 5)
  return classification.ClassificationBatches(rows, [len(r) % 2 for r in rows], batch_size=8,
                                              max_len=24, seed=3)


def tagged():
  rows = _sequences(30, 6)
  labels = [np.arange(len(r), dtype=np.int32) % 3 for r in rows]
  return conll.TaggingBatches(conll.Encoded(rows, labels), batch_size=8, max_len=24, seed=3)


BATCHERS = {
    'bucketed': (bucketed, {'epoch', 'position'}),
    'packed': (packed, {'epoch', 'position'}),
    'span_corruption': (span_corrupted, {'epoch', 'position'}),
    'lm_windows': (windows, {'step'}),
    'bert_nsp': (pretrain('nsp', False), {'step'}),
    'bert_none_packed': (pretrain('none', True), {'step'}),
    'bert_full_sentences': (pretrain('full_sentences', False), {'step'}),
    'bert_full_sentences_packed': (pretrain('full_sentences', True), {'step'}),
    'classification': (classified, {'epoch', 'index'}),
    'tagging': (tagged, {'epoch', 'index'}),
}


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _assert_same(got, want):
  assert len(got) == len(want)
  for step, (a, b) in enumerate(zip(got, want)):
    assert a.keys() == b.keys(), step
    for key in a:
      assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), (step, key)


@pytest.mark.parametrize('name', list(BATCHERS))
def test_batcher_follows_the_protocol_and_resumes_exactly(name):
  make, state_keys = BATCHERS[name]
  data = make()
  assert isinstance(data, batches.Batches)
  assert set(data.state()) == state_keys  # what checkpoints hold: must never change
  assert all(type(v) is int for v in data.state().values())
  uninterrupted = _take(iter(data), NUM_BATCHES)
  rows = data.global_rows
  assert rows and all(type(r) is int and r > 0 for r in rows)
  assert {len(b['inputs']) for b in uninterrupted} <= set(rows)  # one process: the whole batch
  # The same batches again from a fresh batcher: a pure function of the seed and position.
  _assert_same(_take(iter(make()), NUM_BATCHES), uninterrupted)
  per_epoch = getattr(data, 'num_batches_per_epoch', None) or getattr(data, 'batches_per_epoch',
                                                                      None)
  stops = {0, 1, 5, 11, 17}
  if per_epoch:  # the end of an epoch and the batches just before and after it
    assert 2 * per_epoch + 1 < NUM_BATCHES
    stops |= {per_epoch - 1, per_epoch, per_epoch + 1, 2 * per_epoch}
  for stop in sorted(stops):
    first = make()
    head = _take(iter(first), stop)
    saved = json.loads(json.dumps(first.state()))  # as a checkpoint holds it
    resumed = make()
    resumed.restore(saved)
    assert resumed.state() == saved
    _assert_same(head + _take(iter(resumed), NUM_BATCHES - stop), uninterrupted)
