"""The registry of experiments (transformer_jax/workflows/experiment_kinds.py): every shipped config
names its experiment, an old workdir's config.json without the name is still told apart, and a
wrong name is one line with the nearest ones."""

import json
import pathlib

import ml_collections
import pytest

from test_sections import shipped_configs
from transformer_jax.convert import families
from transformer_jax.errors import ConfigError
from transformer_jax.workflows import experiment_kinds

# The experiment of each shipped config, by the common config it starts from.
EXPECTED = {
    'albert_pretrain_small': experiment_kinds.ENCODER,
    'bert_pretrain_small': experiment_kinds.ENCODER,
    'bert_pretrain_wikipedia': experiment_kinds.ENCODER, 'conll_tagging': experiment_kinds.ENCODER,
    'glue_pairs': experiment_kinds.ENCODER, 'roberta_pretrain_small': experiment_kinds.ENCODER,
    'sst2_albert': experiment_kinds.ENCODER, 'sst2_minilm': experiment_kinds.ENCODER,
    'gpt2_shakespeare_bpe': experiment_kinds.LM, 'gpt2_small': experiment_kinds.LM,
    'llama_shakespeare': experiment_kinds.LM, 'opt_shakespeare': experiment_kinds.LM,
    'shakespeare_char': experiment_kinds.LM, 'multi30k': experiment_kinds.TRANSLATION,
    't5_multi30k': experiment_kinds.TRANSLATION, 't5_span_corruption': experiment_kinds.TRANSLATION,
    'translate_quickstart': experiment_kinds.TRANSLATION, 'wmt14': experiment_kinds.TRANSLATION
}
CROSS_VERSION = pathlib.Path(__file__).resolve().parent / 'cross_version' / 'jax_0.10.2'


def test_every_shipped_config_names_its_experiment():
  configs = dict(shipped_configs())
  assert sorted(configs) == sorted(EXPECTED)
  for name, config in configs.items():
    assert config.experiment == EXPECTED[name], name
    experiment = experiment_kinds.of_config(config)
    assert experiment.name == EXPECTED[name]
    # The name and the keys an old config.json is told apart by agree.
    assert experiment_kinds.legacy_name(config) == experiment.name, name


def test_each_experiment_has_its_kind_workflow_and_batch_option():
  kinds = {e.name: e.kind for e in experiment_kinds.EXPERIMENTS}
  assert kinds == {
      experiment_kinds.LM: families.CAUSAL_LM,
      experiment_kinds.TRANSLATION: families.ENCODER_DECODER,
      experiment_kinds.ENCODER: families.ENCODER
  }
  for experiment in experiment_kinds.EXPERIMENTS:
    assert callable(experiment.workflow.abstract_task), experiment.name
    assert experiment.workflow.__name__ == experiment.module
  assert experiment_kinds.named(experiment_kinds.TRANSLATION).batch_option == 'data.batch_tokens'
  assert experiment_kinds.named(experiment_kinds.LM).batch_option == 'data.batch_size'


def test_a_config_json_written_before_the_name_existed_still_resolves():
  saved = json.loads((CROSS_VERSION / 'char_gpt' / 'config.json').read_text())
  assert 'experiment' not in saved
  assert experiment_kinds.of_config(ml_collections.ConfigDict(saved)).name == experiment_kinds.LM
  saved = json.loads((CROSS_VERSION / 'translation' / 'config.json').read_text())
  assert experiment_kinds.of_config(
      ml_collections.ConfigDict(saved)).name == experiment_kinds.TRANSLATION
  legacy_bert = ml_collections.ConfigDict({'mode': 'finetune', 'data': {'batch_size': 8}})
  assert experiment_kinds.of_config(legacy_bert).name == experiment_kinds.ENCODER
  with pytest.raises(ConfigError, match='cannot tell the experiment of this config') as raised:
    experiment_kinds.of_config(ml_collections.ConfigDict({'data': {'path': 'x'}}))
  assert '\n' not in str(raised.value)


def test_an_unknown_experiment_is_one_line_with_the_nearest_names():
  config = ml_collections.ConfigDict({'experiment': 'translate', 'data': {'block_size': 8}})
  with pytest.raises(ConfigError) as raised:
    experiment_kinds.of_config(config)
  message = str(raised.value)
  assert message.startswith("unknown experiment 'translate' (config.experiment); did you mean "
                            'translation?')
  assert 'known: lm, translation, encoder' in message and '\n' not in message


def test_a_config_of_another_experiment_names_its_command():
  from experiments.configs import bert_pretrain_small
  with pytest.raises(
      ConfigError, match=r"of the 'encoder' experiment .*train it with "
      r'experiments.bert, not experiments.lm'):
    experiment_kinds.require(bert_pretrain_small.get_config(), experiment_kinds.LM)
