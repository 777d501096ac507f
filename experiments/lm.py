r"""Train a decoder-only GPT language model, or measure one's perplexity on a text file.

  python -m experiments.lm --config=experiments/configs/shakespeare_char.py --workdir=/tmp/sc \
      --config.data.path=../shared/data/tinyshakespeare/input.txt
  python -m experiments.lm --config=experiments/configs/shakespeare_char.py --workdir=/tmp/sc \
      --config.data.source=tfds                       # TFDS tiny_shakespeare instead
  python -m experiments.generate --workdir=/tmp/sc --prompt="ROMEO:"   # then sample from it

  python -m experiments.lm --config=experiments/configs/gpt2_shakespeare_bpe.py --workdir=/tmp/ft \
      --config.init.hf_dir=/path/to/gpt2              # continue pretraining a Hugging Face model

--config.init.hf_dir=DIR continues pretraining a Hugging Face causal LM (the flag --hf_dir's
families): DIR's config.json replaces the config's model section (the log names what changed;
dropout, dtypes and memory switches stay the config's), its tokenizer tokenizes the text and its
weights are the parameters at step 0. The workdir is then like one trained from scratch.

Rerunning the command resumes from the latest checkpoint in the workdir. Samples from the
model are written to the log and TensorBoard (tag 'samples') at every evaluation.

  python -m experiments.lm --mode=evaluate --workdir=/tmp/sc --input=some.txt [--stride=64]
  python -m experiments.lm --mode=evaluate --hf_dir=/path/to/gpt2 --input=some.txt

--mode=evaluate scores every token of --input once with a sliding window of the model's context
(max_len) moved by --stride tokens (default max_len // 2: each token after the first window has
at least half a context of text before it; a smaller stride gives more context and costs more).
The last stdout line is one JSON object: loss (mean next-token NLL, nats), perplexity
(exp(loss)), bits_per_character (character models; the first character is context only) or
bits_per_byte (subword models, over the file's UTF-8 bytes: every token is predicted, the first
after the token documents start with), and the counts. The workdir (or --hf_dir, a Hugging Face
folder of any causal family of the registry: the flag's help lists them) is only read.
"""

from transformer_jax.cli import process

if __name__ == '__main__':
  process.setup_allocator()

from absl import app, flags, logging
from ml_collections import config_flags

from transformer_jax.cli import entrypoint
from transformer_jax.cli.workdir import prepare_workdir
from transformer_jax.convert import families
from transformer_jax.errors import ConfigError
from transformer_jax.workflows import lm

_MODE = flags.DEFINE_enum('mode', 'train', ['train', 'evaluate'],
                          'train: train or resume; evaluate: perplexity of --input.')
_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file (Python).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, tokenizer, logs.')
_HF_DIR = flags.DEFINE_string(
    'hf_dir', None, 'evaluate: a Hugging Face causal LM folder (model_type '
    f'{" / ".join(families.names(families.CAUSAL_LM))}) instead of --workdir.')
_INPUT = flags.DEFINE_string('input', None, 'evaluate: the UTF-8 text file to score.')
_STRIDE = flags.DEFINE_integer(
    'stride', None, 'evaluate: tokens the window moves by; default '
    "half the model's context.")
_BATCH_SIZE = flags.DEFINE_integer('batch_size', 8, 'evaluate: windows per jitted call.')


def evaluate():
  """Prints the perplexity JSON line of --input (see the module docstring)."""
  import json
  import os
  if bool(_WORKDIR.value) == bool(_HF_DIR.value):
    raise ConfigError('--mode=evaluate needs exactly one of --workdir (trained by experiments.lm) '
                      'and --hf_dir (a Hugging Face model folder)')
  if not _INPUT.value:
    raise ConfigError('--mode=evaluate needs --input=FILE, the text to score')
  if _CONFIG.value is not None:
    raise ConfigError('--mode=evaluate reads the workdir\'s saved config; drop --config')
  if _HF_DIR.value:
    task, tokenizer, params = lm.load_hf_model(_HF_DIR.value)
  else:
    from transformer_jax.cli.workdir import load_saved_config
    workdir = os.path.abspath(os.path.expanduser(_WORKDIR.value))
    if not os.path.isdir(workdir):
      raise ConfigError(f'--workdir {workdir} does not exist: train it with experiments.lm first')
    config = load_saved_config(workdir)
    lm.check_lm_workdir(config, workdir)
    model = lm.restore_for_inference(config, workdir)
    task, tokenizer, params = model.task, model.tokenizer, model.params
  results = lm.evaluate_file(task, params, tokenizer, _INPUT.value, _STRIDE.value,
                             _BATCH_SIZE.value)
  print(json.dumps(results), flush=True)


def main(argv):
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {argv[1:]}; options are --flag=value')
  logging.info('allocator: %s', process.allocator_description())
  if _MODE.value == 'evaluate':
    evaluate()
    return
  if _CONFIG.value is None:
    raise ConfigError('--config is required, e.g. --config=experiments/configs/shakespeare_char.py')
  workdir = prepare_workdir(_WORKDIR.value)
  results = lm.train_and_evaluate(_CONFIG.value, workdir)
  logging.info('done: %s',
               {k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()})


if __name__ == '__main__':
  app.run(lambda argv: entrypoint.run(main, argv), flags_parser=entrypoint.parse_flags)
