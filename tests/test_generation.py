"""`inference.generation`: one-shot and streamed generation run one schedule.

The expected tokens were drawn by `LanguageModelTask.generate` before the schedule moved to
inference/generation.py (when `generate` and `generate_stream` each had their own copy of it), on
tiny untrained models seeded as below; streaming then gave the same tokens. Both must still
give exactly these: greedy and sampled, past the context (segments), through EOS.
"""

import jax
import numpy as np
import pytest

from transformer_jax.models.gpt import gpt2_config, llama_config
from transformer_jax.special_tokens import PAD_ID
from transformer_jax.tasks.lm import LanguageModelTask

SAMPLING = {
    'greedy': dict(temperature=0.0),
    'sampled': dict(temperature=1.0, top_k=20, top_p=0.95),
    'hot': dict(temperature=1.5),
}

# (model, sampling, prompt length, new tokens, eos_id): one string of tokens per row. The cache
# holds 16 positions, so 40 tokens after 5 take four segments and a 20-token prompt is cropped.
EXPECTED = {
    ('gpt2', 'greedy', 5, 40, None): (
        '23 33 33 18 33 18 29 29 33 17 33 17 29 33 33 27 33 5 33 33 33 7 29 27 29 29 27 29 33 33 '
        '33 33 33 33 33 33 33 33 33 29',
        '27 27 27 27 27 27 27 27 27 27 27 7 7 0 7 27 27 27 27 27 27 27 27 27 27 27 27 27 27 27 7 '
        '33 7 27 27 27 27 27 7 29',
    ),
    # Row 1 ends at once, row 0 in the second segment: the stream stops after 16 tokens.
    ('gpt2', 'greedy', 5, 40, 27): (
        '23 33 33 18 33 18 29 29 33 17 33 17 29 33 33 27' + ' 0' * 24,
        '27' + ' 0' * 39,
    ),
    # Row 0 ends, row 1 runs on to the budget.
    ('gpt2', 'sampled', 5, 40, 25): (
        '17 5 29 6 13 35 11 18 33 6 7 8 25' + ' 0' * 27,
        '9 4 6 0 19 12 27 6 3 16 18 17 33 11 29 9 27 16 22 11 17 9 6 31 8 6 11 32 20 15 6 36 36 5 '
        '6 23 15 33 11 11',
    ),
    ('gpt2', 'sampled', 3, 6, 23): ('17 5 29 6 13 23', '9 4 5 0 23 0'),
    ('llama', 'sampled', 20, 30, 8): (
        '17 22 26 13 21 13 4 34 29 9 0 22 13 8' + ' 0' * 16,
        '21 33 35 29 33 7 3 19 28 18 20 6 31 8' + ' 0' * 16,
    ),
    # Trained with scanned layers: the decoder unstacks them.
    ('gpt2_scanned', 'hot', 5, 40, 25): (
        '17 5 30 6 2 35 11 26 29 20 7 8 25' + ' 0' * 27,
        '9 25' + ' 0' * 38,
    ),
}


def _config(model: str):
  base = dict(vocab_size=37, emb_dim=32, num_heads=4, mlp_dim=48, num_decoder_layers=2, max_len=16,
              dropout_rate=0.0, attention_dropout_rate=0.0)
  if model == 'llama':
    return llama_config(**base, num_kv_heads=2)
  return gpt2_config(**base, scan_layers=model == 'gpt2_scanned')


@pytest.fixture(scope='module')
def models():
  """model name -> (task, params), built once per module."""
  built = {}

  def get(model):
    if model not in built:
      task = LanguageModelTask(_config(model))
      built[model] = task, task.init_variables(jax.random.key(0))['params']
    return built[model]

  return get


@pytest.mark.slow
@pytest.mark.parametrize('key', list(EXPECTED), ids=['-'.join(map(str, key)) for key in EXPECTED])
def test_generate_and_stream_give_the_tokens_of_before(models, key):
  model, sampling, prompt_len, num, eos_id = key
  expected = np.asarray([row.split() for row in EXPECTED[key]], np.int32)
  task, params = models(model)
  prompt = np.asarray(jax.random.randint(jax.random.key(5), (2, 20), 0, 37), np.int32)
  prompt = prompt[:, -prompt_len:]
  rng = jax.random.key(7)
  one_shot = task.generate(params, prompt, num, rng, **SAMPLING[sampling], eos_id=eos_id)
  assert one_shot.dtype == np.int32
  np.testing.assert_array_equal(one_shot, expected)
  columns = list(task.generate_stream(params, prompt, num, rng, **SAMPLING[sampling],
                                      eos_id=eos_id))
  # The stream stops at the last row's EOS (all rows ended) or at the budget.
  ends = expected == eos_id
  stop = int(ends.argmax(1).max()) + 1 if ends.any(1).all() else num
  assert len(columns) == stop
  assert all(column.dtype == np.int32 and column.shape == (2,) for column in columns)
  np.testing.assert_array_equal(np.stack(columns, 1), expected[:, :stop])
  assert np.all(expected[:, stop:] == PAD_ID)
