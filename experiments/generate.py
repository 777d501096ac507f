r"""Sample text from a trained language-model workdir, or from an imported Hugging Face model.

  python -m experiments.generate --workdir=/tmp/sc --prompt="ROMEO:" --max_new_tokens=500 \
      --temperature=0.8 --top_k=200 --top_p=0.95 --seed=0
  python -m experiments.generate --hf_dir=/path/to/gpt2 --prompt="Hello, I'm a language model," \
      --max_new_tokens=30 --temperature=0

--workdir: a workdir trained by experiments.lm; loads its config, tokenizer and latest checkpoint.
--hf_dir: a Hugging Face causal LM folder (config.json, model.safetensors and the tokenizer files:
tokenizer.json, or GPT-2's vocab.json + merges.txt, or tokenizer.model), GPT-2 or LLaMA by
config.json's model_type; its weights are imported (transformer_jax.convert.hf_auto) and its
tokenizer read with transformer_jax.data.hf_tokenizer. Pass exactly one of the two.

Prints prompt + continuation on stdout (logs go to stderr); a continuation stops at the model's
EOS. The prompt is fed after the token the model starts documents with (EOS, GPT-2's
'<|endoftext|>', or LLaMA's BOS), and at most the model's context (max_len) is read. The same
--seed gives the same text; --temperature=0 is greedy.
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
_HF_DIR = flags.DEFINE_string(
    'hf_dir', None, 'A Hugging Face causal LM folder (GPT-2 or LLaMA): config.json, weights '
    'and tokenizer files.')
_PROMPT = flags.DEFINE_string('prompt', '\n', 'Text to continue.')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 500, 'Tokens to generate.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.8, 'Softmax temperature; 0 = greedy.')
_TOP_K = flags.DEFINE_integer('top_k', 200, 'Keep the k most likely tokens; 0 = all.')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Nucleus: smallest set with this mass; 1 = all.')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed: the same seed gives the same text.')
_NUM_SAMPLES = flags.DEFINE_integer('num_samples', 1, 'Independent samples of the prompt.')


def load_hf_model(directory: str):
  """(task, tokenizer, params) of the HF causal LM in `directory`, the task's EOS the
  tokenizer's."""
  from transformer_jax.convert import hf_auto
  from transformer_jax.data.hf_tokenizer import HFTokenizer
  from transformer_jax.tasks.lm import LanguageModelTask
  directory = os.path.abspath(os.path.expanduser(directory))
  if not os.path.isdir(directory):
    raise ConfigError(f'--hf_dir {directory} does not exist: a Hugging Face model folder')
  hf_auto.causal_lm_family(directory)  # refuse another kind of model before reading anything
  tokenizer = HFTokenizer.from_dir(directory)
  family, cfg, params = hf_auto.load_hf_causal_lm(directory)
  # Ids past the embedding would index out of it (jnp.take clamps: silently wrong tokens). A
  # smaller tokenizer is fine: models often round their embedding up.
  if tokenizer.vocab_size > cfg.vocab_size:
    raise ConfigError(f'the tokenizer in {directory} has {tokenizer.vocab_size} tokens but the '
                      f'{family} model\'s embedding has {cfg.vocab_size} rows; use the tokenizer '
                      'the model was trained with')
  task = LanguageModelTask(cfg, tokenizer=tokenizer, eos_id=tokenizer.eos_id)
  return task, tokenizer, params


def until_eos(row, eos_id: int | None) -> list[int]:
  """The ids of `row` before its first EOS (generation pads the rest)."""
  row = [int(i) for i in row]
  return row[:row.index(eos_id)] if eos_id is not None and eos_id in row else row


def main(argv):
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {argv[1:]}; options are --flag=value')
  if _TEMPERATURE.value < 0 or not 0.0 < _TOP_P.value <= 1.0 or _TOP_K.value < 0:
    raise ConfigError('need --temperature >= 0, 0 < --top_p <= 1 and --top_k >= 0')
  if _NUM_SAMPLES.value < 1:
    raise ConfigError('--num_samples must be positive')
  if bool(_WORKDIR.value) == bool(_HF_DIR.value):
    raise ConfigError('pass exactly one of --workdir (a directory trained by experiments.lm) and '
                      '--hf_dir (a Hugging Face model folder)')
  import jax
  import numpy as np
  from transformer_jax.data import lm as lm_data
  from transformer_jax.workflows import lm

  trainer = None
  if _HF_DIR.value:
    task, tokenizer, params = load_hf_model(_HF_DIR.value)
  else:
    workdir = os.path.abspath(os.path.expanduser(_WORKDIR.value))
    if not os.path.isdir(workdir):  # do not create it: there is nothing to sample from
      raise ConfigError(f'--workdir {workdir} does not exist: train it with experiments.lm first')
    config = load_saved_config(workdir)
    task, trainer, tokenizer, params = lm.restore_for_inference(config, workdir)
  prompt = lm_data.prompt_ids(tokenizer, _PROMPT.value)
  tokens = task.generate(params, np.asarray([prompt] * _NUM_SAMPLES.value,
                                            np.int32), _MAX_NEW.value, jax.random.key(_SEED.value),
                         temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value)
  if trainer is not None:
    trainer.close()
  for i, row in enumerate(tokens):
    if i:
      sys.stdout.write('\n' + '-' * 40 + '\n')
    sys.stdout.write(_PROMPT.value + tokenizer.decode(until_eos(row, task.eos_id)))
  sys.stdout.write('\n')
  sys.stdout.flush()


if __name__ == '__main__':
  app.run(lambda argv: entrypoint.run(main, argv), flags_parser=entrypoint.parse_flags)
