"""Typed config sections (transformer_jax/sections.py): every shipped config reads into them, and
a wrong key, type or value is one ConfigError line naming it."""

import importlib
import pkgutil

import ml_collections
import pytest

import experiments.configs
from transformer_jax import sections
from transformer_jax.errors import ConfigError


def shipped_configs():
  for info in pkgutil.iter_modules(experiments.configs.__path__):
    module = importlib.import_module(f'experiments.configs.{info.name}')
    if hasattr(module, 'get_config'):
      yield info.name, module.get_config()


@pytest.mark.parametrize('name, config', list(shipped_configs()))
def test_every_shipped_config_reads_into_the_run_sections(name, config):
  run = sections.RunSections.of(config)
  assert run.train.num_steps == config.train.num_steps
  assert run.mesh.as_dict() == dict(config.mesh)
  assert run.optimizer.learning_rate == config.optimizer.learning_rate
  assert isinstance(run.train.max_minutes, float) and isinstance(run.seed, int)


def train_section(**values):
  base = {'num_steps': 10, 'log_every': 1, 'eval_every': 5, 'checkpoint_every': 5}
  return ml_collections.ConfigDict({**base, **values})


def test_values_take_their_field_types_and_missing_keys_their_defaults():
  train = sections.Train.of(train_section(max_minutes=2), 'train')
  assert train.max_minutes == 2.0 and isinstance(train.max_minutes, float)
  assert train.keep_checkpoints == 3 and train.profile_steps == ''
  assert sections.Mesh.of(None, 'mesh') == sections.Mesh(data=-1, fsdp=1, tensor=1)


@pytest.mark.parametrize('values, message', [
    ({'num_step': 3}, "config section 'train' has no key 'num_step'; did you mean num_steps"),
    ({'num_steps': 2.5}, 'train.num_steps must be an integer, got 2.5'),
    ({'num_steps': '10'}, "train.num_steps must be an integer, got '10'"),
    ({'record_batches': 1}, 'train.record_batches must be True or False, got 1'),
    ({'num_steps': 0}, 'train.num_steps must be positive, got 0'),
    ({'accumulation_steps': 0}, 'train.accumulation_steps must be >= 1, got 0'),
])
def test_a_wrong_key_type_or_value_is_one_line_naming_it(values, message):
  with pytest.raises(ConfigError) as raised:
    sections.Train.of(train_section(**values), 'train')
  assert str(raised.value).startswith(message) and '\n' not in str(raised.value)


def test_a_required_key_missing_is_named():
  with pytest.raises(ConfigError, match=r"config section 'train' is missing \['log_every'\]"):
    sections.Train.of({'num_steps': 1, 'eval_every': 0, 'checkpoint_every': 0}, 'train')


def test_sequences_become_tuples_of_their_item_type():

  import dataclasses

  @dataclasses.dataclass(frozen=True)
  class Buckets(sections.Section):
    lengths: tuple[int, ...] = ()

  assert Buckets.of({'lengths': [8, 16.0]}, 'data').lengths == (8, 16)
  with pytest.raises(ConfigError, match=r'data.lengths\[1\] must be an integer'):
    Buckets.of({'lengths': [8, 'x']}, 'data')
  with pytest.raises(ConfigError, match='data.lengths must be a sequence'):
    Buckets.of({'lengths': 8}, 'data')


def test_optimizer_and_distributed_check_their_choices():
  with pytest.raises(ConfigError, match="optimizer.schedule must be one of .*got 'noam'"):
    sections.Optimizer.of({'schedule': 'noam'}, 'optimizer')
  with pytest.raises(ConfigError, match="distributed.mode must be one of .*got 'sometimes'"):
    sections.Distributed.of({'mode': 'sometimes'}, 'distributed')


def test_model_choices_read_the_few_model_settings_the_checks_need():
  config = ml_collections.ConfigDict({'model': {'dtype': 'bfloat16', 'emb_dim': 64}})
  choices = sections.ModelChoices.of(config)
  assert choices == sections.ModelChoices(dtype='bfloat16')  # the rest: TransformerConfig's
  assert sections.ModelChoices.of({}).attention_implementation == 'auto'
  assert sections.ModelChoices.of({'model': {'matmul_dtype': None}}).matmul_dtype is None
  with pytest.raises(ConfigError, match='model.attention_implementation must be a string'):
    sections.ModelChoices.of({'model': {'attention_implementation': 3}})
