"""The registry of experiments (transformer_jax/workflows/experiments.py): every shipped config
names its experiment, an old workdir's config.json without the name is still told apart, and a
wrong name is one line with the nearest ones."""

import json
import pathlib

import ml_collections
import pytest

from test_sections import shipped_configs
from transformer_jax.convert import families
from transformer_jax.errors import ConfigError
from transformer_jax.workflows import experiments

# The experiment of each shipped config, by the common config it starts from.
EXPECTED = {
    'albert_pretrain_small': experiments.ENCODER, 'bert_pretrain_small': experiments.ENCODER,
    'bert_pretrain_wikipedia': experiments.ENCODER, 'conll_tagging': experiments.ENCODER,
    'glue_pairs': experiments.ENCODER, 'roberta_pretrain_small': experiments.ENCODER,
    'sst2_albert': experiments.ENCODER, 'sst2_minilm': experiments.ENCODER, 'gpt2_shakespeare_bpe':
        experiments.LM, 'gpt2_small': experiments.LM, 'llama_shakespeare': experiments.LM,
    'shakespeare_char': experiments.LM, 'multi30k': experiments.TRANSLATION,
    't5_multi30k': experiments.TRANSLATION, 't5_span_corruption': experiments.TRANSLATION,
    'translate_quickstart': experiments.TRANSLATION, 'wmt14': experiments.TRANSLATION
}
CROSS_VERSION = pathlib.Path(__file__).resolve().parent / 'cross_version' / 'jax_0.10.2'


def test_every_shipped_config_names_its_experiment():
  configs = dict(shipped_configs())
  assert sorted(configs) == sorted(EXPECTED)
  for name, config in configs.items():
    assert config.experiment == EXPECTED[name], name
    experiment = experiments.of_config(config)
    assert experiment.name == EXPECTED[name]
    # The name and the keys an old config.json is told apart by agree.
    assert experiments.legacy_name(config) == experiment.name, name


def test_each_experiment_has_its_kind_workflow_and_batch_option():
  kinds = {e.name: e.kind for e in experiments.EXPERIMENTS}
  assert kinds == {
      experiments.LM: families.CAUSAL_LM, experiments.TRANSLATION: families.ENCODER_DECODER,
      experiments.ENCODER: families.ENCODER
  }
  for experiment in experiments.EXPERIMENTS:
    assert callable(experiment.workflow.abstract_task), experiment.name
    assert experiment.workflow.__name__ == experiment.module
  assert experiments.named(experiments.TRANSLATION).batch_option == 'data.batch_tokens'
  assert experiments.named(experiments.LM).batch_option == 'data.batch_size'


def test_a_config_json_written_before_the_name_existed_still_resolves():
  saved = json.loads((CROSS_VERSION / 'char_gpt' / 'config.json').read_text())
  assert 'experiment' not in saved
  assert experiments.of_config(ml_collections.ConfigDict(saved)).name == experiments.LM
  saved = json.loads((CROSS_VERSION / 'translation' / 'config.json').read_text())
  assert experiments.of_config(ml_collections.ConfigDict(saved)).name == experiments.TRANSLATION
  legacy_bert = ml_collections.ConfigDict({'mode': 'finetune', 'data': {'batch_size': 8}})
  assert experiments.of_config(legacy_bert).name == experiments.ENCODER
  with pytest.raises(ConfigError, match='cannot tell the experiment of this config') as raised:
    experiments.of_config(ml_collections.ConfigDict({'data': {'path': 'x'}}))
  assert '\n' not in str(raised.value)


def test_an_unknown_experiment_is_one_line_with_the_nearest_names():
  config = ml_collections.ConfigDict({'experiment': 'translate', 'data': {'block_size': 8}})
  with pytest.raises(ConfigError) as raised:
    experiments.of_config(config)
  message = str(raised.value)
  assert message.startswith("unknown experiment 'translate' (config.experiment); did you mean "
                            'translation?')
  assert 'known: lm, translation, encoder' in message and '\n' not in message


def test_a_config_of_another_experiment_names_its_command():
  from experiments.configs import bert_pretrain_small
  with pytest.raises(
      ConfigError, match=r"of the 'encoder' experiment .*train it with "
      r'experiments.bert, not experiments.lm'):
    experiments.require(bert_pretrain_small.get_config(), experiments.LM)
