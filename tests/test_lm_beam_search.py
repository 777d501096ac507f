"""`LanguageModelTask.beam_search` picks the hypotheses, in the order and with the scores, of
transformers' `generate(num_beams=k, do_sample=False, length_penalty=a, early_stopping=e)`.

Needs the `parity` extra (torch, transformers). No download: the references are tiny seeded random
GPT2LMHeadModel, LlamaForCausalLM (grouped-query attention) and OPTForCausalLM with a 64-token
vocabulary, imported through `convert.families`. The EOS ids are tokens the models' greedy
continuations emit, picked so that hypotheses end at EOS early enough for the stop rules to
decide: the tests check that some hypothesis did end at EOS and that early_stopping False and
'never' came out differently, or those rules would go untested.
"""

import jax
import numpy as np
import pytest

torch = pytest.importorskip('torch', reason='needs the parity extra: pip install -e ".[parity]"')
transformers = pytest.importorskip('transformers',
                                   reason='needs the parity extra: pip install -e ".[parity]"')

from transformer_jax.convert import families
from transformer_jax.errors import ConfigError
from transformer_jax.special_tokens import PAD_ID
from transformer_jax.tasks.lm import LanguageModelTask

pytestmark = pytest.mark.parity

VOCAB = 64
NEW_TOKENS = 12
LENGTH_PENALTIES = (1.0, 0.6, 2.0, -1.0)
# transformers' greedy search emits these tokens within the first 5 new ones (see the docstring).
EOS_IDS = {'gpt2': 17, 'llama': 29, 'opt': 37}
# (model class, config class, config) of transformers, by family.
HF_MODELS = {
    'gpt2': ('GPT2LMHeadModel', 'GPT2Config',
             dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=VOCAB, bos_token_id=1,
                  eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    'llama': ('LlamaForCausalLM', 'LlamaConfig',
              dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                   max_position_embeddings=64, bos_token_id=1, eos_token_id=1)),
    # OPT's default init (std 0.02, ReLU) repeats one token; std 0.2 gives varied continuations.
    'opt': ('OPTForCausalLM', 'OPTConfig',
            dict(hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                 max_position_embeddings=64, vocab_size=VOCAB, word_embed_proj_dim=32, dropout=0.0,
                 attention_dropout=0.0, bos_token_id=1, eos_token_id=1, pad_token_id=0,
                 activation_function='relu', init_std=0.2)),
}


@pytest.fixture(scope='module', params=sorted(HF_MODELS))
def imported(request, tmp_path_factory):
  """(transformers model, our task without an EOS of its own, params, prompts [3, 5], EOS id)."""
  torch.manual_seed(0)
  model_class, config_class, config = HF_MODELS[request.param]
  model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
  with torch.no_grad():  # HF's zero biases and unit norms would hide a mis-mapped one
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  model.eval()
  directory = str(tmp_path_factory.mktemp(request.param))
  model.save_pretrained(directory, safe_serialization=True)
  loaded = families.of_directory(directory).load(directory)
  prompts = np.random.default_rng(0).integers(0, VOCAB, (3, 5), dtype=np.int32)
  greedy = _hf_generate(model, prompts, eos_id=None)[0]
  assert np.any(greedy[:, :, :5] == EOS_IDS[request.param])
  return model, LanguageModelTask(loaded.config), loaded.params, prompts, EOS_IDS[request.param]


def _hf_generate(model, prompts, *, eos_id, num_beams=1, **beam_flags):
  """transformers' new tokens [B, num_beams, NEW_TOKENS] (zeros after EOS) and their scores."""
  model.generation_config.eos_token_id = eos_id
  with torch.no_grad():
    inputs = torch.from_numpy(prompts).long()
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                         max_new_tokens=NEW_TOKENS, num_beams=num_beams,
                         num_return_sequences=num_beams, eos_token_id=eos_id, pad_token_id=PAD_ID,
                         return_dict_in_generate=True, output_scores=True, **beam_flags)
  tokens = np.zeros((len(out.sequences), NEW_TOKENS), np.int32)
  # transformers fills after EOS with the pad id, or EOS where the pad id is 0: cut at EOS.
  for row, sequence in zip(tokens, out.sequences[:, prompts.shape[1]:].tolist()):
    if eos_id in sequence:
      sequence = sequence[:sequence.index(eos_id) + 1]
    row[:len(sequence)] = sequence
  scores = out.sequences_scores if num_beams > 1 else None
  return tokens.reshape(len(prompts), num_beams, -1), scores


@pytest.mark.parametrize('num_beams,early_stopping', [(3, False), (4, True), (4, 'never')])
def test_hypotheses_and_scores_match_transformers(imported, num_beams, early_stopping):
  model, task, params, prompts, eos_id = imported
  ended_at_eos, stop_rule_decided = 0, False
  for length_penalty in LENGTH_PENALTIES:
    flags = dict(length_penalty=length_penalty, early_stopping=early_stopping)
    theirs, their_scores = _hf_generate(model, prompts, eos_id=eos_id, num_beams=num_beams, **flags)
    if early_stopping == 'never':
      default, _ = _hf_generate(model, prompts, eos_id=eos_id, num_beams=num_beams,
                                length_penalty=length_penalty)
      stop_rule_decided |= not np.array_equal(default, theirs)
    ours, scores = task.beam_search(params, prompts, num_beams, NEW_TOKENS, eos_id=eos_id, **flags)
    assert ours.shape == (3, num_beams, NEW_TOKENS) and scores.shape == (3, num_beams)
    np.testing.assert_array_equal(ours, theirs, err_msg=f'length_penalty {length_penalty}')
    np.testing.assert_allclose(scores.ravel(), their_scores.numpy(), rtol=1e-5, atol=1e-5)
    assert np.all(np.diff(scores, axis=1) <= 0)  # best first
    ended_at_eos += int(np.sum(ours == eos_id))
  assert ended_at_eos > 0  # the EOS rules took part
  assert stop_rule_decided or early_stopping != 'never'


def test_without_eos_every_hypothesis_runs_the_budget(imported):
  model, task, params, prompts, _ = imported
  assert task.eos_id is None
  theirs, their_scores = _hf_generate(model, prompts, eos_id=None, num_beams=3, length_penalty=0.6)
  ours, scores = task.beam_search(params, prompts, 3, NEW_TOKENS, length_penalty=0.6)
  np.testing.assert_array_equal(ours, theirs)
  np.testing.assert_allclose(scores.ravel(), their_scores.numpy(), rtol=1e-5, atol=1e-5)
  assert len({tuple(row) for row in ours.reshape(-1, NEW_TOKENS).tolist()}) == 9  # distinct


def test_one_beam_is_greedy_search(imported):
  model, task, params, prompts, eos_id = imported
  ours, _ = task.beam_search(params, prompts, 1, NEW_TOKENS, eos_id=eos_id)
  greedy = task.generate(params, prompts, NEW_TOKENS, jax.random.key(0), temperature=0.0,
                         eos_id=eos_id)
  np.testing.assert_array_equal(ours[:, 0], greedy)
  np.testing.assert_array_equal(ours, _hf_generate(model, prompts, eos_id=eos_id)[0])
  assert np.any(greedy == eos_id)  # a row ended early, PAD after


def test_settings_out_of_range_are_one_line_errors(imported):
  _, task, params, prompts, _ = imported
  with pytest.raises(ConfigError, match='num_beams and max_new_tokens must be positive'):
    task.beam_search(params, prompts, 0, NEW_TOKENS)
  with pytest.raises(ConfigError, match=r'prompt \(5\) \+ max_new_tokens \(60\) exceed'):
    task.beam_search(params, prompts, 2, 60)
  with pytest.raises(ConfigError, match="early_stopping must be False, True or 'never'"):
    task.beam_search(params, prompts, 2, NEW_TOKENS, early_stopping='sometimes')


def test_prompts_of_other_lengths_in_one_batch_search_as_each_alone(imported):
  """A ragged batch (lengths 1..9) gives every prompt the hypotheses and scores it gets alone,
  and those equal transformers' for that prompt."""
  model, task, params, _, eos_id = imported
  rng = np.random.default_rng(1)
  prompts = [rng.integers(2, VOCAB, n).astype(np.int32) for n in (4, 1, 9, 6, 2)]
  ours, scores = task.beam_search(params, prompts, 3, NEW_TOKENS, eos_id=eos_id)
  for i, prompt in enumerate(prompts):
    alone, alone_scores = task.beam_search(params, [prompt], 3, NEW_TOKENS, eos_id=eos_id)
    np.testing.assert_array_equal(ours[i], alone[0], err_msg=f'prompt {i}')
    np.testing.assert_allclose(scores[i], alone_scores[0], rtol=1e-5, atol=1e-6)
    theirs, _ = _hf_generate(model, prompt[None], eos_id=eos_id, num_beams=3)
    np.testing.assert_array_equal(ours[i], theirs[0], err_msg=f'prompt {i} vs transformers')
