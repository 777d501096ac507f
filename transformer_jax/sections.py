"""Typed config sections: the ml_collections config read once into frozen dataclasses.

    run = sections.RunSections.of(config)        # seed, mesh, train, distributed, optimizer
    run.train.num_steps                          # an int, checked once; no int(config...) later

An experiment's config file is an `ml_collections.ConfigDict` (easy to override from the command
line: `--config.train.num_steps=100`); the code below the command lines reads typed records
instead. `Section.of(node, 'train')` builds one record from one section of that config:
  - every key must be a field (else one line naming the nearest keys, as a command-line
    override with a typo gets);
  - a field without a default must be present;
  - each value is converted to its field's type (int, float, bool, str, a union such as
    `int | str` or a tuple of those),
    with one line naming the key if it cannot be;
  - the record's `check()` refuses values out of range, naming `section.key`.
A section the config lacks is its defaults (a config of another experiment may have none).

The sections every experiment shares are here (experiments/configs/common.py sets them); each
kind of experiment adds its own (data, tokenizer, eval, ...) next to its workflow.
"""

import dataclasses
import difflib
import types
import typing

from transformer_jax.errors import ConfigError


def _items(node) -> dict:
  """A config section (ConfigDict, dict or None) as a plain dict of its top-level keys."""
  if node is None:
    return {}
  return {str(k): node[k] for k in node.keys()}


def _convert(value, kind, where: str):
  """`value` as the field type `kind`; ConfigError naming `where` if it isn't one."""
  if typing.get_origin(kind) in (typing.Union, types.UnionType):
    # `int | str` (a TSV column by position or name): the first of the types the value is.
    for option in typing.get_args(kind):
      try:
        return _convert(value, option, where)
      except ConfigError:
        pass
    names = ' or '.join(option.__name__ for option in typing.get_args(kind))
    raise ConfigError(f'{where} must be {names}, got {value!r}')
  if typing.get_origin(kind) is tuple:
    item = typing.get_args(kind)[0]
    if isinstance(value, (str, bytes)) or not hasattr(value, '__iter__'):
      raise ConfigError(f'{where} must be a sequence, got {value!r}')
    return tuple(_convert(v, item, f'{where}[{i}]') for i, v in enumerate(value))
  if kind is bool:
    if isinstance(value, bool):
      return value
    raise ConfigError(f'{where} must be True or False, got {value!r}')
  if kind is int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
      raise ConfigError(f'{where} must be an integer, got {value!r}')
    return int(value)
  if kind is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f'{where} must be a number, got {value!r}')
    return float(value)
  if kind is str:
    if not isinstance(value, str):
      raise ConfigError(f'{where} must be a string, got {value!r}')
    return value
  raise TypeError(f'{where}: unsupported field type {kind}')  # a bug in a Section, not the config


class Section:
  """A frozen dataclass read from one config section: `Record.of(config.train, 'train')`."""

  @classmethod
  def of(cls, node, name: str):
    values = _items(node)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in values:
      if key not in fields:
        close = difflib.get_close_matches(key, list(fields), n=3)
        hint = f'; did you mean {", ".join(close)}?' if close else ''
        raise ConfigError(f'config section {name!r} has no key {key!r}{hint} '
                          f'(its keys: {", ".join(fields)})')
    missing = [
        f for f, field in fields.items() if f not in values and
        field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    ]
    if missing:
      raise ConfigError(f'config section {name!r} is missing {missing}')
    hints = typing.get_type_hints(cls)
    record = cls(**{k: _convert(v, hints[k], f'{name}.{k}') for k, v in values.items()})
    record.check()
    return record

  def check(self):
    """Refuses values out of range with one ConfigError line (a section's own rules)."""


@dataclasses.dataclass(frozen=True)
class Train(Section):
  """`train.*`: how long, how often and how the loop runs (experiments/configs/common.py)."""
  num_steps: int
  log_every: int
  eval_every: int
  checkpoint_every: int
  keep_checkpoints: int = 3
  max_minutes: float = 0.0
  max_nonfinite: int = 10
  eval_max_batches: int = 0
  accumulation_steps: int = 1
  elastic_accumulation: bool = False
  record_batches: bool = False
  profile_steps: str = ''

  def check(self):
    for key in ('num_steps', 'log_every', 'eval_every', 'checkpoint_every'):
      value = getattr(self, key)
      if value < 0 or (key in ('num_steps', 'log_every') and value == 0):
        raise ConfigError(f'train.{key} must be positive, got {value}')
    if self.accumulation_steps < 1:
      raise ConfigError(f'train.accumulation_steps must be >= 1, got {self.accumulation_steps}')
    if self.keep_checkpoints < 1:
      raise ConfigError(f'train.keep_checkpoints must be >= 1, got {self.keep_checkpoints}')
    if self.max_minutes < 0 or self.max_nonfinite < 0 or self.eval_max_batches < 0:
      raise ConfigError('train.max_minutes, train.max_nonfinite and train.eval_max_batches must '
                        f'be >= 0, got {self.max_minutes}, {self.max_nonfinite} and '
                        f'{self.eval_max_batches}')


@dataclasses.dataclass(frozen=True)
class Mesh(Section):
  """`mesh.*`: the device mesh's axis sizes; -1 = all the devices the others leave."""
  data: int = -1
  fsdp: int = 1
  tensor: int = 1

  def as_dict(self) -> dict[str, int]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Distributed(Section):
  """`distributed.*`: multi-host start-up (parallel/distributed.py); ''/-1 = from the
  environment or jax."""
  mode: str = 'auto'
  coordinator_address: str = ''
  num_processes: int = -1
  process_id: int = -1

  def check(self):
    modes = ('auto', 'on', 'off')
    if self.mode not in modes:
      raise ConfigError(f'distributed.mode must be one of {modes}, got {self.mode!r}')


@dataclasses.dataclass(frozen=True)
class Optimizer(Section):
  """`optimizer.*`: AdamW and its learning-rate schedule (training/optimizer.py)."""
  learning_rate: float = 1e-3
  schedule: str = 'rsqrt'
  warmup_steps: int = 1_000
  decay_steps: int = 0
  end_learning_rate: float = 0.0
  cooldown_steps: int = 0
  b1: float = 0.9
  b2: float = 0.98
  eps: float = 1e-9
  weight_decay: float = 0.0
  grad_clip_norm: float = 0.0

  def check(self):
    schedules = ('rsqrt', 'cosine', 'linear', 'constant')
    if self.schedule not in schedules:
      raise ConfigError(f'optimizer.schedule must be one of {schedules}, got {self.schedule!r}')
    if self.learning_rate <= 0 or self.warmup_steps < 0:
      raise ConfigError(f'optimizer: need learning_rate > 0 and warmup_steps >= 0 (got '
                        f'{self.learning_rate}, {self.warmup_steps})')
    if self.cooldown_steps < 0:
      raise ConfigError(f'optimizer.cooldown_steps must be >= 0, got {self.cooldown_steps}')


@dataclasses.dataclass(frozen=True)
class RunSections:
  """The sections every experiment has: what the trainer, the mesh and the planner read."""
  seed: int
  mesh: Mesh
  train: Train
  distributed: Distributed
  optimizer: Optimizer

  @classmethod
  def of(cls, config) -> 'RunSections':
    return cls(seed=_convert(config.get('seed', 0), int,
                             'seed'), mesh=section_of(config, 'mesh', Mesh),
               train=section_of(config, 'train',
                                Train), distributed=section_of(config, 'distributed', Distributed),
               optimizer=section_of(config, 'optimizer', Optimizer))


def section_of(config, name: str, record: type[Section]):
  """`record` read from config.<name> (its defaults when the config has no such section)."""
  return record.of(config.get(name, None), name)


def value_of(node, key: str, kind, default, where: str = ''):
  """node[key] as the type `kind` (one line naming `where`, else `key`, if it isn't one), or
  `default` when absent: a value outside any record, such as config.mode or data.task, whose
  record is chosen by it."""
  if key not in node:
    return default
  return _convert(node[key], kind, where or key)


@dataclasses.dataclass(frozen=True)
class ModelChoices:
  """The settings of config.model that a run decides from before any model config is built:
  the attention kernel, the dtypes and the remat policy, as the config writes them.

  The model section itself is `TransformerConfig`'s (model_config.py), built by each workflow
  with the sizes only it knows (the tokenizer's vocabulary; a fine-tuned model's checkpoint,
  whose config a BERT fine-tuning section only overrides); the checks of the run
  (cli/validation.py), the trainer's log and the planner read these few keys here instead. The
  defaults are `TransformerConfig`'s; the other keys are left to it.
  """
  attention_implementation: str = 'auto'
  dtype: str = 'float32'
  matmul_dtype: str | None = None  # 'auto', a dtype's name, or None: model.dtype
  remat_policy: str = 'none'

  @classmethod
  def of(cls, config) -> 'ModelChoices':
    model = _items(config['model'] if 'model' in config else None)
    values = {}
    for field in dataclasses.fields(cls):
      if field.name in model:
        value = model[field.name]
        optional = field.name == 'matmul_dtype' and value is None
        values[field.name] = value if optional else _convert(value, str, f'model.{field.name}')
    return cls(**values)
