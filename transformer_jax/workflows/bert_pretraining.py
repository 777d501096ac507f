"""BERT-family pretraining (config.mode='pretrain'): masked LM with an NSP, SOP or no sentence
head, from a config (workflows/bert.py runs it).

Documents come from local text files (blank lines separate documents, each line a sentence) or
a TFDS corpus; per tokenizer.type a WordPiece vocabulary ('wordpiece': tokenizer.vocab_file, or
trained on the training text as WORKDIR/vocab.txt) or RoBERTa's byte-level BPE ('byte_bpe':
trained on the training text, saved as HF tokenizer files in WORKDIR/tokenizer/); `Bert` with
the MLM head and, per data.sentence_task, an NSP ('nsp'), SOP ('sop') or no sentence head
('none': one-document rows; 'full_sentences': RoBERTa's rows packed across documents;
data/bert_pretrain.py describes each). data.type_vocab_size is the number of segment ids (2;
RoBERTa's 1). data.pack=True packs several complete examples into each row, with
'inputs_segment_ids' and 'inputs_positions' ('none' and 'full_sentences' only: the NSP/SOP head
reads one [CLS] per row; 'full_sentences' then keeps every example inside one document,
RoBERTa's DOC-SENTENCES without the padding).

Functions taking `config` take the ml_collections config or its bert_sections.Pretraining.
"""

import os

import jax
import numpy as np
from absl import logging

from transformer_jax.cli import validation
from transformer_jax.cli.workdir import load_saved_config, save_config
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import model_config_from_dict
from transformer_jax.workflows.bert_sections import Pretraining

VOCAB_FILE = 'vocab.txt'
TOKENIZER_DIR = 'tokenizer'  # tokenizer.type='byte_bpe': HF tokenizer files


def load_documents(config) -> tuple[list[list[str]], list[list[str]]]:
  """(training documents, held-out documents), each a list of sentence lines."""
  from transformer_jax.data import bert_pretrain
  run = Pretraining.of(config)
  data = run.data
  if data.source == 'files':
    paths = [p.strip() for p in data.paths.split(',') if p.strip()]
    if not paths:
      raise ConfigError('data.paths is empty: pass --config.data.paths=FILE[,FILE...]')
    documents = []
    for path in paths:
      documents += bert_pretrain.read_documents(path, lines_per_document=data.lines_per_document)
    return bert_pretrain.split_documents(documents, data.valid_fraction, seed=run.seed)
  from transformer_jax.data.tfds_text import load_tfds_train_valid
  train, valid = load_tfds_train_valid(data)  # data.source 'tfds' (checked on reading)
  to_docs = bert_pretrain.text_to_document
  return ([d for d in map(to_docs, train) if d], [d for d in map(to_docs, valid) if d])


def tokenizer_type(config) -> str:
  """tokenizer.type: 'wordpiece' or 'byte_bpe' ('wordpiece' in configs written before it)."""
  return Pretraining.of(config).tokenizer.type


def segment_types(config) -> int:
  """data.type_vocab_size: the segment ids of the pretrained model (2 when absent)."""
  return Pretraining.of(config).data.type_vocab_size


def pretrain_tokenizer(config, workdir: str, train_documents=None):
  """tokenizer.type 'wordpiece': tokenizer.vocab_file if set, else WORKDIR/vocab.txt;
  'byte_bpe': WORKDIR/tokenizer/ (RoBERTa's byte-level BPE). Trained on the first run."""
  t = Pretraining.of(config).tokenizer

  def texts():
    if train_documents is None:
      raise ConfigError(f'no tokenizer in {workdir}: pretrain first')
    return (line for doc in train_documents for line in doc)

  if t.type == 'byte_bpe':
    from transformer_jax.data.roberta_tokenizer import RobertaTokenizer
    return RobertaTokenizer.load_or_train(os.path.join(workdir, TOKENIZER_DIR), texts, t.vocab_size)
  from transformer_jax.data.wordpiece import WordPieceTokenizer
  if t.vocab_file:
    return WordPieceTokenizer.from_vocab(t.vocab_file, lowercase=t.lowercase)
  return WordPieceTokenizer.load_or_train(os.path.join(workdir, VOCAB_FILE), texts, t.vocab_size,
                                          lowercase=t.lowercase)


def model_sentence_task(data_task: str) -> str:
  """The `BertPretrainTask` sentence task of a data.sentence_task: the task knows only whether
  a 2-way sentence head is trained ('nsp'/'sop') or none ('none'); both single-segment inputs
  ('none', 'full_sentences') train none."""
  return 'none' if data_task == 'full_sentences' else data_task


def pretrain_model_config(config, vocab_size: int):
  return model_config_from_dict(
      Pretraining.of(config).model, vocab_size=vocab_size, num_decoder_layers=0)


def pretrain_task(config, cfg, eval_batches=()):
  """The `BertPretrainTask` of a pretraining config on the model config `cfg`."""
  from transformer_jax.tasks.bert import BertPretrainTask
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
  from transformer_jax.training.trainer import Trainer
  run = Pretraining.of(config)
  task, tokenizer = build_pretrain_task(run, workdir, tokenizer, eval_batches)
  return task, Trainer(run.config, task, workdir), tokenizer


def validate_pretrain(config) -> Pretraining:
  """Every check of a pretraining run, before anything is read or written; the config read."""
  run = Pretraining.of(config)
  cfg = pretrain_model_config(run, run.tokenizer.vocab_size)
  if run.data.max_len > cfg.max_len:
    raise ConfigError(f'data.max_len={run.data.max_len} exceeds model.max_len={cfg.max_len} '
                      '(the position table)')
  validation.check_training(run.config, run.data.batch_size)
  return run


def pretrain_options(config):
  """The `bert_pretrain.PretrainOptions` of a pretraining config."""
  from transformer_jax.data import bert_pretrain
  data = Pretraining.of(config).data
  return bert_pretrain.PretrainOptions(max_len=data.max_len, max_predictions=data.max_predictions,
                                       mask_rate=data.mask_rate, sentence_task=data.sentence_task,
                                       short_seq_prob=data.short_seq_prob, pack=data.pack)


def make_pretrain_data(config, tokenizer, train_documents, valid_documents):
  """(endless training batches, fixed held-out batches)."""
  from transformer_jax.data import bert_pretrain
  run = Pretraining.of(config)
  index, count = jax.process_index(), jax.process_count()
  options = pretrain_options(run)
  train_docs = bert_pretrain.tokenize_documents(tokenizer, train_documents)
  valid_docs = bert_pretrain.tokenize_documents(tokenizer, valid_documents)
  batch_size = run.data.batch_size
  train = bert_pretrain.PretrainBatches(train_docs, tokenizer, options, batch_size=batch_size,
                                        seed=run.seed, process_index=index, process_count=count)
  valid = bert_pretrain.PretrainBatches(valid_docs, tokenizer, options, batch_size=batch_size,
                                        seed=run.seed + 1_000_003, process_index=index,
                                        process_count=count)
  return train, [valid.batch(i) for i in range(run.data.eval_batches)]


def pretrain(config, workdir: str) -> dict:
  """Pretrains (or resumes) to train.num_steps; returns the trainer's final metrics."""
  run = validate_pretrain(config)
  train_docs, valid_docs = load_documents(run)
  os.makedirs(workdir, exist_ok=True)
  tokenizer = pretrain_tokenizer(run, workdir, train_docs)
  train_data, valid_batches = make_pretrain_data(run, tokenizer, train_docs, valid_docs)
  task, trainer, _ = build_pretrain(run, workdir, tokenizer, valid_batches)
  save_config(run.config, workdir)
  logging.info('documents: %d train (%d lines), %d held out (%d lines); vocabulary %d',
               len(train_docs), sum(map(len, train_docs)), len(valid_docs),
               sum(map(len, valid_docs)), tokenizer.vocab_size)
  results = trainer.fit(train_data, lambda: iter(valid_batches))
  results['params'] = trainer.num_params()
  trainer.close()
  return results


def restore_pretrained(workdir: str):
  """(model config, params, tokenizer) of a pretraining workdir's latest checkpoint (its
  data.type_vocab_size is `segment_types(load_saved_config(workdir))`)."""
  from transformer_jax.training import trained_model
  run = Pretraining.of(load_saved_config(workdir))
  task, tokenizer = build_pretrain_task(run, workdir)
  params = jax.device_get(trained_model.restore(run.config, task, workdir).params)
  return task.cfg, params, tokenizer


def abstract_pretrain(config):
  """(task, {key: jax.ShapeDtypeStruct}) of one global pretraining batch: the model has
  tokenizer.vocab_size entries (no vocabulary is read or trained)."""
  run = Pretraining.of(config)
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
