r"""The baby character GPT on Tiny Shakespeare, exactly as configured; prints the losses.

  python benchmarks/lm_shakespeare.py --data_path=../shared/data/tinyshakespeare/input.txt

Trains experiments/configs/shakespeare_char.py (4 layers, 128 wide, block 64, batch 12,
2,000 steps) on the first 90% of the text and reports, at the last step, the loss on the
fixed validation batches (the last 10%) and on as many fixed batches of the training text.
nanoGPT's figure for this run is a validation loss of about 1.88. A generated sample goes to
the log. Last line: one JSON object.
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

_DATA_PATH = flags.DEFINE_string('data_path', '../shared/data/tinyshakespeare/input.txt',
                                 'Tiny Shakespeare input.txt.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Work directory (default: a fresh temp dir).')
_NUM_STEPS = flags.DEFINE_integer('num_steps', 0, 'Override train.num_steps (0 = the config).')
_SAMPLE_TOKENS = flags.DEFINE_integer('sample_tokens', 300, 'Length of the logged sample.')


def steady_tokens_per_s(workdir: str) -> float:
  """Median training throughput over the logged intervals after the first (which includes
  compilation); evaluation pauses fall in a few intervals only, so the median ignores them."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rates = [r['train/tokens_per_s'] for r in map(json.loads, f) if 'train/tokens_per_s' in r]
  rates = rates[1:] or rates
  return float(sorted(rates)[len(rates) // 2]) if rates else 0.0


def main(argv):
  del argv
  from experiments.configs import shakespeare_char
  from transformer_jax.cli.workdir import prepare_workdir, save_config
  from transformer_jax.data import lm as lm_data
  from transformer_jax.workflows import lm

  config = shakespeare_char.get_config()
  config.data.path = _DATA_PATH.value
  if _NUM_STEPS.value:
    config.train.num_steps = _NUM_STEPS.value
  workdir = prepare_workdir(_WORKDIR.value or tempfile.mkdtemp(prefix='lm_sc_'))
  logging.info('workdir %s, config:\n%s', workdir, config)

  start = time.time()
  sections = lm.sections_of(config)
  corpus = lm.prepared_corpus(sections, workdir)
  task, trainer, tokenizer = lm.build(config, workdir, sections=sections)
  save_config(config, workdir)
  train_tokens, valid_tokens = corpus.split('train'), corpus.split('valid')
  train_data, valid_batches = lm.make_data(sections, train_tokens, valid_tokens)
  results = trainer.fit(train_data, lambda: iter(valid_batches))
  params = trainer.state.params

  # Training-text loss on fixed windows, measured like the validation loss (not the running
  # average of the last training steps, which lags behind the parameters).
  train_batches = lm_data.eval_batches(train_tokens, config.data.block_size, config.data.batch_size,
                                       config.data.eval_batches, seed=config.seed + 1)
  train_eval = trainer.evaluate(params, iter(train_batches))
  sample = task.sample_text(params, _SAMPLE_TOKENS.value)
  logging.info('sample (%d tokens, temperature %.1f, top_k %d):\n%s', _SAMPLE_TOKENS.value,
               task.temperature, task.top_k, sample)
  out = {
      'benchmark': 'lm_shakespeare',
      'steps': results['step'],
      'val_loss': round(results['eval_loss'], 4),
      'train_loss': round(train_eval['loss'], 4),
      'minutes': round(results['minutes'], 2),
      'total_minutes': round((time.time() - start) / 60, 2),
      'tokens_per_s': round(steady_tokens_per_s(workdir)),
      'tokens_per_s_overall': round(results['tokens_per_s']),
      'params': trainer.num_params(),
      'target_val_loss': 1.88,
      'allocator': process.allocator_description().split(' ')[0],
      'workdir': workdir,
  }
  trainer.close()
  print(json.dumps(out))


if __name__ == '__main__':
  from transformer_jax.cli import entrypoint
  app.run(lambda argv: entrypoint.run(main, argv))
