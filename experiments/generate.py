r"""Sample text from a trained language-model workdir, or from an imported Hugging Face model.

  python -m experiments.generate --workdir=/tmp/sc --prompt="ROMEO:" --max_new_tokens=500 \
      --temperature=0.8 --top_k=200 --top_p=0.95 --seed=0
  python -m experiments.generate --hf_dir=/path/to/gpt2 --prompt="Hello, I'm a language model," \
      --max_new_tokens=30 --temperature=0

--workdir: a workdir trained by experiments.lm; loads its config, tokenizer and latest checkpoint.
--hf_dir: a Hugging Face causal LM folder (config.json, model.safetensors and the tokenizer files:
tokenizer.json, or GPT-2's vocab.json + merges.txt, or tokenizer.model) of any causal family of
the registry (the --hf_dir flag's help lists them), by config.json's model_type; its weights are
imported (transformer_jax.convert.families) and its tokenizer read with
transformer_jax.data.hf_tokenizer. Pass exactly one of the two.

Prints prompt + continuation on stdout (logs go to stderr); a continuation stops at the model's
EOS. A single prompt and sample is streamed: each token is printed (and flushed) as soon as it is
drawn, through one jitted decode step per token (`LanguageModelTask.generate_stream`: the same
tokens as the one-shot sampler for the same seed); --stream=false prints it all at the end.

  python -m experiments.generate --workdir=/tmp/sc --prompts_file=prompts.txt \
      --output_format=jsonl --temperature=0

--prompts_file: one prompt per line (a line is a prompt, an empty one too), generated --batch_size
prompts at a time in file order, prompts of any lengths in one batch (each row's KV cache keeps
its own position, `inference/generation.py`); outputs come in file order, with a progress line
per batch on stderr. Each line draws with its own key, fold_in(key(--seed), line number - 1), so
its text does not depend on --batch_size or on the other lines (greedy: exactly what the prompt
gets alone). --output_format=jsonl writes one {"prompt", "completion"} object per line (also for
--prompt).

  python -m experiments.generate --hf_dir=/path/to/gpt2 --prompts_file=prompts.txt \
      --num_beams=4 --length_penalty=1.0 --max_new_tokens=40

--num_beams > 1: beam search (as transformers' `generate(num_beams=...)`, length penalty on the
generated tokens; `LanguageModelTask.beam_search`) prints each prompt's best hypothesis; the
prompt and the new tokens must fit in the model's context.

The prompt is fed after the token the model starts documents with (EOS, GPT-2's '<|endoftext|>',
or LLaMA's BOS); a prompt longer than the model's context (max_len) is refused. The same --seed
gives the same text; --temperature=0 is greedy.
"""

from transformer_jax.cli import process

if __name__ == '__main__':
  process.setup_allocator()

import json
import os
import sys

from absl import app, flags

from transformer_jax.cli import entrypoint
from transformer_jax.cli.workdir import load_saved_config
from transformer_jax.convert import families
from transformer_jax.errors import ConfigError

_WORKDIR = flags.DEFINE_string('workdir', None, 'A workdir trained by experiments.lm.')
_HF_DIR = flags.DEFINE_string(
    'hf_dir', None, 'A Hugging Face causal LM folder (model_type '
    f'{" / ".join(families.names(families.CAUSAL_LM))}): config.json, weights and tokenizer files.')
_PROMPT = flags.DEFINE_string('prompt', '\n', 'Text to continue.')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 500, 'Tokens to generate.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.8, 'Softmax temperature; 0 = greedy.')
_TOP_K = flags.DEFINE_integer('top_k', 200, 'Keep the k most likely tokens; 0 = all.')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Nucleus: smallest set with this mass; 1 = all.')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed: the same seed gives the same text.')
_NUM_SAMPLES = flags.DEFINE_integer('num_samples', 1, 'Independent samples of the prompt.')
_PROMPTS_FILE = flags.DEFINE_string('prompts_file', None,
                                    'A UTF-8 file of prompts, one per line, instead of --prompt.')
_OUTPUT_FORMAT = flags.DEFINE_enum(
    'output_format', 'text', ['text', 'jsonl'],
    'text: prompt + continuation; jsonl: one JSON object '
    '{"prompt", "completion"} per line.')
_BATCH_SIZE = flags.DEFINE_integer('batch_size', 16, 'Prompts generated together (one batch).')
_NUM_BEAMS = flags.DEFINE_integer('num_beams', 1, 'Beam search with this many beams; 1 = sample.')
_LENGTH_PENALTY = flags.DEFINE_float(
    'length_penalty', 1.0, 'Beam search: a hypothesis scores its log-probability / (new tokens '
    '** length_penalty).')
_STREAM = flags.DEFINE_boolean(
    'stream', True, 'Print the tokens of a single prompt and sample '
    'as they are drawn; false: all at the end.')


def load_hf_model(directory: str):
  """(task, tokenizer, params) of the HF causal LM in `directory` (`workflows.lm.load_hf_model`)."""
  from transformer_jax.workflows import lm
  return lm.load_hf_model(directory)


def until_eos(row, eos_id: int | None) -> list[int]:
  """The ids of `row` before its first EOS (generation pads the rest)."""
  row = [int(i) for i in row]
  return row[:row.index(eos_id)] if eos_id is not None and eos_id in row else row


def read_prompts(path: str) -> list[str]:
  """The lines of `path` (without their newlines); a one-line error if there are none."""
  from transformer_jax.data import lm as lm_data
  text = lm_data.read_text(path)
  prompts = text.split('\n')
  if prompts and prompts[-1] == '':
    prompts.pop()  # the file's final newline ends the last line, it starts no prompt
  if not prompts:
    raise ConfigError(f'--prompts_file {path} has no lines: one prompt per line')
  return prompts


def encode_prompts(tokenizer, prompts: list[str], max_len: int, *,
                   source: str | None = None) -> list[list[int]]:
  """The ids of every prompt; one line naming the prompt (`source`:line) that cannot be encoded
  or is longer than the model's context of `max_len` tokens."""
  from transformer_jax.data import lm as lm_data
  from transformer_jax.errors import DataError
  ids = []
  for line, prompt in enumerate(prompts, 1):
    where = f'{source}:{line}: ' if source else ''
    try:
      row = lm_data.prompt_ids(tokenizer, prompt)
    except DataError as error:
      raise DataError(f'{where}{error}') from None
    if len(row) > max_len:
      raise DataError(f'{where}the prompt is {len(row)} tokens, longer than the model\'s context '
                      f'of {max_len}')
    ids.append(row)
  return ids


def generate_batch(task, tokenizer, params, prompts: list[str], max_new_tokens: int, rng, *,
                   batch_size: int = 16, num_beams: int = 1, length_penalty: float = 1.0,
                   source: str | None = None, **sampling) -> list[str]:
  """The completion of every prompt, in order: `batch_size` prompts (any lengths) per batch, in
  file order. Prompt i draws with fold_in(rng, i); `num_beams` > 1: beam search's best.

  `source` (the prompts file) names the line of a prompt that cannot be encoded."""
  import time

  import jax
  import numpy as np
  from absl import logging
  ids = encode_prompts(tokenizer, prompts, task.cfg.max_len, source=source)
  completions = []
  start, generated = time.time(), 0
  for first in range(0, len(ids), batch_size):
    rows = ids[first:first + batch_size]
    if num_beams > 1:
      tokens = task.beam_search(params, rows, num_beams, max_new_tokens,
                                length_penalty=length_penalty)[0][:, 0]
    else:
      keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng,
                                                             np.arange(first, first + len(rows)))
      tokens = task.generate(params, rows, max_new_tokens, keys, **sampling)
    for row in tokens:
      kept = until_eos(row, task.eos_id)
      generated += len(kept)
      completions.append(tokenizer.decode(kept))
    done, elapsed = len(completions), time.time() - start
    logging.info('prompts %d/%d: %.1f new tokens/s, %.0f s, ETA %.0f s', done, len(ids),
                 generated / max(elapsed, 1e-9), elapsed, elapsed / done * (len(ids) - done))
  return completions


def stream_one(task, tokenizer, params, prompt: str, max_new_tokens: int, rng, **sampling):
  """Writes `prompt`, then each piece of text as its token is drawn, flushing every time."""
  import numpy as np
  from transformer_jax.data import lm as lm_data
  ids = lm_data.prompt_ids(tokenizer, prompt)
  sys.stdout.write(prompt)
  sys.stdout.flush()
  decoder = lm_data.IncrementalDecoder(tokenizer)
  for column in task.generate_stream(params, np.asarray([ids], np.int32), max_new_tokens, rng,
                                     **sampling):
    token = int(column[0])
    if task.eos_id is not None and token == task.eos_id:
      break
    piece = decoder.push(token)
    if piece:
      sys.stdout.write(piece)
      sys.stdout.flush()
  sys.stdout.write(decoder.finish() + '\n')
  sys.stdout.flush()


def main(argv):
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {argv[1:]}; options are --flag=value')
  if _TEMPERATURE.value < 0 or not 0.0 < _TOP_P.value <= 1.0 or _TOP_K.value < 0:
    raise ConfigError('need --temperature >= 0, 0 < --top_p <= 1 and --top_k >= 0')
  if _NUM_SAMPLES.value < 1:
    raise ConfigError('--num_samples must be positive')
  if _MAX_NEW.value < 1:
    raise ConfigError('--max_new_tokens must be positive')
  if bool(_WORKDIR.value) == bool(_HF_DIR.value):
    raise ConfigError('pass exactly one of --workdir (a directory trained by experiments.lm) and '
                      '--hf_dir (a Hugging Face model folder)')
  if _BATCH_SIZE.value < 1:
    raise ConfigError(f'--batch_size must be positive, got {_BATCH_SIZE.value}')
  if _NUM_BEAMS.value < 1:
    raise ConfigError(f'--num_beams must be positive, got {_NUM_BEAMS.value}')
  if _PROMPTS_FILE.value and _NUM_SAMPLES.value > 1:
    raise ConfigError('--num_samples applies to --prompt; with --prompts_file, repeat a line to '
                      'sample it again')
  prompts = read_prompts(
      _PROMPTS_FILE.value) if _PROMPTS_FILE.value else [_PROMPT.value] * _NUM_SAMPLES.value
  import jax
  from transformer_jax.workflows import lm

  if _HF_DIR.value:
    task, tokenizer, params = load_hf_model(_HF_DIR.value)
  else:
    workdir = os.path.abspath(os.path.expanduser(_WORKDIR.value))
    if not os.path.isdir(workdir):  # do not create it: there is nothing to sample from
      raise ConfigError(f'--workdir {workdir} does not exist: train it with experiments.lm first')
    config = load_saved_config(workdir)
    lm.check_lm_workdir(config, workdir)
    model = lm.restore_for_inference(config, workdir)
    task, tokenizer, params = model.task, model.tokenizer, model.params
  rng = jax.random.key(_SEED.value)
  sampling = dict(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value)
  streamed = _STREAM.value and _OUTPUT_FORMAT.value == 'text' and _NUM_BEAMS.value == 1
  if len(prompts) == 1 and streamed:
    encode_prompts(tokenizer, prompts, task.cfg.max_len)  # refuses one longer than the context
    stream_one(task, tokenizer, params, prompts[0], _MAX_NEW.value, rng, **sampling)
    return
  if _PROMPTS_FILE.value:
    completions = generate_batch(task, tokenizer, params, prompts, _MAX_NEW.value, rng,
                                 batch_size=_BATCH_SIZE.value, num_beams=_NUM_BEAMS.value,
                                 length_penalty=_LENGTH_PENALTY.value, source=_PROMPTS_FILE.value,
                                 **sampling)
  elif _NUM_BEAMS.value > 1:  # --prompt: its best hypothesis (repeated --num_samples times)
    completions = generate_batch(task, tokenizer, params, prompts[:1], _MAX_NEW.value, rng,
                                 num_beams=_NUM_BEAMS.value,
                                 length_penalty=_LENGTH_PENALTY.value) * len(prompts)
  else:  # --prompt --num_samples=n: n rows drawing from one key together, as before
    ids = encode_prompts(tokenizer, prompts, task.cfg.max_len)
    tokens = task.generate(params, ids, _MAX_NEW.value, rng, **sampling)
    completions = [tokenizer.decode(until_eos(row, task.eos_id)) for row in tokens]
  if _OUTPUT_FORMAT.value == 'jsonl':
    for prompt, completion in zip(prompts, completions):
      sys.stdout.write(json.dumps({'prompt': prompt, 'completion': completion}) + '\n')
  else:
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
      if i:
        sys.stdout.write('\n' + '-' * 40 + '\n')
      sys.stdout.write(prompt + completion)
    sys.stdout.write('\n')
  sys.stdout.flush()


if __name__ == '__main__':
  app.run(lambda argv: entrypoint.run(main, argv), flags_parser=entrypoint.parse_flags)
