r"""Train a decoder-only GPT language model.

  python -m experiments.lm --config=experiments/configs/shakespeare_char.py --workdir=/tmp/sc \
      --config.data.path=../shared/data/tinyshakespeare/input.txt
  python -m experiments.lm --config=experiments/configs/shakespeare_char.py --workdir=/tmp/sc \
      --config.data.source=tfds                       # TFDS tiny_shakespeare instead
  python -m experiments.generate --workdir=/tmp/sc --prompt="ROMEO:"   # then sample from it

Rerunning the command resumes from the latest checkpoint in the workdir. Samples from the
model are written to the log and TensorBoard (tag 'samples') at every evaluation.
"""

from transformer_jax.cli import process

if __name__ == '__main__':
  process.setup_allocator()

from absl import app, flags, logging
from ml_collections import config_flags

from transformer_jax.cli import entrypoint
from transformer_jax.cli.workdir import prepare_workdir
from transformer_jax.errors import ConfigError
from transformer_jax.workflows import lm

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file (Python).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, tokenizer, logs.')


def main(argv):
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {argv[1:]}; options are --flag=value')
  logging.info('allocator: %s', process.allocator_description())
  if _CONFIG.value is None:
    raise ConfigError('--config is required, e.g. --config=experiments/configs/shakespeare_char.py')
  workdir = prepare_workdir(_WORKDIR.value)
  results = lm.train_and_evaluate(_CONFIG.value, workdir)
  logging.info('done: %s',
               {k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()})


if __name__ == '__main__':
  app.run(lambda argv: entrypoint.run(main, argv), flags_parser=entrypoint.parse_flags)
