"""A pretrained T5 a translation-workflow run starts from (init.* configs): text-to-text
fine-tuning, or span corruption continuing its pretraining.

init.workdir=W: W is a workdir of the translation workflow whose model is a T5
(t5_span_corruption.py's, say). The run reuses W's spm.model (copied here) and tokenizer
section, so the sentinels keep their ids, and its model: config.model must describe the same
parameters (the fields in RUNTIME_FIELDS may differ). init.hf_dir=D: D is a Hugging Face T5
directory; its config.json gives the model (config.model adds only the RUNTIME_FIELDS), its
tokenizer.json (or spiece.model) the ids, copied to WORKDIR/hf_tokenizer/. Either way the run's
saved config holds the resolved model and tokenizer sections, so --mode=translate / evaluate
need nothing but the workdir, and the pretrained params replace the fresh ones at step 0 only: a
rerun resumes from its own checkpoints without reading W or D again. Span corruption
(data.task='span_corruption', data.text_path) continues the pretraining of an HF T5 the same way:
the sentinels are its tokenizer's (tokenizer.num_sentinels counts those at the top of its ids).

workflows/translation.py calls these; the fine-tuned model's config comes from
workflows/translation_model.py, the init source from the config's record
(workflows/translation_sections.py), init.workdir's params straight from its checkpoint (params
only: no model, optimizer or trainer is built to read them). The functions that rewrite a config
with the init source's sections return it read again, as a record.
"""

import dataclasses
import json
import os

import flax
import jax
import jax.numpy as jnp
import ml_collections
from absl import logging

from transformer_jax.cli.workdir import load_saved_config
from transformer_jax.convert import families
from transformer_jax.data import tokenizer as tok
from transformer_jax.data.t5_tokenizer import load_hf_t5_tokenizer
from transformer_jax.errors import ConfigError
from transformer_jax.files import write_atomically
from transformer_jax.layers import scan_layout
from transformer_jax.model_config import (RUNTIME_FIELDS, TransformerConfig, model_config_from_dict,
                                          model_section)
from transformer_jax.models import EncoderDecoder
from transformer_jax.models.encoder_decoder import T5_V1_0_ARCHITECTURE
from transformer_jax.training.checkpointing import restore_params_only
from transformer_jax.workflows.params_overlay import overlay_params, require_same_parameters
from transformer_jax.workflows.translation_model import HF_TOKENIZER_DIR, SPM_MODEL, model_config
from transformer_jax.workflows.translation_sections import HF_DIR, WORKDIR, Translation

# Copied from init.hf_dir into the workdir, settings first and models last: a half-finished
# copy has no model file and is copied again. config.json names the special ids (as
# HFTokenizer.from_dir reads them) when no tokenizer_config.json does.
_HF_TOKENIZER_FILES = ('config.json', 'special_tokens_map.json', 'tokenizer_config.json',
                       'spiece.model', 'tokenizer.json')
# Fields a model config derives from others (head_dim from emb_dim, ...) or that the workflow
# sets (max_len from data.max_len: relative positions have no table), and `decode`.
_NOT_COMPARED = ('head_dim', 'num_kv_heads', 'source_vocab_size', 'max_len', 'decode')
# The switches that make an encoder-decoder a T5 (convert/hf_t5.py exports exactly these).
_T5_SWITCHES = ('norm_type', 'norm_position', 'position', 'use_bias', 'scale_embeddings',
                'share_embeddings', 'scale_attention_scores')


@dataclasses.dataclass
class Pretrained:
  """What a fine-tuning run takes from its init source: the tokenizer files to copy into the
  workdir (name -> bytes) and the params (host arrays, either layer layout; None when the run
  resumes, loaded again by `pretrained_params` should it start from step 0 after all)."""
  kind: str
  path: str
  files: dict
  params: dict | None = None


def _checkpoint_steps(workdir: str) -> list[int]:
  """Committed checkpoint steps in WORKDIR/checkpoints (orbax names them by step; steps being
  written have a temporary name), read without creating anything."""
  directory = os.path.join(workdir, 'checkpoints')
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def _copy(config):
  """An unlocked deep copy of `config` (the command line's is locked), free to take new keys."""
  return ml_collections.ConfigDict(config.copy_and_resolve_references().to_dict())


def _check_same_model(run: Translation, reference, vocab_size: int, where: str):
  """ConfigError naming every field where config.model describes other parameters than
  `reference` (a model section) for the same vocabulary, with the flags that fix it."""
  sized = lambda section: model_config_from_dict(section, vocab_size=vocab_size, max_len=run.data.
                                                 max_len)
  mine, theirs = sized(run.model), sized(reference)
  differ = {
      f.name: (getattr(mine, f.name), getattr(theirs, f.name))
      for f in dataclasses.fields(mine)
      if f.name not in RUNTIME_FIELDS + _NOT_COMPARED
  }
  differ = {k: v for k, v in differ.items() if v[0] != v[1]}
  if not differ:
    derived = [k for k in ('head_dim', 'num_kv_heads') if getattr(mine, k) != getattr(theirs, k)]
    differ = {k: (getattr(mine, k), getattr(theirs, k)) for k in derived}
  if differ:
    named = ', '.join(f'model.{k}={a!r} ({b!r} there)' for k, (a, b) in differ.items())
    flags = ' '.join(f'--config.model.{k}={b}' for k, (_, b) in differ.items())
    raise ConfigError(f'{named}: the fine-tuned model must have the parameters of {where}; '
                      f'pass {flags}')


def _not_t5(cfg: TransformerConfig) -> dict:
  """The switches of `cfg` that differ from T5's (an encoder and a decoder included)."""
  wrong = {k: getattr(cfg, k) for k in _T5_SWITCHES if getattr(cfg, k) != T5_V1_0_ARCHITECTURE[k]}
  if not cfg.num_encoder_layers or not cfg.num_decoder_layers:
    wrong.update(num_encoder_layers=cfg.num_encoder_layers,
                 num_decoder_layers=cfg.num_decoder_layers)
  return wrong


def _pretrained_workdir_config(path: str) -> Translation:
  """The saved config of init.workdir `path`, read, after checking that it holds a T5 of this
  workflow with a joint SentencePiece model and a checkpoint (reading config files only)."""
  if not os.path.isdir(path):
    raise ConfigError(f'init.workdir {path} does not exist: give the workdir of a span-corruption '
                      'run (experiments/configs/t5_span_corruption.py)')
  if not os.path.isfile(os.path.join(path, 'config.json')):
    raise ConfigError(f'init.workdir {path} has no config.json: it is not a trained workdir of '
                      'experiments.translate')
  saved = load_saved_config(path)
  if not all(k in saved for k in ('model', 'tokenizer', 'data')) or 'joint' not in saved.tokenizer:
    raise ConfigError(f'init.workdir {path} was not trained by experiments.translate (its config '
                      'has no model, tokenizer and data sections of that workflow)')
  saved = Translation.of(saved)
  wrong = _not_t5(model_config_from_dict(saved.model, vocab_size=saved.tokenizer.model_vocab_size))
  if wrong:
    raise ConfigError(f'init.workdir {path} is not a T5: its model has '
                      f'{", ".join(f"{k}={v!r}" for k, v in wrong.items())}; fine-tuning starts '
                      'from a T5 (e.g. a t5_span_corruption.py run)')
  if not saved.tokenizer.joint or not os.path.isfile(os.path.join(path, SPM_MODEL)):
    raise ConfigError(f'init.workdir {path} has no {SPM_MODEL} (one SentencePiece model for '
                      'inputs and targets, as span corruption trains): nothing to tokenize with')
  if not _checkpoint_steps(path):
    raise ConfigError(f'init.workdir {path} has no checkpoint: train it first')
  return saved


def _hf_model_config(path: str) -> TransformerConfig:
  """The model init.hf_dir's config.json describes (ConfigError unless it is a T5)."""
  if not os.path.isdir(path):
    raise ConfigError(f'init.hf_dir {path} does not exist: give a Hugging Face T5 directory '
                      '(config.json, model.safetensors, tokenizer.json or spiece.model)')
  config_path = os.path.join(path, 'config.json')
  if not os.path.isfile(config_path):
    raise ConfigError(f'init.hf_dir {path} has no config.json: not a Hugging Face T5 directory')
  try:
    with open(config_path, encoding='utf-8') as f:
      hf_config = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f'cannot read {config_path}: {e}') from None
  found = hf_config.get('model_type') if isinstance(hf_config, dict) else None
  try:
    family = families.of_model_type(str(found or ''), families.ENCODER_DECODER)
  except ConfigError:
    raise ConfigError(f'init.hf_dir {path} is not a T5: config.json has model_type={found!r}, '
                      'fine-tuning needs one of '
                      f'{", ".join(families.names(families.ENCODER_DECODER))} (a '
                      'T5ForConditionalGeneration checkpoint)') from None
  return family.converter.config_from_hf(hf_config)


def _with_workdir_source(run: Translation, saved: Translation, vocab_size: int) -> Translation:
  """`run` taking init.workdir's tokenizer section (its spm.model and sentinels), once
  config.model is checked to describe the same parameters as `saved`'s."""
  _check_same_model(run, saved.model, vocab_size, f'init.workdir {run.init.workdir}')
  config = _copy(run.config)
  config.tokenizer = _copy(saved.config.tokenizer)
  config.tokenizer.vocab_size = vocab_size - saved.tokenizer.num_sentinels  # spm.model's own
  return Translation.of(config)


def _with_hf_source(run: Translation, cfg: TransformerConfig, tokenizer_size: int,
                    sentinels: int = 0) -> Translation:
  """`run` whose model section is the HF checkpoint's `cfg` (config.model's RUNTIME_FIELDS
  kept) and whose tokenizer section describes its tokenizer: `tokenizer_size` ids, the top
  `sentinels` of them T5's sentinels (the tokenizer lists them: none are added on top)."""
  config = _copy(run.config)
  # max_len follows data.max_len (relative positions have no table).
  config.model = ml_collections.ConfigDict(
      model_section(cfg, run.model, leave_out=('max_len', 'source_vocab_size')))
  config.tokenizer.update(
      dict(vocab_size=int(tokenizer_size) - sentinels, num_sentinels=int(sentinels), joint=True))
  return Translation.of(config)


def init_config(config, workdir: str) -> tuple[Translation, 'Pretrained']:
  """(the run's config read, Pretrained) for a config with init.*: the pretrained model's
  tokenizer and model sections in the config, its tokenizer files and params loaded and checked.
  Everything is read and checked here and nothing is written, so bad input leaves the
  workdir untouched.

  A workdir with a checkpoint resumes: its saved config has the resolved sections (config.model
  gives only the RUNTIME_FIELDS and, for init.workdir, must still agree), and nothing of the
  init source is read.
  """
  run = Translation.of(config)
  kind, path = run.init.source
  if _checkpoint_steps(workdir):
    return resumed_config(run, workdir), Pretrained(kind, path, {})
  if kind == WORKDIR:
    saved = _pretrained_workdir_config(path)
    base = tok.Tokenizer.from_file(os.path.join(path, SPM_MODEL))
    vocab = base.vocab_size + saved.tokenizer.num_sentinels
    run = _with_workdir_source(run, saved, vocab)
    with open(os.path.join(path, SPM_MODEL), 'rb') as f:
      files = {SPM_MODEL: f.read()}
    params = _workdir_params(path)
  else:
    declared = _hf_model_config(path)
    tokenizer = load_hf_t5_tokenizer(path)
    if tokenizer.vocab_size > declared.vocab_size:
      raise ConfigError(f'the tokenizer of init.hf_dir {path} has {tokenizer.vocab_size} ids but '
                        f'the model\'s embedding has {declared.vocab_size} rows (vocab_size in '
                        'config.json): the tokenizer does not belong to this checkpoint')
    imported = families.of_directory(path, families.ENCODER_DECODER).load(path)
    cfg, params = imported.config, imported.params
    run = _with_hf_source(run, cfg, tokenizer.vocab_size, tokenizer.sentinels)
    files = {}
    for name in _HF_TOKENIZER_FILES:
      if os.path.isfile(os.path.join(path, name)):
        with open(os.path.join(path, name), 'rb') as f:
          files[name] = f.read()
  vocab = run.tokenizer.model_vocab_size  # the tokenizer's size, no file read
  _check_fits(model_config(run, vocab, vocab), params, kind, path)
  logging.info('starting from init.%s %s: %s', kind, path,
               ', '.join(f'{k}={v}' for k, v in sorted(run.model.items())))
  return run, Pretrained(kind, path, files, params)


def resumed_config(config, workdir: str) -> Translation:
  """`config` (read) with the model and tokenizer sections a fine-tuning workdir saved (the
  first run resolved them); config.model's RUNTIME_FIELDS still apply."""
  run = Translation.of(config)
  saved = Translation.of(load_saved_config(workdir))
  if run.init.source != saved.init.source:
    logging.warning(
        'init.%s=%s is not read: %s resumes from its checkpoints (an init applies at '
        'step 0 only)', *run.init.source, workdir)
  if run.init.kind == WORKDIR:
    _check_same_model(run, saved.model, saved.tokenizer.model_vocab_size, f'{workdir} (resumed)')
  runtime = {k: v for k, v in run.model.items() if k in RUNTIME_FIELDS}
  config = _copy(run.config)
  config.model = _copy(saved.config.model)
  config.model.update(runtime)
  config.tokenizer = _copy(saved.config.tokenizer)
  return Translation.of(config)


def _workdir_params(path: str) -> dict:
  """init.workdir's params of its latest readable checkpoint, as host arrays in the layer
  layout they were saved in (the optimizer state is not read; nothing is written there)."""
  return restore_params_only(os.path.join(path, 'checkpoints'))


def _check_fits(model_cfg: TransformerConfig, params, kind: str, path: str):
  """ConfigError unless `params` are exactly those of `model_cfg` (the fine-tuned model): the
  same tree and shapes, so that none is left at its random initialisation (checked by tracing,
  nothing computed)."""
  cfg = model_cfg.replace(scan_layers=False)
  dummy = jnp.ones((1, 2), jnp.int32)
  shapes = jax.eval_shape(EncoderDecoder(cfg).init, jax.random.key(0), dummy, dummy)
  require_same_parameters(flax.linen.meta.unbox(shapes['params']),
                          scan_layout.unstack_layers(params), f'init.{kind} {path}')


def write_init_tokenizer(workdir: str, pretrained: Pretrained):
  """Copies the pretrained model's tokenizer files into the workdir (each atomically, the model
  file last), so that inference and resumed runs read them from there."""
  if not pretrained.files:
    return
  directory = workdir if pretrained.kind == WORKDIR else os.path.join(workdir, HF_TOKENIZER_DIR)
  if pretrained.kind == HF_DIR and os.path.isdir(directory):
    for name in _HF_TOKENIZER_FILES:  # a stale copy from another init.hf_dir
      if name not in pretrained.files and os.path.isfile(os.path.join(directory, name)):
        os.remove(os.path.join(directory, name))
  for name, data in pretrained.files.items():
    write_atomically(os.path.join(directory, name), data)


def pretrained_params(pretrained: Pretrained, scan_layers: bool) -> dict:
  """The pretrained params in the model's layer layout (read again if the run resumed)."""
  params = pretrained.params
  if params is None:  # resumed, but the checkpoints proved unreadable: step 0 after all
    if pretrained.kind == WORKDIR:
      _pretrained_workdir_config(pretrained.path)  # still a T5 of ours, with a checkpoint
      params = _workdir_params(pretrained.path)
    else:
      params = families.of_directory(pretrained.path,
                                     families.ENCODER_DECODER).load(pretrained.path).params
  return scan_layout.for_layout(params, scan_layers)


def start_state(trainer, train_data, pretrained: Pretrained):
  """The trainer's state: restored from the workdir's checkpoint, or at step 0 the fresh one
  with every param replaced by the pretrained model's (as BERT fine-tuning starts)."""
  state = trainer.init_or_restore(train_data)
  if int(jax.device_get(state.step)) == 0:
    state = overlay_params(state, pretrained_params(pretrained, trainer.task.cfg.scan_layers))
  return state


def planned_config(config) -> Translation:
  """`config` (read) with the model and tokenizer sections of its init source's config file
  (the planner's view: neither weights nor tokenizer are read); unchanged without init.*."""
  run = Translation.of(config)
  kind, path = run.init.source
  if kind == WORKDIR:
    saved = Translation.of(load_saved_config(path))
    return _with_workdir_source(run, saved, saved.tokenizer.model_vocab_size)
  if kind == HF_DIR:
    cfg = _hf_model_config(path)
    return _with_hf_source(run, cfg, cfg.vocab_size)
  return run
