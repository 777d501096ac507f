"""End-to-end `python -m experiments.bert`: pretrain a tiny BERT, fine-tune it, bad input."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

pytestmark = pytest.mark.slow  # every test runs the CLI in a subprocess

PRETRAIN = os.path.join('experiments', 'configs', 'bert_pretrain_small.py')
SST2 = os.path.join('experiments', 'configs', 'sst2_minilm.py')
TINY_MODEL = {
    'model.emb_dim': 32, 'model.num_heads': 2, 'model.mlp_dim': 64, 'model.num_encoder_layers': 1,
    'model.max_len': 32
}
TINY_TRAIN = {
    'train.num_steps': 12, 'train.log_every': 4, 'train.eval_every': 6, 'train.checkpoint_every': 6,
    'optimizer.warmup_steps': 2, 'optimizer.decay_steps': 50
}


def _run(translate_cli, *args):
  return subprocess.run([sys.executable, '-m', 'experiments.bert', *args], cwd=REPO_ROOT,
                        env=translate_cli.env(), capture_output=True, text=True, timeout=600,
                        check=False)


def _flags(values):
  return [f'--config.{k}={v}' for k, v in values.items()]


def _write_data(tmp_path):
  text = tmp_path / 'text.txt'
  words = 'the cat sat on a mat while dogs ran in the park and birds sang songs'.split()
  rng = __import__('random').Random(0)
  docs = [
      '\n'.join(' '.join(rng.choice(words) for _ in range(8)) for _ in range(5)) for _ in range(40)
  ]
  text.write_text('\n\n'.join(docs) + '\n')
  sst2 = tmp_path / 'sst2'
  sst2.mkdir()
  rows = [(1, 'a great and lovely film'), (0, 'a dull and boring mess'),
          (1, 'lovely songs and great cats'), (0, 'boring dogs in a dull park')] * 12
  (sst2 / 'train.tsv').write_text('label\tsentence\n' + ''.join(f'{y}\t{s}\n' for y, s in rows))
  (sst2 / 'dev.tsv').write_text('label\tcontent\n' + ''.join(f'{y}\t{s}\n' for y, s in rows[:8]))
  return str(text), str(sst2)


def _metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def test_pretrain_then_finetune(translate_cli, tmp_path):
  text, sst2 = _write_data(tmp_path)
  pre = str(tmp_path / 'pre')
  result = _run(
      translate_cli, f'--config={PRETRAIN}', f'--workdir={pre}',
      *_flags({
          **TINY_MODEL, **TINY_TRAIN, 'data.paths': text, 'data.lines_per_document': 0,
          'data.valid_fraction': 0.1, 'data.max_len': 32, 'data.max_predictions': 5,
          'data.batch_size': 8, 'data.eval_batches': 2, 'tokenizer.vocab_size': 100
      }))
  assert result.returncode == 0, result.stderr[-3000:]
  assert os.path.exists(os.path.join(pre, 'vocab.txt'))
  evals = [m for m in _metrics(pre) if 'eval/accuracy' in m]
  assert [m['step'] for m in evals] == [6, 12]
  assert 0.0 <= evals[-1]['eval/nsp_accuracy'] <= 1.0 and evals[-1]['eval/loss'] > 0

  before = {str(p): p.stat().st_mtime_ns for p in tmp_path.joinpath('pre').rglob('*')}
  fine = str(tmp_path / 'fine')
  args = [
      f'--config={SST2}', f'--workdir={fine}', '--config.init.hf_dir=',
      f'--config.init.bert_workdir={pre}', f'--config.data.dir={sst2}', *_flags(
          {**TINY_TRAIN, 'data.batch_size': 8, 'data.max_len': 16, 'optimizer.learning_rate': 1e-3})
  ]
  result = _run(translate_cli, *args)
  assert result.returncode == 0, result.stderr[-3000:]
  evals = [m for m in _metrics(fine) if 'eval/accuracy' in m]
  assert [m['step'] for m in evals] == [6, 12]
  assert 0.0 <= evals[-1]['eval/accuracy'] <= 1.0
  # Fine-tuning read the pretraining workdir and wrote nothing there.
  assert {str(p): p.stat().st_mtime_ns for p in tmp_path.joinpath('pre').rglob('*')} == before
  # Rerunning resumes from the last checkpoint: nothing left to train, one more evaluation.
  result = _run(translate_cli, *args)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'restored checkpoint at step 12' in result.stderr


def test_bad_input_is_one_error_line(translate_cli, tmp_path):
  result = _run(translate_cli, f'--config={SST2}', f'--workdir={tmp_path / "w"}',
                f'--config.data.dir={tmp_path / "missing"}')
  assert result.returncode == 1
  assert 'Traceback' not in result.stderr
  errors = translate_cli.error_lines(result.stderr)
  assert len(errors) == 1 and 'does not exist' in errors[0], result.stderr[-2000:]
  result = _run(translate_cli, f'--config={PRETRAIN}', f'--workdir={tmp_path / "w2"}',
                '--config.data.sentence_task=xyz', '--config.data.paths=/nonexistent')
  errors = translate_cli.error_lines(result.stderr)
  assert result.returncode == 1 and len(errors) == 1, result.stderr[-2000:]
