"""BERT-family fine-tuning on sentence classification (config.mode='finetune'; workflows/bert.py
runs it), from the model of config.init (workflows/bert_init.py).

SST-2-style sentences, or sentence pairs (GLUE RTE, MRPC, MNLI...): data.text_columns names two
TSV columns, or data.tfds_name a GLUE pair task; segment ids 0 and 1. Not packed: the
classifier reads each row's one [CLS] (data.pack=True is refused). Functions taking `config`
take the ml_collections config or its bert_sections.FineTuning.
"""

import os

import jax
import numpy as np
from absl import logging

from transformer_jax.cli import validation
from transformer_jax.cli.workdir import save_config
from transformer_jax.data import classification
from transformer_jax.errors import ConfigError
from transformer_jax.tasks.bert import BertClassificationTask
from transformer_jax.training.trainer import Trainer
from transformer_jax.workflows.bert_init import (init_model_config, load_init, overlay_params,
                                                 save_tokenizer)
from transformer_jax.workflows.bert_sections import ClassificationData, FineTuning


def classification_data(config) -> ClassificationData:
  """config.data of sentence (pair) classification; ConfigError for a tagging config."""
  data = FineTuning.of(config).data
  if not isinstance(data, ClassificationData):
    raise ConfigError(f'data.task={data.task} is fine-tuned by '
                      'workflows/token_classification.finetune (experiments.bert picks it)')
  return data


def load_classification_data(config) -> dict:
  data = classification_data(config)
  if data.source == 'tsv':
    if not data.dir:
      raise ConfigError('data.dir is empty: pass --config.data.dir=DIR with train.tsv and dev.tsv')
    splits = classification.load_sst2_tsv(data.dir, data.text_columns, data.label_column,
                                          data.label_names, (data.train_file, data.dev_file))
  else:  # 'tfds' (data.source is checked on reading)
    splits = classification.load_glue_tfds(data.tfds_data_dir or None, data.tfds_name)
  if data.max_train_examples:
    splits['train'] = tuple(x[:data.max_train_examples] for x in splits['train'])
  for split, (_, labels) in splits.items():
    bad = sorted({y for y in labels if not 0 <= y < data.num_labels})
    if bad:
      raise ConfigError(f'{split} labels {bad[:5]} are outside [0, data.num_labels='
                        f'{data.num_labels})')
  return splits


def is_pair_task(config) -> bool:
  """Whether examples are sentence pairs: two data.text_columns, or a TFDS GLUE pair task."""
  data = classification_data(config)
  if data.source == 'tfds':
    return len(classification.GLUE_FEATURES[classification.glue_task(data.tfds_name)]) == 2
  return len(data.text_columns) == 2


def validate_finetune(config) -> FineTuning:
  """The checks of a fine-tuning run that need no data, the config read; the pretrained
  model's position table is checked against data.max_len once it is loaded, still before
  anything is written."""
  run = FineTuning.of(config)
  data = classification_data(run)
  validation.check_training(run.config, data.batch_size)
  data.class_names()
  if data.source == 'tfds':
    classification.glue_task(data.tfds_name)
  return run


def classification_task(config, cfg, type_vocab_size: int):
  """The `BertClassificationTask` of a fine-tuning config on the model config `cfg`."""
  return BertClassificationTask(cfg,
                                classification_data(config).num_labels,
                                type_vocab_size=type_vocab_size)


def finetune(config, workdir: str) -> dict:
  """Fine-tunes a pretrained BERT on sentence classification; returns final metrics with
  'dev_accuracy' (accuracy on the whole dev split)."""
  run = validate_finetune(config)
  data = run.data
  splits = load_classification_data(run)
  cfg, pretrained, tokenizer, type_vocab_size = load_init(run)
  os.makedirs(workdir, exist_ok=True)
  max_len = data.max_len
  if max_len > cfg.max_len:
    raise ConfigError(f'data.max_len={max_len} exceeds the model position table ({cfg.max_len})')
  save_tokenizer(tokenizer, workdir)
  save_config(run.config, workdir)
  index, count = jax.process_index(), jax.process_count()
  encode = lambda split: classification.encode_examples(tokenizer, splits[split][0], max_len)
  batch = data.batch_size
  train_data = classification.ClassificationBatches(encode('train'), splits['train'][1],
                                                    batch_size=batch, max_len=max_len,
                                                    seed=run.seed, process_index=index,
                                                    process_count=count)
  dev = classification.eval_batches(encode('dev'), splits['dev'][1], batch_size=batch,
                                    max_len=max_len, process_index=index, process_count=count)
  logging.info('fine-tuning: %d train examples (%d batches per epoch), %d dev examples',
               len(splits['train'][0]), train_data.batches_per_epoch, len(splits['dev'][0]))
  task = classification_task(run, cfg, type_vocab_size)
  trainer = Trainer(run.config, task, workdir)
  state = trainer.init_or_restore(train_data)
  if int(jax.device_get(state.step)) == 0:
    state = overlay_params(state, pretrained)
  if is_pair_task(run) and type_vocab_size < 2:
    logging.warning('sentence pairs on a model with %d segment id(s): both sentences get id 0',
                    type_vocab_size)
  results = trainer.fit(train_data, lambda: iter(dev), state=state)
  results['dev_accuracy'] = results.get('eval_accuracy', float('nan'))
  results['params'] = trainer.num_params()
  trainer.close()
  return results


def abstract_finetune(config):
  """(task, {key: jax.ShapeDtypeStruct}) of one global fine-tuning batch: the model is the one
  init.hf_dir's config.json (or init.bert_workdir's saved config and vocab.txt) describes, with
  config.model's overrides; no weights are read."""
  data = classification_data(config)
  rows, length = data.batch_size, data.max_len
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)
  cfg, type_vocab_size = init_model_config(config)
  if length > cfg.max_len:
    raise ConfigError(f'data.max_len={length} exceeds the model position table ({cfg.max_len})')
  return classification_task(config, cfg, type_vocab_size), {
      'inputs': i32(rows, length), 'segments': i32(rows, length), 'labels': i32(rows),
      'weights': jax.ShapeDtypeStruct((rows,), np.float32)
  }
