"""The BERT experiments' typed config sections (workflows/bert_sections.py): every shipped BERT
config reads into the record of its kind, a key of another kind or a typo is one line naming
the nearest keys, and a saved config written before a key existed reads as it meant."""

import ml_collections
import pytest

from experiments.configs import (albert_pretrain_small, bert_pretrain_small,
                                 bert_pretrain_wikipedia, conll_tagging, glue_pairs,
                                 roberta_pretrain_small, sst2_albert, sst2_minilm)
from transformer_jax.errors import ConfigError
from transformer_jax.workflows import bert_sections
from transformer_jax.workflows.bert_sections import (ClassificationData, FineTuning, Pretraining,
                                                     TaggingData)

PRETRAINING = [
    bert_pretrain_small, bert_pretrain_wikipedia, roberta_pretrain_small, albert_pretrain_small
]


@pytest.mark.parametrize('module', PRETRAINING, ids=lambda m: m.__name__.split('.')[-1])
def test_every_pretraining_config_reads_with_its_values(module):
  config = module.get_config()
  run = Pretraining.of(config)
  assert bert_sections.mode_of(config) == 'pretrain'
  assert {k: getattr(run.data, k) for k in config.data.keys()} == dict(config.data)
  assert {k: getattr(run.tokenizer, k) for k in config.tokenizer.keys()} == dict(config.tokenizer)
  assert run.model == dict(config.model) and run.config is config
  assert Pretraining.of(run) is run  # a record passed down is not read again


@pytest.mark.parametrize('config, record', [
    (sst2_minilm.get_config(), ClassificationData),
    (sst2_albert.get_config(), ClassificationData),
    (glue_pairs.get_config('mnli'), ClassificationData),
    (conll_tagging.get_config(), TaggingData),
])
def test_every_finetuning_config_reads_into_the_data_record_of_its_task(config, record):
  run = FineTuning.of(config)
  assert type(run.data) is record and run.tagging == (record is TaggingData)
  assert {k: getattr(run.data, k) for k in config.data.keys()} == dict(config.data)
  assert (run.init.hf_dir, run.init.bert_workdir) == (config.init.hf_dir, config.init.bert_workdir)


def _one_line(error) -> str:
  assert '\n' not in str(error.value)
  return str(error.value)


def test_a_key_of_another_kind_or_a_typo_names_the_nearest_keys():
  config = sst2_minilm.get_config().to_dict()
  config['data']['paths'] = 'a.txt'  # a pretraining key in a fine-tuning config
  with pytest.raises(ConfigError) as error:
    FineTuning.of(config)
  assert _one_line(error).startswith("config section 'data' has no key 'paths'")
  assert 'num_labels' in str(error.value)  # the keys of sentence classification are listed
  config = bert_pretrain_small.get_config().to_dict()
  config['data']['mask_rat'] = 0.2
  with pytest.raises(ConfigError) as error:
    Pretraining.of(config)
  assert "has no key 'mask_rat'; did you mean mask_rate" in _one_line(error)
  config = conll_tagging.get_config().to_dict()
  config['data']['num_labels'] = 9  # sentence classification's, not tagging's
  with pytest.raises(ConfigError, match="config section 'data' has no key 'num_labels'"):
    FineTuning.of(config)


@pytest.mark.parametrize('section, key, value, message', [
    ('data', 'sentence_task', 'mlm', "data.sentence_task must be one of .* got 'mlm'"),
    ('data', 'type_vocab_size', 0, 'data.type_vocab_size must be at least 1, got 0'),
    ('data', 'max_len', 64.5, 'data.max_len must be an integer, got 64.5'),
    ('data', 'source', 'tsv', "data.source must be 'files' or 'tfds', got 'tsv'"),
    ('tokenizer', 'type', 'bpe', "tokenizer.type must be one of .* got 'bpe'"),
    ('tokenizer', 'lowercase', 'yes', "tokenizer.lowercase must be True or False, got 'yes'"),
])
def test_a_wrong_pretraining_value_is_one_line_naming_it(section, key, value, message):
  config = bert_pretrain_small.get_config().to_dict()
  config[section][key] = value
  with pytest.raises(ConfigError, match=message) as error:
    Pretraining.of(config)
  _one_line(error)


def test_pairs_across_configs_need_two_segment_ids_with_wordpiece():
  config = bert_pretrain_small.get_config()
  config.data.type_vocab_size = 1
  with pytest.raises(ConfigError, match="sentence_task='nsp' with WordPiece .* must be 2, got 1"):
    Pretraining.of(config)
  config.tokenizer.type = 'byte_bpe'  # RoBERTa's tokenizer gives every token segment 0
  assert Pretraining.of(config).data.type_vocab_size == 1


def test_columns_by_position_or_name_and_the_data_task():
  config = glue_pairs.get_config().to_dict()
  config['data']['text_columns'] = [3, 'sentence2']  # as JSON writes a saved tuple
  assert FineTuning.of(config).data.text_columns == (3, 'sentence2')
  config['data']['text_columns'] = [1.5]
  with pytest.raises(ConfigError, match=r'data.text_columns\[0\] must be int or str, got 1.5'):
    FineTuning.of(config)
  config['data']['text_columns'] = ['a', 'b', 'c']
  with pytest.raises(ConfigError, match='one or two columns'):
    FineTuning.of(config)
  config['data']['text_columns'] = []
  config['data']['task'] = 'tagging'
  with pytest.raises(ConfigError, match="data.task must be one of .* got 'tagging'"):
    FineTuning.of(config)


def test_label_names_are_checked_where_classes_are_named():
  config = glue_pairs.get_config('rte')
  config.data.num_labels = 3
  data = FineTuning.of(config).data  # reads: a split's labels need no names
  with pytest.raises(ConfigError, match='data.label_names has 2 names but data.num_labels=3'):
    data.class_names()
  config.data.label_names = ()
  assert FineTuning.of(config).data.class_names() == ('0', '1', '2')


def test_a_config_saved_before_newer_keys_reads_with_what_it_meant():
  config = bert_pretrain_small.get_config().to_dict()
  for key in ('type_vocab_size', 'short_seq_prob', 'pack', 'lines_per_document'):
    del config['data'][key]
  del config['tokenizer']['type']
  run = Pretraining.of(ml_collections.ConfigDict(config))
  assert (run.data.type_vocab_size, run.data.short_seq_prob, run.data.pack) == (2, 0.1, False)
  assert run.data.lines_per_document == 0 and run.tokenizer.type == 'wordpiece'
  del config['data']['max_predictions']
  with pytest.raises(ConfigError, match=r"config section 'data' is missing \['max_predictions'\]"):
    Pretraining.of(config)


def test_fine_tuning_refuses_packing_on_reading():
  for module in (sst2_minilm, conll_tagging):
    config = module.get_config()
    config.data.pack = True
    with pytest.raises(ConfigError, match='fine-tuning is not packed') as error:
      FineTuning.of(config)
    _one_line(error)


def test_the_mode_is_read_as_a_string_or_absent():
  assert bert_sections.mode_of({'mode': 'finetune'}) == 'finetune'
  assert bert_sections.mode_of({'seed': 0}) is None  # not a BERT experiment's config
  with pytest.raises(ConfigError, match='mode must be a string, got 3'):
    bert_sections.mode_of({'mode': 3})
