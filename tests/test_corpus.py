"""Prepared corpora (transformer_jax/corpus/): the shards hold exactly the tokenizer's ids, the
bytes do not depend on the workers or the engine, a killed preparation finishes the same corpus,
bad input is one line with nothing half-written, and a remote store works like a folder."""

import errno
import gzip
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from transformer_jax.corpus import engines, prepare, shards, sources, storage, tokenizers
from transformer_jax.corpus.reader import PreparedCorpus
from transformer_jax.data import bert_pretrain
from transformer_jax.errors import ConfigError, DataError

REPO = pathlib.Path(__file__).resolve().parent.parent

# Documents that stress a tokenizer and the format: scripts, emoji, an empty document (two blank
# lines in a row), a very long one, CRLF line ends, a line of spaces.
HARD_DOCUMENTS = [
    'Плохое питание — причина многих болезней.\nВторая строка.',
    '日本語のテキスト、句読点。\n中文文本：你好，世界！',
    'emoji 🙂🚀 and ZWJ 👩‍👩‍👧 sequences',
    'عربي مع أرقام ١٢٣ and mixed text',
    'one\r\ntwo\r\nthree',
    ' '.join(f'word{i % 97}' for i in range(20000)),  # ~140 KB: crosses encode batches
    'after the empty one',
]


def write_corpus(path: pathlib.Path, documents=HARD_DOCUMENTS, repeat: int = 1) -> str:
  text = '\n\n'.join(documents * repeat) + '\n'
  # An empty document: a run of blank lines between two documents.
  text = text.replace('after the empty one', '\n\n\nafter the empty one')
  path.write_bytes(text.encode('utf-8'))
  return str(path)


def options(source: str, **overrides) -> prepare.Options:
  values = dict(sources=(source,), tokenizer='byte_bpe', vocab_size=300, unit_bytes=1 << 16)
  values.update(overrides)
  return prepare.Options(**values)


def stream_of(corpus: PreparedCorpus, split: str) -> np.ndarray:
  tokens = corpus.split(split)
  return tokens.tokens(0, len(tokens)) if len(tokens) else np.zeros(0, np.int64)


def checksums(root: str) -> dict:
  """SHA-256 of every file of a prepared corpus but the plan (whose paths differ by folder)."""
  found = {}
  for path in sorted(pathlib.Path(root).rglob('*')):
    if path.is_file() and path.name not in (prepare.PLAN,):
      found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
  return found


@pytest.fixture(scope='module')
def hard_corpus(tmp_path_factory):
  folder = tmp_path_factory.mktemp('hard')
  return write_corpus(folder / 'text.txt', repeat=3)


@pytest.mark.parametrize('kind', ['byte_bpe', 'sentencepiece', 'char'])
def test_shards_hold_each_documents_ids_then_eos(tmp_path, hard_corpus, kind):
  """Every document of the text, in order, through the saved tokenizer, then EOS (none for
  characters, whose stream is the text itself)."""
  extra = {'documents': 'whole'} if kind == 'char' else {}
  if kind == 'sentencepiece':
    extra['vocab_size'] = 90
  manifest = prepare.prepare(options(hard_corpus, tokenizer=kind, **extra), str(tmp_path / 'c'))
  corpus = PreparedCorpus(str(tmp_path / 'c'))
  tokenizer = tokenizers.load(kind, os.path.join(tmp_path, 'c', tokenizers.FILE_NAMES[kind]))
  text = pathlib.Path(hard_corpus).read_text(encoding='utf-8').replace('\r\n', '\n')
  if kind == 'char':
    expected = np.asarray(tokenizer.encode(text))
  else:
    eos = tokenizers.eos_id(kind, tokenizer)
    documents = sources.split_documents(text, 'blank_lines')
    assert len(documents) == 3 * len(HARD_DOCUMENTS)
    expected = np.concatenate([np.asarray(tokenizer.encode(d) + [eos]) for d in documents])
    bounds = corpus.split('train').document_bounds()
    assert len(bounds) == len(documents) and bounds[-1] == len(expected)
  np.testing.assert_array_equal(stream_of(corpus, 'train'), expected)
  assert manifest['splits']['valid']['tokens'] == 0
  assert len(manifest['splits']['train']['shards']) > 1  # the 64 KB units cut the file
  assert corpus.dtype == np.dtype('<u2')


def test_lines_unit_keeps_each_line_and_document(tmp_path, hard_corpus):
  """BERT's and T5's unit: each non-empty line alone, lines grouped into their documents, as
  data/bert_pretrain.py reads and tokenizes them in memory."""
  prepare.prepare(options(hard_corpus, tokenizer='wordpiece', unit='lines', vocab_size=400),
                  str(tmp_path / 'c'))
  corpus = PreparedCorpus(str(tmp_path / 'c'))
  tokenizer = tokenizers.load('wordpiece', str(tmp_path / 'c' / 'vocab.txt'))
  expected = bert_pretrain.tokenize_documents(tokenizer, bert_pretrain.read_documents(hard_corpus))
  documents = corpus.split('train').documents()
  assert len(documents) == len(expected)
  for d, lines in enumerate(expected):
    assert len(documents[d]) == len(lines)
    for i, line in enumerate(lines):
      np.testing.assert_array_equal(documents[d][i], line)


def test_bytes_do_not_depend_on_the_workers(tmp_path, hard_corpus):
  one = prepare.prepare(options(hard_corpus, valid_fraction=0.3), str(tmp_path / 'one'), workers=1)
  two = prepare.prepare(options(hard_corpus, valid_fraction=0.3), str(tmp_path / 'two'), workers=2)
  assert one['splits'] == two['splits'] and one['plan'] == two['plan']
  assert checksums(tmp_path / 'one') == checksums(tmp_path / 'two')
  assert one['splits']['valid']['documents'] > 0  # the seeded draw held some out


def test_a_finished_corpus_is_not_prepared_again(tmp_path, hard_corpus, monkeypatch):
  root = str(tmp_path / 'c')
  prepare.prepare(options(hard_corpus), root)
  monkeypatch.setattr(prepare, 'prepare_unit', lambda task: pytest.fail('tokenized again'))
  prepare.prepare(options(hard_corpus), root)  # returns from the manifest
  with pytest.raises(DataError, match='prepared from other sources, options or tokenizer'):
    prepare.prepare(options(hard_corpus, valid_fraction=0.5), root)


def test_a_run_that_fails_midway_resumes_without_redoing_shards(tmp_path, hard_corpus, monkeypatch):
  """Units 0 and 1 finish, unit 2 fails: their shards stay; the rerun does the rest only, and
  the corpus equals an uninterrupted one."""
  reference = prepare.prepare(options(hard_corpus), str(tmp_path / 'ref'))
  root = str(tmp_path / 'c')
  real = prepare.prepare_unit

  def failing(task):
    if task.unit.index == 2:
      raise OSError(errno.EIO, 'simulated failure')
    return real(task)

  monkeypatch.setattr(prepare, 'prepare_unit', failing)
  with pytest.raises(OSError):
    prepare.prepare(options(hard_corpus), root, workers=1)
  assert not (tmp_path / 'c' / shards.MANIFEST).exists()
  assert not [p for p in (tmp_path / 'c').rglob('*') if storage.is_staging_name(p.name)]
  done = []
  monkeypatch.setattr(prepare, 'prepare_unit',
                      lambda task: done.append(task.unit.index) or real(task))
  manifest = prepare.prepare(options(hard_corpus), root, workers=1)
  assert 0 not in done and 1 not in done and 2 in done
  assert manifest['splits'] == reference['splits']
  assert checksums(tmp_path / 'c') == checksums(tmp_path / 'ref')


@pytest.mark.slow
def test_sigkill_at_random_points_then_rerun_gives_the_same_bytes(tmp_path, hard_corpus):
  """The command killed with SIGKILL at two random moments, rerun each time, ends with the
  checksums of an uninterrupted run (benchmarks/prepare.py --kills does five)."""
  big = write_corpus(tmp_path / 'big.txt', repeat=40)
  flags = ['--tokenizer=byte_bpe', '--vocab_size=300', '--unit_mb=1', '--valid_fraction=0.01']
  env = dict(os.environ, PYTHONPATH=str(REPO))
  command = [sys.executable, '-m', 'experiments.prepare', f'--sources={big}']
  reference = tmp_path / 'reference'
  subprocess.run(command + [f'--output={reference}'] + flags, cwd=REPO, env=env, check=True,
                 capture_output=True)
  killed = tmp_path / 'killed'
  rng = np.random.default_rng(0)
  unfinished = 0
  for _ in range(2):
    process = subprocess.Popen(command + [f'--output={killed}', '--workers=2'] + flags, cwd=REPO,
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    time.sleep(float(rng.uniform(0.5, 3.0)))
    os.killpg(process.pid, signal.SIGKILL)  # the workers too
    process.wait()
    unfinished += not (killed / shards.MANIFEST).exists()
  assert unfinished, 'no kill landed before the end: the test proved nothing'
  subprocess.run(command + [f'--output={killed}', '--workers=2'] + flags, cwd=REPO, env=env,
                 check=True, capture_output=True)
  assert checksums(killed) == checksums(reference)


# -- bad input: one line, nothing half-written ---------------------------------------------------


def test_missing_and_empty_sources(tmp_path):
  with pytest.raises(DataError, match='does not exist'):
    prepare.prepare(options(str(tmp_path / 'nope.txt')), str(tmp_path / 'c'))
  with pytest.raises(DataError, match='no file matches'):
    prepare.prepare(options(str(tmp_path / '*.missing')), str(tmp_path / 'c'))
  (tmp_path / 'empty').mkdir()
  with pytest.raises(DataError, match='holds no files'):
    prepare.prepare(options(str(tmp_path / 'empty')), str(tmp_path / 'c'))
  (tmp_path / 'blank.txt').write_text('\n\n  \n')
  with pytest.raises(DataError, match='empty'):
    prepare.prepare(options(str(tmp_path / 'blank.txt')), str(tmp_path / 'c'))
  assert not (tmp_path / 'c' / shards.MANIFEST).exists()


def test_undecodable_lines_are_skipped_and_counted_or_refused(tmp_path):
  path = tmp_path / 'bad.txt'
  path.write_bytes(b'good line one\n\xff\xfe broken\nanother good line\n\nsecond document\n' * 50)
  manifest = prepare.prepare(options(str(path)), str(tmp_path / 'skip'))
  assert manifest['invalid_utf8_lines_skipped'] == 50
  with pytest.raises(DataError, match=r'bad.txt:2: invalid UTF-8 at byte 14 .*--invalid_utf8=skip'):
    prepare.prepare(options(str(path), invalid_utf8='error'), str(tmp_path / 'error'))
  assert not (tmp_path / 'error' / shards.MANIFEST).exists()


def test_vocabulary_too_large_for_the_dtype(tmp_path, hard_corpus):
  with pytest.raises(DataError, match='does not fit uint16'):
    shards.token_dtype(70_000, 'uint16')
  assert shards.token_dtype(65_536) == np.dtype('<u2')
  assert shards.token_dtype(65_537) == np.dtype('<u4')
  with pytest.raises(ConfigError, match='dtype must be'):
    prepare.prepare(options(hard_corpus, dtype='int8'), str(tmp_path / 'c'))


def test_truncated_and_corrupted_shards_are_named(tmp_path, hard_corpus):
  root = tmp_path / 'c'
  prepare.prepare(options(hard_corpus), str(root))
  shard = root / 'train' / '000001.tokens'
  data = bytearray(shard.read_bytes())
  data[10] ^= 0xFF
  shard.write_bytes(bytes(data))
  split = PreparedCorpus(str(root)).split('train')
  split.tokens(0, 5)  # shard 0 is intact
  start = int(split.starts[1])
  with pytest.raises(DataError, match=r'000001.tokens is corrupted: tokens 0-'):
    split.tokens(start, start + 3)
  shard.write_bytes(bytes(data[:-2]))
  with pytest.raises(DataError, match=r'000001.tokens has \d+ bytes, its record says'):
    PreparedCorpus(str(root)).split('train')


def test_a_tokenizer_other_than_the_manifests_is_refused(tmp_path, hard_corpus):
  prepare.prepare(options(hard_corpus), str(tmp_path / 'c'))
  prepare.prepare(options(hard_corpus, vocab_size=280), str(tmp_path / 'other'))
  corpus = PreparedCorpus(str(tmp_path / 'c'))
  corpus.check_tokenizer(str(tmp_path / 'c' / 'tokenizer'))
  with pytest.raises(DataError, match='is not the one .* was prepared with'):
    corpus.check_tokenizer(str(tmp_path / 'other' / 'tokenizer'))


def test_a_full_disk_mid_shard_leaves_nothing_half_written(tmp_path, hard_corpus, monkeypatch):
  real = shards._File.write
  written = {'bytes': 0}

  def filling(self, data):
    written['bytes'] += len(data)
    if written['bytes'] > 40_000:
      raise OSError(errno.ENOSPC, 'No space left on device')
    return real(self, data)

  monkeypatch.setattr(shards._File, 'write', filling)
  with pytest.raises(OSError, match='No space left'):
    prepare.prepare(options(hard_corpus), str(tmp_path / 'c'), workers=1)
  files = [p for p in (tmp_path / 'c').rglob('*') if p.is_file()]
  assert not [p for p in files if storage.is_staging_name(p.name)]
  for record in (tmp_path / 'c').rglob('*.json'):
    if record.parent.name in shards.SPLITS:  # every recorded shard is whole
      entry = json.loads(record.read_text())
      assert shards.is_complete(str(tmp_path / 'c'), entry, 2)


def test_the_command_line_says_one_line_and_exits_nonzero(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(REPO))
  result = subprocess.run([
      sys.executable, '-m', 'experiments.prepare', f'--sources={tmp_path}/missing.txt',
      f'--output={tmp_path}/c', '--tokenizer=byte_bpe'
  ], cwd=REPO, env=env, capture_output=True, text=True)
  assert result.returncode != 0
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and 'does not exist' in errors[0], result.stderr[-2000:]
  assert 'Traceback' not in result.stderr


# -- sources ------------------------------------------------------------------------------------


def test_jsonl_parquet_gzip_folders_and_globs_read_the_same_documents(tmp_path):
  documents = [f'document {i}: ' + 'some text here. ' * (i % 7 + 1) for i in range(60)]
  folder = tmp_path / 'src'
  folder.mkdir()
  (folder / 'a.txt').write_text('\n\n'.join(documents[:30]) + '\n')
  with gzip.open(folder / 'b.txt.gz', 'wt') as f:
    f.write('\n\n'.join(documents[30:]) + '\n')
  with gzip.open(tmp_path / 'docs.jsonl.gz', 'wt') as f:
    for doc in documents:
      f.write(json.dumps({'text': doc, 'id': 1}) + '\n')
  import pyarrow
  import pyarrow.parquet as pq
  pq.write_table(pyarrow.table({'text': documents}), tmp_path / 'docs.parquet', row_group_size=25)
  tokenizer_dir = tmp_path / 'tok'
  prepare.prepare(options(str(folder)), str(tokenizer_dir))
  streams = []
  for i, source in enumerate([
      str(folder),
      str(tmp_path / 'src' / '*'),
      str(tmp_path / 'docs.jsonl.gz'),
      str(tmp_path / 'docs.parquet')
  ]):
    root = str(tmp_path / f'c{i}')
    prepare.prepare(options(source, tokenizer_from=str(tokenizer_dir)), root)
    streams.append(stream_of(PreparedCorpus(root), 'train'))
  for stream in streams[1:]:
    np.testing.assert_array_equal(stream, streams[0])
  assert len(sources.plan([str(tmp_path / 'docs.parquet')])) == 3  # a unit per row group
  with pytest.raises(DataError, match="no text field 'body'"):
    prepare.prepare(options(str(tmp_path / 'docs.jsonl.gz'), text_field='body'),
                    str(tmp_path / 'bad'))


def test_tail_split_matches_the_character_split(tmp_path):
  """train_fraction: the last characters validate, counted as `data.lm.split_train_val` counts
  them (universal newlines, multi-byte characters)."""
  from transformer_jax.data import lm as lm_data
  text = ('line é ü 日本\r\n' * 300) + 'line\rline\n'
  path = tmp_path / 'text.txt'
  path.write_bytes(text.encode('utf-8'))
  root = str(tmp_path / 'c')
  prepare.prepare(
      options(str(path), tokenizer='char', documents='whole', train_fraction=0.9,
              unit_bytes=1 << 16), root)
  corpus = PreparedCorpus(root)
  tokenizer = tokenizers.load('char', os.path.join(root, 'tokenizer.json'))
  train, valid = lm_data.split_train_val(lm_data.read_text(str(path)), 0.9)
  np.testing.assert_array_equal(stream_of(corpus, 'train'), tokenizer.encode(train))
  np.testing.assert_array_equal(stream_of(corpus, 'valid'), tokenizer.encode(valid))


# -- storage and engines ------------------------------------------------------------------------


def test_a_remote_store_prepares_and_reads_like_a_folder(tmp_path, hard_corpus):
  """fsspec's in-memory filesystem stands in for gs://: the same bytes as a local folder. (It
  lives in this process, so the units run here: workers=1.)"""
  import fsspec
  local = prepare.prepare(options(hard_corpus, valid_fraction=0.3), str(tmp_path / 'local'))
  remote = prepare.prepare(options(hard_corpus, valid_fraction=0.3), 'memory://corpus/c', workers=1)
  assert remote['splits'] == local['splits']
  corpus = PreparedCorpus('memory://corpus/c')
  np.testing.assert_array_equal(stream_of(corpus, 'train'),
                                stream_of(PreparedCorpus(str(tmp_path / 'local')), 'train'))
  windows = corpus.split('train').windows([0, 7, 100], 16)
  assert windows.shape == (3, 16) and windows.dtype == np.int32
  fs = fsspec.filesystem('memory')
  names = fs.ls('/corpus/c/train', detail=False)
  assert not [n for n in names if '.tmp' in n]
  workdir_tokenizer = str(tmp_path / 'tokenizer')
  corpus.copy_tokenizer(workdir_tokenizer)
  assert os.path.isdir(workdir_tokenizer)
  fs.rm('/corpus', recursive=True)


@pytest.mark.slow
def test_ray_engine_gives_the_local_engines_bytes(tmp_path, hard_corpus):
  """`--engine=ray` on a local Ray the test starts: the same checksums as the local engine."""
  import ray
  local = str(tmp_path / 'local')
  prepare.prepare(options(hard_corpus, valid_fraction=0.3), local, workers=2)
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
  try:
    prepare.prepare(options(hard_corpus, valid_fraction=0.3), str(tmp_path / 'ray'), engine='ray')
  finally:
    ray.shutdown()
  assert checksums(tmp_path / 'ray') == checksums(local)


def test_engines_refuse_an_unknown_name():
  with pytest.raises(ConfigError, match='engine must be one of'):
    list(engines.run(len, [1], engine='spark'))
