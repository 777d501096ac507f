r"""Sample text from a trained language-model workdir (see experiments/lm.py).

  python -m experiments.generate --workdir=/tmp/sc --prompt="ROMEO:" --max_new_tokens=500 \
      --temperature=0.8 --top_k=200 --top_p=0.95 --seed=0

Loads the workdir's config, tokenizer and latest checkpoint and prints prompt + continuation
on stdout (logs go to stderr). The same --seed gives the same text; --temperature=0 is greedy.
"""

from transformer_jax.cli import process

if __name__ == '__main__':
  process.setup_allocator()

import os
import sys

from absl import app, flags

from transformer_jax.cli import entrypoint
from transformer_jax.cli.workdir import load_saved_config
from transformer_jax.errors import ConfigError

_WORKDIR = flags.DEFINE_string('workdir', None, 'A workdir trained by experiments.lm.')
_PROMPT = flags.DEFINE_string('prompt', '\n', 'Text to continue.')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 500, 'Tokens to generate.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.8, 'Softmax temperature; 0 = greedy.')
_TOP_K = flags.DEFINE_integer('top_k', 200, 'Keep the k most likely tokens; 0 = all.')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Nucleus: smallest set with this mass; 1 = all.')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed: the same seed gives the same text.')
_NUM_SAMPLES = flags.DEFINE_integer('num_samples', 1, 'Independent samples of the prompt.')


def main(argv):
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {argv[1:]}; options are --flag=value')
  if _TEMPERATURE.value < 0 or not 0.0 < _TOP_P.value <= 1.0 or _TOP_K.value < 0:
    raise ConfigError('need --temperature >= 0, 0 < --top_p <= 1 and --top_k >= 0')
  if _NUM_SAMPLES.value < 1:
    raise ConfigError('--num_samples must be positive')
  import jax
  import numpy as np
  from transformer_jax.data import lm as lm_data
  from transformer_jax.workflows import lm

  if not _WORKDIR.value:
    raise ConfigError('--workdir is required: a directory trained by experiments.lm')
  workdir = os.path.abspath(os.path.expanduser(_WORKDIR.value))
  if not os.path.isdir(workdir):  # do not create it: there is nothing to sample from
    raise ConfigError(f'--workdir {workdir} does not exist: train it with experiments.lm first')
  config = load_saved_config(workdir)
  task, trainer, tokenizer, params = lm.restore_for_inference(config, workdir)
  prompt = lm_data.prompt_ids(tokenizer, _PROMPT.value)
  tokens = task.generate(params, np.asarray([prompt] * _NUM_SAMPLES.value,
                                            np.int32), _MAX_NEW.value, jax.random.key(_SEED.value),
                         temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value)
  trainer.close()
  for i, row in enumerate(tokens):
    if i:
      sys.stdout.write('\n' + '-' * 40 + '\n')
    sys.stdout.write(_PROMPT.value + tokenizer.decode(row))
  sys.stdout.write('\n')
  sys.stdout.flush()


if __name__ == '__main__':
  app.run(lambda argv: entrypoint.run(main, argv), flags_parser=entrypoint.parse_flags)
