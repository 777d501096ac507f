r"""Train, evaluate and use an encoder-decoder Transformer for translation.

  python -m experiments.translate --config=experiments/configs/translate_quickstart.py \
      --workdir=/tmp/qs
  python -m experiments.translate --config=experiments/configs/multi30k.py \
      --config.data.dir=../shared/data/multi30k --workdir=/tmp/m30k
  # translate new text with a trained workdir (stdin or a file), one sentence per line:
  echo "A dog runs on the beach." | python -m experiments.translate --workdir=/tmp/m30k \
      --mode=translate
  # BLEU on the test set named by eval.test_prefix in the workdir's saved config:
  python -m experiments.translate --workdir=/tmp/m30k --mode=evaluate
  # --config.* overrides need --config (without it they are unknown flags):
  python -m experiments.translate --config=experiments/configs/multi30k.py \
      --config.data.dir=../shared/data/multi30k --workdir=/tmp/m30k --mode=evaluate \
      --config.eval.test_prefix=test_2016_flickr

Rerunning the train command resumes from the latest checkpoint in the workdir.

T5 (experiments/configs/t5_*.py): span-corruption pretraining on plain text, text-to-text
translation with a task prefix, and fine-tuning a pretrained T5, from a span-corruption workdir
(--config.init.workdir=DIR) or a Hugging Face T5 directory (--config.init.hf_dir=DIR); the
commands are in t5_span_corruption.py and t5_multi30k.py.
"""

from transformer_jax.cli import process

if __name__ == '__main__':
  process.setup_allocator()

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from transformer_jax.cli import entrypoint
from transformer_jax.cli.workdir import load_saved_config, prepare_workdir
from transformer_jax.errors import ConfigError
from transformer_jax.workflows import translation
from transformer_jax.workflows.translation_sections import Translation

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file (Python).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, tokenizer, logs.')
_MODE = flags.DEFINE_enum('mode', 'train', ['train', 'evaluate', 'translate'],
                          'train (and evaluate), evaluate a test set, or translate text.')
_INPUT = flags.DEFINE_string('input', '-', 'translate mode: file of sentences, - for stdin.')
_OUTPUT = flags.DEFINE_string('output', '-', 'translate mode: output file, - for stdout.')


def translate_text(config, workdir: str):
  model = translation.restore_for_inference(config, workdir)
  source = sys.stdin if _INPUT.value == '-' else open(_INPUT.value, encoding='utf-8')
  with source:
    lines = [line.rstrip('\n') for line in source]
  outputs = model.task.translate(model.params, lines, model.mesh)
  if _OUTPUT.value == '-':
    sys.stdout.write(''.join(o + '\n' for o in outputs))
  else:
    with open(_OUTPUT.value, 'w', encoding='utf-8') as f:
      f.write(''.join(o + '\n' for o in outputs))


def main(argv):
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {argv[1:]}; options are --flag=value')
  logging.info('allocator: %s', process.allocator_description())
  workdir = prepare_workdir(_WORKDIR.value)
  config = _CONFIG.value
  if config is None:  # inference modes may rely on the workdir's saved config
    if _MODE.value == 'train':
      raise ConfigError('--config is required for training, e.g. '
                        '--config=experiments/configs/translate_quickstart.py')
    config = load_saved_config(workdir)
  run = Translation.of(config)  # read once: a typo or a wrong type is one line, before any work
  if _MODE.value == 'train':
    results = translation.train_and_evaluate(run, workdir)
    logging.info('done: %s',
                 {k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()})
  elif _MODE.value == 'evaluate':
    if not run.eval.test_prefix:
      raise ConfigError(
          '--mode=evaluate needs --config=CONFIG --config.eval.test_prefix=PREFIX (e.g. '
          'test_2016_flickr)')
    model = translation.restore_for_inference(run, workdir)
    translation.evaluate_test_set(run, workdir, model.task, model.mesh, model.params)
  else:
    translate_text(run, workdir)


if __name__ == '__main__':
  app.run(lambda argv: entrypoint.run(main, argv), flags_parser=entrypoint.parse_flags)
