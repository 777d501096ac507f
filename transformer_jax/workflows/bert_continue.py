"""Continued pretraining of a Hugging Face encoder: a pretraining config with init.hf_dir.

    python -m experiments.bert --config=experiments/configs/roberta_pretrain_small.py \
        --config.init.hf_dir=/path/to/roberta --workdir=/tmp/rp_more

The folder is read through the registry (convert/families.py): a BERT, ALBERT or RoBERTa saved
with its tokenizer. Before anything is written, the run's config is rewritten with what the
folder fixes, and saved so: config.model becomes the imported model's config (config.model keeps
only its RUNTIME_FIELDS: dropout, dtypes, remat, attention), the tokenizer section describes the
imported tokenizer (tokenizer.type 'wordpiece', 'byte_bpe' or ALBERT's 'sentencepiece', its size
and lowercasing), and data.type_vocab_size is the folder's number of segment types. The
tokenizer is copied into the workdir where a trained one would be (WORKDIR/vocab.txt or
WORKDIR/tokenizer/), and at step 0 the imported params replace the fresh ones: a head the
folder lacks (NSP, say, from a ...ForMaskedLM) starts afresh, one the run does not train is
dropped. A rerun resumes from its own checkpoints without reading the folder; restoring,
fill-mask, fine-tuning from the workdir and export read the workdir alone.

workflows/bert_pretraining.py calls these (and copies the tokenizer: the workdir's layout is
its own); functions taking `config` take the ml_collections config or its
bert_sections.Pretraining, and those that rewrite it return it read again.
"""

import dataclasses
import json
import os

import jax
import ml_collections
from absl import logging

from transformer_jax.cli.workdir import load_saved_config
from transformer_jax.convert import families
from transformer_jax.data.albert_tokenizer import AlbertTokenizer
from transformer_jax.data.bert_pretrain import PAIR_TASKS
from transformer_jax.data.roberta_tokenizer import RobertaTokenizer
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.layers import scan_layout
from transformer_jax.model_config import RUNTIME_FIELDS, model_section
from transformer_jax.workflows.bert_sections import Pretraining
from transformer_jax.workflows.params_overlay import overlay_params

# Model fields the workflow sets itself (an encoder has one vocabulary).
_LEFT_OUT = ('source_vocab_size',)


@dataclasses.dataclass
class Imported:
  """What a continued run takes from its folder at step 0: the tokenizer (copied into the
  workdir) and the params (host arrays, unrolled layers)."""
  tokenizer: object
  params: dict


def _tokenizer_type(tokenizer) -> str:
  """The tokenizer.type of an imported encoder's tokenizer."""
  if isinstance(tokenizer, RobertaTokenizer):
    return 'byte_bpe'
  if isinstance(tokenizer, AlbertTokenizer):
    return 'sentencepiece'
  return 'wordpiece'


def _copy(config):
  """An unlocked deep copy of `config` (the command line's is locked), free to take new keys."""
  return ml_collections.ConfigDict(config.copy_and_resolve_references().to_dict())


def _checkpointed(workdir: str) -> bool:
  """Whether WORKDIR/checkpoints holds a committed step (orbax names them by step), read
  without creating anything."""
  directory = os.path.join(workdir, 'checkpoints')
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def _family(hf_dir: str) -> families.Family:
  """The encoder family of init.hf_dir (reading config.json only); one ConfigError line
  naming the folder otherwise."""
  try:
    return families.of_directory(hf_dir, families.ENCODER)
  except DataError as e:
    raise ConfigError(f'init.hf_dir: {e}') from None


def _with_import(run: Pretraining, cfg, tokenizer_kind: str, tokenizer_size: int,
                 type_vocab_size: int, lowercase: bool | None = None) -> Pretraining:
  """`run` rewritten with an import's model `cfg` (config.model's RUNTIME_FIELDS kept), its
  tokenizer's type and size, and its segment types; read again."""
  task = run.data.sentence_task
  if task in PAIR_TASKS and type_vocab_size < 2 and tokenizer_kind != 'byte_bpe':
    raise ConfigError(f'init.hf_dir={run.init.hf_dir} has {type_vocab_size} segment type, but '
                      f'data.sentence_task={task!r} gives sentence B the segment id 1: set '
                      "data.sentence_task to 'none' or 'full_sentences'")
  config = _copy(run.config)
  config.model = ml_collections.ConfigDict(model_section(cfg, run.model, _LEFT_OUT))
  config.tokenizer.update(dict(type=tokenizer_kind, vocab_size=int(tokenizer_size), vocab_file=''))
  if lowercase is not None:
    config.tokenizer.lowercase = bool(lowercase)
  config.data.type_vocab_size = int(type_vocab_size)
  return Pretraining.of(config)


def _resumed(run: Pretraining, workdir: str) -> Pretraining:
  """`run` with the model, tokenizer and segment types its workdir saved (the first run took
  them from the folder); config.model's RUNTIME_FIELDS still apply."""
  saved = Pretraining.of(load_saved_config(workdir))
  if saved.init.hf_dir != run.init.hf_dir:
    logging.warning(
        'init.hf_dir=%s is not read: %s resumes from its checkpoints (an import '
        'applies at step 0 only)', run.init.hf_dir, workdir)
  config = _copy(run.config)
  config.model = _copy(saved.config.model)
  config.model.update({k: v for k, v in run.model.items() if k in RUNTIME_FIELDS})
  config.tokenizer = _copy(saved.config.tokenizer)
  config.data.type_vocab_size = saved.data.type_vocab_size
  return Pretraining.of(config)


def continued_config(config, workdir: str) -> tuple[Pretraining, Imported | None]:
  """(the run's config read, Imported) for a pretraining config with init.hf_dir: the folder's
  model, tokenizer and segment types in the config, its tokenizer and params loaded. Everything
  is read and checked here and nothing is written, so bad input leaves the workdir untouched.
  Without init.hf_dir: (the config read, None).

  A workdir with a checkpoint resumes: its saved config has the rewritten sections and nothing
  of the folder is read (Imported None).
  """
  run = Pretraining.of(config)
  if not run.init.hf_dir:
    return run, None
  if _checkpointed(workdir):
    return _resumed(run, workdir), None
  family = _family(run.init.hf_dir)
  model = family.load(run.init.hf_dir)
  if model.tokenizer is None:
    raise ConfigError(f'init.hf_dir={run.init.hf_dir} has no tokenizer this {family.name} import '
                      'reads: save it beside the model (tokenizer.save_pretrained(DIR))')
  tokenizer, heads = model.tokenizer, model.heads
  kind = _tokenizer_type(tokenizer)
  run = _with_import(run, model.config, kind, tokenizer.vocab_size, heads['type_vocab_size'],
                     tokenizer.lowercase if kind == 'wordpiece' else None)
  fresh = [
      name for name, missing in (('masked-LM', not heads.get('mlm')), (
          'sentence', run.data.sentence_task in PAIR_TASKS and not heads.get('sentence_classes')))
      if missing
  ]
  logging.info('continuing the pretraining of %s (%s): %s; %s', run.init.hf_dir, family.name,
               ', '.join(f'{k}={v}' for k, v in sorted(run.model.items())),
               f'the {" and ".join(fresh)} head(s) start afresh' if fresh else 'every head kept')
  return run, Imported(tokenizer, model.params)


def start_state(trainer, train_data, config, imported: Imported | None):
  """The trainer's state: restored from the workdir's checkpoint, or at step 0 the fresh one
  with the imported params in place (read from the folder again if the run resumed but found
  no readable checkpoint)."""
  state = trainer.init_or_restore(train_data)
  if int(jax.device_get(state.step)) == 0:
    if imported is None:
      hf_dir = Pretraining.of(config).init.hf_dir
      imported = Imported(None, _family(hf_dir).load(hf_dir).params)
    state = overlay_params(state,
                           scan_layout.for_layout(imported.params, trainer.task.cfg.scan_layers))
  return state


def planned_config(config) -> Pretraining:
  """`config` (read) with the model and segment types of init.hf_dir's config.json (the
  planner's view: no weights or tokenizer read, so the vocabulary is the embedding's);
  unchanged without init.hf_dir."""
  run = Pretraining.of(config)
  if not run.init.hf_dir:
    return run
  family = _family(run.init.hf_dir)
  with open(os.path.join(run.init.hf_dir, 'config.json'), encoding='utf-8') as f:
    cfg, types = family.converter.config_from_hf(json.load(f))
  kind = 'byte_bpe' if family.byte_level else run.tokenizer.type
  return _with_import(run, cfg, kind, cfg.vocab_size, types)
