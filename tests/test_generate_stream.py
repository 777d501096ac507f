"""`experiments.generate`: tokens streamed as they are drawn (`LanguageModelTask.generate_stream`,
`data.lm.IncrementalDecoder`), and prompts from a file generated in batches.

Streaming must give exactly the one-shot sampler's tokens for the same seed, greedy and sampled,
through EOS and past the context (segments); a prompts-file batch must give each prompt what it
gets alone. The command line runs on a trained character workdir and on small random Hugging Face
LLaMA and OPT folders (`--hf_dir`).
"""

import io
import json
import os

import numpy as np
import pytest

from test_lm_evaluate import (_cli, _one_error_line, _snapshot, save_random_causal_lm,
                              train_tiny_char_lm)

from transformer_jax.data import lm as lm_data
from transformer_jax.special_tokens import PAD_ID


def _streamed(task, params, prompt, num, rng, **kw) -> np.ndarray:
  columns = list(task.generate_stream(params, prompt, num, rng, **kw))
  out = np.stack(columns, 1)
  return np.pad(out, ((0, 0), (0, num - out.shape[1])), constant_values=PAD_ID)


def test_incremental_decoder_prints_whole_characters():
  from transformer_jax.data.hf_tokenizer import HFTokenizer
  text = 'naïve café — 日本語の文章 🙂 and émigré 🎉 déjà vu'
  tokenizer = HFTokenizer.train_byte_level_bpe(['plain english words only'] * 20, 270)
  ids = tokenizer.encode(text)
  decoder = lm_data.IncrementalDecoder(tokenizer)
  pieces = [decoder.push(i) for i in ids]
  pieces.append(decoder.finish())
  assert ''.join(pieces) == tokenizer.decode(ids) == text
  assert not any('\ufffd' in p for p in pieces)
  assert pieces.count('') >= 10  # multi-byte characters waited for their last byte
  # Decoding token by token would have printed broken characters.
  assert '\ufffd' in ''.join(tokenizer.decode([i]) for i in ids)


# -- the command line, on a trained character model --------------------------------------------


@pytest.fixture(scope='module')
def char_workdir(tmp_path_factory):
  return train_tiny_char_lm(tmp_path_factory.mktemp('gen_stream'))


@pytest.fixture(scope='module')
def char_lm(char_workdir):
  """(task, tokenizer, params) restored from `char_workdir`: context 16, 28 characters."""
  from transformer_jax.cli.workdir import load_saved_config
  from transformer_jax.workflows import lm
  model = lm.restore_for_inference(load_saved_config(char_workdir), char_workdir)
  return model.task, model.tokenizer, model.params


@pytest.mark.parametrize(
    'sampling',
    [dict(temperature=0.0), dict(temperature=1.0, top_k=20, top_p=0.95)], ids=['greedy', 'sampled'])
def test_stream_equals_generate(char_lm, sampling):
  import jax
  task, tokenizer, params = char_lm
  prompt = np.asarray([tokenizer.encode('the q'), tokenizer.encode('fox j')], np.int32)
  rng = jax.random.key(7)
  # 40 new tokens after 5: past the 16-token context, so three more segments.
  expected = task.generate(params, prompt, 40, rng, **sampling, eos_id=-1)
  if sampling.get('temperature'):  # a real draw: another seed gives other tokens
    assert not np.array_equal(
        task.generate(params, prompt, 40, jax.random.key(8), **sampling, eos_id=-1), expected)
  else:  # greedy choices are not all the same token
    assert len(set(expected.ravel().tolist())) > 3
  np.testing.assert_array_equal(_streamed(task, params, prompt, 40, rng, **sampling, eos_id=-1),
                                expected)
  # With an EOS: a token row 0 first draws in a later segment (step >= 12); row 0 ends there and
  # is PAD after it, row 1 runs on (or ends where that token comes up in it).
  row = expected[0].tolist()
  later = [t for i, t in enumerate(row) if i >= 12 and t not in row[:i]]
  eos = later[0] if later else row[20]
  with_eos = task.generate(params, prompt, 40, rng, **sampling, eos_id=eos)
  assert np.all(with_eos[0, np.argmax(with_eos[0] == eos) + 1:] == PAD_ID)
  np.testing.assert_array_equal(_streamed(task, params, prompt, 40, rng, **sampling, eos_id=eos),
                                with_eos)
  # Both rows ending: the stream stops early, at the last EOS.
  single = prompt[:1]
  first = task.generate(params, single, 40, rng, **sampling, eos_id=eos)
  assert eos in first[0]
  columns = list(task.generate_stream(params, single, 40, rng, **sampling, eos_id=eos))
  assert len(columns) == int(np.argmax(first[0] == eos)) + 1
  np.testing.assert_array_equal(np.concatenate(columns), first[0, :len(columns)])


# What the command line generates from: the character workdir (--workdir; shakespeare_char.py's
# model is GPT-2's architecture) or a Hugging Face folder of a causal family (--hf_dir).
SOURCES = [
    'char',
    pytest.param('llama', marks=pytest.mark.parity),
    pytest.param('opt', marks=pytest.mark.parity)
]


@pytest.fixture(scope='module')
def hf_lms(tmp_path_factory):
  """family -> (folder, task, tokenizer, params): a random causal LM of that family with a
  24-token context (test_lm_evaluate._hf_causal_lm) and a byte-level BPE, saved by transformers
  and imported here; built on first use."""
  built = {}

  def get(family):
    if family not in built:
      from transformer_jax.workflows import lm
      folder = tmp_path_factory.mktemp(family)
      save_random_causal_lm(folder, family)
      built[family] = (str(folder), *lm.load_hf_model(str(folder)))
    return built[family]

  return get


@pytest.fixture
def source(request, char_workdir, char_lm, hf_lms):
  """(the flag naming the model, task, tokenizer, params) of the case `request.param`."""
  if request.param == 'char':
    return (f'--workdir={char_workdir}', *char_lm)
  folder, task, tokenizer, params = hf_lms(request.param)
  return (f'--hf_dir={folder}', task, tokenizer, params)


def _one_shot(task, tokenizer, params, prompt, new, key, **sampling) -> list[int]:
  """The ids `experiments.generate` continues `prompt` alone with, up to EOS."""
  from experiments.generate import until_eos
  ids = np.asarray([lm_data.prompt_ids(tokenizer, prompt)], np.int32)
  return until_eos(task.generate(params, ids, new, key, **sampling)[0], task.eos_id)


class _Recorder(io.StringIO):
  """stdout that counts its flushes."""
  flushes = 0

  def flush(self):
    self.flushes += 1


def test_stream_one_flushes_per_token_and_prints_the_one_shot_text(char_lm, monkeypatch):
  import jax
  from experiments import generate
  task, tokenizer, params = char_lm
  for sampling in (dict(temperature=0.0), dict(temperature=1.2, top_k=5)):
    recorder = _Recorder()
    monkeypatch.setattr('sys.stdout', recorder)
    generate.stream_one(task, tokenizer, params, 'the ', 30, jax.random.key(3), **sampling)
    monkeypatch.undo()
    one_shot = task.generate(params, np.asarray([tokenizer.encode('the ')], np.int32), 30,
                             jax.random.key(3), **sampling)[0]
    assert recorder.getvalue() == 'the ' + tokenizer.decode(one_shot) + '\n'
    assert recorder.flushes == 1 + 30 + 1  # the prompt, each token, the end


@pytest.mark.slow
@pytest.mark.parametrize('source', SOURCES, indirect=True)
def test_cli_stream_equals_one_shot(source):
  import jax
  flag, task, tokenizer, params = source
  directory = flag.split('=', 1)[1]
  before = _snapshot(directory)
  # Sampled (greedy: in-process above); seed 5 draws no EOS before the models' contexts end.
  args = (flag, '--prompt=the ', '--max_new_tokens=40', '--temperature=1.0', '--top_k=8',
          '--seed=5')
  streamed = _cli('experiments.generate', *args)
  one_shot = _cli('experiments.generate', *args, '--stream=false')
  assert streamed.returncode == 0 and one_shot.returncode == 0, streamed.stderr[-3000:]
  assert streamed.stdout == one_shot.stdout
  ids = _one_shot(task, tokenizer, params, 'the ', 40, jax.random.key(5), temperature=1.0, top_k=8)
  assert streamed.stdout == 'the ' + tokenizer.decode(ids) + '\n'
  # Past the model's context (16 or 24 tokens): the stream went on in segments.
  assert len(lm_data.prompt_ids(tokenizer, 'the ')) + len(ids) > task.cfg.max_len, ids
  assert _snapshot(directory) == before


@pytest.mark.slow
@pytest.mark.parametrize('source', ['char', pytest.param('opt', marks=pytest.mark.parity)],
                         indirect=True)  # GPT-2's and LLaMA's batches: test_ragged_generation.py
def test_prompts_file_batch_equals_each_prompt_alone(source, tmp_path):
  """Prompts of lengths 4, 10, 4, 8, 1, 4 characters in batches of 4 (two batches, file order):
  greedy, each line gets what its prompt gets alone; sampled, line i draws with
  fold_in(key(seed), i), so the text does not depend on --batch_size."""
  import jax
  prompts = ['the ', 'the quick ', 'fox ', 'the lazy', 'a', 'dog ']
  path = tmp_path / 'prompts.txt'
  path.write_text('\n'.join(prompts) + '\n')
  flag, task, tokenizer, params = source

  def run(*flags):
    result = _cli('experiments.generate', flag, f'--prompts_file={path}', '--max_new_tokens=24',
                  '--output_format=jsonl', *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'prompts 6/6' in result.stderr and 'ETA' in result.stderr  # progress per batch
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line['prompt'] for line in lines] == prompts
    return [line['completion'] for line in lines]

  def alone(prompt, key, **sampling):
    return tokenizer.decode(_one_shot(task, tokenizer, params, prompt, 24, key, **sampling))

  greedy = run('--temperature=0', '--batch_size=4')
  assert greedy == [alone(p, jax.random.key(0), temperature=0.0) for p in prompts]
  assert len(set(greedy)) > 1  # the prompts matter
  sampled = run('--temperature=1.0', '--top_k=8', '--seed=4', '--batch_size=4')
  assert sampled == run('--temperature=1.0', '--top_k=8', '--seed=4', '--batch_size=1')
  key = jax.random.key(4)
  assert sampled == [
      alone(p, jax.random.fold_in(key, i), temperature=1.0, top_k=8) for i, p in enumerate(prompts)
  ]
  assert len(set(sampled)) == len(prompts)  # each line its own draws


def test_generate_bad_inputs_are_one_line(char_workdir, tmp_path):
  empty = tmp_path / 'empty.txt'
  empty.write_text('')
  bad = tmp_path / 'bad.txt'
  bad.write_text('the \nthe ~\n')
  long = tmp_path / 'long.txt'
  long.write_text('the \n' + 'a' * 17 + '\n')  # the model reads 16 characters
  cases = [
      ((f'--prompts_file={empty}',), 'has no lines'),
      ((f'--prompts_file={bad}',), f"{bad}:2: character '~'"),
      ((f'--prompts_file={bad}', '--num_samples=2'), '--num_samples applies to --prompt'),
      ((f'--prompts_file={tmp_path}/none.txt',), 'none.txt does not exist'),
      ((f'--prompts_file={long}',), f'{long}:2: the prompt is 17 tokens, longer than the model\'s '
       'context of 16'),
      (('--prompt=' + 'the ' * 5,), 'the prompt is 20 tokens'),
      ((f'--prompts_file={long}', '--batch_size=0'), '--batch_size must be positive'),
      (('--num_beams=0',), '--num_beams must be positive'),
  ]
  bert = tmp_path / 'bert'
  bert.mkdir()
  (bert / 'config.json').write_text(json.dumps({'tokenizer': {'type': 'wordpiece'}}))
  before = _snapshot(char_workdir)
  for flags, message in cases:
    line = _one_error_line(
        _cli('experiments.generate', f'--workdir={char_workdir}', '--max_new_tokens=4', *flags))
    assert message in line, (flags, line)
  line = _one_error_line(_cli('experiments.generate', f'--workdir={bert}', '--max_new_tokens=4'))
  assert 'not a language-model workdir' in line
  assert _snapshot(char_workdir) == before and os.listdir(bert) == ['config.json']


def test_prompts_file_with_beams_prints_each_best_hypothesis(char_workdir, char_lm, tmp_path):
  prompts = ['the ', 'fox jumps ', 'a']
  path = tmp_path / 'prompts.txt'
  path.write_text('\n'.join(prompts) + '\n')
  result = _cli('experiments.generate', f'--workdir={char_workdir}', f'--prompts_file={path}',
                '--max_new_tokens=5', '--num_beams=3', '--length_penalty=0.5',
                '--output_format=jsonl', '--batch_size=2')
  assert result.returncode == 0, result.stderr[-3000:]
  task, tokenizer, params = char_lm
  best, _ = task.beam_search(params, [tokenizer.encode(p) for p in prompts], 3, 5,
                             length_penalty=0.5)
  lines = [json.loads(line) for line in result.stdout.splitlines()]
  assert [line['completion'] for line in lines] == [tokenizer.decode(row) for row in best[:, 0]]
