"""Tests for the SentencePiece tokenizer wrapper."""

import io
import os

import numpy as np
import pytest
import sentencepiece as spm

from transformer_jax.data import text
from transformer_jax.data import tokenizer as tok_lib
from transformer_jax.special_tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.errors import DataError

NUM_LINES = 2000
VOCAB_SIZE = 1000


@pytest.fixture(scope='module')
def sentences(corpus) -> list[str]:
  src, tgt = text.read_parallel(
      *text.find_parallel_files(str(corpus('multi30k')), 'train', 'en', 'de'))
  return src[:NUM_LINES] + tgt[:NUM_LINES]


@pytest.fixture(scope='module')
def trained(sentences, tmp_path_factory) -> tuple[tok_lib.Tokenizer, str]:
  path = str(tmp_path_factory.mktemp('tok') / 'spm.model')
  return tok_lib.train_tokenizer(sentences, path, VOCAB_SIZE), path


def test_special_ids(trained):
  tokenizer, path = trained
  assert (PAD_ID, EOS_ID, BOS_ID, UNK_ID) == (0, 1, 2, 3)
  processor = spm.SentencePieceProcessor(model_file=path)
  assert processor.pad_id() == 0 and processor.eos_id() == 1
  assert processor.bos_id() == 2 and processor.unk_id() == 3
  assert tokenizer.vocab_size == VOCAB_SIZE


def test_round_trip(trained, sentences):
  tokenizer, _ = trained
  for sentence in sentences:
    ids = tokenizer.encode(sentence)
    assert ids and all(i > UNK_ID for i in ids), sentence  # No specials, no unknowns.
    # SentencePiece collapses runs of spaces, the only change it makes to this text.
    assert tokenizer.decode(ids) == ' '.join(sentence.split())


def test_batch_matches_single(trained, sentences):
  tokenizer, _ = trained
  batch = sentences[:50]
  encoded = tokenizer.encode_batch(batch)
  assert encoded == [tokenizer.encode(s) for s in batch]
  assert tokenizer.decode_batch(encoded) == [tokenizer.decode(ids) for ids in encoded]


def test_decode_stops_at_eos_and_skips_pad_and_bos(trained, sentences):
  tokenizer, _ = trained
  ids = tokenizer.encode(sentences[0])
  other = tokenizer.encode(sentences[1])
  expected = tokenizer.decode(ids)
  assert tokenizer.decode([BOS_ID] + ids + [EOS_ID] + other) == expected
  assert tokenizer.decode(ids[:2] + [PAD_ID] + ids[2:] + [PAD_ID, PAD_ID]) == expected
  # A padded 2-D model output, as a NumPy array.
  rows = np.zeros((2, len(ids) + 5), np.int32)
  rows[0, :len(ids)] = ids
  rows[0, len(ids)] = EOS_ID
  rows[0, len(ids) + 1:] = other[:4]
  assert tokenizer.decode_batch(rows) == [expected, '']
  assert tokenizer.decode(np.asarray(ids + [EOS_ID])) == expected


def test_ids_beyond_vocab_decode_as_unknown(trained):
  tokenizer, _ = trained
  assert tokenizer.decode([VOCAB_SIZE + 5]) == tokenizer.decode([UNK_ID])


def test_training_is_deterministic_and_atomic(sentences, tmp_path):
  tok_lib.train_tokenizer(sentences, str(tmp_path / 'a.model'), 500)
  second = tok_lib.train_tokenizer(sentences, str(tmp_path / 'sub' / 'b.model'), 500)
  with open(tmp_path / 'a.model', 'rb') as f:
    assert f.read() == second.serialized_proto
  # Only the final files: no temporary leftovers next to them.
  assert sorted(os.listdir(tmp_path)) == ['a.model', 'sub']
  assert os.listdir(tmp_path / 'sub') == ['b.model']


def test_max_sentences_samples_with_seed(sentences, tmp_path):

  def train(seed, name):
    return tok_lib.train_tokenizer(sentences, str(tmp_path / name), 300, max_sentences=300,
                                   seed=seed).serialized_proto

  assert train(0, 'a.model') == train(0, 'b.model')
  assert train(0, 'a.model') != train(1, 'c.model')


def test_vocab_too_large(tmp_path):
  with pytest.raises(DataError, match='smaller vocab_size'):
    tok_lib.train_tokenizer(['a tiny corpus', 'of two lines'], str(tmp_path / 't.model'), 1000)
  assert not os.listdir(tmp_path)


def test_load_or_train_reuses_existing_file(sentences, tmp_path):
  path = str(tmp_path / 'spm.model')
  calls = []

  def texts_fn():
    calls.append(1)
    return iter(sentences)

  first = tok_lib.load_or_train_tokenizer(path, texts_fn, 400)
  assert calls == [1]
  mtime = os.stat(path).st_mtime_ns
  second = tok_lib.load_or_train_tokenizer(path, texts_fn, 400)
  assert calls == [1]  # Not called again: nothing was retrained.
  assert os.stat(path).st_mtime_ns == mtime
  assert second.serialized_proto == first.serialized_proto


def test_from_file_errors(tmp_path):
  missing = str(tmp_path / 'workdir' / 'spm.model')
  with pytest.raises(DataError, match='missing from the workdir') as info:
    tok_lib.Tokenizer.from_file(missing)
  assert missing in str(info.value)
  corrupt = tmp_path / 'corrupt.model'
  corrupt.write_bytes(b'not a model')
  with pytest.raises(DataError, match='corrupt.model'):
    tok_lib.Tokenizer.from_file(str(corrupt))


def test_rejects_model_with_other_special_ids(sentences):
  model = io.BytesIO()
  # SentencePiece's defaults: unk=0, bos=1, eos=2, no pad.
  spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model,
                                 vocab_size=300, minloglevel=1)
  with pytest.raises(DataError, match='special ids'):
    tok_lib.Tokenizer.from_serialized(model.getvalue())
