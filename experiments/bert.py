r"""Pretrain BERT (masked LM + NSP/SOP) or fine-tune one on sentence classification.

  # MLM + NSP pretraining of a small BERT on local text (WordPiece trained on it)
  python -m experiments.bert --config=experiments/configs/bert_pretrain_small.py --workdir=/tmp/bp
  # fine-tune the imported MiniLM-L6 checkpoint on SST-2
  python -m experiments.bert --config=experiments/configs/sst2_minilm.py --workdir=/tmp/sst2 \
      --config.data.dir=../shared/data/sst2
  # fine-tune our own pretrained workdir instead
  python -m experiments.bert --config=experiments/configs/sst2_minilm.py --workdir=/tmp/ft \
      --config.init.hf_dir= --config.init.bert_workdir=/tmp/bp

The mode comes from the config (config.mode) unless --mode overrides it. Rerunning the same
command resumes from the latest checkpoint in the workdir.
"""

from transformer_jax.cli import process

if __name__ == '__main__':
  process.setup_allocator()

from absl import app, flags, logging
from ml_collections import config_flags

from transformer_jax.cli import entrypoint
from transformer_jax.cli.workdir import prepare_workdir
from transformer_jax.errors import ConfigError
from transformer_jax.workflows import bert

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file (Python).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, vocabulary, logs.')
_MODE = flags.DEFINE_enum('mode', None, list(bert.MODES), 'Overrides config.mode.')


def main(argv):
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {argv[1:]}; options are --flag=value')
  logging.info('allocator: %s', process.allocator_description())
  if _CONFIG.value is None:
    raise ConfigError('--config is required, e.g. --config=experiments/configs/sst2_minilm.py')
  workdir = prepare_workdir(_WORKDIR.value)
  results = bert.run(_CONFIG.value, workdir, _MODE.value or '')
  logging.info('done: %s',
               {k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()})


if __name__ == '__main__':
  app.run(lambda argv: entrypoint.run(main, argv), flags_parser=entrypoint.parse_flags)
