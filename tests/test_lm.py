"""Tests for language-model data, training and generation (transformer_jax/{data,tasks,runs}/lm).

One tiny character model is trained once per module (`trained_workdir`) on a short repeated
text; the overfitting, generation and command-line tests share it.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from transformer_jax.data import lm as lm_data
from transformer_jax.errors import ConfigError, DataError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = 'the quick brown fox jumps over the lazy dog. ' * 60


def set_path(config, dotted_key: str, value):
  *parents, leaf = dotted_key.split('.')
  node = config
  for part in parents:
    node = node[part]
  if leaf not in node:
    raise KeyError(dotted_key)
  node[leaf] = value


TINY = {
    'model.emb_dim': 32,
    'model.num_heads': 2,
    'model.mlp_dim': 64,
    'model.num_decoder_layers': 2,
    'data.block_size': 16,
    'data.batch_size': 8,
    'data.eval_batches': 2,
    'optimizer.learning_rate': 1e-2,
    'optimizer.end_learning_rate': 1e-3,
    'optimizer.warmup_steps': 10,
    'optimizer.decay_steps': 120,
    'train.num_steps': 120,
    'train.log_every': 10,
    'train.eval_every': 0,
    'train.checkpoint_every': 0,
    'train.eval_max_batches': 0,
    'eval.sample_tokens': 20,
    'eval.sample_prompt': 'the ',
}


def tiny_char_config(**overrides):
  from experiments.configs import shakespeare_char
  config = shakespeare_char.get_config()
  for key, value in dict(TINY, **{k.replace('__', '.'): v for k, v in overrides.items()}).items():
    set_path(config, key, value)
  return config


# -- tokenizer and text ---------------------------------------------------------------------------


def test_char_tokenizer_round_trip_and_save_load(tmp_path):
  text = 'Hello, World!\nÉtude ü'
  tokenizer = lm_data.CharTokenizer.from_text(text)
  assert tokenizer.chars == sorted(set(text))
  assert tokenizer.vocab_size == len(set(text))
  ids = tokenizer.encode(text)
  assert tokenizer.decode(ids) == text
  assert tokenizer.decode(np.asarray(ids)) == text
  path = str(tmp_path / 'vocab' / 'tokenizer.json')
  tokenizer.save(path)
  assert not [f for f in os.listdir(tmp_path / 'vocab') if '.tmp' in f]
  loaded = lm_data.CharTokenizer.load(path)
  assert loaded.chars == tokenizer.chars and loaded.encode(text) == ids
  # load_or_build keeps the saved vocabulary (a resumed run must keep its ids).
  again = lm_data.CharTokenizer.load_or_build(path, 'completely different')
  assert again.chars == tokenizer.chars


def test_char_tokenizer_unknown_characters(tmp_path):
  tokenizer = lm_data.CharTokenizer.from_text('abc')
  with pytest.raises(DataError, match=r"character 'z' \(at position 2\)"):
    tokenizer.encode('abz')
  assert tokenizer.encode('abz', skip_unknown=True) == [0, 1]
  bad = tmp_path / 'bad.json'
  bad.write_text('{"chars": ["a"]}')
  with pytest.raises(DataError, match='not a character vocabulary'):
    lm_data.CharTokenizer.load(str(bad))
  with pytest.raises(DataError, match='missing'):
    lm_data.CharTokenizer.load(str(tmp_path / 'none.json'))


def test_split_train_val():
  text = ''.join(chr(ord('a') + i % 26) for i in range(1000))
  train, valid = lm_data.split_train_val(text, 0.9)
  assert train == text[:900] and valid == text[900:]
  with pytest.raises(DataError):
    lm_data.split_train_val(text, 1.0)


# -- windows --------------------------------------------------------------------------------------


def test_random_windows_shapes_and_shift():
  tokens = np.arange(500, dtype=np.uint16)
  data = lm_data.RandomWindows(tokens, block_size=16, batch_size=6, seed=0)
  batch = next(iter(data))
  assert batch['inputs'].shape == batch['targets'].shape == (6, 16)
  assert batch['inputs'].dtype == batch['targets'].dtype == np.int32
  # tokens are their own positions, so each window is a run of consecutive numbers
  np.testing.assert_array_equal(batch['targets'], batch['inputs'] + 1)
  np.testing.assert_array_equal(np.diff(batch['inputs'], axis=1), 1)
  assert batch['targets'].max() < 500
  starts = np.concatenate([b['inputs'][:, 0] for b in (data.batch(s) for s in range(200))])
  assert starts.min() == 0 and starts.max() == 500 - 17  # every window can be drawn


def test_random_windows_depend_on_the_seed_and_the_step():
  tokens = np.random.default_rng(0).integers(0, 50, size=2000)
  first = lm_data.RandomWindows(tokens, block_size=8, batch_size=4, seed=3)
  it = iter(first)
  seen = [next(it) for _ in range(5)]
  assert first.state() == {'step': 5}
  other = iter(lm_data.RandomWindows(tokens, block_size=8, batch_size=4, seed=4))
  assert not np.array_equal(next(other)['inputs'], seen[0]['inputs'])
  assert not np.array_equal(seen[0]['inputs'], seen[1]['inputs'])


def test_random_windows_split_over_processes():
  tokens = np.arange(1000)
  whole = lm_data.RandomWindows(tokens, block_size=8, batch_size=6, seed=1).batch(7)
  parts = [
      lm_data.RandomWindows(tokens, block_size=8, batch_size=6, seed=1, process_index=i,
                            process_count=3).batch(7) for i in range(3)
  ]
  np.testing.assert_array_equal(np.concatenate([p['inputs'] for p in parts]), whole['inputs'])


def test_eval_batches_fixed_and_short_text_error():
  tokens = np.arange(300)
  a = lm_data.eval_batches(tokens, 8, 4, 3, seed=0)
  b = lm_data.eval_batches(tokens, 8, 4, 3, seed=0)
  assert len(a) == 3 and a[0]['inputs'].shape == (4, 8)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x['targets'], y['targets'])
  with pytest.raises(DataError, match='block_size'):
    lm_data.RandomWindows(np.arange(8), block_size=8, batch_size=2, seed=0)


# -- training and generation ----------------------------------------------------------------------


@pytest.fixture(scope='module')
def trained_workdir(tmp_path_factory):
  """A tiny character GPT trained on TEXT; returns (workdir, results, config)."""
  from transformer_jax.workflows import lm
  root = tmp_path_factory.mktemp('lm')
  text_path = root / 'text.txt'
  text_path.write_text(TEXT)
  config = tiny_char_config(data__path=str(text_path))
  workdir = str(root / 'work')
  results = lm.train_and_evaluate(config, workdir)
  return workdir, results, config


@pytest.mark.slow
def test_tiny_model_overfits(trained_workdir):
  workdir, results, _ = trained_workdir
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  train_losses = [r['train/loss'] for r in records if 'train/loss' in r]
  vocab = len(set(TEXT))
  # Initial logits are near zero (embeddings of std 0.02), so the loss starts at ln(V).
  assert train_losses[0] > 0.5 * math.log(vocab)
  assert train_losses[-1] < 0.5 * train_losses[0], train_losses
  assert results['eval_loss'] < 0.5 * math.log(vocab)
  assert results['step'] == 120 and results['params'] > 0
  assert results['tokens'] == 120 * 8 * 16


@pytest.mark.slow
def test_generation_is_deterministic_and_continues_the_text(trained_workdir):
  from transformer_jax.workflows import lm
  import jax
  workdir, _, config = trained_workdir
  model = lm.restore_for_inference(config, workdir)
  task, tokenizer, params = model.task, model.tokenizer, model.params
  prompt = np.asarray([tokenizer.encode('the quick ')] * 2, np.int32)
  # 40 new tokens > block_size 16: the cached generation continues in segments.
  greedy = task.generate(params, prompt, 40, jax.random.key(0), temperature=0.0)
  assert greedy.shape == (2, 40)
  text = tokenizer.decode(greedy[0])
  expected = TEXT[len('the quick '):][:40]
  # The model has memorised the sentence: greedy decoding reproduces most of it.
  agreement = np.mean([a == b for a, b in zip(text, expected)])
  assert agreement > 0.8, (text, expected)
  a = task.generate(params, prompt, 30, jax.random.key(1), temperature=1.5)
  b = task.generate(params, prompt, 30, jax.random.key(1), temperature=1.5)
  c = task.generate(params, prompt, 30, jax.random.key(2), temperature=1.5)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  with pytest.raises(ConfigError):
    task.generate(params, prompt, 0, jax.random.key(0))


def _generate_cli(workdir, *flags):
  env = dict(os.environ, TRANSFORMER_JAX_ALLOCATOR='system', JAX_PLATFORMS='cpu',
             TF_CPP_MIN_LOG_LEVEL='2')
  env['PYTHONPATH'] = os.pathsep.join(filter(None, [REPO_ROOT, env.get('PYTHONPATH')]))
  return subprocess.run(
      [sys.executable, '-m', 'experiments.generate', f'--workdir={workdir}', *flags], cwd=REPO_ROOT,
      env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow
def test_generate_cli_same_seed_same_text(trained_workdir):
  workdir, _, _ = trained_workdir
  args = ('--prompt=the ', '--max_new_tokens=30', '--temperature=1.2', '--top_k=10', '--top_p=0.95',
          '--num_samples=2')
  first = _generate_cli(workdir, *args, '--seed=5')
  assert first.returncode == 0, first.stderr[-3000:]
  second = _generate_cli(workdir, *args, '--seed=5')
  assert second.returncode == 0, second.stderr[-3000:]
  assert first.stdout == second.stdout
  assert first.stdout.startswith('the ')
  samples = first.stdout.rstrip('\n').split('\n' + '-' * 40 + '\n')
  assert len(samples) == 2 and all(len(s) == len('the ') + 30 for s in samples)
  # An unknown character is one readable error line.
  bad = _generate_cli(workdir, '--prompt=the ~', '--max_new_tokens=5')
  assert bad.returncode == 1
  assert [line for line in bad.stderr.splitlines() if line.startswith('error:')] == [
      "error: character '~' (at position 4) is not in the "
      f'{len(set(TEXT))}-character vocabulary of this model'
  ]


@pytest.mark.slow
def test_gpt2_small_config_runs_tiny_on_mock_lm1b(tmp_path):
  import tensorflow_datasets as tfds
  from experiments.configs import gpt2_small
  from transformer_jax.workflows import lm
  config = gpt2_small.get_config()
  assert (config.model.num_decoder_layers, config.model.num_heads, config.model.emb_dim,
          config.data.block_size, config.tokenizer.vocab_size) == (12, 12, 768, 1024, 32_000)
  for key, value in {
      'model.emb_dim': 32, 'model.num_heads': 2, 'model.mlp_dim': 64, 'model.num_decoder_layers': 1,
      'data.block_size': 16, 'data.batch_size': 4, 'data.eval_batches': 1,
      'data.max_valid_examples': 0, 'tokenizer.vocab_size': 60, 'train.num_steps': 3,
      'train.log_every': 1, 'train.eval_every': 0, 'train.checkpoint_every': 0,
      'optimizer.warmup_steps': 1, 'optimizer.decay_steps': 3, 'eval.sample_tokens': 20
  }.items():
    set_path(config, key, value)
  with tfds.testing.mock_data(num_examples=64):
    results = lm.train_and_evaluate(config, str(tmp_path))
  assert results['step'] == 3
  assert np.isfinite(results['eval_loss'])
  assert os.path.exists(tmp_path / 'spm.model')


@pytest.mark.slow
def test_tfds_tiny_shakespeare_source_on_mock_data(tmp_path):
  import tensorflow_datasets as tfds
  from transformer_jax.workflows import lm
  config = tiny_char_config(data__source='tfds', data__block_size=4, data__batch_size=2,
                            data__eval_batches=1, train__num_steps=2, train__log_every=1,
                            optimizer__warmup_steps=1, optimizer__decay_steps=2,
                            eval__sample_tokens=5, eval__sample_prompt=' ')
  assert config.data.tfds_name == 'tiny_shakespeare'
  with tfds.testing.mock_data(num_examples=1):
    text = next(iter(tfds.as_numpy(tfds.load('tiny_shakespeare', split='train'))))['text']
    text = text.decode('utf-8')
    config.eval.sample_prompt = text[0]  # mock text is random letters
    results = lm.train_and_evaluate(config, str(tmp_path))
  assert results['step'] == 2 and np.isfinite(results['eval_loss'])
  vocab = lm_data.CharTokenizer.load(str(tmp_path / 'tokenizer.json'))
  assert vocab.chars == sorted(set(text))
  corpus = lm.prepared_corpus(lm.sections_of(config), str(tmp_path))
  train = corpus.split('train')
  assert train.tokens(0, len(train)).tolist() == vocab.encode(text)  # one example, as it is


def test_lm_sections_are_typed_once_and_name_a_wrong_key():
  """workflows/lm_sections.py: every LM config reads into its sections; a typo or a value out of
  range is one ConfigError line naming the key."""
  from experiments.configs import gpt2_small, llama_shakespeare, shakespeare_char
  from transformer_jax.workflows import lm
  for module in (shakespeare_char, llama_shakespeare, gpt2_small):
    config = module.get_config()
    sections = lm.sections_of(config)
    assert sections.data.block_size == config.data.block_size == sections.model.max_len
    assert isinstance(sections.eval.top_p, float) and sections.run.seed == config.seed
  config = shakespeare_char.get_config()
  config.data.block_sise = 8
  with pytest.raises(ConfigError, match="section 'data' has no key 'block_sise'; did you mean "
                     'block_size'):
    lm.validate(config)
  config = shakespeare_char.get_config()
  config.eval.top_p = 0.0
  with pytest.raises(ConfigError, match=r'eval: need .*0 < top_p <= 1'):
    lm.sections_of(config)
