"""Workdirs written by the oldest supported stack (Python 3.11, jax 0.10.2) work on the running
one: they resume, generate, evaluate, translate and export.

The workdirs under tests/cross_version/jax_0.10.2/ (a tiny character GPT and a tiny translation
model, with what the entry points answered from them when written) were made by
`python tests/cross_version/write_workdirs.py` under jax 0.10.2. On jax 0.10.2 this checks
that nothing drifted; on 0.11 and 0.12 that checkpoints survive the upgrade.
"""

import json
import os
import pathlib
import shutil
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / 'cross_version'))
import write_workdirs  # noqa: E402  (tests/cross_version/write_workdirs.py)

pytestmark = pytest.mark.slow

WRITTEN = pathlib.Path(__file__).resolve().parent / 'cross_version' / 'jax_0.10.2'
# Evaluation figures: summed in float32 on another XLA; relative.
LOSS_RTOL = 1e-5


@pytest.fixture
def copy(tmp_path) -> pathlib.Path:
  """A private copy of the committed workdirs (the entry points may write into them)."""
  target = tmp_path / 'written'
  shutil.copytree(WRITTEN, target)
  return target


def expected() -> dict:
  return json.loads((WRITTEN / 'expected.json').read_text())


def test_the_committed_workdirs_were_written_by_the_oldest_supported_stack():
  written_by = expected()['written_by']
  assert written_by['jax'] == '0.10.2' and written_by['python'].startswith('3.11.')


def test_evaluate_generate_and_translate_answer_as_when_written(copy):
  answers = write_workdirs.answers(str(copy / 'char_gpt'), str(copy / 'translation'),
                                   str(copy / 'eval.txt'))
  then = expected()
  evaluated, evaluated_then = answers['lm_evaluate'], then['lm_evaluate']
  for key in ('tokens', 'characters', 'window', 'stride', 'windows'):
    assert evaluated[key] == evaluated_then[key], key
  for key in ('loss', 'perplexity', 'bits_per_character'):
    assert evaluated[key] == pytest.approx(evaluated_then[key], rel=LOSS_RTOL), key
  assert answers['lm_greedy'] == then['lm_greedy']
  assert answers['translations'] == then['translations']


def metrics_steps(workdir: pathlib.Path) -> list[int]:
  with open(workdir / 'metrics.jsonl') as f:
    return [record['step'] for record in map(json.loads, f) if 'train/loss' in record]


def test_both_workdirs_resume_from_their_checkpoint(copy):
  steps = expected()['steps']
  lm_workdir, translate_workdir = copy / 'char_gpt', copy / 'translation'
  write_workdirs.run(
      'experiments.lm',
      *write_workdirs.lm_train_flags(str(lm_workdir), str(copy / 'train.txt'),
                                     steps['char_gpt'] + 10))
  write_workdirs.run(
      'experiments.translate',
      *write_workdirs.translate_train_flags(str(translate_workdir), steps['translation'] + 10))
  for workdir, name in ((lm_workdir, 'char_gpt'), (translate_workdir, 'translation')):
    # metrics.jsonl was not committed: every step it logs is one trained after the resume.
    logged = metrics_steps(workdir)
    assert logged and min(logged) > steps[name] and max(logged) == steps[name] + 10, logged
    assert sorted(
        int(s) for s in os.listdir(workdir / 'checkpoints')) == [steps[name], steps[name] + 10]


def test_the_language_model_exports_and_reimports_the_same_weights(copy, tmp_path):
  from transformer_jax.cli.workdir import load_saved_config
  from transformer_jax.convert import hf_gpt2
  from transformer_jax.workflows import lm
  written = copy / 'char_gpt'
  out = tmp_path / 'hf'
  printed = write_workdirs.run('experiments.export', f'--workdir={written}', f'--out={out}')
  assert printed.split() == [str(out), 'gpt2']
  reimported = hf_gpt2.load(str(out)).params
  config = load_saved_config(str(written))
  params = lm.restore_for_inference(config, str(written)).params
  flat = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  flat_reimported = dict(jax.tree_util.tree_flatten_with_path(reimported)[0])
  assert flat.keys() == flat_reimported.keys()
  for path, value in flat.items():
    np.testing.assert_array_equal(np.asarray(value), np.asarray(flat_reimported[path]))
