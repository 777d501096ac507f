"""BERT-family pretraining (config.mode='pretrain'): masked LM with an NSP, SOP or no sentence
head, from a config (workflows/bert.py runs it).

Documents come from local text files (blank lines separate documents, each line a sentence) or
a TFDS corpus, read and tokenized at every start; per tokenizer.type a WordPiece vocabulary
('wordpiece': tokenizer.vocab_file, or trained on the training text as WORKDIR/vocab.txt) or
RoBERTa's byte-level BPE ('byte_bpe': trained on the training text, saved as HF tokenizer files
in WORKDIR/tokenizer/). Or, for a corpus of any size, data.source='prepared': the folder
data.prepared of `python -m experiments.prepare --unit=lines` (local or an fsspec URL), whose
token shards are read as rows are fed (`prepared_documents`): nothing is tokenized at start or
resume, and what start-up holds grows by an int64 per line, not a Python object. Its tokenizer
(kind 'wordpiece' for tokenizer.type 'wordpiece', 'roberta_bpe' for 'byte_bpe') is copied into
the workdir on the first run and checked against the corpus's on every later one. `Bert` with
the MLM head and, per data.sentence_task, an NSP ('nsp'), SOP ('sop') or no sentence head
('none': one-document rows; 'full_sentences': RoBERTa's rows packed across documents;
data/bert_pretrain.py describes each). data.type_vocab_size is the number of segment ids (2;
RoBERTa's 1). data.pack=True packs several complete examples into each row, with
'inputs_segment_ids' and 'inputs_positions' ('none' and 'full_sentences' only: the NSP/SOP head
reads one [CLS] per row; 'full_sentences' then keeps every example inside one document,
RoBERTa's DOC-SENTENCES without the padding).

init.hf_dir continues the pretraining of a Hugging Face BERT, ALBERT or RoBERTa instead: its
model, its tokenizer (copied into the workdir, never trained) and, at step 0, its params
(workflows/bert_continue.py).

Functions taking `config` take the ml_collections config or its bert_sections.Pretraining.
"""

import os

import jax
import numpy as np
from absl import logging

from transformer_jax.cli import validation
from transformer_jax.cli.workdir import load_saved_config, save_config
from transformer_jax.corpus.reader import PreparedCorpus
from transformer_jax.data import albert_tokenizer, bert_pretrain
from transformer_jax.data.roberta_tokenizer import RobertaTokenizer
from transformer_jax.data.tfds_text import load_tfds_train_valid
from transformer_jax.data.wordpiece import WordPieceTokenizer
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.model_config import model_config_from_dict
from transformer_jax.workflows import bert_continue
from transformer_jax.tasks.bert import BertPretrainTask
from transformer_jax.training import trained_model
from transformer_jax.training.trainer import Trainer
from transformer_jax.workflows.bert_sections import Pretraining

VOCAB_FILE = 'vocab.txt'
TOKENIZER_DIR = 'tokenizer'  # tokenizer.type='byte_bpe': HF tokenizer files
# tokenizer.type -> the kind of tokenizer a prepared corpus for it was tokenized with
# (transformer_jax/corpus/tokenizers.py); the files are the same as the workdir's.
CORPUS_TOKENIZERS = {'wordpiece': 'wordpiece', 'byte_bpe': 'roberta_bpe'}


def load_documents(config) -> tuple[list[list[str]], list[list[str]]]:
  """(training documents, held-out documents), each a list of sentence lines ('files' and
  'tfds'; a prepared corpus has ids, not text: `prepared_documents`)."""
  run = Pretraining.of(config)
  data = run.data
  if data.source == 'prepared':
    raise ConfigError(f'data.source=\'prepared\' ({data.prepared}) holds token ids, not text '
                      'documents: read it with prepared_documents')
  if data.source == 'files':
    paths = [p.strip() for p in data.paths.split(',') if p.strip()]
    if not paths:
      raise ConfigError('data.paths is empty: pass --config.data.paths=FILE[,FILE...]')
    documents = []
    for path in paths:
      documents += bert_pretrain.read_documents(path, lines_per_document=data.lines_per_document)
    return bert_pretrain.split_documents(documents, data.valid_fraction, seed=run.seed)
  train, valid = load_tfds_train_valid(data)  # data.source 'tfds' (checked on reading)
  to_docs = bert_pretrain.text_to_document
  return ([d for d in map(to_docs, train) if d], [d for d in map(to_docs, valid) if d])


def open_prepared(config):
  """The `PreparedCorpus` of data.source='prepared' (its manifest read, nothing else), refused
  with one line unless its sentence lines were tokenized by the tokenizer tokenizer.type
  names."""
  run = Pretraining.of(config)
  corpus = PreparedCorpus(run.data.prepared)
  kind, wanted = corpus.tokenizer_kind, CORPUS_TOKENIZERS[run.tokenizer.type]
  if kind != wanted:
    fits = [t for t, k in CORPUS_TOKENIZERS.items() if k == kind]
    fix = (f'set --config.tokenizer.type={fits[0]}'
           if fits else 'prepare it with --tokenizer=wordpiece or --tokenizer=roberta_bpe')
    raise ConfigError(f'{corpus.root} was tokenized with a {kind} tokenizer, but '
                      f'tokenizer.type={run.tokenizer.type!r} reads a {wanted} corpus: {fix}')
  if corpus.unit != 'lines':
    raise DataError(f'{corpus.root} was prepared with --unit={corpus.unit}: BERT pretraining '
                    'reads sentence lines; prepare it with --unit=lines')
  lowercase = corpus.manifest['tokenizer'].get('lowercase', True)
  if kind == 'wordpiece' and lowercase != run.tokenizer.lowercase:
    raise ConfigError(f'{corpus.root} was tokenized with lowercase={lowercase} but '
                      f'tokenizer.lowercase={run.tokenizer.lowercase}: the workdir\'s tokenizer '
                      f'would encode text otherwise; set --config.tokenizer.lowercase={lowercase}')
  return corpus


def prepared_documents(corpus, held_out: bool = True):
  """(training documents, held-out documents) of a prepared corpus: `Documents` views of its
  'train' and 'valid' splits (each line read from the shards when a row takes it); without
  `held_out` (data.eval_batches=0) none are held out ([])."""
  train, valid = corpus.split('train'), corpus.split('valid')
  if not train.num_documents:
    raise DataError(f'{corpus.root} has no training documents')
  if not held_out:
    return train.documents(), []
  if not valid.num_documents:
    raise DataError(f'{corpus.root} has no held-out documents to evaluate on: prepare it with '
                    '--valid_fraction (or --valid_sources, --tfds_valid_split), or set '
                    'data.eval_batches=0')
  return train.documents(), valid.documents()


def install_corpus_tokenizer(corpus, config, workdir: str):
  """The corpus's tokenizer as the workdir's (WORKDIR/vocab.txt or WORKDIR/tokenizer/): copied
  on the first run; after, the workdir's must be the one the ids came from (one error line)."""
  name = TOKENIZER_DIR if Pretraining.of(config).tokenizer.type == 'byte_bpe' else VOCAB_FILE
  path = os.path.join(workdir, name)
  if not os.path.exists(path):
    try:
      corpus.copy_tokenizer(path)
      logging.info('tokenizer: %s copied from %s', path, corpus.root)
      return
    except OSError:  # another process of this run copied it first: check that one
      if not os.path.exists(path):
        raise
  corpus.check_tokenizer(path)


def tokenizer_type(config) -> str:
  """tokenizer.type: 'wordpiece' or 'byte_bpe' ('wordpiece' in configs written before it)."""
  return Pretraining.of(config).tokenizer.type


def segment_types(config) -> int:
  """data.type_vocab_size: the segment ids of the pretrained model (2 when absent)."""
  return Pretraining.of(config).data.type_vocab_size


def pretrain_tokenizer(config, workdir: str, train_documents=None):
  """tokenizer.type 'wordpiece': tokenizer.vocab_file if set, else WORKDIR/vocab.txt;
  'byte_bpe': WORKDIR/tokenizer/ (RoBERTa's byte-level BPE). Trained on the first run, unless
  the run continues an import (init.hf_dir), whose tokenizer is copied there first; ALBERT's
  ('sentencepiece', WORKDIR/tokenizer/) only comes so."""
  t = Pretraining.of(config).tokenizer

  def texts():
    if train_documents is None:
      raise ConfigError(f'no tokenizer in {workdir}: pretrain first')
    return (line for doc in train_documents for line in doc)

  if t.type == 'sentencepiece':
    directory = os.path.join(workdir, TOKENIZER_DIR)
    if not albert_tokenizer.is_saved_here(directory):
      raise ConfigError(f'no ALBERT tokenizer in {directory}: a run continuing an import copies '
                        'it there before its first step; rerun its training command')
    return albert_tokenizer.AlbertTokenizer.from_dir(directory)
  if t.type == 'byte_bpe':
    return RobertaTokenizer.load_or_train(os.path.join(workdir, TOKENIZER_DIR), texts, t.vocab_size)
  if t.vocab_file:
    return WordPieceTokenizer.from_vocab(t.vocab_file, lowercase=t.lowercase)
  return WordPieceTokenizer.load_or_train(os.path.join(workdir, VOCAB_FILE), texts, t.vocab_size,
                                          lowercase=t.lowercase)


def save_tokenizer(tokenizer, workdir: str) -> None:
  """The workdir's copy of a tokenizer it did not train (an import's, or that of the model a
  fine-tuning run starts from), where `pretrain_tokenizer` and fine-tuning read theirs:
  WORKDIR/vocab.txt (WordPiece) or WORKDIR/tokenizer/ (RoBERTa's byte-level BPE or ALBERT's
  SentencePiece, HF files)."""
  if isinstance(tokenizer, (RobertaTokenizer, albert_tokenizer.AlbertTokenizer)):
    tokenizer.save(os.path.join(workdir, TOKENIZER_DIR))
  else:
    tokenizer.save(os.path.join(workdir, VOCAB_FILE))


def model_sentence_task(data_task: str) -> str:
  """The `BertPretrainTask` sentence task of a data.sentence_task: the task knows only whether
  a 2-way sentence head is trained ('nsp'/'sop') or none ('none'); both single-segment inputs
  ('none', 'full_sentences') train none."""
  return 'none' if data_task == 'full_sentences' else data_task


def pretrain_model_config(config, vocab_size: int):
  """The model for a tokenizer of `vocab_size` ids, or, continuing an import (init.hf_dir, its
  config in config.model), the import's: its embedding may have rows the tokenizer lacks."""
  run = Pretraining.of(config)
  if run.init.hf_dir and 'vocab_size' in run.model:
    vocab_size = int(run.model['vocab_size'])
  return model_config_from_dict(run.model, vocab_size=vocab_size, num_decoder_layers=0)


def pretrain_task(config, cfg, eval_batches=()):
  """The `BertPretrainTask` of a pretraining config on the model config `cfg`."""
  data = Pretraining.of(config).data
  return BertPretrainTask(cfg, sentence_task=model_sentence_task(data.sentence_task),
                          type_vocab_size=data.type_vocab_size, eval_batches=eval_batches)


def build_pretrain_task(config, workdir: str, tokenizer=None, eval_batches=()):
  """(task, tokenizer) for a pretraining config; the workdir's tokenizer if none is given."""
  run = Pretraining.of(config)
  if tokenizer is None:
    tokenizer = pretrain_tokenizer(run, workdir)
  return pretrain_task(run, pretrain_model_config(run, tokenizer.vocab_size),
                       eval_batches), tokenizer


def build_pretrain(config, workdir: str, tokenizer=None, eval_batches=()):
  """(task, trainer, tokenizer) for a pretraining config, as `build_pretrain_task`."""
  run = Pretraining.of(config)
  task, tokenizer = build_pretrain_task(run, workdir, tokenizer, eval_batches)
  return task, Trainer(run.config, task, workdir), tokenizer


def validate_pretrain(config) -> Pretraining:
  """Every check of a pretraining run, before anything is read or written; the config read
  (one continuing an import: once rewritten by bert_continue.continued_config)."""
  run = Pretraining.of(config)
  cfg = pretrain_model_config(run, run.tokenizer.vocab_size)
  if run.data.max_len > cfg.max_len:
    raise ConfigError(f'data.max_len={run.data.max_len} exceeds model.max_len={cfg.max_len} '
                      '(the position table)')
  if run.tokenizer.vocab_size > cfg.vocab_size:
    raise ConfigError(f'the tokenizer has {run.tokenizer.vocab_size} ids but the model\'s '
                      f'embedding has {cfg.vocab_size} rows')
  validation.check_training(run.config, run.data.batch_size)
  return run


def pretrain_options(config):
  """The `bert_pretrain.PretrainOptions` of a pretraining config."""
  data = Pretraining.of(config).data
  return bert_pretrain.PretrainOptions(max_len=data.max_len, max_predictions=data.max_predictions,
                                       mask_rate=data.mask_rate, sentence_task=data.sentence_task,
                                       short_seq_prob=data.short_seq_prob, pack=data.pack)


def make_pretrain_data(config, tokenizer, train_documents, valid_documents):
  """(endless training batches, fixed held-out batches). The documents are text ('files',
  'tfds': tokenized here), or with data.source='prepared' the `prepared_documents` views, read
  from the shards as rows are fed."""
  run = Pretraining.of(config)
  index, count = jax.process_index(), jax.process_count()
  options = pretrain_options(run)
  if run.data.source == 'prepared':
    train_docs, valid_docs = train_documents, valid_documents
  else:
    train_docs = bert_pretrain.tokenize_documents(tokenizer, train_documents)
    valid_docs = bert_pretrain.tokenize_documents(tokenizer, valid_documents)
  batch_size = run.data.batch_size
  train = bert_pretrain.PretrainBatches(train_docs, tokenizer, options, batch_size=batch_size,
                                        seed=run.seed, process_index=index, process_count=count)
  if not run.data.eval_batches:
    return train, []
  valid = bert_pretrain.PretrainBatches(valid_docs, tokenizer, options, batch_size=batch_size,
                                        seed=run.seed + 1_000_003, process_index=index,
                                        process_count=count)
  return train, [valid.batch(i) for i in range(run.data.eval_batches)]


def pretrain(config, workdir: str) -> dict:
  """Pretrains (or resumes) to train.num_steps, from scratch or continuing an import
  (init.hf_dir: workflows/bert_continue.py); returns the trainer's final metrics."""
  run, imported = bert_continue.continued_config(config, workdir)  # the folder read, if any
  run = validate_pretrain(run)
  if run.data.source == 'prepared':
    corpus = open_prepared(run)
    train_docs, valid_docs = prepared_documents(corpus, held_out=run.data.eval_batches > 0)
    os.makedirs(workdir, exist_ok=True)
    install_corpus_tokenizer(corpus, run, workdir)
    tokenizer = pretrain_tokenizer(run, workdir)
  else:
    train_docs, valid_docs = load_documents(run)
    os.makedirs(workdir, exist_ok=True)
    if imported is not None:  # continuing an import: its tokenizer, never trained here
      save_tokenizer(imported.tokenizer, workdir)
    tokenizer = pretrain_tokenizer(run, workdir, train_docs)
  train_data, valid_batches = make_pretrain_data(run, tokenizer, train_docs, valid_docs)
  task, trainer, _ = build_pretrain(run, workdir, tokenizer, valid_batches)
  save_config(run.config, workdir)
  logging.info('documents: %d train (%d lines), %d held out (%d lines); vocabulary %d',
               len(train_docs), _lines(train_docs), len(valid_docs), _lines(valid_docs),
               tokenizer.vocab_size)
  state = None  # the trainer's own: a checkpoint's, or fresh
  if run.init.hf_dir:
    state = bert_continue.start_state(trainer, train_data, run, imported)
  results = trainer.fit(train_data, lambda: iter(valid_batches), state=state)
  results['params'] = trainer.num_params()
  trainer.close()
  return results


def _lines(documents) -> int:
  """Lines of a list of documents or of a `Documents` view (without visiting its documents)."""
  return documents.num_lines if hasattr(documents, 'num_lines') else sum(map(len, documents))


def restore_pretrained(workdir: str):
  """(model config, params, tokenizer) of a pretraining workdir's latest checkpoint (its
  data.type_vocab_size is `segment_types(load_saved_config(workdir))`)."""
  run = Pretraining.of(load_saved_config(workdir))
  task, tokenizer = build_pretrain_task(run, workdir)
  params = jax.device_get(trained_model.restore(run.config, task, workdir).params)
  return task.cfg, params, tokenizer


def abstract_pretrain(config):
  """(task, {key: jax.ShapeDtypeStruct}) of one global pretraining batch: the model has
  tokenizer.vocab_size entries (no vocabulary is read or trained), or continuing an import,
  the one its config.json describes (no weights read)."""
  run = bert_continue.planned_config(config)  # init.hf_dir: its config.json's model
  rows, length = run.data.batch_size, run.data.max_len
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)
  cfg = pretrain_model_config(run, run.tokenizer.vocab_size)
  if length > cfg.max_len:
    raise ConfigError(f'data.max_len={length} exceeds model.max_len={cfg.max_len} (the '
                      'position table)')
  predictions = pretrain_options(run).row_predictions
  shapes = {
      'inputs': i32(rows, length), 'segments': i32(rows,
                                                   length), 'mlm_positions': i32(rows, predictions),
      'mlm_ids': i32(rows, predictions), 'mlm_weights': jax.ShapeDtypeStruct(
          (rows, predictions), np.float32), 'sentence_labels': i32(rows)
  }
  if run.data.pack:
    shapes.update(inputs_segment_ids=i32(rows, length), inputs_positions=i32(rows, length))
  return pretrain_task(run, cfg), shapes
