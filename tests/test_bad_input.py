"""Bad input: one readable 'error:' line, exit status 1, no stack trace, workdir untouched.

Cases already covered elsewhere: unknown config key, width not divisible by heads, missing
data directory, parallel files with different line counts, empty corpus, invalid UTF-8 in
parallel text, missing --config file, workdir that cannot be created, translate mode on an
untrained workdir (tests/test_translate_cli.py); invalid UTF-8 skipped and counted with
data.skip_invalid_utf8 (tests/test_data_text.py); over-long pairs filtered or truncated and
counted (tests/test_batching.py); a corrupted latest checkpoint (tests/test_trainer.py).
Here: the remaining ones, through the command line where the flag parser or the order of
writes matters, in-process where a failure has to be provoked (a full disk).
"""

import errno
import os
import subprocess
import sys
import tempfile

import jax.numpy as jnp
import pytest

from benchmarks import resume
from transformer_jax import xla_options
from transformer_jax.training import checkpointing
from transformer_jax.cli import entrypoint
from transformer_jax.cli.workdir import load_saved_config, prepare_workdir
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.training.trainer import TrainState


def cli(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-m', module, *args], cwd=resume.REPO_ROOT,
                        env=resume.environment(env), capture_output=True, text=True, timeout=600,
                        check=False)


def one_error_line(result: subprocess.CompletedProcess, *expected: str) -> str:
  """Exit status 1, no traceback, exactly one 'error:' line, the last, containing `expected`."""
  stderr = result.stderr
  assert result.returncode == 1, stderr[-3000:]
  assert 'Traceback' not in stderr, stderr[-3000:]
  errors = [line for line in stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and stderr.strip().splitlines()[-1] == errors[0], stderr[-3000:]
  for text in expected:
    assert text in errors[0], errors[0]
  return errors[0]


def assert_untouched(workdir: str, before: dict | None = None):
  """Nothing written: the workdir is absent or empty, or its files are as in `before`."""
  assert snapshot(workdir) == (before or {}), (snapshot(workdir), before)


def snapshot(workdir: str) -> dict[str, bytes]:
  files = {}
  if os.path.isdir(workdir):
    for root, _, names in os.walk(workdir):
      for name in names:
        path = os.path.join(root, name)
        with open(path, 'rb') as f:
          files[os.path.relpath(path, workdir)] = f.read()
  return files


def tiny_translate(workdir: str, **overrides) -> list[str]:
  return resume.command('translate', workdir, 4, 0, overrides)[3:]  # the flags after -m MODULE


def tiny_lm(workdir: str, **overrides) -> list[str]:
  return resume.command('lm', workdir, 4, 2, overrides)[3:]


# -- config files and flags ----------------------------------------------------------------------


@pytest.mark.slow
def test_config_flag_errors_are_one_line(tmp_path):
  """A value of the wrong type, a config file without get_config() and one that is not valid
  Python each stop at flag parsing with one line naming the problem."""
  workdir = str(tmp_path / 'work')
  wrong_type = cli('experiments.translate', *tiny_translate(workdir),
                   '--config.train.num_steps=many')
  assert wrong_type.returncode == 1 and 'Traceback' not in wrong_type.stderr
  assert "--config.train.num_steps=many: invalid literal for int() with base 10: 'many'" in (
      wrong_type.stderr), wrong_type.stderr[-2000:]

  no_function = tmp_path / 'no_get_config.py'
  no_function.write_text('CONFIG = {"seed": 0}\n')
  one_error_line(cli('experiments.translate', f'--config={no_function}', f'--workdir={workdir}'),
                 f'--config={no_function} does not define get_config()')

  broken = tmp_path / 'broken.py'
  broken.write_text('def get_config(:\n  pass\n')
  one_error_line(cli('experiments.lm', f'--config={broken}', f'--workdir={workdir}'),
                 f'cannot load the config: {broken}:1: invalid syntax')
  assert_untouched(workdir)


def test_attention_kernel_for_another_backend_fails_before_anything_is_written(tmp_path):
  """Every experiment config lets the attention implementation be chosen on the command line;
  a kernel this backend can't run (Pallas is TPU-only) is one line, not a compiler trace."""
  workdir = str(tmp_path / 'work')
  one_error_line(
      cli('experiments.lm', *tiny_lm(workdir, **{'model.attention_implementation': 'pallas'})),
      "model.attention_implementation='pallas' runs on TPU only, and this run is on CPU",
      "use 'auto'")
  assert_untouched(workdir)


def test_workdir_trained_with_another_backends_kernel_is_served_with_auto(tmp_path):
  """A workdir trained on a TPU with Pallas still translates/generates on this CPU."""
  import json
  for implementation, expected in [('pallas', 'auto'), ('cudnn', 'auto'),
                                   ('reference', 'reference')]:
    (tmp_path / 'config.json').write_text(
        json.dumps({'model': {'emb_dim': 32, 'attention_implementation': implementation}}))
    config = load_saved_config(str(tmp_path))
    assert config.model.attention_implementation == expected
    assert config.model.emb_dim == 32


@pytest.mark.parametrize(
    'config_file',
    ['translate_quickstart', 'shakespeare_char', 'bert_pretrain_small', 'sst2_minilm'])
def test_every_experiment_config_names_its_attention_implementation(config_file):
  import importlib
  from transformer_jax.model_config import model_config_from_dict
  config = importlib.import_module(f'experiments.configs.{config_file}').get_config()
  assert config.model.attention_implementation == 'auto'
  config.model.attention_implementation = 'reference'  # what --config.model.... sets
  if 'emb_dim' in config.model:  # fine-tuning configs only override the pretrained model's
    assert model_config_from_dict(config.model,
                                  vocab_size=64).attention_implementation == ('reference')


# -- mesh and batch ------------------------------------------------------------------------------


def test_mesh_not_matching_the_devices_fails_before_the_tokenizer_is_written(tmp_path):
  """mesh.data=2 on one CPU device: one line, and no spm.model or config.json is left."""
  workdir = str(tmp_path / 'work')
  one_error_line(cli('experiments.translate', *tiny_translate(workdir, **{'mesh.data': 2})),
                 "mesh {'data': 2, 'fsdp': 1, 'tensor': 1} does not fit 1 devices")
  assert_untouched(workdir)


def test_batch_not_divisible_by_the_data_axes_on_eight_devices(tmp_path):
  """8 (forced host) devices, mesh data=-1: data.batch_size=12 is not a multiple of 8."""
  workdir = str(tmp_path / 'work')
  result = cli('experiments.lm', *tiny_lm(workdir, **{'data.batch_size': 12}),
               env=xla_options.host_devices_env(8, {}))
  one_error_line(result, 'batch of 12 rows is not divisible by the data-parallel size 8',
                 'data.batch_size')
  assert_untouched(workdir)


# -- data ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_language_model_data_errors_are_one_line(tmp_path):
  """A missing text file, and one with invalid UTF-8 on line 3 (named with file and line)."""
  workdir = str(tmp_path / 'work')
  missing = str(tmp_path / 'no_such.txt')
  one_error_line(cli('experiments.lm', *tiny_lm(workdir, **{'data.path': missing})),
                 f'text file {missing} does not exist')
  assert_untouched(workdir)

  bad = tmp_path / 'bad.txt'
  bad.write_bytes(b'first line\nsecond line\nthird \xc3\x28 line\n' + b'more text\n' * 50)
  one_error_line(cli('experiments.lm', *tiny_lm(workdir, **{'data.path': str(bad)})),
                 f'{bad}:3: invalid UTF-8', '0xc3')
  assert_untouched(workdir)


def test_missing_parallel_file_names_what_was_looked_for(tmp_path):
  """data.dir holds train.en but no train.de: the message lists the paths tried."""
  data = tmp_path / 'data'
  data.mkdir()
  (data / 'train.en').write_text('one\ntwo\n')
  workdir = str(tmp_path / 'work')
  one_error_line(
      cli('experiments.translate',
          *tiny_translate(workdir, **{'data.source': 'files', 'data.dir': str(data)})),
      "no 'de' file for split 'train'", str(data / 'train.de'))
  assert_untouched(workdir)


# -- checkpoints and tokenizers of a trained workdir ---------------------------------------------


@pytest.mark.slow
def test_trained_workdir_with_another_model_or_without_its_tokenizer(tmp_path, tiny_shakespeare):
  """After training a tiny GPT: rerunning with a different mlp_dim names the parameter whose
  shape differs and leaves config.json and the checkpoints as they were; sampling after
  tokenizer.json is deleted says it is missing."""
  workdir = str(tmp_path / 'work')
  text = {'data.path': tiny_shakespeare}
  trained = cli('experiments.lm', *tiny_lm(workdir, **text))
  assert trained.returncode == 0, trained.stderr[-3000:]
  before = snapshot(workdir)
  changed = cli('experiments.lm', *tiny_lm(workdir, **text, **{'model.mlp_dim': 48}))
  one_error_line(changed, 'checkpoint at step 4', 'does not fit the model of this config',
                 'params.stack.layer_0.mlp.wi.bias has shape (64,) in the checkpoint but (48,)')
  assert_untouched(workdir, before)

  os.remove(os.path.join(workdir, 'tokenizer.json'))
  one_error_line(cli('experiments.generate', f'--workdir={workdir}', '--max_new_tokens=3'),
                 'tokenizer.json is missing')


def test_translation_tokenizer_missing_from_workdir(tmp_path, tiny_config):
  """Inference modes never train a tokenizer: a workdir without spm.model is a ConfigError."""
  from transformer_jax.workflows import translation_model
  with pytest.raises(ConfigError, match=r'no tokenizer model \(spm\*\.model\) in .*train first'):
    translation_model.load_tokenizers(tiny_config(), str(tmp_path))
  assert os.listdir(tmp_path) == []


def make_state(emb: int) -> TrainState:
  params = {'embed': jnp.ones((10, emb)), 'layer': {'kernel': jnp.ones((emb, 3))}}
  return TrainState(step=jnp.asarray(5, jnp.int32), params=params, opt_state=(jnp.zeros(
      (), jnp.int32),))


def test_checkpoint_shape_mismatch_names_the_parameter_not_corruption(tmp_path):
  """check_fits and restore raise ConfigError naming the parameter (never fall back to an
  older checkpoint or to a fresh start); a removed parameter is named too."""
  checkpointer = checkpointing.Checkpointer(str(tmp_path / 'ckpt'), save_every=1)
  try:
    checkpointer.maybe_save(5, make_state(4), {'position': 5})
    checkpointer.wait()
    other = checkpointing.abstract_like(make_state(6))
    with pytest.raises(
        ConfigError, match=r'params\.embed has shape \(10, 4\) in the checkpoint '
        r'but \(10, 6\) in the config \(and 1 more\)'):
      checkpointer.check_fits(other)
    with pytest.raises(ConfigError, match='does not fit the model'):
      checkpointer.restore(other)
    fewer = make_state(4)
    del fewer.params['layer']
    with pytest.raises(ConfigError, match=r'params\.layer\.kernel is in the checkpoint but not'):
      checkpointer.check_fits(checkpointing.abstract_like(fewer))
    checkpointer.check_fits(checkpointing.abstract_like(make_state(4)))  # same shapes: fine
    assert checkpointer.restore(checkpointing.abstract_like(make_state(4)))[2] == 5
  finally:
    checkpointer.close()


# -- full or non-writable workdir ----------------------------------------------------------------


def test_full_disk_when_probing_the_workdir(tmp_path, monkeypatch):
  """prepare_workdir writes a probe file; ENOSPC there is a ConfigError saying so."""

  def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(tempfile, 'NamedTemporaryFile', no_space)
  with pytest.raises(ConfigError, match='is not writable .No space left on device.'):
    prepare_workdir(str(tmp_path / 'work'))


def test_full_disk_while_saving_a_checkpoint_is_one_line(tmp_path, monkeypatch, capsys):
  """orbax reports a full disk as ValueError('RESOURCE_EXHAUSTED: ...') from its background
  save; Checkpointer turns it into a DataError naming the last good checkpoint, and run()
  prints it as one line and exits 1 (also when a later OSError(ENOSPC) from another writer
  replaced it) without running exit handlers that would fail to write again."""
  checkpointer = checkpointing.Checkpointer(str(tmp_path / 'ckpt'), save_every=1)
  try:
    checkpointer.maybe_save(1, make_state(4), {'position': 1})
    checkpointer.wait()

    def exhausted(*args, **kwargs):
      raise ValueError('RESOURCE_EXHAUSTED: Error writing local file "x": Failed to write')

    monkeypatch.setattr(checkpointer.manager, 'save', exhausted)
    with pytest.raises(
        DataError, match=r'cannot write a checkpoint in .*ckpt \(RESOURCE_EXHAUSTED'
        r'\); free space .*last good checkpoint: step 1\)'):
      checkpointer.maybe_save(2, make_state(4), {'position': 2})
    monkeypatch.setattr(checkpointer.manager, 'save', lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # anything else is a bug and keeps its traceback
      checkpointer.maybe_save(3, make_state(4), {'position': 3})
  finally:
    monkeypatch.undo()
    checkpointer.close()

  def main(argv):
    try:
      raise DataError('cannot write a checkpoint in X (No space left on device)')
    finally:
      raise OSError(errno.ENOSPC, 'No space left on device', 'metrics.jsonl')

  def exit_now(status):
    raise SystemExit(status)

  monkeypatch.setattr(os, '_exit', exit_now)
  with pytest.raises(SystemExit) as exited:
    entrypoint.run(main)
  assert exited.value.code == 1
  assert capsys.readouterr().err.splitlines()[-1] == (
      'error: cannot write a checkpoint in X (No space left on device)')

  def main_plain(argv):
    raise OSError(errno.ENOSPC, 'No space left on device', 'metrics.jsonl')

  with pytest.raises(SystemExit):
    entrypoint.run(main_plain)
  assert capsys.readouterr().err.splitlines()[-1] == (
      'error: cannot write metrics.jsonl (No space left on device); free space or choose another '
      '--workdir and rerun')


# -- security ------------------------------------------------------------------------------------


def test_no_code_path_unpickles_files():
  """Checkpoints are orbax (TensorStore + JSON), tokenizers protobuf/JSON, imported weights
  safetensors or torch.load(weights_only=True): nothing in the package or the entry points
  imports pickle, allows pickles in numpy, or calls torch.load without weights_only=True."""
  offenders = []
  for top in ('transformer_jax', 'experiments'):
    for root, _, names in os.walk(os.path.join(resume.REPO_ROOT, top)):
      for name in names:
        if not name.endswith('.py'):
          continue
        path = os.path.join(root, name)
        with open(path, encoding='utf-8') as f:
          for number, line in enumerate(f, 1):
            code = line.split('#')[0]
            if ('import pickle' in code or 'cPickle' in code or 'allow_pickle=True' in code or
                'dill' in code.split() or
                ('torch.load(' in code and 'weights_only=True' not in code)):
              offenders.append(f'{path}:{number}: {line.strip()}')
  assert not offenders, offenders
