"""T5 span-corruption pretraining from a prepared corpus (data.prepared): token shards of a
`--unit=lines` corpus read on demand, step-indexed batches.

What must hold: the chunks read from the shards are the chunks the text path cuts from the same
lines tokenized in memory; batch s of `SpanCorruptionSteps` is a pure function of (seed, s) (the
same after a restore through JSON, the same global rows for any process count), each row a valid
corruption of its chunk, every chunk once per epoch with new masks each epoch; the command line
trains from the shards and resumes without tokenizing; a workdir tokenizer that is not the
corpus's is one error line; a run on 8 simulated devices (fsdp) resumes on 4 with the same global
batches.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO_ROOT
from experiments.configs import t5_span_corruption
from transformer_jax import xla_options
from transformer_jax.corpus import prepare
from transformer_jax.corpus.reader import PreparedCorpus
from transformer_jax.data import span_corruption, span_corruption_stream, text
from transformer_jax.data.tokenizer import Tokenizer, train_tokenizer
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.special_tokens import EOS_ID, PAD_ID
from transformer_jax.training import batch_record
from transformer_jax.workflows import span_corruption as span_workflow
from transformer_jax.workflows import translation

VOCAB = 200  # the corpus's SentencePiece pieces; the model has 100 sentinels more
MAX_LEN = 32  # corrupted inputs, EOS included: 34-token chunks, 8-column targets
BATCH_TOKENS = 512  # 16 rows

# -- a prepared corpus --------------------------------------------------------------------------


@pytest.fixture(scope='module')
def lines_corpus(tiny_shakespeare, tmp_path_factory):
  """(corpus folder, training text file, validation text file): the first 2,000 lines of Tiny
  Shakespeare for training and the next 200 for validation, prepared as lines with a
  200-piece SentencePiece model trained on them."""
  folder = tmp_path_factory.mktemp('t5_corpus')
  with open(tiny_shakespeare, encoding='utf-8') as f:
    lines = f.read().split('\n')
  train, valid = folder / 'train.txt', folder / 'valid.txt'
  train.write_text('\n'.join(lines[:2000]) + '\n', encoding='utf-8')
  valid.write_text('\n'.join(lines[2000:2200]) + '\n', encoding='utf-8')
  output = str(folder / 'corpus')
  prepare.prepare(
      prepare.Options(sources=(str(train),), valid_sources=(str(valid),), tokenizer='sentencepiece',
                      unit='lines', documents='lines', vocab_size=VOCAB), output, workers=1)
  return output, str(train), str(valid)


def chunks_in_memory(path: str, tokenizer, length: int) -> list[np.ndarray]:
  """The text path's chunks of a file: its non-empty lines tokenized in memory, packed and cut
  (workflows/span_corruption.py's text_chunks)."""
  config = t5_span_corruption.get_config()
  config.data.max_len = MAX_LEN
  assert span_corruption.chunk_length(MAX_LEN) == length
  lines = [line for line in text.read_lines(path) if line]
  return span_workflow.text_chunks(config, tokenizer, lines)


def test_chunks_from_the_shards_are_the_text_paths_chunks_of_the_same_lines(lines_corpus):
  folder, train_path, valid_path = lines_corpus
  corpus = PreparedCorpus(folder)
  assert (corpus.unit, corpus.tokenizer_kind, corpus.vocab_size) == ('lines', 'sentencepiece',
                                                                     VOCAB)
  tokenizer = Tokenizer.from_file(corpus.tokenizer_path)
  length = span_corruption.chunk_length(MAX_LEN)
  for split, path in (('train', train_path), ('valid', valid_path)):
    chunks = span_corruption_stream.StreamChunks(corpus.split(split), length)
    expected = chunks_in_memory(path, tokenizer, length)
    assert len(chunks) == len(expected) > 10
    for got, want in zip(chunks, expected):
      assert got.dtype == np.int32
      np.testing.assert_array_equal(got, want)
    assert 0 < len(chunks[len(chunks) - 1]) < length or len(corpus.split(split)) % length == 0
  # The same, from the lines read back through the shards, for other chunk lengths too.
  documents = corpus.split('train').documents()
  lines = [documents.line(k) for k in range(documents.num_lines)]
  assert len(lines) == len([line for line in text.read_lines(train_path) if line])
  for length in (1, 7, 141, 5000):
    chunks = span_corruption_stream.StreamChunks(corpus.split('train'), length)
    expected = span_corruption.pack_and_split(lines, length)
    assert len(chunks) == len(expected)
    assert all(np.array_equal(a, b) for a, b in zip(chunks, expected)), length
  assert len(span_corruption_stream.StreamChunks(corpus.split('train'), 141, limit=3)) == 3
  with pytest.raises(IndexError):
    span_corruption_stream.StreamChunks(corpus.split('train'), 141, limit=3)[3]


# -- the batcher --------------------------------------------------------------------------------

NUM_SENTINELS = 20
BASE = 60  # token ids 5..59, sentinels 79 down to 60
SMALL = dict(max_len=48, batch_tokens=192, seed=3, vocab_size=BASE + NUM_SENTINELS,
             num_sentinels=NUM_SENTINELS)


def small_batcher(num_tokens: int = 632, **overrides) -> span_corruption_stream.SpanCorruptionSteps:
  """Random ids in a stream of 632 tokens: 13 chunks of 52 (the last of 8), 4 rows a batch of
  48-token inputs and 16-token targets (52 tokens have 8 noise tokens in 3 spans)."""
  ids = np.random.default_rng(0).integers(5, BASE, size=num_tokens)
  source = span_corruption_stream.TokenArray(ids.astype(np.uint16))
  return span_corruption_stream.SpanCorruptionSteps(source, **{**SMALL, **overrides})


def uncorrupt(inputs: np.ndarray, targets: np.ndarray, vocab_size: int,
              num_sentinels: int) -> tuple[list[int], int]:
  """(the text an (inputs, targets) row stands for, its number of noise spans). Asserts the
  row's form: inputs and targets end with EOS then PAD, the sentinels of the inputs are 0, 1,
  2, ... in order, the targets list them in that order, each before its span's tokens, with at
  most one final sentinel more."""

  def ids(row):
    row = row.tolist()
    end = row.index(EOS_ID)
    assert all(t == PAD_ID for t in row[end + 1:]), row
    return row[:end]

  def sentinel(token):
    i = vocab_size - 1 - token
    return i if 0 <= i < num_sentinels else None

  spans, current = {}, None
  for token in ids(targets):
    if sentinel(token) is not None:
      current = sentinel(token)
      assert current == len(spans), targets
      spans[current] = []
    else:
      assert current is not None, targets  # the targets start with a sentinel
      spans[current].append(token)
  out, used = [], 0
  for token in ids(inputs):
    if sentinel(token) is None:
      out.append(token)
      continue
    assert sentinel(token) == used, inputs
    assert spans[used], (inputs, targets)  # a noise span is never empty
    out += spans[used]
    used += 1
  assert len(spans) - used in (0, 1) and (len(spans) == used or not spans[used])
  return out, used


def test_rows_are_corruptions_of_their_chunks_with_fixed_shapes():
  batcher = small_batcher()
  rows = batcher.global_rows[0]
  assert rows == 4 and batcher.num_examples == 13
  assert batcher.targets_length == span_corruption.targets_length(48) == 16
  length = span_corruption.chunk_length(48)
  for step in range(8):  # 32 rows: two and a half epochs
    batch = batcher.batch(step)
    assert batch['inputs'].shape == (rows, 48) and batch['inputs'].dtype == np.int32
    assert batch['targets'].shape == (rows, batcher.targets_length)
    assert batch['targets'].dtype == np.int32
    for chunk, inputs, targets in zip(batch['index'], batch['inputs'], batch['targets']):
      original = batcher.chunks[chunk]
      assert len(original) == (length if chunk < 12 else 632 - 12 * length)
      rebuilt, spans = uncorrupt(inputs, targets, BASE + NUM_SENTINELS, NUM_SENTINELS)
      assert rebuilt == original.tolist()
      assert spans == span_corruption.noise_counts(len(original))[1]


def test_every_chunk_once_per_epoch_in_a_new_order_with_new_masks():
  batcher = small_batcher()
  steps = [batcher.batch(s) for s in range(13)]  # 52 rows: 4 epochs of 13
  index = np.concatenate([b['index'] for b in steps])
  inputs = np.concatenate([b['inputs'] for b in steps])
  epochs = index.reshape(4, 13)
  for order in epochs:
    assert sorted(order) == list(range(13))
  assert len({tuple(order) for order in epochs}) == 4
  np.testing.assert_array_equal(epochs[0], np.random.default_rng((3, 0)).permutation(13))
  # The same chunk in two epochs: the same tokens under another mask (inputs differ).
  first = {c: inputs[k] for k, c in enumerate(index[:13])}
  second = {c: inputs[13 + k] for k, c in enumerate(index[13:26])}
  assert sum(not np.array_equal(first[c], second[c]) for c in range(13)) >= 10
  # Another seed, other batches.
  other = small_batcher(seed=4).batch(0)
  assert not np.array_equal(other['inputs'], steps[0]['inputs'])


@pytest.mark.parametrize('saved_at', [0, 3, 7, 13])
def test_batch_s_is_the_same_after_a_restore_through_json(saved_at):
  """Positions at the start, mid epoch and on batches that span two epochs (13 rows an epoch,
  4 a batch)."""
  batcher = small_batcher()
  stream = iter(batcher)
  for _ in range(saved_at):
    next(stream)
  state = json.loads(json.dumps(batcher.state()))
  assert state == {'step': saved_at}
  expected = [next(stream) for _ in range(6)]
  restored = small_batcher()
  restored.restore(state)
  for want, got in zip(expected, iter(restored)):
    assert want.keys() == got.keys()
    for key in want:
      np.testing.assert_array_equal(want[key], got[key])


def test_two_processes_feed_the_halves_of_the_global_batch():
  whole = small_batcher(batch_tokens=384, multiple_of=2)
  halves = [
      small_batcher(batch_tokens=384, multiple_of=2, process_index=p, process_count=2)
      for p in (0, 1)
  ]
  assert whole.global_rows == halves[0].global_rows == halves[1].global_rows == [8]
  for step in (0, 1, 5):
    batch = whole.batch(step)
    parts = [h.batch(step) for h in halves]
    for key in batch:
      assert parts[0][key].shape[0] == 4
      np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), batch[key])


def test_rows_are_a_multiple_of_the_layout_and_bad_positions_are_one_line():
  assert small_batcher(batch_tokens=300, multiple_of=3).global_rows == [6]  # 300 // 48 = 6
  assert small_batcher(batch_tokens=192, multiple_of=8).global_rows == [8]  # at least 8
  assert small_batcher(max_chunks=5).num_examples == 5
  with pytest.raises(ConfigError, match='cannot be split evenly over 3 processes'):
    small_batcher(process_count=3)
  with pytest.raises(DataError, match='no text to corrupt'):
    small_batcher(num_tokens=0)
  with pytest.raises(ConfigError, match=r"must look like \{'step': 0\}") as error:
    small_batcher().restore({'epoch': 1, 'position': 2})  # a text-path run's position
  assert '\n' not in str(error.value)


# -- the workflow -------------------------------------------------------------------------------

TINY = {
    'model.emb_dim': 32,
    'model.num_heads': 2,
    'model.mlp_dim': 64,
    'model.num_encoder_layers': 1,
    'model.num_decoder_layers': 1,
    'tokenizer.vocab_size': VOCAB,
    'data.max_len': MAX_LEN,
    'data.batch_tokens': BATCH_TOKENS,
    'optimizer.warmup_steps': 2,
    'train.log_every': 1,
    'train.eval_every': 0,
    'train.checkpoint_every': 3,
    'train.eval_max_batches': 1,
    'train.record_batches': True,
    'eval.bleu_sentences': 2,
}

# `python -m experiments.translate` with SentencePiece's encoding counted: the lines encoded go
# to stderr as 'ENCODED n' when the process ends.
COUNTING = '''
import atexit, runpy, sys
from transformer_jax.data import tokenizer
encoded = [0]
def counting(method, size):
  def wrapped(self, texts, *args, **kwargs):
    encoded[0] += size(texts)
    return method(self, texts, *args, **kwargs)
  return wrapped
tokenizer.Tokenizer.encode = counting(tokenizer.Tokenizer.encode, lambda text: 1)
tokenizer.Tokenizer.encode_batch = counting(tokenizer.Tokenizer.encode_batch, len)
atexit.register(lambda: print(f'ENCODED {encoded[0]}', file=sys.stderr))
sys.argv = ['translate'] + sys.argv[1:]
runpy.run_module('experiments.translate', run_name='__main__', alter_sys=True)
'''


def run_cli(translate_cli, folder: str, workdir, steps: int, devices: int = 1,
            flags: dict | None = None) -> subprocess.CompletedProcess:
  """The T5 config from the prepared corpus, tiny, for `steps` steps on `devices` CPU devices."""
  values = {**TINY, 'train.num_steps': steps, **(flags or {})}
  command = [
      sys.executable, '-c', COUNTING, '--config=experiments/configs/t5_span_corruption.py',
      f'--config.data.prepared={folder}', '--config.data.text_path=', f'--workdir={workdir}'
  ] + [f'--config.{k}={v}' for k, v in values.items()]
  env = xla_options.host_devices_env(devices, translate_cli.env())
  proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc


def encoded(proc) -> int:
  return int([line for line in proc.stderr.splitlines() if line.startswith('ENCODED ')][-1][8:])


# Texts a run may encode: the 2 held-out inputs decoded for BLEU, each encoded again at the end
# a piece at a time between its sentinels. Tokenizing the corpus would be its ~1,900 lines.
FEW = 20


def losses(workdir) -> dict[int, float]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  return {r['step']: r['train/loss'] for r in records if 'train/loss' in r}


def expected_digests(folder: str, steps: int, multiple_of: int,
                     batch_tokens: int = BATCH_TOKENS) -> dict[int, str]:
  """{step: SHA-256} of the global batches the run must train on: `SpanCorruptionSteps`'s
  batch s - 1 at step s, computed here."""
  batcher = span_corruption_stream.SpanCorruptionSteps(
      PreparedCorpus(folder).split('train'), max_len=MAX_LEN, batch_tokens=batch_tokens,
      seed=t5_span_corruption.get_config().seed, vocab_size=VOCAB + 100, num_sentinels=100,
      multiple_of=multiple_of)
  out = {}
  for step in range(1, steps + 1):
    batch = batcher.batch(step - 1)
    out[step] = batch_record.digest({k: batch[k] for k in ('inputs', 'targets')})
  return out


@pytest.mark.slow
def test_the_command_line_trains_from_the_shards_and_resumes_without_tokenizing(
    lines_corpus, translate_cli, tmp_path):
  folder = lines_corpus[0]
  workdir = tmp_path / 'work'
  first = run_cli(translate_cli, folder, workdir, steps=3)
  assert encoded(first) <= FEW, encoded(first)
  saved = json.loads((workdir / 'config.json').read_text())
  assert saved['data']['prepared'] == folder and saved['data']['text_path'] == ''
  with open(PreparedCorpus(folder).tokenizer_path, 'rb') as f:
    assert (workdir / 'spm.model').read_bytes() == f.read()  # the corpus's, copied
  resumed = run_cli(translate_cli, folder, workdir, steps=5)
  assert 'restored checkpoint at step 3' in resumed.stderr
  assert encoded(resumed) <= FEW, encoded(resumed)
  trained = losses(workdir)
  assert sorted(trained) == [1, 2, 3, 4, 5] and all(np.isfinite(list(trained.values())))
  assert batch_record.read(workdir) == expected_digests(folder, 5, multiple_of=1)
  # The saved config reads back for inference: the model has 200 + 100 entries.
  task = translation.restore_for_inference(saved, str(workdir)).task
  assert task.cfg.vocab_size == VOCAB + 100


def test_text_path_and_prepared_are_one_of_two(lines_corpus, tmp_path):
  config = t5_span_corruption.get_config()
  assert config.data.text_path == t5_span_corruption.TEXT_PATH and config.data.prepared == ''
  config.data.prepared = lines_corpus[0]
  with pytest.raises(ConfigError, match='are both set.*pass --config.data.text_path=$') as error:
    translation.train_and_evaluate(config, str(tmp_path / 'work'))
  assert '\n' not in str(error.value) and not (tmp_path / 'work').exists()
  config.data.text_path = ''
  config.data.valid_text_path = lines_corpus[2]
  with pytest.raises(ConfigError, match='valid_text_path is for data.text_path'):
    translation.train_and_evaluate(config, str(tmp_path / 'work'))


def test_a_workdir_tokenizer_other_than_the_corpuss_is_one_error_line(lines_corpus, tmp_path):
  folder, train_path, _ = lines_corpus
  config = t5_span_corruption.get_config()
  config.data.prepared, config.data.text_path = folder, ''
  for key, value in TINY.items():
    section, name = key.split('.')
    config[section][name] = value
  workdir = tmp_path / 'work'
  workdir.mkdir()
  config.train.num_steps = 1  # a run that wrongly starts ends soon
  # A workdir whose spm.model was trained on the text itself, as the text path does, with
  # fewer pieces (with as many, SentencePiece would write the corpus's model byte for byte).
  lines = [line for line in text.read_lines(train_path) if line]
  train_tokenizer(lines, str(workdir / 'spm.model'), VOCAB - 50)
  with pytest.raises(DataError, match='is not the one .* was prepared with') as error:
    translation.train_and_evaluate(config, str(workdir))
  assert '\n' not in str(error.value)
  assert sorted(os.listdir(workdir)) == ['spm.model']  # nothing else written


def test_a_corpus_of_documents_is_refused(tmp_path):
  source = tmp_path / 'text.txt'
  words = 'the quick brown fox jumps over a lazy dog while birds sing'.split()
  rng = np.random.default_rng(0)
  source.write_text('\n'.join(' '.join(rng.choice(words, 8)) for _ in range(300)) + '\n')
  folder = str(tmp_path / 'docs')
  prepare.prepare(
      prepare.Options(sources=(str(source),), tokenizer='sentencepiece', vocab_size=40,
                      valid_fraction=0.1), folder, workers=1)
  config = t5_span_corruption.get_config()
  config.data.prepared, config.data.text_path = folder, ''
  with pytest.raises(DataError, match='--unit=documents; span corruption reads lines'):
    translation.train_and_evaluate(config, str(tmp_path / 'work'))


def test_the_planner_sizes_prepared_batches_from_the_config():
  config = t5_span_corruption.get_config()
  config.data.prepared, config.data.text_path = '/never/read', ''
  config.data.buckets = (256,)  # a text-path setting: rows of max_len from a prepared corpus
  _, batch = translation.abstract_task(config, num_devices=1)
  assert (batch['inputs'].shape, batch['targets'].shape) == ((16, 128), (16, 32))


@pytest.mark.slow
def test_eight_devices_fsdp_resumed_on_four(lines_corpus, translate_cli, tmp_path):
  """3 steps on 8 simulated devices (mesh data=2 x fsdp=4), resumed to 6 on 4 devices (data=4):
  every step trains on the batcher's global batch for it, computed here, and the losses are
  finite. 480 // 32 = 15 rows: 8 on the first layout, and still 8 on 4 devices (12 would be
  other batches)."""
  folder = lines_corpus[0]
  workdir = tmp_path / 'work'
  batch_tokens = {'data.batch_tokens': 480}
  run_cli(translate_cli, folder, workdir, steps=3, devices=8,
          flags={'mesh.data': 2, 'mesh.fsdp': 4, **batch_tokens})
  resumed = run_cli(translate_cli, folder, workdir, steps=6, devices=4, flags=batch_tokens)
  assert 'resuming the run saved at step 3 on 8 devices' in resumed.stderr
  assert encoded(resumed) <= FEW
  trained = losses(workdir)
  assert sorted(trained) == [1, 2, 3, 4, 5, 6] and all(np.isfinite(list(trained.values())))
  assert batch_record.read(workdir) == expected_digests(folder, 6, multiple_of=8, batch_tokens=480)
  with open(workdir / 'provenance.jsonl') as f:
    start = [json.loads(line) for line in f][-1]
  assert start['start_step'] == 3 and start['layout']['devices'] == 4
  assert start['resumed_from']['mesh'] == {'data': 2, 'fsdp': 4, 'tensor': 1}
  assert start['layout']['batch_multiple'] == 8
