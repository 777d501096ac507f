"""Prompts of any lengths in one batch: every row gets what its prompt gets alone.

`inference/generation.py` right-pads a batch, prefills it in one call and moves each row's cache
position back to its own prompt's end; from there each row writes its own slots. These tests
generate a batch of prompts of lengths 1..40 (shuffled, so neighbours differ) and compare each
row with the prompt run alone: greedy ids, and sampled ids with one key per row. Models: GPT-2
(learned positions), LLaMA (rotary, grouped-query heads), a causal model with T5's relative
bias, and the translation model's decoder (sources of lengths 1..40).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.gpt import gpt2_config, llama_config
from transformer_jax.special_tokens import PAD_ID
from transformer_jax.tasks.lm import LanguageModelTask
from transformer_jax.tasks.translation import TranslationTask

VOCAB = 53
LENGTHS = np.random.default_rng(0).permutation(np.arange(1, 41))


def _config(model: str, max_len: int = 64):
  base = dict(vocab_size=VOCAB, emb_dim=32, num_heads=4, mlp_dim=48, num_decoder_layers=2,
              max_len=max_len, dropout_rate=0.0, attention_dropout_rate=0.0)
  if model == 'llama':
    return llama_config(**base, num_kv_heads=2)
  if model == 'relative':  # T5's bias in a causal stack: per-row query positions over the slots
    return gpt2_config(**base, position='relative', relative_buckets=16, relative_max_distance=32)
  return gpt2_config(**base)


@pytest.fixture(scope='module')
def models():
  built = {}

  def get(model, max_len=64):
    if (model, max_len) not in built:
      task = LanguageModelTask(_config(model, max_len))
      built[model, max_len] = task, task.init_variables(jax.random.key(1))['params']
    return built[model, max_len]

  return get


def _prompts(lengths, seed=2):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, VOCAB, size=n).astype(np.int32) for n in lengths]


def _alone(task, params, prompts, new, keys, **sampling):
  return [task.generate(params, [p], new, key, **sampling)[0] for p, key in zip(prompts, keys)]


@pytest.mark.parametrize('model', ['gpt2', 'llama', 'relative'])
def test_a_ragged_batch_gives_each_prompt_its_greedy_ids_alone(models, model):
  task, params = models(model)
  prompts = _prompts(LENGTHS)
  batch = task.generate(params, prompts, 10, jax.random.key(0), temperature=0.0)
  assert batch.shape == (len(prompts), 10)
  alone = _alone(task, params, prompts, 10, [jax.random.key(0)] * len(prompts), temperature=0.0)
  np.testing.assert_array_equal(batch, np.stack(alone))


@pytest.mark.parametrize('model', ['gpt2', 'llama'])
def test_sampling_with_a_key_per_row_gives_each_prompt_its_draws_alone(models, model):
  task, params = models(model)
  prompts = _prompts(LENGTHS[:24], seed=3)
  keys = jax.random.split(jax.random.key(9), len(prompts))
  sampling = dict(temperature=1.3, top_k=30, top_p=0.9)
  batch = task.generate(params, prompts, 12, keys, **sampling)
  alone = _alone(task, params, prompts, 12, keys, **sampling)
  np.testing.assert_array_equal(batch, np.stack(alone))
  # The keys matter: another key gives other draws.
  other = task.generate(params, prompts, 12, jax.random.split(jax.random.key(10), len(prompts)),
                        **sampling)
  assert (other != batch).any()


def test_per_row_budgets_settings_and_eos(models):
  """Each row its own budget, temperature and EOS point; the batch equals the rows alone."""
  task, params = models('gpt2')
  prompts = _prompts([3, 17, 1, 30, 8], seed=4)
  budgets = [5, 12, 1, 9, 12]
  temperatures = [0.0, 1.0, 0.7, 0.0, 1.5]
  keys = jax.random.split(jax.random.key(4), len(prompts))
  greedy_row = task.generate(params, [prompts[0]], 5, keys[0], temperature=0.0)[0]
  eos = int(greedy_row[2])  # row 0 then ends at its third token, or earlier
  batch = task.generate(params, prompts, budgets, keys, temperature=temperatures, eos_id=eos)
  assert batch.shape == (5, 12)
  for i, (prompt, budget, temperature) in enumerate(zip(prompts, budgets, temperatures)):
    alone = task.generate(params, [prompt], budget, keys[i], temperature=temperature, eos_id=eos)[0]
    np.testing.assert_array_equal(batch[i, :budget], alone, err_msg=f'row {i}')
    assert (batch[i, budget:] == PAD_ID).all()
  assert eos in batch[0] and (batch[0, list(batch[0]).index(eos) + 1:] == PAD_ID).all()


@pytest.mark.parametrize('model', ['gpt2', 'llama'])
def test_past_the_context_each_row_goes_on_in_its_own_segments(models, model):
  """A context of 16: prompts of 1..20 tokens (the longest cropped) and 30 new tokens take
  several segments, which start at different tokens for different rows."""
  task, params = models(model, 16)
  prompts = _prompts([1, 20, 7, 16, 12, 4], seed=5)
  keys = jax.random.split(jax.random.key(5), len(prompts))
  for sampling in (dict(temperature=0.0), dict(temperature=1.0, top_k=10)):
    batch = task.generate(params, prompts, 30, keys, **sampling)
    np.testing.assert_array_equal(batch,
                                  np.stack(_alone(task, params, prompts, 30, keys, **sampling)))
    streamed = np.stack(list(task.generate_stream(params, prompts, 30, keys, **sampling)), 1)
    np.testing.assert_array_equal(streamed, batch)


def test_the_stream_of_a_ragged_batch_equals_generate(models):
  task, params = models('llama')
  prompts = _prompts(LENGTHS[:8], seed=6)
  keys = jax.random.split(jax.random.key(6), len(prompts))
  whole = task.generate(params, prompts, 9, keys, temperature=0.9)
  columns = list(task.generate_stream(params, prompts, 9, keys, temperature=0.9))
  np.testing.assert_array_equal(np.stack(columns, 1), whole)


@pytest.mark.parametrize('bad, message', [
    ([], 'batch is empty'),
    ([[1, 2], []], 'prompt 1 must be a non-empty'),
])
def test_bad_prompts_are_one_line(models, bad, message):
  task, params = models('gpt2')
  with pytest.raises(ConfigError, match=message):
    task.generate(params, bad, 4, jax.random.key(0))


def test_bad_settings_are_one_line(models):
  task, params = models('gpt2')
  prompts = _prompts([2, 3])
  with pytest.raises(ConfigError, match='max_new_tokens must be positive'):
    task.generate(params, prompts, [3, 0], jax.random.key(0))
  with pytest.raises(ConfigError, match='one value or one per prompt'):
    task.generate(params, prompts, 3, jax.random.key(0), temperature=[1.0, 1.0, 1.0])
  with pytest.raises(ConfigError, match='one key or one per prompt'):
    task.generate(params, prompts, 3, jax.random.split(jax.random.key(0), 3))


def test_the_translation_decoder_gives_each_source_its_ids_alone():
  """Sources of lengths 1..40 in one batch (padded, masked) decode as each does alone: greedy
  and beam."""
  cfg = TransformerConfig(vocab_size=VOCAB, emb_dim=32, num_heads=4, mlp_dim=48,
                          num_encoder_layers=2, num_decoder_layers=2, max_len=48, dropout_rate=0.0,
                          attention_dropout_rate=0.0)
  task = TranslationTask(cfg)
  params = task.init_variables(jax.random.key(3))['params']
  sources = _prompts(LENGTHS, seed=7)
  inputs = np.zeros((len(sources), 40), np.int32)
  for i, source in enumerate(sources):
    inputs[i, :len(source)] = np.maximum(source, 2)  # no PAD or EOS inside a source
  for beam_size in (1, 3):
    predict = jax.jit(
        lambda p, x, b=beam_size: task.predict_tokens(p, x, max_len=12, beam_size=b, alpha=0.6))
    batch = np.asarray(predict(params, jnp.asarray(inputs)))
    for i, source in enumerate(sources):
      alone = np.asarray(predict(params, jnp.asarray(inputs[i:i + 1, :len(source)])))[0]
      np.testing.assert_array_equal(batch[i], alone, err_msg=f'beam {beam_size} source {i}')
