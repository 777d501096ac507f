"""Token classification (CoNLL-style tagging) fine-tuned from a pretrained BERT-family encoder.

The starting model is the one sentence classification fine-tunes from (init.hf_dir: a Hugging
Face encoder folder of a family of convert/families.py whose tokenizer is read; init.bert_workdir:
a pretraining workdir of ours), loaded by workflows/bert_init.py; only the head differs: `Bert`'s
per-token classifier on the final hidden states, one label per word on its first sub-word
(data/conll.py). The tag set is the training file's tags, saved as WORKDIR/labels.txt (one per
line, line i = label id i) beside the tokenizer and config.

Config (experiments/configs/conll_tagging.py): data.task='token_classification',
data.train / data.dev (CoNLL files), data.max_len, data.batch_size, init.*, model.* overrides;
read once as a bert_sections.FineTuning whose data is a TaggingData.
"""

import os

import jax
from absl import logging

from transformer_jax.cli import validation
from transformer_jax.cli.workdir import save_config
from transformer_jax.data import conll
from transformer_jax.errors import ConfigError
from transformer_jax.files import write_atomically
from transformer_jax.tasks.token_classification import TokenClassificationTask
from transformer_jax.training.trainer import Trainer
from transformer_jax.workflows import bert_init
from transformer_jax.workflows.bert_sections import TAGGING_TASK, FineTuning, TaggingData

LABELS_FILE = 'labels.txt'


def validate(config) -> FineTuning:
  """The checks that need no data or model, before anything is read or written; the config
  read (data.pack=True is refused on reading: one example per row, as in sentence
  classification)."""
  run = FineTuning.of(config)
  if not isinstance(run.data, TaggingData):
    raise ConfigError(f'data.task must be {TAGGING_TASK!r} for token classification, got '
                      f'{run.data.task!r}')
  for split, path in (('train', run.data.train), ('dev', run.data.dev)):
    if not path:
      raise ConfigError(f'data.{split} is empty: pass --config.data.{split}=FILE (CoNLL-style: '
                        'word and tag per line, blank line between sentences)')
  validation.check_training(run.config, run.data.batch_size)
  return run


def load_labels(workdir: str) -> list[str] | None:
  """The tag names a run saved in `workdir` (line i = label id i), or None."""
  path = os.path.join(workdir, LABELS_FILE)
  if not os.path.isfile(path):
    return None
  with open(path, encoding='utf-8') as f:
    return [line.rstrip('\n') for line in f if line.strip()]


def finetune(config, workdir: str) -> dict:
  """Fine-tunes (or resumes) a tagger to train.num_steps; returns the trainer's final metrics
  with 'dev_accuracy' (token accuracy over the dev words) and 'dev_accuracy_<tag>' per tag."""
  run = validate(config)
  data = run.data
  train_sentences, dev_sentences = conll.read_conll(data.train), conll.read_conll(data.dev)
  label_names = conll.tag_vocabulary(train_sentences)
  saved = load_labels(workdir)
  if saved is not None and saved != label_names:
    raise ConfigError(f'{workdir} was trained with the tags {saved}, but {data.train} has '
                      f'{label_names}: use a new --workdir')
  conll.check_tags(data.dev, dev_sentences, label_names)
  cfg, pretrained, tokenizer, type_vocab_size = bert_init.load_init(run)
  max_len = data.max_len
  if max_len > cfg.max_len:
    raise ConfigError(f'data.max_len={max_len} exceeds the model position table ({cfg.max_len})')
  train = conll.encode_sentences(tokenizer, train_sentences, label_names, max_len)
  dev = conll.encode_sentences(tokenizer, dev_sentences, label_names, max_len)
  for name, encoded in (('train', train), ('dev', dev)):
    if encoded.truncated:
      logging.warning('%s: %d of %d sentences cut to data.max_len=%d sub-words (%d words lost)',
                      name, encoded.truncated, len(encoded.rows), max_len, encoded.words_dropped)
  index, count = jax.process_index(), jax.process_count()
  batch = data.batch_size
  train_data = conll.TaggingBatches(train, batch_size=batch, max_len=max_len, seed=run.seed,
                                    process_index=index, process_count=count)
  dev_batches = conll.eval_batches(dev, batch_size=batch, max_len=max_len, process_index=index,
                                   process_count=count)
  task = TokenClassificationTask(cfg, label_names, type_vocab_size=type_vocab_size,
                                 eval_batches=dev_batches)
  os.makedirs(workdir, exist_ok=True)
  bert_init.save_tokenizer(tokenizer, workdir)
  write_atomically(os.path.join(workdir, LABELS_FILE), '\n'.join(label_names) + '\n')
  save_config(run.config, workdir)
  trainer = Trainer(run.config, task, workdir)
  logging.info('tagging: %d train sentences (%d batches per epoch), %d dev sentences; tags %s',
               len(train.rows), train_data.batches_per_epoch, len(dev.rows), label_names)
  state = trainer.init_or_restore(train_data)
  if int(jax.device_get(state.step)) == 0:
    state = bert_init.overlay_params(state, pretrained)
  results = trainer.fit(train_data, lambda: iter(dev_batches), state=state)
  results['dev_accuracy'] = results.get('eval_accuracy', float('nan'))
  for name in label_names:
    if f'eval_accuracy_{name}' in results:
      results[f'dev_accuracy_{name}'] = results[f'eval_accuracy_{name}']
  results['params'] = trainer.num_params()
  trainer.close()
  return results
