"""Packed data for the language model (documents as segments of a window) and BERT-family
pretraining (several complete [CLS] ... [SEP] examples per row): data/lm.py, data/bert_pretrain.py
and their workflows (the packed batch keys: 'inputs_segment_ids', 'inputs_positions')."""

import dataclasses
import gzip
import itertools
import os

import numpy as np
import pytest

from transformer_jax.data import bert_pretrain
from transformer_jax.data import lm as lm_data
from transformer_jax.data import packing
from transformer_jax.data.wordpiece import WordPieceTokenizer
from transformer_jax.errors import ConfigError, DataError

# -- language model: segments from EOS ids --------------------------------------------------------

EOS = 9


@pytest.mark.parametrize(
    'window, segment_ids, positions',
    [
        # Starts with EOS: one segment opens there, not two.
        ([9, 5, 6, 9, 7, 8], [1, 1, 1, 2, 2, 2], [0, 1, 2, 0, 1, 2]),
        # Two EOS in a row: the first is an empty document's BOS, the second opens the next.
        ([5, 9, 9, 6, 7, 8], [1, 2, 3, 3, 3, 3], [0, 0, 0, 1, 2, 3]),
        # No EOS: one document throughout.
        ([1, 2, 3, 4, 5, 6], [1, 1, 1, 1, 1, 1], [0, 1, 2, 3, 4, 5]),
        # EOS at the last position: a one-token segment.
        ([1, 2, 3, 4, 5, 9], [1, 1, 1, 1, 1, 2], [0, 1, 2, 3, 4, 0]),
        # All of it at once.
        ([9, 9, 1, 9, 2, 9], [1, 2, 2, 3, 3, 4], [0, 0, 1, 0, 1, 0]),
    ])
def test_lm_segments_of_hand_built_windows(window, segment_ids, positions):
  inputs = np.asarray([window], np.int32)
  got_ids, got_positions = lm_data.segment_ids_and_positions(inputs, EOS)
  assert got_ids.dtype == np.int32 and got_positions.dtype == np.int32
  np.testing.assert_array_equal(got_ids, [segment_ids])
  np.testing.assert_array_equal(got_positions, [positions])
  np.testing.assert_array_equal(inputs, [window])  # the input is left as it was


def test_lm_segments_batch_at_once_equals_row_by_row():
  rows = np.asarray([[9, 5, 6, 9, 7, 8], [5, 9, 9, 6, 7, 8], [1, 2, 3, 4, 5, 9]], np.int32)
  ids, positions = lm_data.segment_ids_and_positions(rows, EOS)
  for r, row in enumerate(rows):
    one_ids, one_positions = lm_data.segment_ids_and_positions(row[None], EOS)
    np.testing.assert_array_equal(ids[r], one_ids[0])
    np.testing.assert_array_equal(positions[r], one_positions[0])


def _reference_segments(row, eos):
  """Segment ids and positions by walking the row (the rule of data/lm.py, written out)."""
  ids, positions, segment, position = [], [], 0, 0
  for j, token in enumerate(row):
    if j == 0 or token == eos:
      segment, position = segment + 1, 0
    else:
      position += 1
    ids.append(segment)
    positions.append(position)
  return ids, positions


def _captions(corpus, count: int) -> list[str]:
  with gzip.open(corpus('multi30k') / 'train.en.gz', 'rt', encoding='utf-8') as f:
    return [line.strip() for line in itertools.islice(f, count)]


@pytest.fixture(scope='module')
def caption_documents(corpus):
  """300 Multi30k captions, one a document (about 50 byte-level BPE tokens each)."""
  return _captions(corpus, 300)


@pytest.fixture(scope='module')
def byte_bpe(caption_documents):
  from transformer_jax.data.hf_tokenizer import HFTokenizer
  return HFTokenizer.train_byte_level_bpe(caption_documents, 300)


def test_packed_lm_batches_follow_the_eos_ids(byte_bpe, caption_documents):
  eos = lm_data.lm_eos_id(byte_bpe)
  tokens = lm_data.encode_documents(byte_bpe, caption_documents)
  assert np.count_nonzero(tokens == eos) == len(caption_documents)
  train = lm_data.RandomWindows(tokens, block_size=64, batch_size=6, seed=1, pack_eos_id=eos)
  plain = lm_data.RandomWindows(tokens, block_size=64, batch_size=6, seed=1)
  evals = lm_data.eval_batches(tokens, 64, 6, 2, seed=2, pack_eos_id=eos)
  boundaries, most = 0, 0
  for batch in [train.batch(0), train.batch(7)] + evals:
    assert set(batch) == {'inputs', 'targets', 'inputs_segment_ids', 'inputs_positions'}
    assert all(v.shape == (6, 64) and v.dtype == np.int32 for v in batch.values())
    np.testing.assert_array_equal(batch['inputs'][:, 1:], batch['targets'][:, :-1])
    for r, row in enumerate(batch['inputs']):
      ids, positions = _reference_segments(row.tolist(), eos)
      assert batch['inputs_segment_ids'][r].tolist() == ids
      assert batch['inputs_positions'][r].tolist() == positions
    boundaries += int(np.count_nonzero(batch['inputs'] == eos))
    most = max(most, int(batch['inputs_segment_ids'].max()))
  assert boundaries > 20 and most >= 3  # the windows really do cross documents
  # Packing adds keys and changes nothing else; the draw is the same.
  packed, unpacked = train.batch(3), plain.batch(3)
  for key in ('inputs', 'targets'):
    np.testing.assert_array_equal(packed[key], unpacked[key])


def _tiny_lm_config(**values):
  from experiments.configs import gpt2_shakespeare_bpe
  config = gpt2_shakespeare_bpe.get_config()
  settings = {
      'model.emb_dim': 32, 'model.num_heads': 2, 'model.mlp_dim': 64, 'model.num_decoder_layers': 1,
      'data.block_size': 32, 'data.batch_size': 4, 'data.eval_batches': 1,
      'tokenizer.vocab_size': 300, 'train.num_steps': 3, 'train.log_every': 1,
      'train.eval_every': 3, 'train.checkpoint_every': 0, 'train.eval_max_batches': 0,
      'optimizer.warmup_steps': 1, 'optimizer.decay_steps': 3, 'eval.sample_tokens': 4,
      'eval.sample_prompt': 'A'
  }
  settings.update(values)
  for key, value in settings.items():
    *parents, leaf = key.split('.')
    node = config
    for part in parents:
      node = node[part]
    assert leaf in node, key
    node[leaf] = value
  return config


def test_lm_make_data_packs_train_and_eval_batches(byte_bpe, caption_documents):
  from transformer_jax.workflows import lm
  tokens = lm_data.encode_documents(byte_bpe, caption_documents)
  eos = lm_data.lm_eos_id(byte_bpe)
  packed = lm.sections_of(_tiny_lm_config(**{'data.pack': True}))
  train, valid = lm.make_data(packed, tokens, tokens, eos)
  for batch in [train.batch(0), *valid]:
    assert 'inputs_segment_ids' in batch and 'inputs_positions' in batch
  train, valid = lm.make_data(lm.sections_of(_tiny_lm_config()), tokens, tokens, eos)
  assert set(train.batch(0)) == set(valid[0]) == {'inputs', 'targets'}
  _, shapes = lm.abstract_task(_tiny_lm_config(**{'data.pack': True}))
  assert set(shapes) == {'inputs', 'targets', 'inputs_segment_ids', 'inputs_positions'}
  with pytest.raises(ConfigError, match='no EOS'):
    lm.make_data(packed, tokens, tokens, None)


def test_char_corpus_cannot_be_packed(tmp_path):
  from experiments.configs import shakespeare_char
  from transformer_jax.workflows import lm
  config = shakespeare_char.get_config()
  config.data.pack = True
  workdir = tmp_path / 'w'
  with pytest.raises(ConfigError) as error:
    lm.train_and_evaluate(config, str(workdir))
  message = str(error.value)
  assert '\n' not in message and 'needs documents' in message and "'char'" in message
  assert not workdir.exists()  # refused before anything was written
  with pytest.raises(ConfigError, match='needs documents'):
    lm.abstract_task(config)


def test_lm_packed_training_end_to_end(tmp_path, monkeypatch, corpus):
  """experiments.lm's workflow on 200 two-caption documents, byte-level BPE, data.pack=True."""
  from transformer_jax.workflows import lm
  lines = _captions(corpus, 400)
  documents = [' '.join(lines[i:i + 2]) for i in range(0, len(lines), 2)]
  text = tmp_path / 'documents.txt'  # blank lines separate a 'file' source's documents
  text.write_text('\n\n'.join(documents) + '\n')
  seen = []
  make_data = lm.make_data

  def recording_make_data(*args):
    train, valid = make_data(*args)
    seen.append(valid[0])
    return train, valid

  monkeypatch.setattr(lm, 'make_data', recording_make_data)
  results = lm.train_and_evaluate(
      _tiny_lm_config(**{'data.pack': True, 'data.path': str(text), 'data.train_fraction': 0.9}),
      str(tmp_path / 'workdir'))
  assert results['step'] == 3 and np.isfinite(results['eval_loss'])
  assert seen and seen[0]['inputs_segment_ids'].max() > 1  # batches with several documents


# -- BERT pretraining -----------------------------------------------------------------------------

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4


class _WordPieceLike:
  """The special-token surface PretrainBatches needs, over a 5,000-id vocabulary, with
  WordPiece's build_pair: one segment is [CLS] a [SEP] (cut to max_len), token types 0."""
  pad_id, unk_id, cls_id, sep_id, mask_id = PAD, UNK, CLS, SEP, MASK
  special_ids = np.arange(5)
  vocab_size = 5000
  build_pair = WordPieceTokenizer.build_pair


class _NeverCut(_WordPieceLike):
  """As _WordPieceLike, but an example that would need cutting fails the test."""

  def build_pair(self, a, b, max_len=None):
    assert b is None and len(a) <= max_len - 2, 'an example longer than a row'
    return super().build_pair(a, b, max_len)


def _documents(num_docs=24, seed=0):
  """Documents whose every token names its (document, line): 1000 + 100 d + line; 1-6 lines
  of 1-9 tokens; document 5's first line is longer than a 32-token row."""
  rng = np.random.default_rng(seed)
  docs = []
  for d in range(num_docs):
    lengths = rng.integers(1, 10, size=int(rng.integers(1, 7)))
    if d == 5:
      lengths[0] = 40
    docs.append([np.full(n, 1000 + 100 * d + i, np.int32) for i, n in enumerate(lengths)])
  return docs


def _originals(batch, r):
  """Row r's ids before masking: the masked positions hold their original ids again."""
  row = batch['inputs'][r].copy()
  chosen = batch['mlm_weights'][r] > 0
  row[batch['mlm_positions'][r][chosen]] = batch['mlm_ids'][r][chosen]
  return row


def _examples(batch, r):
  """[(start, end)] of row r's packed examples, after checking the row's segment layout: ids
  1..n in order, each a contiguous run, 0 only on padding at the end, padding all zeros."""
  ids = batch['inputs_segment_ids'][r]
  used = int(np.count_nonzero(ids))
  assert (ids[:used] > 0).all() and (ids[used:] == 0).all()
  for key in ('inputs', 'segments', 'inputs_positions'):
    assert (batch[key][r][used:] == 0).all(), key
  n = int(ids.max())
  spans = []
  for k in range(1, n + 1):
    where = np.flatnonzero(ids == k)
    assert len(where) and (np.diff(where) == 1).all(), f'example {k} is not one run'
    spans.append((int(where[0]), int(where[-1]) + 1))
  assert [s for s, _ in spans] == [0] + [e for _, e in spans[:-1]]  # in order, back to back
  return spans


def _check_row(batch, r, options, vocab_size=5000):
  """Every invariant of a packed row; returns its examples' original ids."""
  spans = _examples(batch, r)
  original = _originals(batch, r)
  examples = []
  for start, end in spans:
    ids = original[start:end]
    assert ids[0] == CLS and ids[-1] == SEP and not np.isin(ids[1:-1], [CLS, SEP, PAD]).any()
    np.testing.assert_array_equal(batch['inputs_positions'][r][start:end], np.arange(end - start))
    assert batch['segments'][r][start] == 0 and (batch['segments'][r][start:end] == 0).all()
    examples.append(ids[1:-1])
  weights = batch['mlm_weights'][r]
  count = int(weights.sum())
  assert (weights[:count] == 1).all() and (weights[count:] == 0).all()
  positions = batch['mlm_positions'][r][:count]
  assert (np.diff(positions) > 0).all() if count > 1 else True
  assert (batch['inputs_segment_ids'][r][positions] > 0).all()  # inside real tokens
  assert not np.isin(original[positions], _WordPieceLike.special_ids).any()  # never special
  # Only the chosen positions changed, each to [MASK], a random ordinary id or itself.
  changed = np.flatnonzero(batch['inputs'][r] != original)
  assert set(changed.tolist()) <= set(positions.tolist())
  unchosen = np.setdiff1d(np.arange(len(original)), positions)
  assert (batch['inputs'][r][unchosen] != MASK).all()  # no [MASK] without its prediction
  assert ((batch['inputs'][r][changed] == MASK) | (batch['inputs'][r][changed] >= 5)).all()
  # Each example got its own unpacked count of masks, unless the row's slots ran out.
  expected = [
      min(options.max_predictions, max(1, int(round(len(e) * options.mask_rate))), len(e))
      for e in examples
  ]
  per_example = [int(np.count_nonzero((positions >= s) & (positions < e))) for s, e in spans]
  if sum(expected) <= options.row_predictions:
    assert per_example == expected
  else:
    assert count == options.row_predictions
  return examples


def _key(token: int) -> tuple[int, int]:
  return (token - 1000) // 100, (token - 1000) % 100


def test_row_predictions_scale_with_the_packed_row():
  assert bert_pretrain.PretrainOptions(max_len=64, max_predictions=10).row_predictions == 10
  packed = bert_pretrain.PretrainOptions(max_len=64, max_predictions=10, pack=True)
  assert packed.row_predictions == 10 + 4  # round(64 * 0.15) = 10, plus 64 / 16
  assert bert_pretrain.PretrainOptions(max_len=128, max_predictions=20,
                                       pack=True).row_predictions == 19 + 8
  assert bert_pretrain.PretrainOptions(max_len=32, max_predictions=30,
                                       pack=True).row_predictions == 30


def test_pack_lengths_best_fit_decreasing():
  # By hand: 5 -> new row A (3 left), 5 -> new row B (3 left), 3 -> B (the last of the rows
  # with 3 left), 3 -> A, 2 -> new row C. Rows list their items in index order.
  assert packing.pack_lengths([5, 5, 3, 3, 2], 8) == [[0, 3], [1, 2], [4]]
  for longest in (16, 32):
    lengths = np.random.default_rng(0).integers(1, longest + 1, size=500)
    rows = packing.pack_lengths(lengths, 32)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 32 for row in rows)
    # Close to the least possible: the tokens' rows, or one row for each item over half a row.
    least = max(-(-lengths.sum() // 32), np.count_nonzero(lengths > 16))
    assert len(rows) <= 1.04 * least + 1, (len(rows), least)
  with pytest.raises(DataError):
    packing.pack_lengths([33], 32)


def _none_batches(**kw):
  # 7 prediction slots a row: round(32 * 0.15) = 5, plus 32 / 16.
  options = bert_pretrain.PretrainOptions(max_len=32, max_predictions=4, sentence_task='none',
                                          pack=True, **kw)
  return options, bert_pretrain.PretrainBatches(_documents(), _WordPieceLike(), options,
                                                batch_size=8, seed=3)


def test_bert_none_packed_rows():
  options, data = _none_batches()
  docs = _documents()
  rows = segments = 0
  for step in range(6):
    batch = data.batch(step)
    assert {k: v.shape for k, v in batch.items()} == {
        'inputs': (8, 32), 'segments': (8, 32), 'inputs_segment_ids': (8, 32),
        'inputs_positions': (8, 32), 'mlm_positions': (8, 7), 'mlm_ids': (8, 7),
        'mlm_weights': (8, 7), 'sentence_labels': (8,)
    }
    assert (batch['sentence_labels'] == 0).all()
    lengths = []
    for r in range(8):
      examples = _check_row(batch, r, options)
      for body in examples:
        # make_pair's 'none' example: consecutive whole lines of one document (a line cut
        # only where it alone is longer than the row).
        keys = [_key(t) for t in body]
        assert len({d for d, _ in keys}) == 1
        lines = sorted({i for _, i in keys})
        assert lines == list(range(lines[0], lines[-1] + 1))
        d = keys[0][0]
        for i in lines[1:]:
          assert sum(1 for k in keys if k[1] == i) == len(docs[d][i])
      lengths.append([len(e) + 2 for e in examples])
      rows, segments = rows + 1, segments + len(examples)
    # Greedy: the draw that did not fit closed the row before and starts the next one.
    for before, after in zip(lengths, lengths[1:]):
      assert sum(before) + after[0] > 32
  assert segments / rows > 1.3  # several examples a row, so less padding than one a row
  plain = bert_pretrain.PretrainBatches(docs, _WordPieceLike(),
                                        dataclasses.replace(options, pack=False), batch_size=8,
                                        seed=3)
  padding = lambda data: np.mean([np.mean(data.batch(s)['inputs'] == PAD) for s in range(6)])
  assert padding(data) < 0.75 * padding(plain)


def test_bert_packed_row_prediction_slots_run_out_in_order():
  # One-token documents: ten 3-token examples a row, each wanting its one mask, in 7 slots.
  docs = [[np.full(1, 1000 + 100 * d, np.int32)] for d in range(40)]
  options = bert_pretrain.PretrainOptions(max_len=32, max_predictions=1, sentence_task='none',
                                          pack=True)
  assert options.row_predictions == 7
  batch = bert_pretrain.PretrainBatches(docs, _WordPieceLike(), options, batch_size=4,
                                        seed=0).batch(0)
  for r in range(4):
    _check_row(batch, r, options)
    assert batch['inputs_segment_ids'][r].max() == 10
    # The first seven examples got their mask (each at its one token), the last three none.
    np.testing.assert_array_equal(batch['mlm_positions'][r], [1, 4, 7, 10, 13, 16, 19])
    assert batch['mlm_weights'][r].sum() == 7
    np.testing.assert_array_equal(batch['inputs'][r][22:30:3] % 100, 0)  # unmasked documents


def test_bert_packed_batches_split_over_processes():
  options, data = _none_batches()
  first = data.batch(4)
  halves = [
      bert_pretrain.PretrainBatches(_documents(), _WordPieceLike(), options, batch_size=8, seed=3,
                                    process_index=i, process_count=2).batch(4) for i in (0, 1)
  ]
  for key in first:
    np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), first[key])
  assert not np.array_equal(data.batch(5)['inputs'], first['inputs'])


def test_bert_full_sentences_packed_never_crosses_a_document():
  docs = _documents(num_docs=30, seed=1)
  options = bert_pretrain.PretrainOptions(max_len=32, max_predictions=4,
                                          sentence_task='full_sentences', pack=True)
  data = bert_pretrain.PretrainBatches(docs, _NeverCut(), options, batch_size=4, seed=5)
  assert data.truncated_lines == 1  # document 5's 40-token first line, cut to 30
  epoch = data.rows_per_epoch
  seen = {}  # (document, line) -> tokens seen this epoch
  for step in range(-(-epoch // 4)):
    batch = data.batch(step)
    for r in range(4):
      if step * 4 + r >= epoch:
        break
      for body in _check_row(batch, r, options):
        keys = [_key(t) for t in body]
        assert len({d for d, _ in keys}) == 1, f'an example spans documents {keys}'
        lines = sorted({i for _, i in keys})
        assert lines == list(range(lines[0], lines[-1] + 1))  # consecutive whole lines
        for k in keys:
          seen[k] = seen.get(k, 0) + 1
  # One epoch feeds every line once, whole (the too-long line cut to a row).
  expected = {(d, i): min(len(x), 30) for d, doc in enumerate(docs) for i, x in enumerate(doc)}
  assert seen == expected
  # Packed rows are nearly full; each example alone would have padded its row.
  tokens = sum(expected.values()) + 2 * len(data.examples)  # [CLS] and [SEP] of each
  assert epoch <= -(-tokens // 32) + 3 and len(data.examples) > epoch


def test_pair_tasks_cannot_be_packed():
  for task in ('nsp', 'sop'):
    options = bert_pretrain.PretrainOptions(max_len=32, sentence_task=task, pack=True)
    with pytest.raises(DataError, match='one \\[CLS\\] per row'):
      bert_pretrain.PretrainBatches(_documents(), _WordPieceLike(), options, batch_size=4, seed=0)


def _tiny_bert_config(**values):
  from experiments.configs import bert_pretrain_small
  config = bert_pretrain_small.get_config()
  settings = {
      'model.emb_dim': 32, 'model.num_heads': 2, 'model.mlp_dim': 64, 'model.num_encoder_layers': 1,
      'model.max_len': 32, 'data.lines_per_document': 0, 'data.valid_fraction': 0.1,
      'data.max_len': 32, 'data.max_predictions': 5, 'data.batch_size': 8, 'data.eval_batches': 2,
      'tokenizer.vocab_size': 100, 'train.num_steps': 4, 'train.log_every': 2,
      'train.eval_every': 4, 'train.checkpoint_every': 0, 'optimizer.warmup_steps': 1,
      'optimizer.decay_steps': 4
  }
  settings.update(values)
  for key, value in settings.items():
    *parents, leaf = key.split('.')
    node = config
    for part in parents:
      node = node[part]
    assert leaf in node, key
    node[leaf] = value
  return config


def test_bert_workflow_refuses_packing_what_reads_one_cls(tmp_path):
  from experiments.configs import sst2_minilm
  from transformer_jax.workflows import bert
  for task in ('nsp', 'sop'):
    config = _tiny_bert_config(**{'data.pack': True, 'data.sentence_task': task})
    workdir = tmp_path / task
    with pytest.raises(ConfigError) as error:
      bert.run(config, str(workdir))
    assert '\n' not in str(error.value) and 'one [CLS] per row' in str(error.value)
    assert task in str(error.value) and not workdir.exists()
    with pytest.raises(ConfigError, match='one \\[CLS\\] per row'):
      bert.abstract_task(config)
  config = sst2_minilm.get_config()
  config.data.pack = True
  with pytest.raises(ConfigError) as error:
    bert.run(config, str(tmp_path / 'fine'))
  assert '\n' not in str(error.value) and 'fine-tuning is not packed' in str(error.value)
  assert not (tmp_path / 'fine').exists()


def test_bert_abstract_task_has_the_packed_keys():
  from transformer_jax.workflows import bert
  _, shapes = bert.abstract_task(
      _tiny_bert_config(**{'data.pack': True, 'data.sentence_task': 'none'}))
  assert shapes['inputs_segment_ids'].shape == shapes['inputs_positions'].shape == (8, 32)
  assert shapes['mlm_positions'].shape == (8, 7)  # round(32 * 0.15) = 5, plus 32 / 16
  _, shapes = bert.abstract_task(_tiny_bert_config())
  assert 'inputs_segment_ids' not in shapes and shapes['mlm_positions'].shape == (8, 5)


def _write_text(tmp_path) -> str:
  words = 'the cat sat on a mat while dogs ran in the park and birds sang songs'.split()
  rng = np.random.default_rng(0)
  lines = lambda: [
      ' '.join(rng.choice(words, size=int(rng.integers(2, 7))))
      for _ in range(int(rng.integers(1, 4)))
  ]
  docs = ['\n'.join(lines()) for _ in range(60)]
  path = tmp_path / 'text.txt'
  path.write_text('\n\n'.join(docs) + '\n')
  return str(path)


def test_bert_packed_pretraining_end_to_end(tmp_path):
  """experiments.bert's pretraining workflow with data.pack=True and sentence_task 'none'."""
  import json
  from transformer_jax.workflows import bert
  config = _tiny_bert_config(
      **{'data.pack': True, 'data.sentence_task': 'none', 'data.paths': _write_text(tmp_path)})
  workdir = tmp_path / 'w'
  results = bert.run(config, str(workdir))
  assert results['step'] == 4 and np.isfinite(results['eval_loss'])
  with open(workdir / 'metrics.jsonl') as f:
    metrics = [json.loads(line) for line in f]
  assert any('eval/accuracy' in m for m in metrics)
  # The documents are short: unpacked, most of every row would be padding.
  fractions = [m['train/padding_fraction'] for m in metrics if 'train/padding_fraction' in m]
  assert fractions and max(fractions) < 0.25, fractions
  assert os.path.exists(workdir / 'vocab.txt')
