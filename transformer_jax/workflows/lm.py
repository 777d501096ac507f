"""A language-model experiment from a config: text, tokenizer, token streams, task, trainer.

`experiments/lm.py` (training, and --mode=evaluate: `evaluate_file`), `experiments/generate.py`
(sampling) and `benchmarks/lm_shakespeare.py` are thin callers of these functions.

Data sources (config.data.source):
  'file': one UTF-8 text file (data.path), split into the first data.train_fraction for
          training and the rest for validation (nanoGPT's shakespeare_char);
  'tfds': a TFDS text corpus (data.tfds_name, e.g. 'tiny_shakespeare' or 'lm1b'), with its
          own train and validation splits.
Tokenizers (config.tokenizer.type): 'char' (sorted distinct characters of the training
text, saved as tokenizer.json), 'sentencepiece' (spm.model, trained on the training
text; documents joined with EOS) or 'byte_bpe' (GPT-2's byte-level BPE with
tokenizer.vocab_size tokens, trained on the training text and saved as the Hugging Face
folder tokenizer/, which transformers.AutoTokenizer reads; documents joined with
'<|endoftext|>', as GPT-2's were).
Packing (config.data.pack=True): every training and evaluation window also carries
'inputs_segment_ids' and 'inputs_positions' from its EOS ids (data/lm.py), so no token attends
to another document and positions restart at each one. It needs documents joined with EOS, i.e.
a subword tokenizer; a 'char' tokenizer is refused before anything is written.
"""

import math
import os
import shutil
import tempfile

import jax
import numpy as np
from absl import logging

from transformer_jax.cli import validation
from transformer_jax.cli.workdir import save_config
from transformer_jax.data import lm as lm_data
from transformer_jax.data import tokenizer as tok
from transformer_jax.data.hf_tokenizer import HFTokenizer
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.workflows import experiments
from transformer_jax.workflows.lm_sections import Data, LmSections, Tokenizer

CHAR_VOCAB_FILE = 'tokenizer.json'
SPM_FILE = 'spm.model'
BPE_DIR = 'tokenizer'  # a byte-level BPE: HFTokenizer.save's Hugging Face files

# -- data ---------------------------------------------------------------------------------------


def load_documents(data: Data) -> tuple[list[str], list[str]]:
  """(training documents, validation documents) from data.source ('file' or 'tfds')."""
  if data.source == 'file':
    train, valid = lm_data.split_train_val(lm_data.read_text(data.path), data.train_fraction)
    return [train], [valid]
  from transformer_jax.data.tfds_text import load_tfds_train_valid
  train, valid = load_tfds_train_valid(data)
  return train, valid


def load_tokenizer(tokenizer: Tokenizer, workdir: str, train_documents: list[str] | None = None):
  """The workdir's tokenizer of tokenizer.type; built from the training documents on the first
  run."""
  kind = tokenizer.type
  if kind == 'char':
    path = os.path.join(workdir, CHAR_VOCAB_FILE)
    if train_documents is None:
      return lm_data.CharTokenizer.load(path)
    return lm_data.CharTokenizer.load_or_build(path, ''.join(train_documents))
  if kind == 'sentencepiece':

    def texts():  # read only when the model file is missing
      if train_documents is None:
        raise ConfigError(f'no tokenizer model in {workdir}: train first')
      return iter(train_documents)

    return tok.load_or_train_tokenizer(os.path.join(workdir, SPM_FILE), texts, tokenizer.vocab_size,
                                       model_type=tokenizer.model_type,
                                       max_sentences=tokenizer.max_sentences)
  # 'byte_bpe' (Tokenizer.check refused any other type)
  return load_or_train_byte_bpe(os.path.join(workdir, BPE_DIR), train_documents,
                                tokenizer.vocab_size)


def load_or_train_byte_bpe(directory: str, train_documents: list[str] | None,
                           vocab_size: int) -> HFTokenizer:
  """The byte-level BPE saved in `directory`, else one trained on the documents and saved.

  A resumed run must keep its ids, so an existing folder wins over the config's vocab_size.
  The folder appears whole or not at all: it is written beside and renamed into place.
  """
  if os.path.isdir(directory):
    tokenizer = HFTokenizer.from_dir(directory)
    if tokenizer.vocab_size != vocab_size:
      logging.warning(
          'tokenizer %s has %d tokens but vocab_size=%d was requested; using the '
          'existing one', directory, tokenizer.vocab_size, vocab_size)
    return tokenizer
  if train_documents is None:
    raise ConfigError(f'no tokenizer folder {directory}: train first')
  tokenizer = HFTokenizer.train_byte_level_bpe(train_documents, vocab_size)
  staging = tempfile.mkdtemp(dir=os.path.dirname(directory), prefix=f'.{BPE_DIR}.tmp-')
  try:
    os.chmod(staging, 0o755)  # mkdtemp makes an owner-only folder; this is a normal one
    tokenizer.save(staging)
    try:
      os.replace(staging, directory)
    except OSError:
      if not os.path.isdir(directory):
        raise
      # Another process of this job saved its folder first: all use that one, so ids agree.
      shutil.rmtree(staging, ignore_errors=True)
      return HFTokenizer.from_dir(directory)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  logging.info('saved the byte-level BPE to %s', directory)
  return tokenizer


def encode(tokenizer, documents: list[str]) -> np.ndarray:
  """One token stream: characters as they are, subword documents each followed by the
  tokenizer's EOS."""
  if isinstance(tokenizer, lm_data.CharTokenizer):
    ids = tokenizer.encode(''.join(documents))
    return np.asarray(ids, lm_data.token_dtype(tokenizer.vocab_size))
  return lm_data.encode_documents(tokenizer, documents)


# -- composition --------------------------------------------------------------------------------


def sections_of(config) -> LmSections:
  """The config's typed sections (lm_sections.py): data, tokenizer, eval, the model and the run's
  shared ones, each key checked once."""
  return LmSections.of(config)


def model_config(config, vocab_size: int):
  """config.model with the tokenizer's vocabulary; the context length is data.block_size."""
  return sections_of(config).model_config(vocab_size)


def validate(config) -> LmSections:
  """Every check of a language-model run, before anything is read or written: the sections and
  the model shape (with the requested vocabulary size, before a tokenizer is trained), training
  switches, the batch against the mesh. Returns the typed sections the run then reads."""
  experiments.require(config, experiments.LM)
  sections = sections_of(config)
  validation.check_training(config, sections.data.batch_size)
  return sections


def build_task(config, workdir: str, train_documents: list[str] | None = None,
               sections: LmSections | None = None):
  """(task, tokenizer) for `config` (read into `sections` unless given), the model sized to the
  tokenizer."""
  from transformer_jax.tasks.lm import LanguageModelTask
  sections = sections or sections_of(config)
  tokenizer = load_tokenizer(sections.tokenizer, workdir, train_documents)
  sample = sections.eval
  task = LanguageModelTask(sections.model_config(tokenizer.vocab_size), tokenizer=tokenizer,
                           eos_id=lm_data.lm_eos_id(tokenizer),
                           sample_prompt=lm_data.prompt_ids(tokenizer, sample.sample_prompt),
                           sample_tokens=sample.sample_tokens, temperature=sample.temperature,
                           top_k=sample.top_k, top_p=sample.top_p, sample_seed=sections.run.seed)
  return task, tokenizer


def build(config, workdir: str, train_documents: list[str] | None = None,
          sections: LmSections | None = None):
  """(task, trainer, tokenizer) for `config`, as `build_task`."""
  from transformer_jax.training.trainer import Trainer
  task, tokenizer = build_task(config, workdir, train_documents, sections)
  return task, Trainer(config, task, workdir), tokenizer


def abstract_task(config, num_devices: int | None = None):
  """(task, {key: jax.ShapeDtypeStruct}) of one global training batch, from the config alone.

  Nothing is read and no tokenizer is built: the model has tokenizer.vocab_size entries (a
  char tokenizer sizes itself from the text; 256 covers any byte-sized alphabet). For the
  planner (`transformer_jax/planning/`); `num_devices` is unused (the batch is data.batch_size
  rows whatever the mesh), taken for the same signature as the other workflows.
  """
  import jax
  from transformer_jax.tasks.lm import LanguageModelTask
  del num_devices
  sections = sections_of(config)
  task = LanguageModelTask(sections.model)
  shape = (sections.data.batch_size, sections.data.block_size)
  keys = ['inputs', 'targets']
  if sections.data.pack:
    keys += ['inputs_segment_ids', 'inputs_positions']
  return task, {k: jax.ShapeDtypeStruct(shape, np.int32) for k in keys}


def make_data(sections: LmSections, train_tokens: np.ndarray, valid_tokens: np.ndarray,
              eos_id: int | None = None):
  """(training windows, fixed evaluation batches); with data.pack, both segmented at `eos_id`
  (the EOS that joins the documents: `data.lm.lm_eos_id` of the tokenizer)."""
  import jax
  data, seed = sections.data, sections.run.seed
  block, batch = data.block_size, data.batch_size
  pack_eos_id = None
  if data.pack:
    if eos_id is None:
      raise ConfigError('data.pack=True needs documents joined with EOS, and this tokenizer has '
                        'no EOS; set data.pack=False')
    pack_eos_id = int(eos_id)
  train = lm_data.RandomWindows(train_tokens, block_size=block, batch_size=batch, seed=seed,
                                process_index=jax.process_index(),
                                process_count=jax.process_count(), pack_eos_id=pack_eos_id)
  # Every process evaluates the same windows; each feeds its own rows of them.
  local = batch // jax.process_count()
  rows = slice(jax.process_index() * local, (jax.process_index() + 1) * local)
  batches = lm_data.eval_batches(valid_tokens, block, batch, data.eval_batches, seed=seed + 1,
                                 pack_eos_id=pack_eos_id)
  valid = [{k: v[rows] for k, v in b.items()} for b in batches]
  return train, valid


def train_and_evaluate(config, workdir: str) -> dict:
  """Trains (or resumes) to train.num_steps; returns the trainer's final metrics."""
  sections = validate(config)
  os.makedirs(workdir, exist_ok=True)
  train_docs, valid_docs = load_documents(sections.data)
  task, trainer, tokenizer = build(config, workdir, train_docs, sections)
  save_config(config, workdir)
  train_tokens, valid_tokens = encode(tokenizer, train_docs), encode(tokenizer, valid_docs)
  logging.info('tokens: %s train, %s validation; vocabulary %d', f'{len(train_tokens):,}',
               f'{len(valid_tokens):,}', tokenizer.vocab_size)
  train_data, valid_batches = make_data(sections, train_tokens, valid_tokens,
                                        lm_data.lm_eos_id(tokenizer))
  results = trainer.fit(train_data, lambda: iter(valid_batches))
  results['params'] = trainer.num_params()
  trainer.close()
  return results


def restore_for_inference(config, workdir: str):
  """The workdir's model for inference (`trained_model.TrainedModel`: task, params of the latest
  checkpoint, mesh, tokenizer); the params alone are read, and nothing is written."""
  from transformer_jax.training import trained_model
  task, tokenizer = build_task(config, workdir, sections=validate(config))
  return trained_model.restore(config, task, workdir, tokenizer=tokenizer)


# -- inference: a trained workdir or an imported Hugging Face model -----------------------------


def check_lm_workdir(config, workdir: str):
  """ConfigError unless `workdir` was trained by experiments.lm (its config is a language
  model's: workflows/experiments.py) and holds a checkpoint.

  Checked before anything is read, so that a wrong workdir reads as one line.
  """
  try:
    trained_by = experiments.of_config(config)
  except ConfigError as error:
    raise ConfigError(f'{workdir} is not a language-model workdir ({error}): pass a workdir '
                      'trained by experiments.lm') from None
  if trained_by.name != experiments.LM:
    raise ConfigError(f'{workdir} is not a language-model workdir (its config has experiment '
                      f'{trained_by.name!r}, trained by {trained_by.command}): pass a workdir '
                      'trained by experiments.lm')
  checkpoints = os.path.join(workdir, 'checkpoints')
  if not os.path.isdir(checkpoints) or not any(name.isdigit() for name in os.listdir(checkpoints)):
    raise ConfigError(f'no checkpoint in {checkpoints}: train it with experiments.lm first')


def load_hf_model(directory: str):
  """(task, tokenizer, params) of the HF causal LM in `directory`, the task's EOS the
  tokenizer's."""
  from transformer_jax.convert import families
  from transformer_jax.tasks.lm import LanguageModelTask
  directory = os.path.abspath(os.path.expanduser(directory))
  if not os.path.isdir(directory):
    raise ConfigError(f'--hf_dir {directory} does not exist: a Hugging Face model folder')
  # Refuses another kind of model before reading anything.
  family = families.of_directory(directory, families.CAUSAL_LM)
  tokenizer = HFTokenizer.from_dir(directory)
  imported = family.load(directory)
  cfg, params = imported.config, imported.params
  # Ids past the embedding would index out of it (jnp.take clamps: silently wrong tokens). A
  # smaller tokenizer is fine: models often round their embedding up.
  if tokenizer.vocab_size > cfg.vocab_size:
    raise ConfigError(
        f'the tokenizer in {directory} has {tokenizer.vocab_size} tokens but the '
        f'{family.name} model\'s embedding has {cfg.vocab_size} rows; use the tokenizer '
        'the model was trained with')
  task = LanguageModelTask(cfg, tokenizer=tokenizer, eos_id=tokenizer.eos_id)
  # On the device once: host arrays would be copied in again by every generation call.
  return task, tokenizer, jax.device_put(params)


def evaluation_tokens(tokenizer, text: str) -> tuple[np.ndarray, str, int]:
  """(token stream, unit, units) of `text` for `evaluate_file`.

  Characters for a character model (the first is context only: there is nothing to predict
  it from, so `units` counts the other characters); otherwise subword ids after the token a
  document starts with (`data.lm.prompt_ids`: EOS or BOS), so every token of the text is
  predicted, and `units` is the text's UTF-8 bytes.
  """
  if isinstance(tokenizer, lm_data.CharTokenizer):
    return np.asarray(tokenizer.encode(text), np.int32), 'character', len(text) - 1
  return np.asarray(lm_data.prompt_ids(tokenizer, text),
                    np.int32), 'byte', len(text.encode('utf-8'))


def evaluate_file(task, params, tokenizer, path: str, stride: int | None = None,
                  batch_size: int = 8) -> dict:
  """Loss, perplexity and bits per character/byte of the text file `path`.

  Sliding windows of the model's context (max_len) advanced by `stride` tokens (default
  max_len // 2: every token after the first window sees at least half a context, at twice
  the cost of disjoint windows); each token is scored once (`data.lm.sliding_windows`).
  loss is the mean next-token NLL in nats, perplexity exp(loss), and bits per unit
  loss / ln 2 * tokens / units (`evaluation_tokens`).

  The file is scored as one document (`evaluation_tokens` starts it with EOS or BOS and puts no
  EOS inside), so a model trained with data.pack=True sees what packing would give it: one
  segment per window, positions 0..T-1. No segment ids are needed.
  """
  window = int(task.cfg.max_len)
  stride = max(1, window // 2) if stride is None else int(stride)
  if not 1 <= stride <= window:
    raise ConfigError(f'--stride must be in [1, {window}] (the model\'s context), got {stride}')
  if batch_size < 1:
    raise ConfigError(f'--batch_size must be positive, got {batch_size}')
  text = lm_data.read_text(path)
  tokens, unit, units = evaluation_tokens(tokenizer, text)
  if len(tokens) < 2 or units < 1:
    raise DataError(f'{path} is too short to score: it needs at least two tokens')
  windows = lm_data.sliding_windows(tokens, window, stride)
  nll, count = task.score_windows(params, windows, batch_size)
  loss = nll / count
  return {
      'file': os.path.abspath(path), 'tokens': count, f'{unit}s': units, 'window': window,
      'stride': stride, 'windows': len(windows['inputs']), 'loss': loss,
      'perplexity': math.exp(loss), f'bits_per_{unit}': nll / math.log(2) / units
  }
