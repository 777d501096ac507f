"""BERT experiments from a config: pretraining (MLM + NSP/SOP) and fine-tuning (classification).

`experiments/bert.py` and `benchmarks/{bert_pretrain,sst2_minilm}.py` are thin callers.

Pretraining (config.mode='pretrain'): documents from local text files (blank lines separate
documents, each line a sentence) or a TFDS corpus; per tokenizer.type a WordPiece vocabulary
('wordpiece': tokenizer.vocab_file, or trained on the training text as WORKDIR/vocab.txt) or
RoBERTa's byte-level BPE ('byte_bpe': trained on the training text, saved as HF tokenizer files
in WORKDIR/tokenizer/); `Bert` with the MLM head and, per data.sentence_task, an NSP ('nsp'),
SOP ('sop') or no sentence head ('none': one-document rows; 'full_sentences': RoBERTa's rows
packed across documents; data/bert_pretrain.py describes each). data.type_vocab_size is the
number of segment ids (2; RoBERTa's 1). data.pack=True packs several complete examples into each
row, with 'inputs_segment_ids' and 'inputs_positions' ('none' and 'full_sentences' only: the
NSP/SOP head reads one [CLS] per row; 'full_sentences' then keeps every example inside one
document, RoBERTa's DOC-SENTENCES without the padding).
Fine-tuning (config.mode='finetune'): SST-2-style sentence classification starting from an HF
checkpoint (init.hf_dir: an encoder family of convert/families.py) or a pretraining workdir
of ours (init.bert_workdir). Sentence pairs (GLUE RTE, MRPC, MNLI...): data.text_columns names
two TSV columns, or data.tfds_name a GLUE pair task; segment ids 0 and 1. Not packed: the
classifier reads each row's one [CLS] (data.pack=True is refused).

Using a trained workdir (predict, evaluate, fill_mask) is workflows/bert_use.py.
"""

import os

import flax
import jax
import numpy as np
from absl import logging

from transformer_jax.cli import validation
from transformer_jax.cli.workdir import load_saved_config, save_config
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import model_config_from_dict, with_overrides

VOCAB_FILE = 'vocab.txt'
TOKENIZER_DIR = 'tokenizer'  # tokenizer.type='byte_bpe': HF tokenizer files
TOKENIZER_TYPES = ('wordpiece', 'byte_bpe')
TRAIN_MODES = ('pretrain', 'finetune')
MODES = TRAIN_MODES + ('predict', 'evaluate', 'fill_mask')
PREDICTIONS_FILE = 'predictions.tsv'
# HF model_types fine-tuning can start from (init.hf_dir), each read by its converter.


def _process():
  return jax.process_index(), jax.process_count()


def overlay_params(state, pretrained: dict):
  """`state` with its params replaced by `pretrained` wherever that names one (each leaf put
  on the device(s) of the leaf it replaces). Heads the model lacks are dropped; any other
  unknown or mis-shaped parameter is a ConfigError naming it."""
  target = flax.traverse_util.flatten_dict(state.params)
  heads = ('mlm_transform', 'mlm_norm', 'mlm_bias', 'sentence_head', 'classifier',
           'token_classifier')
  replaced = 0
  for path, value in flax.traverse_util.flatten_dict(pretrained).items():
    name = '/'.join(path)
    if path not in target:
      if path[0] in heads:
        continue
      raise ConfigError(f'pretrained parameter {name} has no place in the model')
    if tuple(np.shape(value)) != tuple(target[path].shape):
      raise ConfigError(f'pretrained parameter {name} has shape {tuple(np.shape(value))} but the '
                        f'model has {tuple(target[path].shape)}')
    target[path] = jax.device_put(np.asarray(value, target[path].dtype), target[path].sharding)
    replaced += 1
  logging.info('initialised %d of %d parameter arrays from the pretrained model', replaced,
               len(target))
  return state.replace(params=flax.traverse_util.unflatten_dict(target))


# -- pretraining --------------------------------------------------------------------------------


def load_documents(config) -> tuple[list[list[str]], list[list[str]]]:
  """(training documents, held-out documents), each a list of sentence lines."""
  from transformer_jax.data import bert_pretrain
  data = config.data
  if data.source == 'files':
    paths = [p.strip() for p in str(data.paths).split(',') if p.strip()]
    if not paths:
      raise ConfigError('data.paths is empty: pass --config.data.paths=FILE[,FILE...]')
    documents = []
    for path in paths:
      documents += bert_pretrain.read_documents(
          path, lines_per_document=int(data.get('lines_per_document', 0)))
    return bert_pretrain.split_documents(documents, float(data.valid_fraction),
                                         seed=int(config.seed))
  if data.source == 'tfds':
    from transformer_jax.data.tfds_text import load_tfds_train_valid
    train, valid = load_tfds_train_valid(data)
    to_docs = bert_pretrain.text_to_document
    return ([d for d in map(to_docs, train) if d], [d for d in map(to_docs, valid) if d])
  raise ConfigError(f"data.source must be 'files' or 'tfds', got {data.source!r}")


def tokenizer_type(config) -> str:
  """config.tokenizer.type ('wordpiece' when absent, as in configs written before it existed)."""
  kind = config.tokenizer.get('type', 'wordpiece')
  if kind not in TOKENIZER_TYPES:
    raise ConfigError(f'tokenizer.type must be one of {TOKENIZER_TYPES}, got {kind!r}')
  return kind


def segment_types(config) -> int:
  """data.type_vocab_size: the segment ids of the pretrained model (2 when absent)."""
  return int(config.data.get('type_vocab_size', 2))


def pretrain_tokenizer(config, workdir: str, train_documents=None):
  """tokenizer.type 'wordpiece': tokenizer.vocab_file if set, else WORKDIR/vocab.txt;
  'byte_bpe': WORKDIR/tokenizer/ (RoBERTa's byte-level BPE). Trained on the first run."""
  t = config.tokenizer

  def texts():
    if train_documents is None:
      raise ConfigError(f'no tokenizer in {workdir}: pretrain first')
    return (line for doc in train_documents for line in doc)

  if tokenizer_type(config) == 'byte_bpe':
    from transformer_jax.data.roberta_tokenizer import RobertaTokenizer
    return RobertaTokenizer.load_or_train(os.path.join(workdir, TOKENIZER_DIR), texts,
                                          int(t.vocab_size))
  from transformer_jax.data.wordpiece import WordPieceTokenizer
  if t.vocab_file:
    return WordPieceTokenizer.from_vocab(t.vocab_file, lowercase=bool(t.lowercase))
  return WordPieceTokenizer.load_or_train(os.path.join(workdir, VOCAB_FILE), texts,
                                          int(t.vocab_size), lowercase=bool(t.lowercase))


def model_sentence_task(data_task: str) -> str:
  """The `BertPretrainTask` sentence task of a data.sentence_task: the task knows only whether
  a 2-way sentence head is trained ('nsp'/'sop') or none ('none'); both single-segment inputs
  ('none', 'full_sentences') train none."""
  return 'none' if data_task == 'full_sentences' else data_task


def pretrain_model_config(config, vocab_size: int):
  return model_config_from_dict(config.model, vocab_size=vocab_size, num_decoder_layers=0)


def build_pretrain(config, workdir: str, tokenizer=None, eval_batches=()):
  """(task, trainer, tokenizer) for a pretraining config; the workdir's tokenizer if none is
  given."""
  from transformer_jax.tasks.bert import BertPretrainTask
  from transformer_jax.training.trainer import Trainer
  if tokenizer is None:
    tokenizer = pretrain_tokenizer(config, workdir)
  cfg = pretrain_model_config(config, tokenizer.vocab_size)
  task = BertPretrainTask(cfg, sentence_task=model_sentence_task(config.data.sentence_task),
                          type_vocab_size=segment_types(config), eval_batches=eval_batches)
  return task, Trainer(config, task, workdir), tokenizer


def packed(config) -> bool:
  """config.data.pack (False in configs written before it existed)."""
  return bool(config.data.get('pack', False))


def _check_sentence_task(config):
  """data.sentence_task and data.type_vocab_size: known, and enough segment ids for pairs;
  data.pack only with a task without a per-row sentence label."""
  from transformer_jax.data.bert_pretrain import PAIR_TASKS, SENTENCE_TASKS
  task_name = config.data.sentence_task
  if task_name not in SENTENCE_TASKS:
    raise ConfigError(f'data.sentence_task must be one of {SENTENCE_TASKS}, got {task_name!r}')
  if packed(config) and task_name in PAIR_TASKS:
    raise ConfigError(f'data.pack=True cannot pack data.sentence_task={task_name!r}: its sentence '
                      "head reads one [CLS] per row; use sentence_task 'none' or "
                      "'full_sentences', or data.pack=False")
  types = segment_types(config)
  if types < 1:
    raise ConfigError(f'data.type_vocab_size must be at least 1, got {types}')
  # WordPiece pairs give segment B the id 1; RoBERTa's tokenizer gives every token segment 0.
  if task_name in PAIR_TASKS and types < 2 and tokenizer_type(config) == 'wordpiece':
    raise ConfigError(f"data.sentence_task={task_name!r} with WordPiece gives sentence B segment "
                      f'id 1: data.type_vocab_size must be 2, got {types}')


def validate_pretrain(config):
  """Every check of a pretraining run, before anything is read or written."""
  validation.require_keys(config, 'data', ('source', 'max_len', 'batch_size', 'max_predictions',
                                           'mask_rate', 'sentence_task', 'eval_batches'))
  tokenizer_type(config)
  _check_sentence_task(config)
  cfg = pretrain_model_config(config, int(config.tokenizer.vocab_size))
  if int(config.data.max_len) > cfg.max_len:
    raise ConfigError(f'data.max_len={config.data.max_len} exceeds model.max_len={cfg.max_len} '
                      '(the position table)')
  validation.check_training(config, int(config.data.batch_size))


def pretrain_options(config):
  """The `bert_pretrain.PretrainOptions` of a pretraining config."""
  from transformer_jax.data import bert_pretrain
  data = config.data
  short_seq_prob = float(data.get('short_seq_prob', 0.1))
  return bert_pretrain.PretrainOptions(max_len=int(data.max_len),
                                       max_predictions=int(data.max_predictions),
                                       mask_rate=float(data.mask_rate),
                                       sentence_task=data.sentence_task,
                                       short_seq_prob=short_seq_prob, pack=packed(config))


def make_pretrain_data(config, tokenizer, train_documents, valid_documents):
  """(endless training batches, fixed held-out batches)."""
  from transformer_jax.data import bert_pretrain
  data = config.data
  index, count = _process()
  options = pretrain_options(config)
  train_docs = bert_pretrain.tokenize_documents(tokenizer, train_documents)
  valid_docs = bert_pretrain.tokenize_documents(tokenizer, valid_documents)
  train = bert_pretrain.PretrainBatches(train_docs, tokenizer, options,
                                        batch_size=int(data.batch_size), seed=int(config.seed),
                                        process_index=index, process_count=count)
  valid = bert_pretrain.PretrainBatches(valid_docs, tokenizer, options,
                                        batch_size=int(data.batch_size),
                                        seed=int(config.seed) + 1_000_003, process_index=index,
                                        process_count=count)
  return train, [valid.batch(i) for i in range(int(data.eval_batches))]


def pretrain(config, workdir: str) -> dict:
  """Pretrains (or resumes) to train.num_steps; returns the trainer's final metrics."""
  validate_pretrain(config)
  train_docs, valid_docs = load_documents(config)
  os.makedirs(workdir, exist_ok=True)
  tokenizer = pretrain_tokenizer(config, workdir, train_docs)
  train_data, valid_batches = make_pretrain_data(config, tokenizer, train_docs, valid_docs)
  task, trainer, _ = build_pretrain(config, workdir, tokenizer, valid_batches)
  save_config(config, workdir)
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
  config = load_saved_config(workdir)
  _, trainer, tokenizer = build_pretrain(config, workdir)
  params = jax.device_get(trainer.restore_params())
  cfg = pretrain_model_config(config, tokenizer.vocab_size)
  trainer.close()
  return cfg, params, tokenizer


def abstract_task(config, num_devices: int | None = None):
  """(task, {key: jax.ShapeDtypeStruct}) of one global training batch, from the config alone.

  Pretraining: the model has tokenizer.vocab_size entries (no vocabulary is read or trained).
  Fine-tuning: the model is the one init.hf_dir's config.json (or init.bert_workdir's saved
  config and vocab.txt) describes, with config.model's overrides; no weights are read. Batches
  are data.batch_size rows of data.max_len tokens (the longest bucket). For the planner
  (`transformer_jax/planning/`); `num_devices` is unused, taken for the same signature as the
  other workflows.
  """
  del num_devices
  mode = config.get('mode', '')
  if mode not in TRAIN_MODES:
    raise ConfigError(f'mode must be one of {TRAIN_MODES} (config.mode), got {mode!r}')
  rows, length = int(config.data.batch_size), int(config.data.max_len)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)
  if mode == 'pretrain':
    from transformer_jax.tasks.bert import BertPretrainTask
    validation.require_keys(config, 'data',
                            ('max_len', 'batch_size', 'max_predictions', 'sentence_task'))
    _check_sentence_task(config)
    cfg = pretrain_model_config(config, int(config.tokenizer.vocab_size))
    if length > cfg.max_len:
      raise ConfigError(f'data.max_len={length} exceeds model.max_len={cfg.max_len} (the '
                        'position table)')
    task = BertPretrainTask(cfg, sentence_task=model_sentence_task(config.data.sentence_task),
                            type_vocab_size=segment_types(config))
    predictions = pretrain_options(config).row_predictions
    weights = jax.ShapeDtypeStruct((rows, predictions), np.float32)
    shapes = {
        'inputs': i32(rows, length), 'segments': i32(rows, length),
        'mlm_positions': i32(rows, predictions), 'mlm_ids': i32(rows, predictions),
        'mlm_weights': weights, 'sentence_labels': i32(rows)
    }
    if packed(config):
      shapes.update(inputs_segment_ids=i32(rows, length), inputs_positions=i32(rows, length))
    return task, shapes
  from transformer_jax.tasks.bert import BertClassificationTask
  validation.require_keys(config, 'data', ('max_len', 'batch_size', 'num_labels'))
  refuse_packed_finetuning(config)
  cfg, type_vocab_size = init_model_config(config)
  if length > cfg.max_len:
    raise ConfigError(f'data.max_len={length} exceeds the model position table ({cfg.max_len})')
  task = BertClassificationTask(cfg, int(config.data.num_labels), type_vocab_size=type_vocab_size)
  return task, {
      'inputs': i32(rows, length), 'segments': i32(rows, length), 'labels': i32(rows),
      'weights': jax.ShapeDtypeStruct((rows,), np.float32)
  }


def hf_family(hf_dir: str):
  """The encoder family (convert/families.py) of init.hf_dir if fine-tuning can start from it,
  else one ConfigError line naming it. Reads config.json only."""
  from transformer_jax.convert import families
  from transformer_jax.errors import DataError
  tunable = [f.name for f in families.FAMILIES if f.kind == families.ENCODER and f.tokenizer]
  try:
    family = families.of_directory(hf_dir)
  except DataError as e:
    raise ConfigError(f'init.hf_dir: {e}') from None
  except ConfigError:
    family = None
  if family is None or family.kind != families.ENCODER:
    model_type = families.model_type(hf_dir)
    raise ConfigError(f'init.hf_dir={hf_dir} has model_type={model_type!r}; fine-tuning starts '
                      f'from {", ".join(tunable)} checkpoints')
  if not family.tokenizer:
    name = family.name.upper()
    raise ConfigError(f'init.hf_dir={hf_dir} is an {name} checkpoint (model_type='
                      f'{families.model_type(hf_dir)!r}) whose tokenizer is not read here: {name} '
                      'fine-tuning starts from a pretraining workdir for now (set '
                      '--config.init.hf_dir= --config.init.bert_workdir=DIR)')
  return family


def init_model_config(config):
  """(model config, type_vocab_size) of the model fine-tuning starts from, weights unread."""
  import json
  init, overrides = config.init, dict(config.get('model', {}))
  if init.hf_dir:
    from_hf = hf_family(init.hf_dir).converter.config_from_hf
    with open(os.path.join(init.hf_dir, 'config.json'), encoding='utf-8') as f:
      cfg, types = from_hf(json.load(f))
    return with_overrides(cfg, overrides), types
  if init.bert_workdir:
    saved = load_saved_config(init.bert_workdir)
    if tokenizer_type(saved) == 'byte_bpe':
      from transformer_jax.data.roberta_tokenizer import RobertaTokenizer
      tokenizer_dir = os.path.join(init.bert_workdir, TOKENIZER_DIR)
      if not os.path.isfile(os.path.join(tokenizer_dir, 'tokenizer.json')):
        raise ConfigError(f'no {TOKENIZER_DIR}/tokenizer.json in {init.bert_workdir}: pretrain '
                          'first')
      vocab_size = RobertaTokenizer.from_dir(tokenizer_dir).vocab_size
    else:
      vocab_path = os.path.join(init.bert_workdir, VOCAB_FILE)
      if not os.path.isfile(vocab_path):
        raise ConfigError(f'no {VOCAB_FILE} in {init.bert_workdir}: pretrain first')
      with open(vocab_path, encoding='utf-8') as f:
        vocab_size = sum(1 for _ in f)
    cfg = pretrain_model_config(saved, vocab_size)
    return with_overrides(cfg, overrides), segment_types(saved)
  raise ConfigError('fine-tuning needs a pretrained model: set --config.init.hf_dir=DIR or '
                    '--config.init.bert_workdir=DIR')


# -- fine-tuning --------------------------------------------------------------------------------


def load_init(config):
  """(model config, pretrained params, tokenizer, type_vocab_size) from init.*."""
  init = config.init
  overrides = dict(config.get('model', {}))
  if init.hf_dir:
    model = hf_family(init.hf_dir).load(init.hf_dir)
    return (with_overrides(model.config, overrides), model.params, model.tokenizer,
            model.heads['type_vocab_size'])
  if init.bert_workdir:
    cfg, params, tokenizer = restore_pretrained(init.bert_workdir)
    types = segment_types(load_saved_config(init.bert_workdir))
    return with_overrides(cfg, overrides), params, tokenizer, types
  raise ConfigError('fine-tuning needs a pretrained model: set --config.init.hf_dir=DIR (a '
                    'Hugging Face BERT or RoBERTa directory) or --config.init.bert_workdir=DIR (a '
                    'pretraining workdir)')


def save_tokenizer(tokenizer, workdir: str) -> None:
  """The fine-tuning workdir's copy of its tokenizer: WORKDIR/vocab.txt (WordPiece) or
  WORKDIR/tokenizer/ (RoBERTa's byte-level BPE, HF files)."""
  from transformer_jax.data.roberta_tokenizer import RobertaTokenizer
  if isinstance(tokenizer, RobertaTokenizer):
    tokenizer.save(os.path.join(workdir, TOKENIZER_DIR))
  else:
    tokenizer.save(os.path.join(workdir, VOCAB_FILE))


def finetune_tokenizer(config, workdir: str):
  """The tokenizer a fine-tuning run saved in its workdir (`save_tokenizer`):
  WORKDIR/tokenizer/ (RoBERTa) or WORKDIR/vocab.txt, lowercased as its starting model's."""
  directory = os.path.join(workdir, TOKENIZER_DIR)
  if os.path.isdir(directory):
    from transformer_jax.data.roberta_tokenizer import RobertaTokenizer
    return RobertaTokenizer.from_dir(directory)
  from transformer_jax.data.wordpiece import WordPieceTokenizer
  path = os.path.join(workdir, VOCAB_FILE)
  if not os.path.isfile(path):
    raise ConfigError(f'no {VOCAB_FILE} or {TOKENIZER_DIR}/ in {workdir}: fine-tune first')
  if config.init.hf_dir:
    from transformer_jax.convert.hf_bert import tokenizer_lowercase
    lowercase = tokenizer_lowercase(config.init.hf_dir)  # as hf_bert.load reads it
  else:
    lowercase = bool(load_saved_config(config.init.bert_workdir).tokenizer.lowercase)
  return WordPieceTokenizer.from_vocab(path, lowercase=lowercase)


def load_classification_data(config) -> dict:
  from transformer_jax.data import classification
  data = config.data
  if data.source == 'tsv':
    if not data.dir:
      raise ConfigError('data.dir is empty: pass --config.data.dir=DIR with train.tsv and dev.tsv')
    splits = classification.load_sst2_tsv(
        data.dir, text_columns(config), data.get('label_column', ''), label_names(config, 0),
        (data.get('train_file', 'train.tsv'), data.get('dev_file', 'dev.tsv')))
  elif data.source == 'tfds':
    splits = classification.load_glue_tfds(data.tfds_data_dir or None, data.tfds_name)
  else:
    raise ConfigError(f"data.source must be 'tsv' or 'tfds', got {data.source!r}")
  limit = int(data.get('max_train_examples', 0))
  if limit:
    splits['train'] = tuple(x[:limit] for x in splits['train'])
  num_labels = int(data.num_labels)
  for split, (_, labels) in splits.items():
    bad = sorted({y for y in labels if not 0 <= y < num_labels})
    if bad:
      raise ConfigError(f'{split} labels {bad[:5]} are outside [0, data.num_labels={num_labels})')
  return splits


def text_columns(config) -> tuple:
  """data.text_columns: () (the one column named sentence/content/text) or 1-2 TSV columns."""
  columns = tuple(config.data.get('text_columns', ()) or ())
  if len(columns) > 2:
    raise ConfigError(f'data.text_columns={columns}: one or two columns (a sentence pair), not '
                      f'{len(columns)}')
  return columns


def is_pair_task(config) -> bool:
  """Whether examples are sentence pairs: two data.text_columns, or a TFDS GLUE pair task."""
  data = config.data
  if data.get('source') == 'tfds':
    from transformer_jax.data.classification import GLUE_FEATURES, glue_task
    return len(GLUE_FEATURES[glue_task(data.tfds_name)]) == 2
  return len(text_columns(config)) == 2


def label_names(config, num_labels: int) -> tuple[str, ...]:
  """data.label_names (also how a TSV's label names map to ids), else '0', '1', ... for
  `num_labels` classes."""
  names = tuple(str(n) for n in (config.data.get('label_names', ()) or ()))
  if names and num_labels and len(names) != num_labels:
    raise ConfigError(f'data.label_names has {len(names)} names but data.num_labels={num_labels}')
  return names or tuple(str(i) for i in range(num_labels))


def refuse_packed_finetuning(config):
  if packed(config):
    raise ConfigError('data.pack=True is for pretraining only: fine-tuning is not packed (the '
                      'classifier reads one [CLS] per row, one example per row); set '
                      'data.pack=False')


def validate_finetune(config):
  """The checks of a fine-tuning run that need no data; the pretrained model's position table
  is checked against data.max_len once it is loaded, still before anything is written."""
  refuse_packed_finetuning(config)
  validation.require_keys(config, 'data', ('source', 'max_len', 'batch_size', 'num_labels'))
  validation.require_keys(config, 'init', ('hf_dir', 'bert_workdir'))
  validation.check_training(config, int(config.data.batch_size))
  text_columns(config)
  label_names(config, int(config.data.num_labels))
  if config.data.source == 'tfds':
    from transformer_jax.data.classification import glue_task
    glue_task(config.data.tfds_name)


def finetune(config, workdir: str) -> dict:
  """Fine-tunes a pretrained BERT on sentence classification; returns final metrics with
  'dev_accuracy' (accuracy on the whole dev split)."""
  from transformer_jax.data import classification
  from transformer_jax.tasks.bert import BertClassificationTask
  from transformer_jax.training.trainer import Trainer
  validate_finetune(config)
  splits = load_classification_data(config)
  cfg, pretrained, tokenizer, type_vocab_size = load_init(config)
  os.makedirs(workdir, exist_ok=True)
  max_len = int(config.data.max_len)
  if max_len > cfg.max_len:
    raise ConfigError(f'data.max_len={max_len} exceeds the model position table ({cfg.max_len})')
  save_tokenizer(tokenizer, workdir)
  save_config(config, workdir)
  index, count = _process()
  encode = lambda split: classification.encode_examples(tokenizer, splits[split][0], max_len)
  batch = int(config.data.batch_size)
  train_data = classification.ClassificationBatches(encode('train'), splits['train'][1],
                                                    batch_size=batch, max_len=max_len,
                                                    seed=int(config.seed), process_index=index,
                                                    process_count=count)
  dev = classification.eval_batches(encode('dev'), splits['dev'][1], batch_size=batch,
                                    max_len=max_len, process_index=index, process_count=count)
  logging.info('fine-tuning: %d train examples (%d batches per epoch), %d dev examples',
               len(splits['train'][0]), train_data.batches_per_epoch, len(splits['dev'][0]))
  task = BertClassificationTask(cfg, int(config.data.num_labels), type_vocab_size=type_vocab_size)
  trainer = Trainer(config, task, workdir)
  state = trainer.init_or_restore(train_data)
  if int(jax.device_get(state.step)) == 0:
    state = overlay_params(state, pretrained)
  if is_pair_task(config) and type_vocab_size < 2:
    logging.warning('sentence pairs on a model with %d segment id(s): both sentences get id 0',
                    type_vocab_size)
  results = trainer.fit(train_data, lambda: iter(dev), state=state)
  results['dev_accuracy'] = results.get('eval_accuracy', float('nan'))
  results['params'] = trainer.num_params()
  trainer.close()
  return results


def train_mode(config, mode: str = '') -> str:
  """The training mode: `mode` (--mode) if given, else config.mode; one of TRAIN_MODES."""
  mode = mode or config.get('mode', '')
  if mode not in TRAIN_MODES:
    raise ConfigError(f'mode must be one of {TRAIN_MODES} (--mode or config.mode), got {mode!r}')
  return mode


def run(config, workdir: str, mode: str = '') -> dict:
  """Pretrains, or fine-tunes on sentence classification, per `mode` or config.mode.

  A tagging config (data.task='token_classification') is refused: workflows/
  token_classification.py fine-tunes it with this module's functions, so this module cannot
  call it; experiments/bert.py, above both, picks between them.
  """
  mode = train_mode(config, mode)
  if mode == 'pretrain':
    return pretrain(config, workdir)
  if config.data.get('task', '') == 'token_classification':
    raise ConfigError('data.task=token_classification is fine-tuned by '
                      'workflows/token_classification.finetune (experiments.bert picks it)')
  return finetune(config, workdir)
