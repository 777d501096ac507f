"""A language-model experiment from a config: text, tokenizer, token streams, task, trainer.

`experiments/lm.py` (training, and --mode=evaluate: `evaluate_file`), `experiments/generate.py`
(sampling) and `benchmarks/lm_shakespeare.py` are thin callers of these functions.

Data sources (config.data.source):
  'file':     one UTF-8 text file (data.path), split into the first data.train_fraction for
              training and the rest for validation (nanoGPT's shakespeare_char); subword
              documents are separated by blank lines;
  'tfds':     a TFDS text corpus (data.tfds_name, e.g. 'tiny_shakespeare' or 'lm1b'), with its
              own train and validation splits;
  'prepared': a corpus tokenized once by `python -m experiments.prepare` (data.prepared: its
              folder, local or gs://), any size: nothing is tokenized at start or resume.
A 'file' or 'tfds' corpus is prepared the same way into WORKDIR/corpus on the first run
(`prepared_corpus`) and read from there after, so every source trains from memory-mapped token
shards, each process reading only the windows of its own rows (transformer_jax/corpus/).
Tokenizers (config.tokenizer.type): 'char' (sorted distinct characters of the training
text, saved as tokenizer.json), 'sentencepiece' (spm.model, trained on the training
text; documents joined with EOS), 'byte_bpe' (GPT-2's byte-level BPE with
tokenizer.vocab_size tokens, trained on the training text and saved as the Hugging Face
folder tokenizer/, which transformers.AutoTokenizer reads; documents joined with
'<|endoftext|>', as GPT-2's were) or 'hf' (a Hugging Face folder's, taken as it is: an imported
model's, documents joined with its EOS).
Continued pretraining (config.init.hf_dir, workflows/lm_init.py): a Hugging Face causal LM's
config.json replaces the model section, its tokenizer tokenizes the text ('hf') and its weights
are the params at step 0.
Packing (config.data.pack=True): every training and evaluation window also carries
'inputs_segment_ids' and 'inputs_positions' from its EOS ids (data/lm.py), so no token attends
to another document and positions restart at each one. It needs documents joined with EOS, i.e.
a subword tokenizer; a 'char' tokenizer is refused before anything is written.
"""

import math
import os
import shutil

import jax
import numpy as np
from absl import logging

from transformer_jax.cli import validation
from transformer_jax.cli.workdir import save_config
from transformer_jax.convert import families
from transformer_jax.corpus import prepare
from transformer_jax.corpus import sources as corpus_sources
from transformer_jax.corpus import tokenizers as corpus_tokenizers
from transformer_jax.corpus.reader import PreparedCorpus
from transformer_jax.data import lm as lm_data
from transformer_jax.data.hf_tokenizer import HFTokenizer
from transformer_jax.errors import ConfigError, DataError, UserError
from transformer_jax.tasks.lm import LanguageModelTask
from transformer_jax.workflows import experiment_kinds, lm_init
from transformer_jax.workflows.lm_sections import Data, LmSections, Tokenizer

CHAR_VOCAB_FILE = 'tokenizer.json'
SPM_FILE = 'spm.model'
BPE_DIR = 'tokenizer'  # a byte-level BPE: HFTokenizer.save's Hugging Face files
CORPUS_DIR = 'corpus'  # a 'file' or 'tfds' source, prepared on the first run

# -- data ---------------------------------------------------------------------------------------


def _preparation(sections: LmSections, workdir: str, tokenizer_from: str = '') -> prepare.Options:
  """How a 'file' or 'tfds' source becomes WORKDIR/corpus: the tokenizer at `tokenizer_from` (an
  imported model's), else the workdir's when it has one (a resumed run keeps its ids), else one
  trained on the training text."""
  data, tok = sections.data, sections.tokenizer
  char = tok.type == 'char'
  if not tokenizer_from and os.path.exists(_tokenizer_path(tok, workdir)):
    tokenizer_from = workdir
  common = dict(tokenizer=tok.type, unit='documents', vocab_size=tok.vocab_size,
                model_type=tok.model_type, max_sentences=tok.max_sentences,
                tokenizer_from=tokenizer_from)
  if data.source == 'file':
    if not data.path:
      raise DataError('data.path is empty: pass --config.data.path=FILE (a UTF-8 text file)')
    if not os.path.isfile(data.path):
      raise DataError(f'text file {data.path} does not exist (relative paths start from '
                      f'{os.getcwd()})')
    return prepare.Options(sources=(data.path,), documents='whole' if char else 'blank_lines',
                           train_fraction=data.train_fraction, invalid_utf8='error', **common)
  # One example, one document (empty ones too: they are an EOS), as the TFDS loader read them.
  return prepare.Options(sources=(f'tfds:{data.tfds_name}',), documents='whole',
                         text_field=data.tfds_feature, tfds_split=data.train_split,
                         tfds_valid_split=data.valid_split, tfds_data_dir=data.tfds_data_dir,
                         max_examples=data.max_train_examples,
                         max_valid_examples=data.max_valid_examples, **common)


def _tokenizer_path(tokenizer: Tokenizer, workdir: str) -> str:
  return os.path.join(workdir, corpus_tokenizers.FILE_NAMES[tokenizer.type])


def prepared_corpus(sections: LmSections, workdir: str, tokenizer_from: str = '') -> PreparedCorpus:
  """The run's prepared corpus, with its tokenizer in the workdir (`tokenizer_from`: the
  tokenizer folder a corpus prepared now takes, as `_preparation` says).

  data.source='prepared': the folder data.prepared. 'file' and 'tfds': WORKDIR/corpus, prepared
  on the first run (a small file in this process, in seconds); a later run, or a resume, finds it
  there and tokenizes nothing. The workdir's tokenizer is the corpus's: copied on the first run,
  checked against the manifest's SHA-256 after.
  """
  data = sections.data
  if data.source == 'prepared':
    corpus = PreparedCorpus(data.prepared)
  else:
    root = os.path.join(workdir, CORPUS_DIR)
    options = None
    if not _still_prepared(root, data):
      options = _preparation(sections, workdir, tokenizer_from)
      if os.path.exists(os.path.join(root, 'manifest.json')):
        logging.warning('%s was prepared from another version of the data; preparing it again',
                        root)
        shutil.rmtree(root)
      small = data.source == 'tfds' or os.path.getsize(data.path) < 2 * options.unit_bytes
      # Prepared beside and renamed into place: bad data leaves nothing in the workdir, and a
      # killed first run resumes its staging folder (its finished shards kept). One folder per
      # process: the processes of a job on one shared workdir each prepare it (as each read the
      # text before), and the first to finish puts its corpus in place for all.
      staging = f'{root}.partial-{jax.process_index()}'
      try:
        prepare.prepare(options, staging, workers=1 if small else 0)
      except UserError:
        shutil.rmtree(staging, ignore_errors=True)
        if not os.listdir(workdir):
          os.rmdir(workdir)  # this run made it
        raise
      try:
        os.replace(staging, root)
      except OSError:
        if not os.path.exists(os.path.join(root, 'manifest.json')):
          raise
        shutil.rmtree(staging, ignore_errors=True)  # another process was first
    corpus = PreparedCorpus(root)
  if corpus.unit != 'documents':
    raise DataError(f'{corpus.root} was prepared with unit=lines (BERT, T5); a language model '
                    'reads unit=documents')
  _install_tokenizer(corpus, sections.tokenizer, workdir)
  return corpus


def _still_prepared(root: str, data: Data) -> bool:
  """Whether WORKDIR/corpus holds a corpus of the configured source as it is now (the file's
  size and ends unchanged): then it is read as it is, without planning anything."""
  if not os.path.exists(os.path.join(root, 'manifest.json')):
    return False
  manifest = PreparedCorpus(root).manifest
  if data.source == 'file':
    return (os.path.isfile(data.path) and
            manifest['sources'][:1] == [corpus_sources.fingerprint(data.path)] and
            manifest['split']['train_fraction'] == data.train_fraction)
  return manifest['sources'][:1] == [{'path': f'tfds:{data.tfds_name}'}]


def _install_tokenizer(corpus: PreparedCorpus, tokenizer: Tokenizer, workdir: str):
  kind = corpus.tokenizer_kind
  # A Hugging Face folder's ids read as a byte-level BPE's (both are HFTokenizer's), or as 'hf'.
  expected = kind if tokenizer.type == 'hf' else {'hf': 'byte_bpe'}.get(kind, kind)
  if expected != tokenizer.type:
    raise ConfigError(f'{corpus.root} was tokenized with a {kind} tokenizer but '
                      f"tokenizer.type={tokenizer.type!r}; set --config.tokenizer.type={expected}")
  path = _tokenizer_path(tokenizer, workdir)
  if os.path.exists(path):
    corpus.check_tokenizer(path)
  else:
    corpus.copy_tokenizer(path)


def load_tokenizer(tokenizer: Tokenizer, workdir: str):
  """The workdir's tokenizer of tokenizer.type (`prepared_corpus` put it there on the first
  run)."""
  path = _tokenizer_path(tokenizer, workdir)
  if not os.path.exists(path):
    raise ConfigError(f'the tokenizer {path} is missing: train first')
  return corpus_tokenizers.load(tokenizer.type, path)


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
  experiment_kinds.require(config, experiment_kinds.LM)
  sections = sections_of(config)
  validation.check_training(config, sections.data.batch_size)
  return sections


def build_task(config, workdir: str, sections: LmSections | None = None):
  """(task, tokenizer) for `config` (read into `sections` unless given), the model sized to the
  tokenizer."""
  sections = sections or sections_of(config)
  tokenizer = load_tokenizer(sections.tokenizer, workdir)
  sample = sections.eval
  cfg = sections.model_config(tokenizer.vocab_size)
  if tokenizer.vocab_size > cfg.vocab_size:  # an imported model's embedding, too small for it
    raise ConfigError(f'the tokenizer in {workdir} has {tokenizer.vocab_size} tokens but the '
                      f'model\'s embedding has {cfg.vocab_size} rows (model.vocab_size)')
  task = LanguageModelTask(cfg, tokenizer=tokenizer, eos_id=lm_data.lm_eos_id(tokenizer),
                           sample_prompt=lm_data.prompt_ids(tokenizer, sample.sample_prompt),
                           sample_tokens=sample.sample_tokens, temperature=sample.temperature,
                           top_k=sample.top_k, top_p=sample.top_p, sample_seed=sections.run.seed)
  return task, tokenizer


def build(config, workdir: str, sections: LmSections | None = None):
  """(task, trainer, tokenizer) for `config`, as `build_task`."""
  # lazy: the trainer (optax, orbax) adds 0.35 s (measured) to the start-up of generate --hf_dir
  # and of lm's flag checks, which never train
  from transformer_jax.training.trainer import Trainer
  task, tokenizer = build_task(config, workdir, sections)
  return task, Trainer(config, task, workdir), tokenizer


def abstract_task(config, num_devices: int | None = None):
  """(task, {key: jax.ShapeDtypeStruct}) of one global training batch, from the config alone.

  Nothing is read and no tokenizer is built: the model has tokenizer.vocab_size entries (a
  char tokenizer sizes itself from the text; 256 covers any byte-sized alphabet). For the
  planner (`transformer_jax/planning/`); `num_devices` is unused (the batch is data.batch_size
  rows whatever the mesh), taken for the same signature as the other workflows.
  """
  del num_devices
  sections = sections_of(lm_init.planned_config(config))
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
  """Trains (or resumes) to train.num_steps; returns the trainer's final metrics.

  With init.hf_dir the run continues pretraining an imported Hugging Face model
  (workflows/lm_init.py): its model and tokenizer sections replace the config's, its tokenizer
  tokenizes the text and its weights are the params at step 0.
  """
  validate(config)
  # The import (or a resumed import's saved sections), read and checked before the first write.
  config, pretrained = lm_init.init_config(config, workdir)
  sections = validate(config)
  os.makedirs(workdir, exist_ok=True)
  with lm_init.imported_tokenizer(pretrained) as tokenizer_from:
    corpus = prepared_corpus(sections, workdir, tokenizer_from)
  task, trainer, tokenizer = build(config, workdir, sections=sections)
  save_config(config, workdir)
  train_tokens, valid_tokens = corpus.split('train'), corpus.split('valid')
  logging.info('tokens: %s train, %s validation (%s); vocabulary %d', f'{len(train_tokens):,}',
               f'{len(valid_tokens):,}', corpus.root, tokenizer.vocab_size)
  train_data, valid_batches = make_data(sections, train_tokens, valid_tokens,
                                        lm_data.lm_eos_id(tokenizer))
  state = None  # the trainer's own: a checkpoint's, or fresh
  if pretrained is not None:
    state = lm_init.start_state(trainer, train_data, pretrained)
  results = trainer.fit(train_data, lambda: iter(valid_batches), state=state)
  results['params'] = trainer.num_params()
  trainer.close()
  return results


def restore_for_inference(config, workdir: str):
  """The workdir's model for inference (`trained_model.TrainedModel`: task, params of the latest
  checkpoint, mesh, tokenizer); the params alone are read, and nothing is written."""
  # lazy: it loads the training package, trainer included (0.24 s, measured), as `build` says
  from transformer_jax.training import trained_model
  task, tokenizer = build_task(config, workdir, sections=validate(config))
  return trained_model.restore(config, task, workdir, tokenizer=tokenizer)


# -- inference: a trained workdir or an imported Hugging Face model -----------------------------


def check_lm_workdir(config, workdir: str):
  """ConfigError unless `workdir` was trained by experiments.lm (its config is a language
  model's: workflows/experiment_kinds.py) and holds a checkpoint.

  Checked before anything is read, so that a wrong workdir reads as one line.
  """
  try:
    trained_by = experiment_kinds.of_config(config)
  except ConfigError as error:
    raise ConfigError(f'{workdir} is not a language-model workdir ({error}): pass a workdir '
                      'trained by experiments.lm') from None
  if trained_by.name != experiment_kinds.LM:
    raise ConfigError(f'{workdir} is not a language-model workdir (its config has experiment '
                      f'{trained_by.name!r}, trained by {trained_by.command}): pass a workdir '
                      'trained by experiments.lm')
  checkpoints = os.path.join(workdir, 'checkpoints')
  if not os.path.isdir(checkpoints) or not any(name.isdigit() for name in os.listdir(checkpoints)):
    raise ConfigError(f'no checkpoint in {checkpoints}: train it with experiments.lm first')


def load_hf_model(directory: str):
  """(task, tokenizer, params) of the HF causal LM in `directory`, the task's EOS the
  tokenizer's."""
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
