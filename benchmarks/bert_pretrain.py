r"""Short MLM + NSP pretraining of the small BERT on local text; prints held-out accuracies.

  python benchmarks/bert_pretrain.py --budget_minutes=10

experiments/configs/bert_pretrain_small.py (4 layers, 256 wide, WordPiece 8k trained on the
English side of Multi30k + Tiny Shakespeare, sequences of 64, batch 64), stopped by the time
budget; the learning-rate schedule is sized to --num_steps. Reports the MLM accuracy and NSP
accuracy on the held-out documents (2%) and the training throughput in tokens/s (non-padding
input tokens, median of the logged intervals after the first). Last line: one JSON object.
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

_DATA = flags.DEFINE_string('data_root', '../shared/data', 'Directory with multi30k/ and '
                            'tinyshakespeare/.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Work directory (default: a fresh temp dir).')
_BUDGET = flags.DEFINE_float('budget_minutes', 10.0, 'Wall-clock budget for training.')
_STEPS = flags.DEFINE_integer('num_steps', 1500, 'Training steps (the schedule length).')
_TASK = flags.DEFINE_enum('sentence_task', 'nsp', ['nsp', 'sop', 'none'], 'Sentence task.')


def main(argv):
  del argv
  from experiments.configs import bert_pretrain_small
  from transformer_jax.cli.workdir import prepare_workdir
  from transformer_jax.workflows import bert

  config = bert_pretrain_small.get_config()
  root = _DATA.value
  config.data.paths = (f'{root}/multi30k/train.en.gz,{root}/tinyshakespeare/input.txt')
  config.data.sentence_task = _TASK.value
  config.train.num_steps = _STEPS.value
  config.optimizer.decay_steps = _STEPS.value
  config.optimizer.warmup_steps = max(1, _STEPS.value // 20)
  config.train.eval_every = max(_STEPS.value // 3, 1)
  config.train.max_minutes = _BUDGET.value
  workdir = prepare_workdir(_WORKDIR.value or tempfile.mkdtemp(prefix='bert_pt_'))
  logging.info('workdir %s, config:\n%s', workdir, config)
  start = time.time()
  results = bert.pretrain(config, workdir)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rates = [r['train/tokens_per_s'] for r in map(json.loads, f) if 'train/tokens_per_s' in r]
  rates = rates[1:] or rates
  out = {
      'benchmark':
          'bert_pretrain',
      'sentence_task':
          _TASK.value,
      'steps':
          results['step'],
      'mlm_accuracy':
          round(results['eval_accuracy'], 4),
      'mlm_loss':
          round(results['eval_loss'], 4),
      f'{_TASK.value}_accuracy':
          round(results.get(f'eval_{_TASK.value}_accuracy', float('nan')), 4),
      'tokens_per_s':
          round(sorted(rates)[len(rates) // 2]) if rates else 0,
      'minutes':
          round((time.time() - start) / 60.0, 2),
      'params':
          results['params'],
  }
  print(json.dumps(out), flush=True)


if __name__ == '__main__':
  app.run(main)
