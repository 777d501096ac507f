"""BERT-family pretraining from a prepared corpus (`python -m experiments.prepare --unit=lines`;
data.source='prepared'): the batches read from token shards are those of the same documents
tokenized in memory, array for array, for every sentence task; the plan of full_sentences,
made from the line lengths alone, is today's packing; the workflow trains, resumes without
tokenizing anything, refuses a corpus or a workdir tokenizer that does not fit in one line, and
continues on another device count.

Corpora are Multi30k captions, four to a document, prepared here into several shards.
"""

import gzip
import hashlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO_ROOT
from transformer_jax import xla_options
from transformer_jax.corpus import prepare
from transformer_jax.corpus import tokenizers as corpus_tokenizers
from transformer_jax.corpus.reader import PreparedCorpus, TokenSplit
from transformer_jax.data import bert_lines, bert_pretrain, packing
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.training import batch_record

CAPTIONS = 4000  # 1,000 documents: four shards of unit_bytes=65536
TASKS = [('nsp', False), ('sop', False), ('none', False), ('none', True), ('full_sentences', False),
         ('full_sentences', True)]


@pytest.fixture(scope='module')
def captions(corpus, tmp_path_factory) -> str:
  """Multi30k's first English captions, four to a document (documents end at blank lines)."""
  with gzip.open(corpus('multi30k') / 'train.en.gz', 'rt', encoding='utf-8') as f:
    lines = [next(f).strip() for _ in range(CAPTIONS)]
  path = tmp_path_factory.mktemp('captions') / 'captions.txt'
  path.write_text('\n\n'.join('\n'.join(lines[i:i + 4]) for i in range(0, CAPTIONS, 4)) + '\n')
  return str(path)


def _prepare(text: str, output: str, kind: str, valid_fraction: float = 0.0,
             unit: str = 'lines') -> PreparedCorpus:
  options = prepare.Options(sources=(text,), tokenizer=kind, unit=unit, vocab_size=1000,
                            valid_fraction=valid_fraction, unit_bytes=1 << 16)
  prepare.prepare(options, output, workers=1)
  return PreparedCorpus(output)


@pytest.fixture(scope='module')
def prepared(captions, tmp_path_factory):
  """prepared(kind) -> a 'lines' corpus of every caption document (no held-out split, so its
  training documents are the file's, in order), made once per kind."""
  made = {}

  def get(kind: str) -> PreparedCorpus:
    if kind not in made:
      made[kind] = _prepare(captions, str(tmp_path_factory.mktemp(kind) / 'corpus'), kind)
    return made[kind]

  return get


@pytest.fixture(scope='module')
def held_out_corpus(captions, tmp_path_factory) -> PreparedCorpus:
  """A WordPiece 'lines' corpus with 10% of its documents held out (the workflow's)."""
  return _prepare(captions, str(tmp_path_factory.mktemp('held_out') / 'corpus'), 'wordpiece',
                  valid_fraction=0.1)


def _in_memory(corpus: PreparedCorpus, captions: str):
  """(tokenizer, documents) as the in-memory path makes them from the same text."""
  tokenizer = corpus_tokenizers.load(corpus.tokenizer_kind, corpus.tokenizer_path)
  docs = bert_pretrain.tokenize_documents(tokenizer, bert_pretrain.read_documents(captions))
  return tokenizer, docs


@pytest.mark.parametrize('kind', ['wordpiece', 'roberta_bpe'])
def test_shards_hold_the_documents_the_in_memory_path_tokenizes(kind, prepared, captions):
  corpus = prepared(kind)
  split = corpus.split('train')
  assert len(split.shard_names) >= 3  # the line index crosses shards
  _, docs = _in_memory(corpus, captions)
  view = split.documents()
  assert len(view) == len(docs) and view.num_lines == sum(map(len, docs))
  for d in (0, 1, len(docs) // 2, len(docs) - 1):
    assert [x.tolist() for x in view[d]] == [x.tolist() for x in docs[d]]


@pytest.mark.parametrize('kind', ['wordpiece', 'roberta_bpe'])
@pytest.mark.parametrize('task, pack', TASKS)
def test_batches_from_shards_equal_the_in_memory_batches(kind, task, pack, prepared, captions):
  corpus = prepared(kind)
  tokenizer, docs = _in_memory(corpus, captions)
  # max_len 24: some captions are longer than a row, so full_sentences cuts a few.
  options = bert_pretrain.PretrainOptions(max_len=24, max_predictions=4, sentence_task=task,
                                          pack=pack, short_seq_prob=0.2)
  common = dict(batch_size=8, seed=5)
  memory = bert_pretrain.PretrainBatches(docs, tokenizer, options, **common)
  shards = bert_pretrain.PretrainBatches(
      corpus.split('train').documents(), tokenizer, options, **common)
  assert shards.lines.num_lines == memory.lines.num_lines
  assert (shards.rows_per_epoch, shards.truncated_lines) == (memory.rows_per_epoch,
                                                             memory.truncated_lines)
  if task == 'full_sentences':
    assert shards.truncated_lines > 0 and len(shards.examples) == len(memory.examples)
  steps = [0, 1, 2, 7]
  if task == 'full_sentences':  # the end of the first epoch and into the second
    steps.append(shards.rows_per_epoch // 8)
  for step in steps:
    want, got = memory.batch(step), shards.batch(step)
    assert sorted(got) == sorted(want)
    for key in want:
      assert got[key].dtype == want[key].dtype, key
      np.testing.assert_array_equal(got[key], want[key], err_msg=f'{key} of batch {step}')


def test_batches_from_shards_read_no_token_until_a_row_is_fed(prepared, monkeypatch):
  """Building the batches, full_sentences' packing included, reads line lengths only; a batch
  reads the lines its rows take."""
  corpus = prepared('wordpiece')
  tokenizer = corpus_tokenizers.load('wordpiece', corpus.tokenizer_path)
  view = corpus.split('train').documents()
  reads = []
  real = TokenSplit.tokens
  monkeypatch.setattr(TokenSplit, 'tokens',
                      lambda self, a, b: reads.append(b - a) or real(self, a, b))
  for task, pack in TASKS:
    options = bert_pretrain.PretrainOptions(max_len=24, max_predictions=4, sentence_task=task,
                                            pack=pack)
    batches = bert_pretrain.PretrainBatches(view, tokenizer, options, batch_size=4, seed=0)
    assert not reads, task
    assert batches.lines._lines is None  # no Python object per line
    batches.batch(0)
    assert 0 < sum(reads) < len(corpus.split('train')) // 10, (task, pack)
    reads.clear()


# Today's packing (before rows were planned from line lengths), verbatim: the reference the plans
# must reproduce.
def _reference_pack_full_sentences(documents, budget, separator):
  sep = np.asarray([separator], np.int32)
  rows, row, length, truncated = [], [], 0, 0  # row: the pieces of the current row
  for doc in documents:
    for i, line in enumerate(doc):
      if len(line) > budget:
        line = line[:budget]
        truncated += 1
      boundary = int(i == 0 and length > 0)
      if length and length + boundary + len(line) > budget:
        rows.append(np.concatenate(row).astype(np.int32))
        row, length, boundary = [], 0, 0
      row += [sep, line] if boundary else [line]
      length += boundary + len(line)
  if row:
    rows.append(np.concatenate(row).astype(np.int32))
  return rows, truncated


def _reference_document_chunks(documents, budget):
  chunks, truncated = [], 0
  for doc in documents:
    rows, cut = _reference_pack_full_sentences([doc], budget, separator=0)
    chunks += rows
    truncated += cut
  return chunks, truncated


def _random_documents(seed: int) -> list[list[np.ndarray]]:
  """Documents with what a list may hold and a corpus may not: empty documents and empty lines,
  beside lines longer than any budget tried."""
  rng = np.random.default_rng(seed)
  docs = []
  for _ in range(int(rng.integers(1, 30))):
    lengths = rng.integers(0, 12, size=int(rng.integers(0, 7)))
    lengths[rng.random(len(lengths)) < 0.05] = 45
    docs.append([rng.integers(5, 900, n).astype(np.int32) for n in lengths])
  return docs


def _rows_equal(got, want):
  assert len(got) == len(want)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype and a.tolist() == b.tolist()


def test_planned_rows_are_todays_packing(prepared):
  corpus = prepared('wordpiece')
  view = corpus.split('train').documents()
  docs = [list(view[d]) for d in range(len(view))]
  lines = bert_lines.LineIndex(view)
  for budget in (14, 22, 126):
    want_rows, want_cut = _reference_pack_full_sentences(docs, budget, 3)
    bounds, cut = bert_lines.plan_rows(lines, budget, per_document=False)
    rows = [bert_lines.row_tokens(lines, a, b, budget, 3) for a, b in zip(bounds, bounds[1:])]
    assert cut == want_cut and (budget > 22 or cut > 0)
    _rows_equal(rows, want_rows)
    want_chunks, want_cut = _reference_document_chunks(docs, budget)
    bounds, cut = bert_lines.plan_rows(lines, budget, per_document=True)
    chunks = [bert_lines.row_tokens(lines, a, b, budget, None) for a, b in zip(bounds, bounds[1:])]
    assert cut == want_cut
    _rows_equal(chunks, want_chunks)
  for seed in range(200):
    docs = _random_documents(seed)
    for budget in (4, 18):
      rows, cut = bert_lines.pack_full_sentences(docs, budget, 3)
      want_rows, want_cut = _reference_pack_full_sentences(docs, budget, 3)
      assert cut == want_cut
      _rows_equal(rows, want_rows)
      chunks, cut = bert_lines.document_chunks(docs, budget)
      want_chunks, want_cut = _reference_document_chunks(docs, budget)
      assert cut == want_cut
      _rows_equal(chunks, want_chunks)


def test_flat_best_fit_is_pack_lengths():
  rng = np.random.default_rng(0)
  for capacity, count in [(8, 0), (8, 1), (32, 300), (128, 3000)]:
    lengths = rng.integers(1, capacity + 1, size=count)
    offsets, members = bert_lines.pack_lengths_flat(lengths, capacity)
    rows = [members[a:b].tolist() for a, b in zip(offsets, offsets[1:])]
    assert rows == packing.pack_lengths(lengths, capacity)
  with pytest.raises(DataError, match='items to pack must have 1 to 8 tokens'):
    bert_lines.pack_lengths_flat([3, 9], 8)


def test_a_line_index_of_documents_with_empty_ones_draws_only_lines():
  docs = [[], [np.arange(3)], [], [], [np.arange(2), np.arange(4)], []]
  lines = bert_lines.LineIndex(docs)
  assert lines.num_lines == 3 and lines.num_documents == 6
  assert [lines.locate(k) for k in range(3)] == [(1, 0), (4, 0), (4, 1)]
  assert lines.first_lines(0, 3).tolist() == [True, True, False]
  assert lines.tokens(1, 3).tolist() == [0, 1, 0, 1, 2, 3]


# -- the workflow ---------------------------------------------------------------------------------

# bert_pretrain_wikipedia.py shrunk: the config that documents its path through preparation.
PRETRAIN = os.path.join('experiments', 'configs', 'bert_pretrain_wikipedia.py')
TINY = {
    'model.emb_dim': 32, 'model.num_heads': 2, 'model.mlp_dim': 64, 'model.num_encoder_layers': 1,
    'model.max_len': 32, 'data.max_len': 32, 'data.max_predictions': 5, 'data.batch_size': 8,
    'data.eval_batches': 1, 'train.log_every': 1, 'train.eval_every': 0,
    'train.checkpoint_every': 2, 'optimizer.warmup_steps': 1, 'tokenizer.vocab_size': 1000
}


def _values(corpus_root: str, steps: int, **more) -> dict:
  return {
      **TINY, 'data.source': 'prepared', 'data.prepared': corpus_root, 'train.num_steps': steps,
      **more
  }


def _cli(translate_cli, workdir, values: dict, devices: int = 1) -> subprocess.CompletedProcess:
  command = [
      sys.executable, '-m', 'experiments.bert', f'--config={PRETRAIN}', f'--workdir={workdir}'
  ] + [f'--config.{k}={v}' for k, v in values.items()]
  env = translate_cli.env()
  if devices > 1:
    env = xla_options.host_devices_env(devices, env)
  return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=600, check=False)


def _config(values: dict):
  from conftest import set_path
  from experiments.configs import bert_pretrain_small
  config = bert_pretrain_small.get_config()
  for key, value in values.items():
    set_path(config, key, value)
  return config


def _sha256(path) -> str:
  with open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def _metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def _provenance(workdir) -> list[dict]:
  with open(os.path.join(workdir, 'provenance.jsonl')) as f:
    return [json.loads(line) for line in f]


def _forbid_tokenizing(monkeypatch):
  """Every way text becomes ids (or a tokenizer is trained) fails the test."""
  from transformer_jax.data.roberta_tokenizer import RobertaTokenizer
  from transformer_jax.data.wordpiece import WordPieceTokenizer

  def forbidden(*args, **kwargs):
    raise AssertionError('tokenized or trained a tokenizer')

  for owner, names in [(WordPieceTokenizer, ('encode', 'encode_batch', 'train')),
                       (RobertaTokenizer, ('encode', 'encode_batch', 'train')),
                       (bert_pretrain, ('tokenize_documents', 'read_documents'))]:
    for name in names:
      monkeypatch.setattr(owner, name, forbidden)


@pytest.mark.slow
def test_pretraining_from_a_prepared_corpus_resumes_without_tokenizing(
    held_out_corpus, translate_cli, tmp_path, monkeypatch):
  from transformer_jax.workflows import bert_pretraining
  workdir = tmp_path / 'run'
  proc = _cli(translate_cli, workdir, _values(held_out_corpus.root, 2))
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert _sha256(workdir / 'vocab.txt') == held_out_corpus.manifest['tokenizer']['sha256']
  assert re.search(r'documents: \d+ train \(\d+ lines\), \d+ held out', proc.stderr)
  assert 'copied from' in proc.stderr
  assert [m['step'] for m in _metrics(workdir) if 'train/loss' in m] == [1, 2]
  # The rerun, in this process: it must neither encode text nor train a tokenizer.
  _forbid_tokenizing(monkeypatch)
  results = bert_pretraining.pretrain(
      _config(_values(held_out_corpus.root, 4, **{'train.eval_every': 4})), str(workdir))
  assert results['step'] == 4 and np.isfinite(results['train_loss'])
  assert np.isfinite(results['eval_loss'])
  assert _provenance(workdir)[-1]['start_step'] == 2
  assert [m['step'] for m in _metrics(workdir) if 'train/loss' in m] == [1, 2, 3, 4]


def test_a_workdir_tokenizer_other_than_the_corpus_is_one_error_line(held_out_corpus, tmp_path):
  from transformer_jax.workflows import bert_pretraining
  workdir = tmp_path / 'run'
  workdir.mkdir()
  with open(held_out_corpus.tokenizer_path, encoding='utf-8') as f:
    vocab = f.read().splitlines()
  vocab[-2], vocab[-1] = vocab[-1], vocab[-2]  # two ids swapped: other tokens for the same ids
  (workdir / 'vocab.txt').write_text('\n'.join(vocab) + '\n', encoding='utf-8')
  before = (workdir / 'vocab.txt').read_bytes()
  with pytest.raises(DataError) as error:
    bert_pretraining.pretrain(_config(_values(held_out_corpus.root, 1)), str(workdir))
  message = str(error.value)
  assert '\n' not in message
  assert f'the tokenizer {workdir / "vocab.txt"} is not the one {held_out_corpus.root}' in message
  assert sorted(os.listdir(workdir)) == ['vocab.txt'
                                        ] and (workdir / 'vocab.txt').read_bytes() == (before)


def test_a_corpus_or_config_that_does_not_fit_is_one_line_and_writes_nothing(
    held_out_corpus, prepared, captions, tmp_path):
  from transformer_jax.workflows import bert_pretraining
  workdir = tmp_path / 'run'
  by_documents = _prepare(captions, str(tmp_path / 'documents'), 'wordpiece', 0.1, unit='documents')
  cases = [
      ({'tokenizer.type': 'byte_bpe'}, held_out_corpus.root, ConfigError,
       "tokenized with a wordpiece tokenizer, but tokenizer.type='byte_bpe' reads a roberta_bpe "
       'corpus: set --config.tokenizer.type=wordpiece'),
      ({}, prepared('roberta_bpe').root, ConfigError, 'set --config.tokenizer.type=byte_bpe'),
      ({}, by_documents.root, DataError, 'prepared with --unit=documents: BERT pretraining reads '
       'sentence lines; prepare it with --unit=lines'),
      ({'tokenizer.lowercase': False}, held_out_corpus.root, ConfigError,
       'set --config.tokenizer.lowercase=True'),
      ({}, prepared('wordpiece').root, DataError, 'has no held-out documents to evaluate on'),
      ({}, str(tmp_path / 'nothing'), DataError, 'is not a prepared corpus'),
      ({'data.prepared': ''}, None, ConfigError, "data.source='prepared' reads a corpus of "
       'python -m experiments.prepare --unit=lines: pass --config.data.prepared=DIR'),
      ({'data.source': 'files'}, held_out_corpus.root, ConfigError,
       "is read only with data.source='prepared', not 'files'"),
      ({'tokenizer.vocab_file': 'vocab.txt'}, held_out_corpus.root, ConfigError,
       "tokenizer.vocab_file='vocab.txt' is not read with data.source='prepared'"),
  ]
  for overrides, root, kind, message in cases:
    values = _values(root or '', 1, **overrides)
    with pytest.raises(kind) as error:
      bert_pretraining.pretrain(_config(values), str(workdir))
    assert message in str(error.value) and '\n' not in str(error.value), overrides
    assert not workdir.exists(), overrides
  # Without evaluation a corpus with no held-out split is enough (it reads no 'valid' split).
  config = _config(_values(prepared('wordpiece').root, 1, **{'data.eval_batches': 0}))
  run = bert_pretraining.validate_pretrain(config)
  train, valid = bert_pretraining.prepared_documents(bert_pretraining.open_prepared(run),
                                                     held_out=False)
  assert valid == [] and train.num_lines > 0


@pytest.mark.slow
def test_fsdp_on_8_devices_resumes_on_4_with_the_same_batches(held_out_corpus, translate_cli,
                                                              tmp_path):
  """Pretraining from shards on 8 simulated devices (fsdp=8), stopped at its step-3 checkpoint,
  resumed on 4 (data=2 x fsdp=2): every step of both runs trained on the global batch the
  batcher makes from the corpus (train.record_batches), and the resumed losses are finite."""
  from transformer_jax.cli.workdir import load_saved_config
  from transformer_jax.workflows import bert_pretraining
  from transformer_jax.workflows.bert_sections import Pretraining
  workdir = tmp_path / 'run'
  common = {'train.checkpoint_every': 3, 'train.record_batches': True}
  first = _cli(translate_cli, workdir,
               _values(held_out_corpus.root, 3, **common, **{'mesh.data': 1, 'mesh.fsdp': 8}),
               devices=8)
  assert first.returncode == 0, first.stderr[-4000:]
  second = _cli(translate_cli, workdir,
                _values(held_out_corpus.root, 6, **common, **{'mesh.data': 2, 'mesh.fsdp': 2}),
                devices=4)
  assert second.returncode == 0, second.stderr[-4000:]
  assert 'resuming the run saved at step 3 on 8 devices' in second.stderr
  assert 'copied from' not in second.stderr  # the workdir's tokenizer checked, not copied again
  start = _provenance(workdir)[-1]
  assert start['start_step'] == 3
  assert start['resumed_from']['devices'] == 8 and start['resumed_from']['mesh']['fsdp'] == 8
  assert start['layout']['devices'] == 4
  losses = {m['step']: m['train/loss'] for m in _metrics(workdir) if 'train/loss' in m}
  assert sorted(losses) == [1, 2, 3, 4, 5, 6] and all(np.isfinite(list(losses.values())))
  run = Pretraining.of(load_saved_config(str(workdir)))
  tokenizer = bert_pretraining.pretrain_tokenizer(run, str(workdir))
  views = bert_pretraining.prepared_documents(held_out_corpus)
  train = bert_pretraining.make_pretrain_data(run, tokenizer, *views)[0]
  want = {s + 1: batch_record.digest(train.batch(s)) for s in range(6)}
  assert batch_record.read(str(workdir)) == want
