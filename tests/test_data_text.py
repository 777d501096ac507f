"""Tests for reading plain-text and gzip corpora."""

import gzip
import logging
import os

import pytest

from transformer_jax.data import text
from transformer_jax.errors import DataError


@pytest.fixture
def multi30k_dir(corpus) -> str:
  return str(corpus('multi30k'))


def _write(path, data: bytes) -> str:
  path = str(path)
  opener = gzip.open if path.endswith('.gz') else open
  with opener(path, 'wb') as f:
    f.write(data)
  return path


@pytest.mark.parametrize('name', ['corpus.txt', 'corpus.txt.gz'])
def test_read_lines_plain_and_gzip(tmp_path, name):
  path = _write(tmp_path / name, '  Grüße aus Köln \r\n\nzweite Zeile\n'.encode())
  assert text.read_lines(path) == ['Grüße aus Köln', '', 'zweite Zeile']


def test_read_lines_strips_byte_order_mark(tmp_path):
  path = _write(tmp_path / 'bom.txt', '\ufefferste\nzweite'.encode())
  assert text.read_lines(path) == ['erste', 'zweite']


def test_read_lines_splits_only_on_newline(tmp_path):
  # U+2028 (line separator) and U+0085 (next line) must stay inside their sentence.
  path = _write(tmp_path / 'seps.txt', 'a\u2028b\nc\x85d\n'.encode())
  assert text.read_lines(path) == ['a\u2028b', 'c\x85d']


def test_read_lines_missing_file(tmp_path):
  path = str(tmp_path / 'nope.txt')
  with pytest.raises(DataError, match='nope.txt'):
    text.read_lines(path)


def test_read_lines_invalid_utf8_names_line_and_option(tmp_path):
  path = _write(tmp_path / 'bad.txt.gz', b'ok\nalso ok\nbad \xff byte\nok\n')
  with pytest.raises(DataError) as info:
    text.read_lines(path)
  message = str(info.value)
  assert message.startswith(f'{path}:3: invalid UTF-8')
  assert 'skip_invalid_utf8' in message


def test_read_lines_skip_invalid_utf8(tmp_path):
  path = _write(tmp_path / 'bad.txt', b'one\n\xc3\x28\ntwo\n\xe2\x82\nthree\n')
  lines, num_skipped = text.read_lines_with_stats(path, skip_invalid_utf8=True)
  assert lines == ['one', 'two', 'three']
  assert num_skipped == 2
  assert text.read_lines(path, skip_invalid_utf8=True) == lines


@pytest.mark.parametrize(
    'data',
    [
        b'this is not gzip\n',  # Plain bytes despite the .gz name.
        gzip.compress(b'a line\n' * 1000, mtime=0)[:40],  # Cut short, e.g. by a failed download.
    ],
    ids=['not_gzip', 'truncated'])
def test_read_lines_bad_gzip(tmp_path, data):
  path = str(tmp_path / 'broken.gz')
  with open(path, 'wb') as f:
    f.write(data)
  with pytest.raises(DataError, match='not a valid gzip file'):
    text.read_lines(path)


def test_find_parallel_files_prefers_gzip(tmp_path):
  for name in ['train.en.gz', 'train.en', 'train.de']:
    _write(tmp_path / name, b'x\n')
  src, tgt = text.find_parallel_files(str(tmp_path), 'train', 'en', 'de')
  assert src == os.path.join(str(tmp_path), 'train.en.gz')
  assert tgt == os.path.join(str(tmp_path), 'train.de')


def test_find_parallel_files_missing_directory(tmp_path):
  missing = str(tmp_path / 'absent')
  with pytest.raises(DataError, match=f'data directory {missing} does not exist'):
    text.find_parallel_files(missing, 'train', 'en', 'de')


def test_find_parallel_files_missing_file_lists_candidates(tmp_path):
  _write(tmp_path / 'train.en.gz', b'x\n')
  with pytest.raises(DataError) as info:
    text.find_parallel_files(str(tmp_path), 'train', 'en', 'de')
  message = str(info.value)
  assert os.path.join(str(tmp_path), 'train.de.gz') in message
  assert os.path.join(str(tmp_path), 'train.de') in message
  assert 'train.en.gz' in message  # What the directory does contain.


def test_read_parallel_line_count_mismatch(tmp_path):
  src = _write(tmp_path / 'a.en', b'1\n2\n3\n')
  tgt = _write(tmp_path / 'a.de', b'1\n2\n')
  with pytest.raises(DataError) as info:
    text.read_parallel(src, tgt)
  message = str(info.value)
  assert src in message and tgt in message
  assert '3 lines' in message and 'has 2' in message


@pytest.mark.parametrize('content', [b'', b'\n  \n\t\n'])
def test_read_parallel_empty_corpus(tmp_path, content):
  src = _write(tmp_path / 'a.en', content)
  tgt = _write(tmp_path / 'a.de', content)
  with pytest.raises(DataError, match='empty|no pair'):
    text.read_parallel(src, tgt)


def test_read_parallel_drops_pairs_and_keeps_alignment(tmp_path, caplog):
  src = _write(tmp_path / 'a.en', b'one\n\xff bad\nthree\n\nfive\nsix\n')
  tgt = _write(tmp_path / 'a.de', b'eins\nzwei\n\xfe drei\nvier\n\nsechs\n')
  with caplog.at_level(logging.INFO):
    pairs = text.read_parallel(src, tgt, skip_invalid_utf8=True)
  assert pairs == (['one', 'six'], ['eins', 'sechs'])
  assert 'dropped 2 pairs with invalid UTF-8' in caplog.text
  assert 'dropped 2 pairs with an empty side' in caplog.text


def test_read_parallel_invalid_utf8_is_an_error_by_default(tmp_path):
  src = _write(tmp_path / 'a.en', b'one\ntwo\n')
  tgt = _write(tmp_path / 'a.de', b'eins\nzw\xffei\n')
  with pytest.raises(DataError, match=r'a\.de:2: invalid UTF-8'):
    text.read_parallel(src, tgt)


@pytest.mark.parametrize('split, num_lines', [('train', 29_000), ('val', 1_014),
                                              ('test_2016_flickr', 1_000)])
def test_multi30k(multi30k_dir, split, num_lines):
  src_path, tgt_path = text.find_parallel_files(multi30k_dir, split, 'en', 'de')
  assert src_path.endswith(f'{split}.en.gz') and tgt_path.endswith(f'{split}.de.gz')
  src, tgt = text.read_parallel(src_path, tgt_path)
  assert len(src) == len(tgt) == num_lines
  assert all(s and s == s.strip() for s in src + tgt)
  if split == 'train':
    assert src[0].startswith('Two young')
    assert tgt[0] == 'Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.'
