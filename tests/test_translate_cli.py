"""End-to-end tests of `python -m experiments.translate`, each in a subprocess.

Bad input must end with exit status != 0 and one readable 'error:' line (no stack trace),
before anything is written to the workdir. The happy path trains a tiny model, then
translates stdin and scores a test set with the trained workdir.
"""

import gzip
import os

import pytest

from transformer_jax.data.numbers import make_numbers_splits

pytestmark = pytest.mark.slow  # every test runs the CLI in a subprocess


def write_corpus(directory, prefix: str, en: bytes, de: bytes, compress: bool = False):
  """Writes {prefix}.en and {prefix}.de (gzipped with compress) with the given bytes."""
  os.makedirs(directory, exist_ok=True)
  for lang, content in (('en', en), ('de', de)):
    path = os.path.join(directory, f'{prefix}.{lang}' + ('.gz' if compress else ''))
    with (gzip.open(path, 'wb') if compress else open(path, 'wb')) as f:
      f.write(content)
  return str(directory)


def files_flags(translate_cli, data_dir: str) -> list[str]:
  return translate_cli.tiny_flags(
      {'data.source': 'files', 'data.dir': data_dir, 'data.valid_prefix': 'val'})


def assert_one_line_error(translate_cli, result, workdir: str, *expected: str):
  """Non-zero exit, exactly one 'error:' line (the last line) naming `expected`, no
  traceback, and no checkpoint or tokenizer in the workdir."""
  stderr = result.stderr
  assert result.returncode != 0, stderr[-3000:]
  assert 'Traceback' not in stderr, stderr[-3000:]
  errors = translate_cli.error_lines(stderr)
  assert len(errors) == 1, stderr[-3000:]
  assert stderr.strip().splitlines()[-1] == errors[0]
  for text in expected:
    assert text in errors[0], errors[0]
  if os.path.isdir(workdir):
    written = os.listdir(workdir)
    assert 'checkpoints' not in written, written
    assert not [name for name in written if name.endswith('.model')], written
    assert 'config.json' not in written, written
  return errors[0]


def test_missing_data_directory_is_one_error_line(translate_cli, tmp_path):
  """--config.data.dir pointing nowhere names the directory."""
  missing, workdir = str(tmp_path / 'no_such_data'), str(tmp_path / 'work')
  result = translate_cli.run(f'--workdir={workdir}', *files_flags(translate_cli, missing))
  assert_one_line_error(translate_cli, result, workdir, missing, 'does not exist')


def test_parallel_files_with_different_line_counts_are_one_error_line(translate_cli, tmp_path):
  """train.en with 3 lines and train.de with 2: the message names both files and counts."""
  data = write_corpus(tmp_path / 'data', 'train', b'one\ntwo\nthree\n', b'eins\nzwei\n',
                      compress=True)
  workdir = str(tmp_path / 'work')
  result = translate_cli.run(f'--workdir={workdir}', *files_flags(translate_cli, data))
  assert_one_line_error(translate_cli, result, workdir, 'different line counts',
                        'train.en.gz has 3 lines', 'train.de.gz has 2')


def test_empty_corpus_is_one_error_line(translate_cli, tmp_path):
  """Empty train files are reported as an empty corpus."""
  data = write_corpus(tmp_path / 'data', 'train', b'', b'')
  workdir = str(tmp_path / 'work')
  result = translate_cli.run(f'--workdir={workdir}', *files_flags(translate_cli, data))
  assert_one_line_error(translate_cli, result, workdir, 'is empty', 'train.en')


def test_invalid_utf8_names_file_and_line(translate_cli, tmp_path):
  """A non-UTF-8 byte on line 2 of train.de: the message is 'PATH:2: invalid UTF-8'."""
  data = write_corpus(tmp_path / 'data', 'train', b'one\ntwo\nthree\n', b'eins\nzw\xffei\ndrei\n')
  workdir = str(tmp_path / 'work')
  result = translate_cli.run(f'--workdir={workdir}', *files_flags(translate_cli, data))
  path = os.path.join(data, 'train.de')
  assert_one_line_error(translate_cli, result, workdir, f'{path}:2: invalid UTF-8', '0xff')


def test_unknown_config_key_is_one_error_line(translate_cli, tmp_path):
  """--config.model.nonexistent=1 names the key instead of printing a traceback."""
  workdir = str(tmp_path / 'work')
  result = translate_cli.run(f'--workdir={workdir}', *translate_cli.tiny_flags(),
                             '--config.model.nonexistent=1')
  assert_one_line_error(translate_cli, result, workdir, '--config.model.nonexistent',
                        "no key 'nonexistent'")


def test_width_not_divisible_by_heads_fails_before_training_a_tokenizer(translate_cli, tmp_path):
  """emb_dim=30 with 4 heads is rejected before the tokenizer is trained and saved."""
  workdir = str(tmp_path / 'work')
  result = translate_cli.run(f'--workdir={workdir}',
                             *translate_cli.tiny_flags({'model.emb_dim': 30, 'model.num_heads': 4}))
  assert_one_line_error(translate_cli, result, workdir, 'emb_dim=30',
                        'not divisible by num_heads=4')


def test_missing_config_file_is_one_error_line(translate_cli, tmp_path):
  """--config=FILE that does not exist names the file."""
  workdir = str(tmp_path / 'work')
  missing = str(tmp_path / 'no_such_config.py')
  result = translate_cli.run(f'--workdir={workdir}', f'--config={missing}')
  assert_one_line_error(translate_cli, result, workdir, missing, 'No such file')


def test_workdir_under_a_file_is_one_error_line(translate_cli, tmp_path):
  """A workdir that cannot be created (its parent is a file) is reported as not writable."""
  blocker = tmp_path / 'a_file'
  blocker.write_text('not a directory')
  workdir = str(blocker / 'work')
  result = translate_cli.run(f'--workdir={workdir}', *translate_cli.tiny_flags())
  assert_one_line_error(translate_cli, result, workdir, workdir, 'not writable')
  assert blocker.read_text() == 'not a directory'


def test_train_then_translate_stdin_then_evaluate_test_set(translate_cli, tmp_path):
  """A tiny quickstart run trains and checkpoints; --mode=translate (config read from the
  workdir) prints one line per stdin line; --mode=evaluate writes one hypothesis per test
  sentence to {test_prefix}.{tgt_lang}.hyp."""
  workdir = str(tmp_path / 'work')
  train = translate_cli.run(
      f'--workdir={workdir}',
      *translate_cli.tiny_flags(
          {'train.num_steps': 20, 'eval.bleu_sentences': 2, 'train.eval_max_batches': 1}))
  assert train.returncode == 0, train.stderr[-3000:]
  assert 'step 20/20 |' in train.stderr
  written = os.listdir(workdir)
  assert {'checkpoints', 'spm.model', 'config.json', 'metrics.jsonl'} <= set(written), written
  assert os.listdir(os.path.join(workdir, 'checkpoints')) == ['20']

  sentences = ['i have forty-two apples', 'the number is seven', '', 'we saw three cats']
  translated = translate_cli.run(f'--workdir={workdir}', '--mode=translate',
                                 stdin=''.join(s + '\n' for s in sentences))
  assert translated.returncode == 0, translated.stderr[-3000:]
  assert 'read the params of the checkpoint at step 20' in translated.stderr
  assert translated.stdout.endswith('\n')
  outputs = translated.stdout[:-1].split('\n')
  assert len(outputs) == len(sentences), translated.stdout
  assert any(outputs), 'every translation is empty'

  evaluated = translate_cli.run(f'--workdir={workdir}', '--mode=evaluate',
                                *translate_cli.tiny_flags({'eval.test_prefix': 'test'}))
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  hyp_path = os.path.join(workdir, 'test.de.hyp')
  with open(hyp_path, encoding='utf-8') as f:
    hypotheses = f.read().split('\n')
  test_sources, _ = make_numbers_splits(seed=0)['test']
  assert hypotheses[-1] == '' and len(hypotheses) - 1 == len(test_sources)
  assert 'BLEU' in evaluated.stderr and hyp_path in evaluated.stderr


def test_translate_mode_without_a_trained_workdir_is_one_error_line(translate_cli, tmp_path):
  """--mode=translate in a fresh workdir (no --config) says there is nothing trained there."""
  workdir = str(tmp_path / 'work')
  result = translate_cli.run(f'--workdir={workdir}', '--mode=translate', stdin='hello\n')
  assert_one_line_error(translate_cli, result, workdir, 'config.json', 'is it a trained workdir')
