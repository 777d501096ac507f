"""Continued pretraining of a Hugging Face causal LM in the language-model workflow (init.hf_dir).

init.hf_dir=D: D is a Hugging Face folder of a causal family of the registry (GPT-2, LLaMA, OPT:
convert/families.py), with its tokenizer. Its config.json gives the model: the run's model
section becomes the imported one (vocab_size and max_len included), and config.model keeps only
RUNTIME_FIELDS (dropout, dtypes, memory switches: how the run trains, not what it trains). Its
tokenizer tokenizes the training text: the corpus is prepared with it, and the workdir keeps the
corpus's copy in WORKDIR/tokenizer/ (tokenizer.type 'hf'), so every later mode reads its ids. Its
weights replace the fresh params at step 0 only: a rerun resumes from its own checkpoints without
reading D again, and the saved config holds the resolved sections, so generate, evaluate and
export need nothing but the workdir.

workflows/lm.py calls these: `init_config` first (everything read and checked before anything
is written), then `imported_tokenizer` for the corpus, then `start_state` once the trainer
exists. No family is named here: the registry finds D's (`families.of_directory`) and loads it
(`Family.load`).
"""

import contextlib
import dataclasses
import os
import tempfile

import jax
import ml_collections
from absl import logging

from transformer_jax.cli.workdir import CONFIG_FILE, load_saved_config
from transformer_jax.convert import families
from transformer_jax.corpus import tokenizers as corpus_tokenizers
from transformer_jax.data.hf_tokenizer import HFTokenizer
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.files import read_json_object
from transformer_jax.layers import scan_layout
from transformer_jax.model_config import RUNTIME_FIELDS, TransformerConfig, model_section
from transformer_jax.sections import section_of
from transformer_jax.workflows.lm_sections import Data, Init
from transformer_jax.workflows.params_overlay import overlay_params, require_same_parameters

# The tokenizer.type of a run that continues an imported model: its folder, taken as it is.
TOKENIZER_TYPE = 'hf'


@dataclasses.dataclass
class Pretrained:
  """The imported model a run starts from: its folder, its tokenizer and params (host arrays;
  None when the run resumes, the params then read again by `start_state` should it start from
  step 0 after all)."""
  hf_dir: str
  tokenizer: HFTokenizer | None = None
  params: dict | None = None


def _checkpoint_steps(workdir: str) -> list[int]:
  """Committed checkpoint steps in WORKDIR/checkpoints (orbax names them by step), read without
  creating anything."""
  directory = os.path.join(workdir, 'checkpoints')
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def hf_family(hf_dir: str) -> families.Family:
  """The causal family of init.hf_dir (reading config.json only), or one ConfigError line."""
  causal = ', '.join(families.names(families.CAUSAL_LM))
  if not os.path.isdir(hf_dir):
    raise ConfigError(f'init.hf_dir {hf_dir} does not exist: give a Hugging Face causal LM folder '
                      f'({causal}: config.json, weights and tokenizer files)')
  try:
    family = families.of_directory(hf_dir)
  except DataError as error:  # no config.json
    raise ConfigError(f'init.hf_dir: {error}') from None
  except ConfigError:
    family = None
  if family is None or family.kind != families.CAUSAL_LM:
    raise ConfigError(f'init.hf_dir {hf_dir} has model_type={families.model_type(hf_dir)!r}; '
                      f'experiments.lm continues pretraining a causal LM ({causal})')
  return family


def imported_model_section(cfg: TransformerConfig, runtime) -> dict:
  """config.model for the imported `cfg` (every field, dtypes by name, vocab_size and max_len
  included), the RUNTIME_FIELDS that `runtime` (the run's config.model) sets replacing its own."""
  return dict(model_section(cfg, runtime, leave_out=('source_vocab_size',)), num_encoder_layers=0)


def _copy(config) -> ml_collections.ConfigDict:
  """An unlocked deep copy of `config` (the command line's is locked), free to take new keys."""
  return ml_collections.ConfigDict(config.copy_and_resolve_references().to_dict())


def _log_replaced(config, section: dict, hf_dir: str, family: str):
  """Says that the import's model replaces config.model's, which of the config's fields it
  changed and which the run keeps."""
  ours = dict(config.model)
  replaced = [
      f'{k} {ours[k]!r} -> {v!r}' for k, v in sorted(section.items())
      if k in ours and k not in RUNTIME_FIELDS and ours[k] != v
  ]
  kept = [f'{k}={section[k]!r}' for k in RUNTIME_FIELDS if k in ours]
  logging.info(
      'init.hf_dir=%s (%s): the model section is the imported model\'s, not the config\'s '
      '(%d layers, width %d, %d heads, vocabulary %d, context %d); config.model changed: %s; '
      'kept from config.model: %s', hf_dir, family, section['num_decoder_layers'],
      section['emb_dim'], section['num_heads'], section['vocab_size'], section['max_len'],
      ', '.join(replaced) or 'nothing', ', '.join(kept) or 'nothing')


def _imported_config(config, hf_dir: str) -> tuple[ml_collections.ConfigDict, Pretrained]:
  """`config` with the model and tokenizer sections of the import in `hf_dir`, and the import."""
  family = hf_family(hf_dir)
  data = section_of(config, 'data', Data)
  if data.source == 'prepared':
    raise ConfigError("init.hf_dir tokenizes the training text with the imported tokenizer, and "
                      "a prepared corpus holds ids of its own: use data.source='file' or 'tfds'")
  try:
    tokenizer = HFTokenizer.from_dir(hf_dir)
  except DataError as error:
    raise ConfigError(f'init.hf_dir: {error}; save the tokenizer beside the model '
                      '(tokenizer.save_pretrained(DIR))') from None
  imported = family.load(hf_dir)
  cfg = imported.config
  # Ids past the embedding would index out of it (jnp.take clamps: silently wrong tokens). A
  # smaller tokenizer is fine: models often round their embedding up.
  if tokenizer.vocab_size > cfg.vocab_size:
    raise ConfigError(f'the tokenizer in init.hf_dir {hf_dir} has {tokenizer.vocab_size} tokens '
                      f'but the {family.name} model\'s embedding has {cfg.vocab_size} rows: the '
                      'tokenizer does not belong to this model')
  if tokenizer.eos_id is None:
    raise ConfigError(f'the tokenizer in init.hf_dir {hf_dir} has no EOS token: the training text '
                      'is documents joined with EOS')
  if data.block_size > cfg.max_len:
    raise ConfigError(f'data.block_size={data.block_size} is longer than the context of the model '
                      f'in init.hf_dir ({cfg.max_len} positions); set --config.data.block_size='
                      f'{cfg.max_len} or less')
  section = imported_model_section(cfg, config.model)
  _log_replaced(config, section, hf_dir, family.name)
  resolved = _copy(config)
  resolved.model = ml_collections.ConfigDict(section)
  resolved.tokenizer.update(dict(type=TOKENIZER_TYPE, vocab_size=int(tokenizer.vocab_size)))
  return resolved, Pretrained(hf_dir, tokenizer, imported.params)


def _resumed_config(config, saved, requested: str) -> ml_collections.ConfigDict:
  """`config` with the model, tokenizer and init sections its workdir saved (the first run
  resolved them from the import); config.model's RUNTIME_FIELDS still apply."""
  hf_dir = section_of(saved, 'init', Init).hf_dir
  if requested and requested != hf_dir:
    logging.warning('init.hf_dir=%s is not read: the workdir continues %s from its checkpoints',
                    requested, hf_dir)
  resolved = _copy(config)
  resolved.model = _copy(saved.model)
  resolved.model.update({k: config.model[k] for k in RUNTIME_FIELDS if k in config.model})
  resolved.tokenizer = _copy(saved.tokenizer)
  resolved.init = _copy(saved.init)
  return resolved


def init_config(config, workdir: str) -> tuple[ml_collections.ConfigDict, Pretrained | None]:
  """(the run's config, the import or None): `config` itself when there is nothing to import;
  with init.hf_dir, the imported model's model and tokenizer sections in it and its tokenizer and
  params loaded and checked. Everything is read and checked here and nothing is written, so bad
  input leaves the workdir untouched.

  A workdir with a checkpoint resumes: with the sections its first run resolved (and nothing of
  init.hf_dir read) if that run continued an import, else as it was trained (from scratch:
  init.hf_dir is then ignored, with a warning).
  """
  requested = section_of(config, 'init', Init).hf_dir
  saved = None
  if _checkpoint_steps(workdir) and os.path.isfile(os.path.join(workdir, CONFIG_FILE)):
    saved = load_saved_config(workdir)
  if saved is not None and section_of(saved, 'init', Init).hf_dir:
    resolved = _resumed_config(config, saved, requested)
    return resolved, Pretrained(resolved.init.hf_dir)
  if saved is not None:
    if requested:
      logging.warning(
          'init.hf_dir=%s is not read: %s was trained from scratch and resumes from '
          'its checkpoints', requested, workdir)
      config = _copy(config)
      config.init.hf_dir = ''
    return config, None
  if not requested:
    return config, None
  return _imported_config(config, os.path.abspath(os.path.expanduser(requested)))


@contextlib.contextmanager
def imported_tokenizer(pretrained: Pretrained | None):
  """The imported tokenizer saved as a folder of its own for the corpus preparation to take
  (`tokenizer_from`: the corpus, then the workdir, get copies of it), removed after; '' when
  nothing is imported (the run resumes, or trains from scratch)."""
  if pretrained is None or pretrained.tokenizer is None:
    yield ''
    return
  with tempfile.TemporaryDirectory(prefix='transformer_jax-imported-tokenizer-') as staging:
    path = os.path.join(staging, corpus_tokenizers.FILE_NAMES[TOKENIZER_TYPE])
    corpus_tokenizers.save(pretrained.tokenizer, TOKENIZER_TYPE, path)
    yield path


def start_state(trainer, train_data, pretrained: Pretrained):
  """The trainer's state: restored from the workdir's checkpoint, or at step 0 the fresh one
  with every param replaced by the imported model's (the optimizer's moments start at zero)."""
  state = trainer.init_or_restore(train_data)
  if int(jax.device_get(state.step)) != 0:
    return state
  params = pretrained.params
  if params is None:  # resumed, but the checkpoints proved unreadable: step 0 after all
    params = hf_family(pretrained.hf_dir).load(pretrained.hf_dir).params
  params = scan_layout.for_layout(params, trainer.task.cfg.scan_layers)
  require_same_parameters(state.params, params, f'init.hf_dir {pretrained.hf_dir}')
  return overlay_params(state, params)


def planned_config(config):
  """`config` with the model section of init.hf_dir's config.json (the planner's view: neither
  weights nor tokenizer are read); unchanged without init.hf_dir, or once resolved (a workdir's
  saved config, whose model section names its vocab_size)."""
  hf_dir = section_of(config, 'init', Init).hf_dir
  if not hf_dir or 'vocab_size' in config.model:
    return config
  hf_dir = os.path.abspath(os.path.expanduser(hf_dir))
  family = hf_family(hf_dir)
  cfg = family.converter.config_from_hf(read_json_object(os.path.join(hf_dir, CONFIG_FILE)))
  resolved = _copy(config)
  resolved.model = ml_collections.ConfigDict(imported_model_section(cfg, config.model))
  resolved.tokenizer.update(dict(type=TOKENIZER_TYPE, vocab_size=int(cfg.vocab_size)))
  return resolved
