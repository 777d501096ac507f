"""The T5 configs train through the translate workflow: span-corruption pretraining on Tiny
Shakespeare and text-to-text Multi30k with a task prefix, both with a T5 v1.1-style model.

Each is shrunk to a tiny model and a few dozen steps, trained in-process like
`python -m experiments.translate` does, and must learn (its loss falls well below the first
logged one). What the configs add to the workflow is checked on the way: the model vocabulary
is the tokenizer's plus the sentinels, and the prefix's ids start every tokenized source.
"""

import json

import numpy as np
import pytest

from experiments.configs import t5_multi30k, t5_span_corruption
from transformer_jax.data import batching
from transformer_jax.data.span_corruption import PrefixedTokenizer, SentinelTokenizer
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.errors import ConfigError
from transformer_jax.models.encoder_decoder import T5_V1_1_ARCHITECTURE
from transformer_jax.special_tokens import EOS_ID
from transformer_jax.workflows import translation, translation_model

TINY_MODEL = dict(emb_dim=32, num_heads=2, mlp_dim=64, num_encoder_layers=1, num_decoder_layers=1)


def shrink(config, *, vocab_size: int, num_steps: int = 40):
  """Tiny model, vocabulary and batches (one shape); evaluation at the end on 2 batches and
  4 greedy decodes."""
  config.model.update(TINY_MODEL)
  config.tokenizer.vocab_size = vocab_size
  config.tokenizer.max_sentences = 5_000
  config.data.update(dict(max_len=32, buckets=(32,), batch_tokens=512, overflow='truncate'))
  config.optimizer.update(dict(learning_rate=5e-3, warmup_steps=10))
  config.train.update(
      dict(num_steps=num_steps, log_every=5, eval_every=0, checkpoint_every=0, eval_max_batches=2))
  config.eval.update(dict(bleu_sentences=4, beam_size=1, test_prefix='', average_last=0))
  return config


def train_losses(workdir) -> list[float]:
  with open(workdir / 'metrics.jsonl') as f:
    records = [json.loads(line) for line in f]
  return [r['train/loss'] for r in records if 'train/loss' in r]


def assert_learns(results, workdir, vocab_size: int):
  """A fresh model starts near uniform over the vocabulary; the final eval loss is well below
  the first logged train loss."""
  losses = train_losses(workdir)
  print(f'train losses {[round(x, 3) for x in losses]}, final eval loss '
        f'{results["eval_loss"]:.3f}')
  assert results['step'] == 40 and not results['interrupted']
  assert losses[0] > 0.6 * np.log(vocab_size), losses
  assert np.isfinite(results['eval_loss'])
  assert results['eval_loss'] < 0.75 * losses[0], (losses, results['eval_loss'])
  assert losses[-1] < 0.75 * losses[0], losses


def assert_t5_v1_1(cfg):
  """The model is T5 v1.1's design: every switch of the model module's definition."""
  assert {k: getattr(cfg, k) for k in T5_V1_1_ARCHITECTURE} == T5_V1_1_ARCHITECTURE
  assert (cfg.norm_type, cfg.position, cfg.activation) == ('rmsnorm', 'relative', 'geglu')
  assert not cfg.tie_output and not cfg.scale_attention_scores


@pytest.fixture(scope='module')
def span_run(tiny_shakespeare, tmp_path_factory):
  """(config, workdir, results) of t5_span_corruption.py shrunk and trained 40 steps on Tiny
  Shakespeare (2,000 chunks)."""
  config = shrink(t5_span_corruption.get_config(), vocab_size=200)
  assert config.data.text_path == '../shared/data/tinyshakespeare/input.txt'
  config.data.text_path = tiny_shakespeare
  config.data.max_train_examples = 2_000
  workdir = tmp_path_factory.mktemp('t5_span')
  return config, workdir, translation.train_and_evaluate(config, str(workdir))


def test_span_corruption_config_pretrains_on_tiny_shakespeare(span_run):
  """t5_span_corruption.py on Tiny Shakespeare: a 200-piece tokenizer trained on the text,
  a 300-entry model vocabulary (100 sentinels on top), 40 steps on span-corrupted chunks
  whose loss falls, validation on the held-out end of the text with fill-ins decoded."""
  config, workdir, results = span_run
  assert_learns(results, workdir, 300)
  assert 'eval_bleu' in results and 'eval_exact_match' in results  # fill-ins were decoded
  assert Tokenizer.from_file(str(workdir / 'spm.model')).vocab_size == 200

  model = translation.restore_for_inference(config, str(workdir))
  task, params = model.task, model.params
  assert task.cfg.vocab_size == task.cfg.source_vocab_size == 300
  assert params['target_embed']['embedding'].shape == (300, 32)
  assert_t5_v1_1(task.cfg)
  assert isinstance(task.src_tokenizer, SentinelTokenizer)
  assert task.src_tokenizer.encode('<extra_id_0>') == [299]


def test_translate_mode_fills_in_sentinels(span_run, translate_cli):
  """`python -m experiments.translate --mode=translate` on the pretrained workdir (its saved
  config) reads '<extra_id_i>' in the input as sentinels and writes one line per input line;
  the model, trained for 40 steps, answers with sentinels too."""
  _, workdir, _ = span_run
  lines = [
      'First Citizen: Before we <extra_id_0> any further, hear me <extra_id_1>.',
      'All: <extra_id_0>, speak.'
  ]
  result = translate_cli.run(f'--workdir={workdir}', '--mode=translate',
                             stdin=''.join(line + '\n' for line in lines))
  assert result.returncode == 0, result.stderr[-3000:]
  outputs = result.stdout.split('\n')
  assert len(outputs) == len(lines) + 1 and outputs[-1] == '', result.stdout
  print(outputs)
  assert all('<extra_id_0>' in output for output in outputs[:-1]), outputs


def test_multi30k_config_trains_text_to_text_with_the_prefix(corpus, tmp_path):
  """t5_multi30k.py on 300 Multi30k pairs: every source, as batched for training and as
  encoded for translation, starts with the ids of 'translate English to German: '; targets do
  not; the loss falls in 40 steps."""
  config = shrink(t5_multi30k.get_config(), vocab_size=300)
  prefix = 'translate English to German: '
  assert config.data.source_prefix == prefix and config.tokenizer.num_sentinels == 100
  config.data.dir = str(corpus('multi30k'))
  config.data.max_train_examples = 300
  results = translation.train_and_evaluate(config, str(tmp_path))
  assert_learns(results, tmp_path, 400)

  src_tok, tgt_tok = translation_model.load_tokenizers(config, str(tmp_path))
  assert isinstance(src_tok, PrefixedTokenizer) and isinstance(tgt_tok, SentinelTokenizer)
  assert src_tok.vocab_size == tgt_tok.vocab_size == 400
  prefix_ids = tgt_tok.encode(prefix)
  assert 0 < len(prefix_ids) < 20
  sources, targets = translation.load_split(config, 'val')
  src_ids, tgt_ids, _ = batching.encode_pairs(src_tok, tgt_tok, sources[:50], targets[:50],
                                              config.data.max_len, 'truncate')
  for source, src, tgt in zip(sources, src_ids, tgt_ids):
    assert src[:len(prefix_ids)].tolist() == prefix_ids
    assert src[len(prefix_ids):-1].tolist() == tgt_tok.encode(source)[:len(src) - len(prefix_ids) -
                                                                      1]
    assert src[-1] == EOS_ID
    assert tgt[:len(prefix_ids)].tolist() != prefix_ids

  task = translation.restore_for_inference(config, str(tmp_path)).task
  assert task.src_tokenizer.encode('A dog runs.')[:len(prefix_ids)] == prefix_ids
  assert_t5_v1_1(task.cfg)


def test_defaults_and_older_configs_leave_translation_unchanged(tiny_config):
  """At the new fields' defaults, and for a saved config from before they existed, the
  tokenizers are the SentencePiece ones themselves and the model vocabulary is theirs."""
  config = tiny_config()
  assert (config.data.task, config.data.source_prefix,
          config.tokenizer.num_sentinels) == ('translation', '', 0)
  marker = object()
  assert translation_model.text_to_text_tokenizers(config, marker, marker) == (marker, marker)
  for key in ('task', 'source_prefix', 'text_path', 'valid_text_path', 'valid_fraction',
              'noise_density', 'mean_noise_span_length'):
    del config.data[key]
  del config.tokenizer['num_sentinels']
  translation.validate(config)
  assert translation_model.requested_vocab_size(config) == config.tokenizer.vocab_size
  assert translation_model.text_to_text_tokenizers(config, marker, marker) == (marker, marker)


@pytest.mark.parametrize('overrides, message', [
    ({'data.text_path': ''}, 'data.text_path is empty'),
    ({'tokenizer.num_sentinels': 0}, 'needs sentinel ids'),
    ({'tokenizer.joint': False}, 'set tokenizer.joint=True'),
    ({'eval.test_prefix': 'test'}, 'span corruption has none'),
    ({'data.source_prefix': 'x: '}, 'data.source_prefix is for text-to-text'),
    ({'data.noise_density': 1.5}, 'noise_density must be in'),
    ({'data.task': 'denoise'}, "data.task must be 'translation' or 'span_corruption'"),
    ({'tokenizer.num_sentinels': 5, 'data.max_len': 512}, 'raise num_sentinels to'),
])
def test_span_corruption_settings_fail_before_anything_is_read(overrides, message, tmp_path):
  config = t5_span_corruption.get_config()
  config.data.text_path = str(tmp_path / 'never_read.txt')
  for key, value in overrides.items():
    section, name = key.split('.')
    config[section][name] = value
  with pytest.raises(ConfigError, match=message):
    translation.train_and_evaluate(config, str(tmp_path / 'work'))
  assert not (tmp_path / 'work').exists() or not list((tmp_path / 'work').iterdir())


def test_abstract_task_sizes_the_t5_configs_without_reading():
  """The planner's view (nothing read): the span-corruption model has 2,000 + 100 entries and
  its batches 16 rows of 128-token inputs and 32-token targets; the text-to-text one 8,100."""
  task, batch = translation.abstract_task(t5_span_corruption.get_config(), num_devices=1)
  assert task.cfg.vocab_size == 2_100
  assert (batch['inputs'].shape, batch['targets'].shape) == ((16, 128), (16, 32))
  task, batch = translation.abstract_task(t5_multi30k.get_config(), num_devices=1)
  assert task.cfg.vocab_size == 8_100
  assert batch['inputs'].shape == batch['targets'].shape == (56, 72)
