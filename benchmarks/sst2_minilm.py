r"""Fine-tune the imported all-MiniLM-L6-v2 on SST-2 train; print dev accuracy and minutes.

  python benchmarks/sst2_minilm.py --data_dir=../shared/data/sst2 --budget_minutes=55

experiments/configs/sst2_minilm.py as configured (batch 32, max_len 64, lr 5e-5, 10% warmup,
linear decay over 2 epochs), stopped early by train.max_minutes if the budget runs out; the
learning-rate schedule is sized to the steps the budget allows when --epochs is not met.
Dev accuracy is measured on all 872 dev sentences. Last line: one JSON object.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformer_jax.cli import process

if __name__ == '__main__':
  process.setup_allocator()

import json
import tempfile
import time

from absl import app, flags, logging

_DATA_DIR = flags.DEFINE_string('data_dir', '../shared/data/sst2', 'Directory with train/dev.tsv.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Work directory (default: a fresh temp dir).')
_BUDGET = flags.DEFINE_float('budget_minutes', 55.0, 'Wall-clock budget for training.')
_STEPS = flags.DEFINE_integer('num_steps', 0, 'Training steps (0 = the config: 2 epochs).')
_LR = flags.DEFINE_float('learning_rate', 0.0, 'Peak learning rate (0 = the config).')


def main(argv):
  del argv
  from experiments.configs import sst2_minilm
  from transformer_jax.cli.workdir import prepare_workdir
  from transformer_jax.workflows import bert

  config = sst2_minilm.get_config()
  config.data.dir = _DATA_DIR.value
  if _STEPS.value:
    config.train.num_steps = _STEPS.value
    config.optimizer.decay_steps = _STEPS.value
    config.optimizer.warmup_steps = max(1, _STEPS.value // 10)
  if _LR.value:
    config.optimizer.learning_rate = _LR.value
  config.train.max_minutes = _BUDGET.value
  config.train.eval_every = max(config.train.num_steps // 4, 1)
  workdir = prepare_workdir(_WORKDIR.value or tempfile.mkdtemp(prefix='sst2_'))
  logging.info('workdir %s, config:\n%s', workdir, config)
  start = time.time()
  results = bert.finetune(config, workdir)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    evals = [r for r in map(json.loads, f) if 'eval/accuracy' in r]
  out = {
      'benchmark': 'sst2_minilm',
      'dev_accuracy': round(results['dev_accuracy'], 4),
      'dev_loss': round(results.get('eval_loss', float('nan')), 4),
      'steps': results['step'],
      'epochs': round(results['step'] * config.data.batch_size / 67349, 2),
      'minutes': round((time.time() - start) / 60.0, 2),
      'train_minutes': round(results['minutes'], 2),
      'params': results['params'],
      'tokens_per_s': round(results['tokens_per_s']),
      'dev_accuracy_by_step': {r['step']: round(r['eval/accuracy'], 4) for r in evals},
      'learning_rate': config.optimizer.learning_rate,
      'batch_size': config.data.batch_size,
      'max_len': config.data.max_len,
  }
  print(json.dumps(out), flush=True)


if __name__ == '__main__':
  app.run(main)
