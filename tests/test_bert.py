"""The BERT model and its tasks: heads, logical axes, padding, and training with the trainer."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.configs import bert_common
from transformer_jax.data import bert_pretrain
from transformer_jax.data.wordpiece import WordPieceTokenizer
from transformer_jax.models.bert import Bert, bert_config
from transformer_jax.tasks.bert import BertClassificationTask, BertPretrainTask
from transformer_jax.training.trainer import Trainer

TINY = dict(vocab_size=97, emb_dim=32, num_heads=4, mlp_dim=64, num_encoder_layers=2, max_len=32,
            dropout_rate=0.0, attention_dropout_rate=0.0)


def _init(model, tokens, **kwargs):
  return model.init(jax.random.key(0), tokens, jnp.zeros_like(tokens), **kwargs)


@pytest.mark.parametrize(
    'heads,expected',
    [
        (dict(), {'mlm_transform', 'mlm_norm', 'mlm_bias', 'sentence_head'}),  # BERT
        (dict(sentence_classes=0), {'mlm_transform', 'mlm_norm', 'mlm_bias'}),  # RoBERTa
        (dict(mlm=False, sentence_classes=0, num_labels=3), {'classifier'}),  # fine-tune
    ])
def test_heads_by_config_and_logical_axes(heads, expected):
  model = Bert(bert_config(**TINY), **heads)
  tokens = jnp.ones((2, 9), jnp.int32)
  variables = _init(model, tokens, mlm_positions=jnp.zeros((2, 3), jnp.int32))
  base = {'token_embed', 'segment_embedding', 'input_embedding', 'encoder', 'pooler'}
  assert set(variables['params']) == base | expected
  # Every parameter carries logical axis names, one per dimension.
  for path, leaf in jax.tree_util.tree_leaves_with_path(
      variables['params'], is_leaf=lambda x: isinstance(x, nn.Partitioned)):
    assert isinstance(leaf, nn.Partitioned), jax.tree_util.keystr(path)
    assert len(leaf.names) == leaf.value.ndim, jax.tree_util.keystr(path)
  specs = nn.get_partition_spec(variables)['params']
  assert tuple(specs['token_embed']['embedding']) == ('vocab', 'embed')
  query = specs['encoder']['layer_0']['self_attention']['query']['kernel']
  assert tuple(query) == ('embed', 'heads', 'kv')
  out = model.apply(variables, tokens, jnp.zeros_like(tokens), mlm_positions=jnp.array([[1, 2, 3],
                                                                                        [0, 4, 8]]))
  assert out['hidden'].shape == (2, 9, 32) and out['pooled'].shape == (2, 32)
  if 'mlm_bias' in expected:
    assert out['mlm_logits'].shape == (2, 3, 97)
  if 'sentence_head' in expected:
    assert out['sentence_logits'].shape == (2, 2)
  if 'classifier' in expected:
    assert out['class_logits'].shape == (2, 3)


def test_mlm_output_is_tied_to_the_token_embedding():
  model = Bert(bert_config(**TINY), sentence_classes=0)
  tokens = jnp.arange(1, 9)[None]
  variables = nn.meta.unbox(_init(model, tokens, mlm_positions=jnp.zeros((1, 2), jnp.int32)))
  out = model.apply(variables, tokens, mlm_positions=jnp.array([[2, 5]]))
  embedding = variables['params']['token_embed']['embedding']
  h = jnp.take_along_axis(out['hidden'], jnp.array([[2, 5]])[..., None], axis=1)
  # Zeroing the embedding table's row 7 zeroes the logit of token 7 up to the bias.
  bias = variables['params']['mlm_bias'].at[:].set(0.5)
  params = dict(variables['params'], mlm_bias=bias,
                token_embed={'embedding': embedding.at[7].set(0.0)})
  logits = model.apply({'params': params}, tokens, mlm_positions=jnp.array([[2, 5]]))['mlm_logits']
  np.testing.assert_allclose(logits[..., 7], 0.5, atol=1e-6)
  assert h.shape == (1, 2, 32)


def test_padding_changes_nothing_for_real_tokens():
  model = Bert(bert_config(**TINY), mlm=False, sentence_classes=0, num_labels=2)
  rng = np.random.default_rng(0)
  tokens = rng.integers(5, 97, (3, 16)).astype(np.int32)
  lengths = np.array([16, 9, 4])
  valid = np.arange(16)[None] < lengths[:, None]
  tokens = np.where(valid, tokens, 0)
  segments = np.where(np.arange(16)[None] < lengths[:, None] // 2, 0, 1) * valid
  variables = _init(model, jnp.asarray(tokens))
  base = model.apply(variables, tokens, segments)
  # Different ids and segments in the padded slots, passed with an explicit validity mask.
  other = np.where(valid, tokens, rng.integers(5, 97, tokens.shape))
  other_segments = np.where(valid, segments, 1)
  changed = model.apply(variables, other, other_segments, valid=jnp.asarray(valid))
  for row, n in enumerate(lengths):
    np.testing.assert_allclose(changed['hidden'][row, :n], base['hidden'][row, :n], atol=1e-5)
  np.testing.assert_allclose(changed['class_logits'], base['class_logits'], atol=1e-5)
  # Without the mask the same ids would be attended to: the test can fail.
  unmasked = model.apply(variables, other, other_segments, valid=jnp.ones_like(jnp.asarray(valid)))
  assert np.abs(unmasked['hidden'][1, :9] - base['hidden'][1, :9]).max() > 1e-3


def _classification_config(num_steps=60):
  config = bert_common.finetune_config()
  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_steps = 5
  config.optimizer.decay_steps = num_steps
  config.train.num_steps = num_steps
  config.train.log_every = 10
  config.train.eval_every = 0
  config.train.checkpoint_every = 0
  return config


def _classification_batches(num, rng):
  """Label = whether token 7 occurs in the sentence (which needs attention to find)."""
  batches = []
  for _ in range(num):
    tokens = rng.integers(10, 97, (16, 12)).astype(np.int32)
    labels = rng.integers(0, 2, 16).astype(np.int32)
    where = rng.integers(1, 11, 16)
    tokens[labels == 1, where[labels == 1]] = 7
    tokens[:, 0] = 2
    tokens[:, 11] = 3
    batches.append({
        'inputs': tokens, 'segments': np.zeros_like(tokens), 'labels': labels,
        'weights': np.ones(16, np.float32)
    })
  return batches


class _Cycle:

  def __init__(self, batches):
    self.batches, self.step = batches, 0

  def __iter__(self):
    while True:
      yield self.batches[self.step % len(self.batches)]
      self.step += 1

  def state(self):
    return {'step': self.step}

  def restore(self, state):
    self.step = state['step']


@pytest.mark.slow
def test_classifier_loss_falls(tmp_path):
  task = BertClassificationTask(bert_config(**TINY), num_labels=2)
  trainer = Trainer(_classification_config(), task, str(tmp_path))
  rng = np.random.default_rng(0)
  valid = _classification_batches(4, rng)
  before = trainer.evaluate(trainer.init_state().params, iter(valid))
  results = trainer.fit(_Cycle(_classification_batches(20, rng)), lambda: iter(valid))
  trainer.close()
  assert results['eval_loss'] < 0.6 * before['loss'], (before, results)
  assert results['eval_accuracy'] > 0.8


class _TinyTokenizer:
  pad_id, unk_id, cls_id, sep_id, mask_id = 0, 1, 2, 3, 4
  special_ids = np.arange(5)
  vocab_size = 97
  build_pair = WordPieceTokenizer.build_pair


@pytest.mark.slow
def test_pretraining_mlm_and_nsp_improve(tmp_path):
  # Every line of document d repeats token 10 + d: a masked token is predictable from the
  # rest of its segment, and a random second segment (another document) is easy to spot.
  docs = [[np.full(4, 10 + d, np.int32) for _ in range(4)] for d in range(40)]
  options = bert_pretrain.PretrainOptions(max_len=24, max_predictions=4, short_seq_prob=0.0)
  data = bert_pretrain.PretrainBatches(docs, _TinyTokenizer(), options, batch_size=16, seed=0)
  valid = [
      bert_pretrain.PretrainBatches(docs, _TinyTokenizer(), options, batch_size=16, seed=1).batch(i)
      for i in range(4)
  ]
  config = _classification_config(num_steps=100)
  config.optimizer.learning_rate = 2e-3
  task = BertPretrainTask(bert_config(**TINY), sentence_task='nsp', eval_batches=valid)
  trainer = Trainer(config, task, str(tmp_path))
  before = trainer.evaluate(trainer.init_state().params, iter(valid))
  results = trainer.fit(data, lambda: iter(valid))
  trainer.close()
  assert results['eval_loss'] < 0.75 * before['loss'], (before, results)
  assert results['eval_accuracy'] > 0.4
  assert results['eval_nsp_accuracy'] > 0.75
