"""`experiments.generate`: tokens streamed as they are drawn (`LanguageModelTask.generate_stream`,
`data.lm.IncrementalDecoder`), and prompts from a file generated in batches.

Streaming must give exactly the one-shot sampler's tokens for the same seed, greedy and sampled,
through EOS and past the context (segments); a prompts-file batch must give each prompt what it
gets alone.
"""

import io
import json
import os

import numpy as np
import pytest

from test_lm_evaluate import _cli, _one_error_line, _snapshot, train_tiny_char_lm

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


def test_cli_stream_equals_one_shot(char_workdir):
  before = _snapshot(char_workdir)
  for sampling in (('--temperature=1.0', '--top_k=8', '--seed=4'),):  # greedy: in-process above
    args = (f'--workdir={char_workdir}', '--prompt=the ', '--max_new_tokens=40', *sampling)
    streamed = _cli('experiments.generate', *args)
    one_shot = _cli('experiments.generate', *args, '--stream=false')
    assert streamed.returncode == 0 and one_shot.returncode == 0, streamed.stderr[-3000:]
    assert streamed.stdout == one_shot.stdout
    assert streamed.stdout.startswith('the ') and len(streamed.stdout) == len('the ') + 40 + 1
  assert _snapshot(char_workdir) == before


def test_prompts_file_batch_equals_each_prompt_alone(char_workdir, char_lm, tmp_path):
  """Prompts of lengths 4, 10, 4, 8, 1, 4 in batches of 4 (two batches, file order): greedy, each
  line gets what its prompt gets alone; sampled, line i draws with fold_in(key(seed), i), so the
  text does not depend on --batch_size."""
  import jax
  prompts = ['the ', 'the quick ', 'fox ', 'the lazy', 'a', 'dog ']
  path = tmp_path / 'prompts.txt'
  path.write_text('\n'.join(prompts) + '\n')
  task, tokenizer, params = char_lm

  def run(*flags):
    result = _cli('experiments.generate', f'--workdir={char_workdir}', f'--prompts_file={path}',
                  '--max_new_tokens=24', '--output_format=jsonl', *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'prompts 6/6' in result.stderr and 'ETA' in result.stderr  # progress per batch
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line['prompt'] for line in lines] == prompts
    return [line['completion'] for line in lines]

  def alone(prompt, key, **sampling):
    ids = np.asarray([tokenizer.encode(prompt)], np.int32)
    return tokenizer.decode(task.generate(params, ids, 24, key, **sampling)[0])

  greedy = run('--temperature=0', '--batch_size=4')
  assert greedy == [alone(p, jax.random.key(0), temperature=0.0) for p in prompts]
  assert len(set(greedy)) > 1  # the prompts matter
  sampled = run('--temperature=1.0', '--top_k=8', '--seed=4', '--batch_size=4')
  assert sampled == run('--temperature=1.0', '--top_k=8', '--seed=4', '--batch_size=1')
  key = jax.random.key(4)
  assert sampled == [
      alone(p, jax.random.fold_in(key, i), temperature=1.0, top_k=8) for i, p in enumerate(prompts)
  ]


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
