"""Every Hugging Face model family the project reads and writes, in one table.

    family = families.of_directory('/path/to/model')        # by config.json's model_type
    model = family.load('/path/to/model')                    # HFModel: config, params, ...
    config_to_hf, export_state_dict = family.exporters(heads, special_ids)
    family = families.exporting(families.CAUSAL_LM, cfg)     # the family that computes `cfg`

A family is a record: its name, the model_types of config.json it reads, the kind of model (a
causal LM, an encoder, an encoder-decoder) and the converter module that knows its names and
switches, imported only when a folder of that family is read or written. Everything that picks a
family (import, export, `generate --hf_dir`, BERT fine-tuning, the parity benchmark) looks it up
here; no other module names one (tests/test_families.py greps for it). Adding a family is its
converter module and one line of FAMILIES (docs/architecture.md).

A converter module has, whatever its family:
  load(directory, **overrides) -> HFModel      the folder's config, params (and tokenizer, heads)
  config_from_hf(hf_config, **overrides)       our config of a config.json dict (encoders: with
                                               the number of segment types)
  exporters(heads, special_ids) -> (config_to_hf(cfg) -> dict, export_state_dict(cfg, params))
  claims(cfg, byte_level) -> bool              whether an export of `cfg` is this family's

Its `config_from_hf` refuses a config.json of another family with `refuse_other_model_type`, one
line naming the family the folder is.
"""

import dataclasses
import importlib
import os
from types import ModuleType
from typing import Any, Mapping

from transformer_jax.convert.hf_files import HFModel, read_hf_config
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig

# The kinds of model, as the experiments train them.
CAUSAL_LM, ENCODER, ENCODER_DECODER = 'causal language model', 'encoder', 'encoder-decoder'


@dataclasses.dataclass(frozen=True)
class Family:
  """One Hugging Face model family and the module converting it."""
  name: str
  kind: str
  module: str
  model_types: tuple[str, ...]
  # Encoders: whether the family tokenizes with RoBERTa's byte-level BPE (else WordPiece).
  byte_level: bool = False
  # Whether `load` reads the folder's tokenizer too (else the caller loads its own).
  tokenizer: bool = False
  # How documentation spells the family ('GPT-2'); the name otherwise.
  title: str = ''

  @property
  def converter(self) -> ModuleType:
    """The converter module, imported on first use: a family's code loads only for its folders."""
    return importlib.import_module(self.module)

  def load(self, directory: str, **overrides) -> HFModel:
    """The Hugging Face folder `directory` of this family; `overrides` go to the config."""
    return self.converter.load(directory, **overrides)

  def exporters(self, heads: dict | None = None, special_ids: dict | None = None):
    """(config_to_hf(cfg) -> dict, export_state_dict(cfg, params) -> dict) of this family.

    `heads` (encoders): the `Bert` heads the params hold, as `hf_bert.bert_heads` gives them;
    `special_ids`: config.json's pad/bos/eos ids in HF's numbering, where the family needs them
    to place rows (RoBERTa's padding row).
    """
    return self.converter.exporters(heads, special_ids)


FAMILIES = (
    Family('gpt2', CAUSAL_LM, 'transformer_jax.convert.hf_gpt2', ('gpt2',), title='GPT-2'),
    Family('llama', CAUSAL_LM, 'transformer_jax.convert.hf_llama', ('llama',), title='LLaMA'),
    Family('opt', CAUSAL_LM, 'transformer_jax.convert.hf_opt', ('opt',), title='OPT'),
    Family('bert', ENCODER, 'transformer_jax.convert.hf_bert', ('bert',), tokenizer=True,
           title='BERT'),
    Family('albert', ENCODER, 'transformer_jax.convert.hf_albert', ('albert',), tokenizer=True,
           title='ALBERT'),
    Family('roberta', ENCODER, 'transformer_jax.convert.hf_roberta', ('roberta',), byte_level=True,
           tokenizer=True, title='RoBERTa'),
    Family('t5', ENCODER_DECODER, 'transformer_jax.convert.hf_t5', ('t5',), title='T5'),
)


def names(kind: str | None = None) -> tuple[str, ...]:
  """The families' names (of one kind)."""
  return tuple(f.name for f in FAMILIES if kind is None or f.kind == kind)


def named(name: str) -> Family:
  """The family called `name`; one ConfigError naming the known ones otherwise."""
  for family in FAMILIES:
    if family.name == name:
      return family
  raise ConfigError(f'unknown model family {name!r}; known: {", ".join(names())}')


def of_model_type(model_type: str, kind: str | None = None, where: str = 'config.json') -> Family:
  """The family reading config.json's `model_type` (of `kind`, if given); one ConfigError
  naming `where` and the supported ones otherwise."""
  for family in FAMILIES:
    if model_type in family.model_types and (kind is None or family.kind == kind):
      return family
  found = f'model_type={model_type!r}' if model_type else 'no model_type'
  supported = ', '.join(t for f in FAMILIES if kind is None or f.kind == kind
                        for t in f.model_types)
  what = f'{kind}s' if kind else 'models'
  raise ConfigError(f'{where} has {found}; supported {what}: {supported}')


def model_type(directory: str) -> str:
  """config.json's model_type of a Hugging Face folder ('' when it names none)."""
  return str(read_hf_config(directory, 'config.json and model.safetensors').get('model_type') or '')


# BERT's oldest config.json files name no model_type.
UNNAMED_MODEL_TYPE = 'bert'


def of_directory(directory: str, kind: str | None = None) -> Family:
  """The family of a Hugging Face folder, by config.json's model_type. Reads config.json only: a
  caller can refuse a folder before reading its weights."""
  found = model_type(directory)
  if not found and kind in (None, ENCODER):
    found = UNNAMED_MODEL_TYPE
  return of_model_type(found, kind, where=os.path.join(directory, 'config.json'))


def refuse_other_model_type(hf_config: Mapping[str, Any], name: str, label: str) -> None:
  """One ConfigError when config.json's model_type (none: family `name`'s own) belongs to
  another family than `name` (`label`: how messages spell it), naming the family the folder is
  and how to import it, or the model_types `name` reads."""
  own = named(name)
  found = hf_config.get('model_type', own.model_types[0])
  if found in own.model_types:
    return
  other = next((f for f in FAMILIES if found in f.model_types), None)
  if other is None:
    raise ConfigError(f'config.json has model_type={found!r}; the {label} importer reads only '
                      f'{", ".join(map(repr, own.model_types))}')
  raise ConfigError(f'config.json has model_type={found!r}: a {other.name} checkpoint, not '
                    f'{label}; import it with convert.families.of_directory(DIR).load(DIR)')


def exporting(kind: str, cfg: TransformerConfig, byte_level: bool = False) -> Family:
  """The family an export of `cfg` (a model of `kind`) is written as: the first of that kind, in
  FAMILIES order, whose converter claims it (`byte_level`: the tokenizer is a byte-level BPE).
  A converter that claims a model may still refuse one of its switches when exporting; one that
  knows no family of the kind computes the model says so in one ConfigError line."""
  for family in FAMILIES:
    if family.kind == kind and family.converter.claims(cfg, byte_level):
      return family
  raise ConfigError(f'no Hugging Face {kind} family computes this model (known: '
                    f'{", ".join(names(kind))})')
