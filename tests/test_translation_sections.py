"""The translation experiment's typed config sections (workflows/translation_sections.py): every
shipped translation config reads with its values, a typo is one line naming the nearest keys, a
wrong type or value is one line naming the key, and a workdir's config saved by an older
version reads as it meant."""

import json
import pathlib

import ml_collections
import pytest

from experiments.configs import (multi30k, t5_multi30k, t5_span_corruption, translate_quickstart,
                                 wmt14)
from transformer_jax.errors import ConfigError
from transformer_jax.workflows.translation_sections import HF_DIR, WORKDIR, Translation

CONFIGS = [translate_quickstart, multi30k, wmt14, t5_multi30k, t5_span_corruption]
SECTIONS = ('data', 'tokenizer', 'eval', 'loss', 'init')
LEGACY = (pathlib.Path(__file__).parent / 'cross_version' / 'jax_0.10.2' / 'translation' /
          'config.json')


def _one_line(error) -> str:
  assert '\n' not in str(error.value)
  return str(error.value)


@pytest.mark.parametrize('module', CONFIGS, ids=lambda m: m.__name__.split('.')[-1])
def test_every_translation_config_reads_with_its_values(module):
  config = module.get_config()
  run = Translation.of(config)
  for section in SECTIONS:
    record = getattr(run, section)
    assert {k: getattr(record, k) for k in config[section].keys()} == dict(config[section])
  assert run.model == dict(config.model) and run.seed == config.seed and run.config is config
  assert run.data.span_corruption == (module is t5_span_corruption)
  assert run.tokenizer.model_vocab_size == (config.tokenizer.vocab_size +
                                            config.tokenizer.num_sentinels)
  assert run.init.source == ('', '')
  assert Translation.of(run) is run  # a record passed down is not read again


def test_packing_and_noise_as_the_workflow_reads_them():
  run = Translation.of(t5_span_corruption.get_config())
  assert run.data.noise == {'noise_density': 0.15, 'mean_noise_span_length': 3.0}
  config = t5_span_corruption.get_config()
  config.data.pack = True  # span corruption's chunks fill the rows: never packed
  assert not Translation.of(config).data.packed
  assert Translation.of(translate_quickstart.get_config()).data.packed


@pytest.mark.parametrize('section, typo, nearest', [
    ('data', 'max_lne', 'max_len'),
    ('data', 'noise_densty', 'noise_density'),
    ('tokenizer', 'num_sentinel', 'num_sentinels'),
    ('eval', 'beam_sise', 'beam_size'),
    ('init', 'hfdir', 'hf_dir'),
])
def test_a_typo_is_one_line_naming_the_nearest_key(section, typo, nearest):
  config = translate_quickstart.get_config().to_dict()
  config[section][typo] = 1
  with pytest.raises(ConfigError) as error:
    Translation.of(config)
  assert _one_line(error).startswith(f"config section '{section}' has no key '{typo}'; "
                                     f'did you mean {nearest}')


@pytest.mark.parametrize('section, key, value, message', [
    ('data', 'task', 'denoise', "data.task must be 'translation' or 'span_corruption', got "
     "'denoise'"),
    ('data', 'source', 'web', "data.source must be 'files', 'tfds' or 'numbers', got 'web'"),
    ('data', 'overflow', 'cut', "data.overflow must be one of .* got 'cut'"),
    ('data', 'max_len', 64.5, 'data.max_len must be an integer, got 64.5'),
    ('data', 'pack', 'yes', "data.pack must be True or False, got 'yes'"),
    ('data', 'buckets', [16, 'x'], r"data.buckets\[1\] must be an integer, got 'x'"),
    ('data', 'max_train_examples', -1, 'max_train_examples >= 0'),
    ('tokenizer', 'num_sentinels', -1, 'tokenizer.num_sentinels must be >= 0, got -1'),
    ('tokenizer', 'joint', 'yes', "tokenizer.joint must be True or False, got 'yes'"),
    ('eval', 'beam_size', 0, 'eval: need beam_size >= 1'),
    ('eval', 'test_prefix', 3, 'eval.test_prefix must be a string, got 3'),
    ('loss', 'label_smoothing', 1.0, r'loss.label_smoothing must be in \[0, 1\), got 1.0'),
    ('init', 'workdir', '/a', 'init.workdir=/a and init.hf_dir=/b are both set'),
])
def test_a_wrong_type_or_value_is_one_line_naming_the_key(section, key, value, message):
  config = translate_quickstart.get_config().to_dict()
  config[section][key] = value
  if section == 'init':
    config['init']['hf_dir'] = '/b'
  with pytest.raises(ConfigError, match=message) as error:
    Translation.of(config)
  _one_line(error)


def test_the_init_source_is_one_of_two_or_none():
  config = t5_multi30k.get_config().to_dict()
  config['init']['workdir'] = '/tmp/pretrained'
  assert Translation.of(config).init.source == (WORKDIR, '/tmp/pretrained')
  config['init'] = {'workdir': '', 'hf_dir': '/data/t5-small'}
  assert Translation.of(config).init.source == (HF_DIR, '/data/t5-small')
  del config['init']  # a config saved before init existed
  assert Translation.of(config).init.kind == ''


def test_the_workdir_config_saved_by_jax_0_10_reads():
  run = Translation.of(ml_collections.ConfigDict(json.loads(LEGACY.read_text())))
  assert (run.data.source, run.data.max_len, run.data.buckets) == ('numbers', 32, (32,))
  assert run.data.packed and run.data.max_train_examples == 2000
  assert (run.tokenizer.model_vocab_size, run.eval.decode_rows) == (128, 256)


def test_a_config_saved_before_newer_keys_reads_with_what_it_meant():
  config = translate_quickstart.get_config().to_dict()
  for key in ('pack', 'task', 'source_prefix', 'text_path', 'valid_text_path', 'valid_fraction',
              'noise_density', 'mean_noise_span_length'):
    del config['data'][key]
  del config['tokenizer']['num_sentinels']
  del config['init']
  run = Translation.of(config)
  assert (run.data.task, run.data.packed, run.data.source_prefix) == ('translation', False, '')
  assert run.data.noise == {'noise_density': 0.15, 'mean_noise_span_length': 3.0}
  assert (run.data.valid_fraction, run.tokenizer.num_sentinels) == (0.05, 0)
  del config['data']['overflow']
  with pytest.raises(ConfigError, match=r"config section 'data' is missing \['overflow'\]"):
    Translation.of(config)
  config['data']['overflow'] = 'filter'
  del config['eval']
  with pytest.raises(ConfigError, match="config has no section 'eval'"):
    Translation.of(config)


def test_keys_at_the_top_of_the_config_beside_the_sections_are_not_read():
  config = translate_quickstart.get_config().to_dict()
  config['experiment'] = 'translate'  # what names the experiment, not a section of it
  assert Translation.of(config).data.source == 'numbers'
