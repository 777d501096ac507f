"""Every kind of experiment the project trains, in one table.

    experiment = experiment_kinds.of_config(config)                 # by config.experiment
    task, batch = experiment.abstract_task(config, num_devices=8)    # the planner's shapes
    cfg, segment_types = experiment.model_config(config, vocab_size)  # export's model
    experiment.kind                                            # families.CAUSAL_LM, ...

An experiment is a record: its name (config.experiment, set by experiments/configs/
{lm,translate,bert}_common.py), the command that trains it, the kind of model it trains (the
kinds of convert/families.py), its workflow module (imported on first use, as a family's
converter is), and the config key that sizes its batches. The planner (planning/compile.py),
export (workflows/export.py), inference and experiments/visualize.py look the experiment of a
config up here; no other module tells experiments apart by the keys their configs have.

A workdir's config.json written before config.experiment existed is told apart by
`legacy_name`, the one place that reads the keys only one experiment's config has.
"""

import dataclasses
import difflib
import importlib
from collections.abc import Callable
from types import ModuleType

from transformer_jax.convert import families
from transformer_jax.errors import ConfigError
from transformer_jax.workflows.translation_sections import Translation

LM, TRANSLATION, ENCODER = 'lm', 'translation', 'encoder'  # the values of config.experiment


@dataclasses.dataclass(frozen=True)
class Experiment:
  """One kind of experiment and the workflow that runs it."""
  name: str
  command: str  # the module that trains it: python -m <command>
  kind: str  # the kind of model, as convert/families.py names them
  module: str  # its workflow: validate, train_and_evaluate (or run), abstract_task, ...
  batch_key: str  # data.<batch_key> sizes a global batch: rows, or tokens (translation)
  embedding: str  # the params' table with one row per token of the vocabulary
  # (workflow, config, vocab_size) -> (the model config the workflow builds with `vocab_size`
  # entries, the number of segment types of a BERT-family model or None)
  _model_config: Callable = dataclasses.field(repr=False)
  # (workflow, config, workdir) -> the tokenizer a trained workdir saved (never trained here)
  _tokenizer: Callable = dataclasses.field(repr=False)
  # (config) -> config.json's task_specific_params of an export ({} for most)
  _task_specific_params: Callable = dataclasses.field(repr=False, default=lambda config: {})

  @property
  def workflow(self) -> ModuleType:
    """The workflow module, imported on first use."""
    return importlib.import_module(self.module)

  @property
  def workflow_name(self) -> str:
    """The workflow module's own name ('lm', 'translation', 'bert'): what the planner reports."""
    return self.module.rsplit('.', 1)[1]

  @property
  def batch_option(self) -> str:
    """The option that sizes a global batch, as a command line overrides it."""
    return f'data.{self.batch_key}'

  def batch_setting(self, config):
    """The config's value of `batch_option` (for the planner's advice)."""
    return config.data[self.batch_key]

  def abstract_task(self, config, num_devices: int | None = None):
    """(task, {key: jax.ShapeDtypeStruct}) of one global training batch, from the config alone:
    no data read, no tokenizer trained (for the planner)."""
    return self.workflow.abstract_task(config, num_devices=num_devices)

  def model_config(self, config, vocab_size: int):
    """(the model config of a saved config with `vocab_size` entries, its segment types or
    None)."""
    return self._model_config(self.workflow, config, vocab_size)

  def load_tokenizer(self, config, workdir: str):
    """The tokenizer `workdir` saved, as the workflow loads it."""
    return self._tokenizer(self.workflow, config, workdir)

  def task_specific_params(self, config) -> dict:
    """What an exported config.json keeps for the model's users besides the model (T5's
    prefix of a text-to-text workdir)."""
    return self._task_specific_params(config)


def _lm_model_config(workflow, config, vocab_size: int):
  return workflow.model_config(config, vocab_size), None


def _lm_tokenizer(workflow, config, workdir: str):
  return workflow.load_tokenizer(workflow.sections_of(config).tokenizer, workdir)


def _translation_model_config(workflow, config, vocab_size: int):
  # One vocabulary: an exported encoder-decoder shares it (export.family_of checks).
  return workflow.model_config(config, vocab_size, vocab_size), None


def _translation_tokenizer(workflow, config, workdir: str):
  return workflow.target_tokenizer(config, workdir)


def _translation_task_params(config) -> dict:
  # A text-to-text workdir's data.source_prefix, where T5 checkpoints keep it.
  prefix = Translation.of(config).data.source_prefix
  return {'translation': {'prefix': prefix}} if prefix else {}


def _bert_model_config(workflow, config, vocab_size: int):
  if config.mode == 'pretrain':
    return workflow.pretrain_model_config(config, vocab_size), workflow.segment_types(config)
  # The model fine-tuning started from, with config.model's overrides (its weights unread).
  cfg, type_vocab_size = workflow.init_model_config(config)
  return cfg.replace(vocab_size=vocab_size), type_vocab_size


def _bert_tokenizer(workflow, config, workdir: str):
  if config.mode == 'pretrain':
    return workflow.pretrain_tokenizer(config, workdir)
  return workflow.finetune_tokenizer(config, workdir)


EXPERIMENTS = (
    Experiment(LM, 'experiments.lm', families.CAUSAL_LM, 'transformer_jax.workflows.lm',
               'batch_size', 'token_embed', _lm_model_config, _lm_tokenizer),
    Experiment(TRANSLATION, 'experiments.translate', families.ENCODER_DECODER,
               'transformer_jax.workflows.translation', 'batch_tokens', 'target_embed',
               _translation_model_config, _translation_tokenizer, _translation_task_params),
    Experiment(ENCODER, 'experiments.bert', families.ENCODER, 'transformer_jax.workflows.bert',
               'batch_size', 'token_embed', _bert_model_config, _bert_tokenizer),
)


def names() -> tuple[str, ...]:
  return tuple(e.name for e in EXPERIMENTS)


def named(name: str) -> Experiment:
  """The experiment called `name`; one ConfigError line naming the nearest ones otherwise."""
  for experiment in EXPERIMENTS:
    if experiment.name == name:
      return experiment
  close = difflib.get_close_matches(str(name), names(), n=3)
  hint = f'; did you mean {", ".join(close)}?' if close else ''
  raise ConfigError(f'unknown experiment {name!r} (config.experiment){hint} (known: '
                    f'{", ".join(names())})')


def of_config(config) -> Experiment:
  """The experiment of a config (or a workdir's saved one): config.experiment, else, for a
  config.json written before that key existed, `legacy_name`'s."""
  if 'experiment' in config:
    return named(config['experiment'])
  return named(legacy_name(config))


def legacy_name(config) -> str:
  """The experiment of a config without config.experiment (a workdir's config.json written before
  the key existed), by the one key only that experiment's config has, in this order:
  config.mode (BERT's pretrain or finetune), data.block_size (a language model),
  data.batch_tokens (translation)."""
  data = (config['data'] if 'data' in config else None) or {}
  if 'mode' in config:
    return ENCODER
  if 'block_size' in data:
    return LM
  if 'batch_tokens' in data:
    return TRANSLATION
  raise ConfigError('cannot tell the experiment of this config: it sets no config.experiment '
                    f'({", ".join(names())}) and has none of config.mode (BERT), data.block_size '
                    '(language model) or data.batch_tokens (translation)')


def require(config, name: str) -> Experiment:
  """The experiment `name` if `config` is one of it; else one ConfigError line naming the
  command that trains it (a BERT config given to experiments.lm, say)."""
  experiment, wanted = of_config(config), named(name)
  if experiment is not wanted:
    raise ConfigError(f'this config is of the {experiment.name!r} experiment (config.experiment): '
                      f'train it with {experiment.command}, not {wanted.command}')
  return experiment
