"""`experiments.lm --mode=evaluate`: loss, perplexity and bits per character/byte of a text file
over sliding windows (transformer_jax/{data,tasks,workflows}/lm.py).

The figures are checked against a hand computation that scores each token with its own window,
found by arithmetic and read unpadded, one full-model call per window; an imported Hugging Face
GPT-2 is checked against transformers' own logits. A tiny character GPT is trained once per
module (80 steps: enough to continue the text, so generations vary).
"""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from transformer_jax.data import lm as lm_data
from transformer_jax.errors import ConfigError, DataError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_TEXT = 'the quick brown fox jumps over the lazy dog. ' * 40
EVAL_TEXT = 'the lazy dog jumps over the quick brown fox. the end. the fox. '
WINDOW = 16

TINY = {
    'model.emb_dim': 32, 'model.num_heads': 2, 'model.mlp_dim': 64, 'model.num_decoder_layers': 2,
    'data.block_size': WINDOW, 'data.batch_size': 8, 'data.eval_batches': 1,
    'optimizer.learning_rate': 1e-2, 'optimizer.end_learning_rate': 1e-3,
    'optimizer.warmup_steps': 5, 'optimizer.decay_steps': 80, 'train.num_steps': 80,
    'train.log_every': 10, 'train.eval_every': 0, 'train.checkpoint_every': 0,
    'train.eval_max_batches': 0, 'eval.sample_tokens': 0, 'eval.sample_prompt': 'the '
}


def train_tiny_char_lm(root) -> str:
  """A workdir with an 80-step character GPT (context WINDOW) trained on TRAIN_TEXT."""
  from experiments.configs import shakespeare_char
  from transformer_jax.workflows import lm
  config = shakespeare_char.get_config()
  (root / 'train.txt').write_text(TRAIN_TEXT)
  config.data.path = str(root / 'train.txt')
  for key, value in TINY.items():
    section, leaf = key.split('.')
    config[section][leaf] = value
  workdir = str(root / 'work')
  lm.train_and_evaluate(config, workdir)
  return workdir


@pytest.fixture(scope='module')
def char_lm(tmp_path_factory):
  """(workdir, task, tokenizer, params, eval file) of the tiny character GPT."""
  from transformer_jax.cli.workdir import load_saved_config
  from transformer_jax.workflows import lm
  root = tmp_path_factory.mktemp('lm_eval')
  workdir = train_tiny_char_lm(root)
  model = lm.restore_for_inference(load_saved_config(workdir), workdir)
  (root / 'eval.txt').write_text(EVAL_TEXT)
  return workdir, model.task, model.tokenizer, model.params, str(root / 'eval.txt')


def hand_nll(logits_fn, tokens, window: int, stride: int) -> tuple[float, int]:
  """(summed NLL, count) with token j (j >= 1) predicted from window begin..begin+window, where
  begin = 0 if j <= window else the first multiple of `stride` whose window reaches j: the window
  of the sliding-window rule that first reaches j. Windows are read unpadded (the last is short).
  """
  tokens = [int(t) for t in tokens]
  log_probs, total = {}, 0.0
  for j in range(1, len(tokens)):
    begin = 0 if j <= window else -(-(j - window) // stride) * stride
    if begin not in log_probs:
      logits = np.asarray(logits_fn(tokens[begin:begin + window]), np.float64)
      log_probs[begin] = logits - np.log(
          np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) - logits.max(
              -1, keepdims=True)
    total -= log_probs[begin][j - 1 - begin, tokens[j]]
  return total, len(tokens) - 1


def _cli(module, *flags) -> subprocess.CompletedProcess:
  env = dict(os.environ, TRANSFORMER_JAX_ALLOCATOR='system', JAX_PLATFORMS='cpu',
             TF_CPP_MIN_LOG_LEVEL='2')
  env['PYTHONPATH'] = os.pathsep.join(filter(None, [REPO_ROOT, env.get('PYTHONPATH')]))
  return subprocess.run([sys.executable, '-m', module, *flags], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=600, check=False)


def _snapshot(directory) -> list:
  """Every path under `directory` with its size and modification time."""
  found = []
  for root, dirs, files in os.walk(directory):
    for name in dirs + files:
      path = os.path.join(root, name)
      stat = os.stat(path)
      found.append((os.path.relpath(path, directory), stat.st_size, stat.st_mtime_ns))
  return sorted(found)


def _one_error_line(result) -> str:
  assert result.returncode == 1, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], result.stderr
  return errors[0]


# -- windows ---------------------------------------------------------------------------------------


@pytest.mark.parametrize('length,window,stride', [(40, 8, 3), (40, 8, 8), (9, 8, 4), (5, 8, 2),
                                                  (33, 8, 1)])
def test_sliding_windows_score_every_token_once(length, window, stride):
  tokens = np.arange(100, 100 + length)  # token i is 100 + i: positions are readable
  w = lm_data.sliding_windows(tokens, window, stride)
  assert w['inputs'].shape == w['targets'].shape == w['weights'].shape
  assert w['inputs'].shape[1] == window
  scored = w['targets'][w['weights'] > 0]
  np.testing.assert_array_equal(np.sort(scored), tokens[1:])  # each target exactly once
  valid = w['weights'] > 0
  np.testing.assert_array_equal(w['targets'][valid], w['inputs'][valid] + 1)
  # Left context of a scored target: its position in the window + 1; at least window - stride
  # + 1 after the first window, everything before it within the first.
  context = np.broadcast_to(np.arange(window) + 1, valid.shape)[valid]
  targets = w['targets'][valid] - 100
  assert np.all((context >= window - stride + 1) | (context == targets))
  with pytest.raises(DataError, match='stride'):
    lm_data.sliding_windows(tokens, window, window + 1)
  with pytest.raises(DataError, match='stride'):
    lm_data.sliding_windows(tokens, window, 0)


# -- a trained character model -------------------------------------------------------------


def test_perplexity_equals_hand_computation_and_moves_with_stride(char_lm):
  import jax.numpy as jnp
  from transformer_jax.workflows import lm
  _, task, tokenizer, params, path = char_lm
  tokens = tokenizer.encode(EVAL_TEXT)

  def logits_fn(ids):
    return task.model.apply({'params': params}, jnp.asarray([ids], jnp.int32))[0]

  losses = {}
  for stride in (WINDOW, WINDOW // 2, 3, 1):
    # batch_size 3 leaves a partial last batch of weight-0 windows.
    result = lm.evaluate_file(task, params, tokenizer, path, stride, batch_size=3)
    nll, count = hand_nll(logits_fn, tokens, WINDOW, stride)
    assert result['tokens'] == count == len(EVAL_TEXT) - 1
    assert result['characters'] == len(EVAL_TEXT) - 1
    assert result['stride'] == stride and result['window'] == WINDOW
    assert result['loss'] == pytest.approx(nll / count, rel=1e-5, abs=0)
    assert result['perplexity'] == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert result['bits_per_character'] == pytest.approx(
        result['loss'] / math.log(2) * result['tokens'] / result['characters'], rel=1e-12)
    losses[stride] = result['loss']
  # A different stride gives tokens different contexts: different figures (each exact above).
  values = list(losses.values())
  assert min(abs(a - b) for i, a in enumerate(values) for b in values[i + 1:]) > 1e-4, losses
  assert lm.evaluate_file(task, params, tokenizer, path)['stride'] == WINDOW // 2  # the default
  # On text like the training text, context helps: disjoint windows (stride = WINDOW) leave the
  # token after each window start with almost none, half-window strides give every token at
  # least WINDOW / 2 + 1. (EVAL_TEXT reorders the sentence, where the memorised context misleads.)
  seen = os.path.join(os.path.dirname(path), 'seen.txt')
  with open(seen, 'w') as f:
    f.write(TRAIN_TEXT[7:307])
  disjoint = lm.evaluate_file(task, params, tokenizer, seen, WINDOW)['loss']
  halves = lm.evaluate_file(task, params, tokenizer, seen, WINDOW // 2)['loss']
  assert halves < 0.8 * disjoint, (halves, disjoint)
  print(
      f'training-like text: stride {WINDOW} loss {disjoint:.4f}, stride {WINDOW // 2} {halves:.4f}')
  print('char losses by stride:', losses)


def test_evaluate_cli_prints_the_figures_and_writes_nothing(char_lm):
  from transformer_jax.workflows import lm
  workdir, task, tokenizer, params, path = char_lm
  before = _snapshot(workdir)
  result = _cli('experiments.lm', '--mode=evaluate', f'--workdir={workdir}', f'--input={path}',
                '--stride=4')
  assert result.returncode == 0, result.stderr[-3000:]
  printed = json.loads(result.stdout.strip().splitlines()[-1])
  expected = lm.evaluate_file(task, params, tokenizer, path, 4)
  assert set(printed) == set(expected)
  for key in ('tokens', 'characters', 'window', 'stride', 'windows'):
    assert printed[key] == expected[key]
  for key in ('loss', 'perplexity', 'bits_per_character'):
    assert printed[key] == pytest.approx(expected[key], rel=1e-6)
  assert _snapshot(workdir) == before


def test_evaluate_errors_are_one_line_and_write_nothing(char_lm, tmp_path):
  workdir, task, tokenizer, params, path = char_lm
  from transformer_jax.workflows import lm
  # Another family's workdir (a BERT one: tokenizer.type 'wordpiece', no data.block_size).
  bert = tmp_path / 'bert'
  bert.mkdir()
  (bert / 'config.json').write_text(
      json.dumps({'tokenizer': {'type': 'wordpiece'}, 'data': {'train': 'x.tsv'}}))
  # A language-model workdir whose training never saved a checkpoint.
  empty = tmp_path / 'no_checkpoint'
  empty.mkdir()
  for name in ('config.json', 'tokenizer.json'):
    shutil.copy(os.path.join(workdir, name), empty / name)
  cases = [
      ((f'--workdir={bert}', f'--input={path}'), 'not a language-model workdir'),
      ((f'--workdir={empty}', f'--input={path}'), 'no checkpoint in'),
      ((f'--workdir={workdir}', f'--input={path}', '--stride=17'), '--stride must be in [1, 16]'),
      ((f'--workdir={workdir}', f'--input={tmp_path}/none.txt'), 'none.txt does not exist'),
      ((f'--workdir={workdir}', f'--hf_dir={tmp_path}', f'--input={path}'), 'exactly one of'),
  ]
  before = {d: _snapshot(d) for d in (workdir, bert, empty)}
  for flags, message in cases:
    line = _one_error_line(_cli('experiments.lm', '--mode=evaluate', *flags))
    assert message in line, (flags, line)
  assert {d: _snapshot(d) for d in before} == before
  (tmp_path / 'one.txt').write_text('t')
  with pytest.raises(DataError, match='too short'):
    lm.evaluate_file(task, params, tokenizer, str(tmp_path / 'one.txt'))
  with pytest.raises(ConfigError, match='stride'):
    lm.evaluate_file(task, params, tokenizer, path, 0)


# -- an imported Hugging Face causal LM of every family -------------------------------------------

BPE_TEXT = ('A café in Zürich serves crème brûlée — naïve visitors pay €4. ' * 3 +
            'The quick brown fox jumps over the lazy dog. ' * 6)


def _hf_causal_lm(transformers, family: str, eos_id: int):
  """A small random causal LM of `family` with a 24-token context and 300 ids."""
  common = dict(vocab_size=300, bos_token_id=eos_id, eos_token_id=eos_id)
  if family == 'gpt2':
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=24, **common))
  if family == 'llama':
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=64,
                                 max_position_embeddings=24, **common))
  return transformers.OPTForCausalLM(
      transformers.OPTConfig(hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
                             max_position_embeddings=24, dropout=0.0, attention_dropout=0.0,
                             pad_token_id=299, **common))


def save_random_causal_lm(folder, family: str):
  """Saves into `folder` a random `_hf_causal_lm` of `family` (weights perturbed so that its
  logits vary) and a byte-level BPE trained on BPE_TEXT, as transformers writes them; returns
  (the torch model, in eval mode, and the tokenizer)."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  from transformer_jax.data.hf_tokenizer import HFTokenizer
  tokenizer = HFTokenizer.train_byte_level_bpe(BPE_TEXT.split('. '), 300)
  torch.manual_seed(0)
  model = _hf_causal_lm(transformers, family, tokenizer.eos_id)
  with torch.no_grad():  # a random model's logits are near-uniform: make them vary
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  model.eval().save_pretrained(str(folder), safe_serialization=True)
  tokenizer.save(str(folder))
  return model, tokenizer


@pytest.mark.parity
@pytest.mark.parametrize('family', ['gpt2', 'llama', 'opt'])
def test_hf_bits_per_byte_matches_transformers_logits(family, tmp_path):
  torch = pytest.importorskip('torch')
  from transformer_jax.workflows import lm
  model, tokenizer = save_random_causal_lm(tmp_path / family, family)
  text_path = tmp_path / 'text.txt'
  text_path.write_text(BPE_TEXT, encoding='utf-8')

  task, loaded, params = lm.load_hf_model(str(tmp_path / family))
  tokens = [tokenizer.eos_id] + tokenizer.encode(BPE_TEXT)  # every text token is predicted
  assert len(tokens) > 3 * 24  # several windows

  def logits_fn(ids):
    with torch.no_grad():
      return model(torch.tensor([ids])).logits[0].double().numpy()

  num_bytes = len(BPE_TEXT.encode('utf-8'))
  assert num_bytes > len(BPE_TEXT)  # multi-byte characters: bytes are not characters
  for stride in (24, 12, 5):
    result = lm.evaluate_file(task, params, loaded, str(text_path), stride)
    nll, count = hand_nll(logits_fn, tokens, 24, stride)
    assert result['tokens'] == count and result['bytes'] == num_bytes
    assert result['loss'] == pytest.approx(nll / count, rel=1e-5)
    assert result['bits_per_byte'] == pytest.approx(nll / math.log(2) / num_bytes, rel=1e-5)
    print(f'{family} stride {stride}: ours {result["loss"]:.7f} transformers {nll / count:.7f}')
  cli = _cli('experiments.lm', '--mode=evaluate', f'--hf_dir={tmp_path / family}',
             f'--input={text_path}', '--stride=12')
  assert cli.returncode == 0, cli.stderr[-3000:]
  printed = json.loads(cli.stdout.strip().splitlines()[-1])
  assert printed['bits_per_byte'] == pytest.approx(
      lm.evaluate_file(task, params, loaded, str(text_path), 12)['bits_per_byte'], rel=1e-6)
