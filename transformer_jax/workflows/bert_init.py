"""The pretrained model BERT-family fine-tuning starts from (config.init): a Hugging Face
encoder directory (init.hf_dir: a family of convert/families.py whose tokenizer is read here)
or a pretraining workdir of ours (init.bert_workdir), with config.model's overrides of its
config; and the tokenizer a fine-tuning workdir keeps of it (written by
bert_pretraining.save_tokenizer, read back by `finetune_tokenizer`).

Sentence classification (workflows/bert_finetuning.py) and token classification
(workflows/token_classification.py) both start here. Functions taking `config` take the
ml_collections config or its bert_sections.FineTuning.
"""

import json
import os

from transformer_jax.cli.workdir import load_saved_config
from transformer_jax.convert import families
from transformer_jax.data import albert_tokenizer
from transformer_jax.data.hf_tokenizer import tokenizer_lowercase
from transformer_jax.data.roberta_tokenizer import RobertaTokenizer
from transformer_jax.data.wordpiece import WordPieceTokenizer
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.model_config import with_overrides
# overlay_params and save_tokenizer: what fine-tuning does with what it starts from, named here
# for the fine-tuning workflows (bert_finetuning.py, token_classification.py).
from transformer_jax.workflows.bert_pretraining import (  # noqa: F401
    TOKENIZER_DIR, VOCAB_FILE, pretrain_model_config, restore_pretrained, save_tokenizer)
from transformer_jax.workflows.params_overlay import overlay_params  # noqa: F401
from transformer_jax.workflows.bert_sections import FineTuning, Pretraining


def hf_family(hf_dir: str):
  """The encoder family (convert/families.py) of init.hf_dir if fine-tuning can start from it,
  else one ConfigError line naming it. Reads config.json only."""
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
  run = FineTuning.of(config)
  init = run.init
  if init.hf_dir:
    from_hf = hf_family(init.hf_dir).converter.config_from_hf
    with open(os.path.join(init.hf_dir, 'config.json'), encoding='utf-8') as f:
      cfg, types = from_hf(json.load(f))
    return with_overrides(cfg, run.model), types
  if init.bert_workdir:
    saved = Pretraining.of(load_saved_config(init.bert_workdir))
    if saved.tokenizer.type == 'sentencepiece':  # continued from an imported ALBERT
      tokenizer_dir = os.path.join(init.bert_workdir, TOKENIZER_DIR)
      if not albert_tokenizer.is_saved_here(tokenizer_dir):
        raise ConfigError(f'no ALBERT tokenizer in {tokenizer_dir}: pretrain first')
      vocab_size = albert_tokenizer.AlbertTokenizer.from_dir(tokenizer_dir).vocab_size
    elif saved.tokenizer.type == 'byte_bpe':
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
    return with_overrides(cfg, run.model), saved.data.type_vocab_size
  raise ConfigError('fine-tuning needs a pretrained model: set --config.init.hf_dir=DIR or '
                    '--config.init.bert_workdir=DIR')


def load_init(config):
  """(model config, pretrained params, tokenizer, type_vocab_size) from init.*."""
  run = FineTuning.of(config)
  init = run.init
  if init.hf_dir:
    family = hf_family(init.hf_dir)
    model = family.load(init.hf_dir)
    if model.tokenizer is None:
      raise ConfigError(f'init.hf_dir={init.hf_dir} has no tokenizer this {family.name} import '
                        'reads: save it beside the model (tokenizer.save_pretrained(DIR))')
    return (with_overrides(model.config, run.model), model.params, model.tokenizer,
            model.heads['type_vocab_size'])
  if init.bert_workdir:
    cfg, params, tokenizer = restore_pretrained(init.bert_workdir)
    types = Pretraining.of(load_saved_config(init.bert_workdir)).data.type_vocab_size
    return with_overrides(cfg, run.model), params, tokenizer, types
  raise ConfigError('fine-tuning needs a pretrained model: set --config.init.hf_dir=DIR (a '
                    'Hugging Face BERT or RoBERTa directory) or --config.init.bert_workdir=DIR (a '
                    'pretraining workdir)')


def finetune_tokenizer(config, workdir: str):
  """The tokenizer a fine-tuning run saved in its workdir (`save_tokenizer`):
  WORKDIR/tokenizer/ (RoBERTa's or ALBERT's, told apart by its tokenizer_config.json) or
  WORKDIR/vocab.txt, lowercased as its starting model's."""
  directory = os.path.join(workdir, TOKENIZER_DIR)
  if os.path.isdir(directory):
    if albert_tokenizer.is_saved_here(directory):
      return albert_tokenizer.AlbertTokenizer.from_dir(directory)
    return RobertaTokenizer.from_dir(directory)
  path = os.path.join(workdir, VOCAB_FILE)
  if not os.path.isfile(path):
    raise ConfigError(f'no {VOCAB_FILE} or {TOKENIZER_DIR}/ in {workdir}: fine-tune first')
  init = FineTuning.of(config).init
  if init.hf_dir:
    lowercase = tokenizer_lowercase(init.hf_dir)  # as the WordPiece family's load reads it
  else:
    lowercase = Pretraining.of(load_saved_config(init.bert_workdir)).tokenizer.lowercase
  return WordPieceTokenizer.from_vocab(path, lowercase=lowercase)
