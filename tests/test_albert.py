"""ALBERT: the base preset's size, one shared layer, the factorised embedding, and a pretraining
run (experiments/configs/albert_pretrain_small.py, shrunk) that lowers MLM and SOP loss and
then fine-tunes."""

import json
import os
import random

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import set_path

from transformer_jax.errors import ConfigError
from transformer_jax.models import GPT, Bert, albert_config, bert_config, gpt2_config

TINY = dict(vocab_size=97, embedding_size=16, emb_dim=32, num_heads=4, mlp_dim=64,
            num_encoder_layers=3, max_len=24)


def _abstract_params(cfg, **heads):
  shapes = jax.eval_shape(
      Bert(cfg, **heads).init, jax.random.key(0), jnp.ones((1, 8), jnp.int32),
      mlm_positions=jnp.zeros((1, 2), jnp.int32))
  return nn.meta.unbox(shapes['params'])


def _count(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


# ALBERT-base (albert-base-v2) written out term by term: V = 30000, E = 128, D = 768, MLP 3072,
# 512 positions, 2 segments; every layer norm has a scale and a bias.
V, E, D, M = 30000, 128, 768, 3072
ALBERT_BASE_ENCODER = (
    (V + 512 + 2) * E + 2 * E  # token, position, segment tables and their LayerNorm, E wide
    + E * D + D  # projection E -> D
    + 4 * (D * D + D) + 2 * D + (D * M + M) + (M * D + D) + 2 * D  # the ONE shared layer
    + D * D + D)  # pooler
ALBERT_BASE_HEADS = (D * E + E + 2 * E + V) + (2 * D + 2)  # MLM D -> E, LayerNorm, bias; SOP


def test_albert_base_parameter_count():
  encoder = _count(_abstract_params(albert_config(), mlm=False, sentence_classes=0))
  pretraining = _count(_abstract_params(albert_config()))
  bert_base = _count(_abstract_params(bert_config(), mlm=False, sentence_classes=0))
  print(f'ALBERT-base encoder + pooler {encoder:,}, with MLM + SOP heads {pretraining:,}; '
        f'BERT-base {bert_base:,}')
  assert encoder == ALBERT_BASE_ENCODER == 11_683_584
  assert pretraining == ALBERT_BASE_ENCODER + ALBERT_BASE_HEADS
  # The paper's "12M" (Lan et al. 2019, Table 1) has two significant figures, as BERT-base's
  # "110M" (109.5M here) does.
  assert round(encoder / 1e6) == 12 and round(bert_base / 1e7) == 11


@pytest.mark.parity
def test_albert_base_parameter_count_equals_transformers():
  transformers = pytest.importorskip('transformers')
  pytest.importorskip('torch')
  hf_config = transformers.AlbertConfig(vocab_size=V, embedding_size=E, hidden_size=D,
                                        num_hidden_layers=12, num_attention_heads=12,
                                        intermediate_size=M, max_position_embeddings=512)
  hf_count = lambda model: sum(p.numel() for p in model.parameters())  # tied: counted once
  encoder = hf_count(transformers.AlbertModel(hf_config))
  pretraining = hf_count(transformers.AlbertForPreTraining(hf_config))
  ours = _count(_abstract_params(albert_config(), mlm=False, sentence_classes=0))
  ours_pretraining = _count(_abstract_params(albert_config()))
  print(f'AlbertModel: transformers {encoder:,}, ours {ours:,}; AlbertForPreTraining: '
        f'transformers {pretraining:,}, ours {ours_pretraining:,}')
  assert (ours, ours_pretraining) == (encoder, pretraining)


def test_param_tree_holds_one_shared_layer():
  shared = _abstract_params(albert_config(**TINY))
  assert list(shared['encoder']) == ['shared_layer']
  assert shared['token_embed']['embedding'].shape == (97, 16)
  assert shared['input_embedding']['projection']['kernel'].shape == (16, 32)
  assert shared['mlm_transform']['kernel'].shape == (32, 16)
  # scan_layers and remat keep the same tree (a checkpoint moves freely between them).
  shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
  for switches in (dict(scan_layers=True), dict(remat_policy='nothing_saveable', scan_layers=True),
                   dict(remat_policy='dots_saveable')):
    assert shapes(_abstract_params(albert_config(**TINY, **switches))) == shapes(shared)
  unshared = _abstract_params(albert_config(**TINY, share_layers=False))
  assert list(unshared['encoder']) == ['layer_0', 'layer_1', 'layer_2']
  assert _count(unshared) - _count(shared) == 2 * _count(shared['encoder']['shared_layer'])


def test_shared_layer_is_the_unshared_model_with_equal_layers():
  """Sharing is applying one layer N times: the unshared model whose N layers hold copies of
  the shared layer computes the same, in the loop, scan and remat forms."""
  cfg = albert_config(**TINY)
  tokens = jnp.asarray(np.random.default_rng(0).integers(5, 97, (2, 10)), jnp.int32)
  positions = jnp.array([[1, 4], [2, 9]], jnp.int32)
  params = nn.meta.unbox(Bert(cfg).init(jax.random.key(1), tokens, mlm_positions=positions))
  params = params['params']
  layer = params['encoder']['shared_layer']
  copies = {**params, 'encoder': {f'layer_{i}': layer for i in range(3)}}
  expected = Bert(cfg.replace(share_layers=False)).apply({'params': copies}, tokens,
                                                         mlm_positions=positions)
  assert not np.allclose(
      expected['hidden'],
      Bert(cfg.replace(num_encoder_layers=2)).apply({'params': params}, tokens,
                                                    mlm_positions=positions)['hidden'], atol=1e-3)
  for switches in ({}, dict(scan_layers=True), dict(remat_policy='nothing_saveable')):
    out = Bert(cfg.replace(**switches)).apply({'params': params}, tokens, mlm_positions=positions)
    np.testing.assert_allclose(out['hidden'], expected['hidden'], atol=1e-5)
    np.testing.assert_allclose(out['mlm_logits'], expected['mlm_logits'], atol=1e-5)


def test_factorisation_and_sharing_are_refused_where_they_cannot_work():
  with pytest.raises(ConfigError, match='share_layers=True cannot decode with a KV cache'):
    albert_config(**TINY, decode=True)
  gpt = GPT(
      gpt2_config(vocab_size=50, emb_dim=32, num_heads=2, mlp_dim=64, num_decoder_layers=1,
                  max_len=16, embedding_size=16))
  with pytest.raises(ConfigError, match='embedding_size=16 .* is implemented by Bert only'):
    gpt.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))
  with pytest.raises(ConfigError, match='embedding_size must be positive'):
    albert_config(embedding_size=0)


# -- pretraining and fine-tuning through the workflow ---------------------------------------------

# albert_pretrain_small.py shrunk to seconds on a CPU (same switches: E < D, shared layers, SOP).
SHRINK = {
    'model.embedding_size': 32, 'model.emb_dim': 64, 'model.num_heads': 4, 'model.mlp_dim': 128,
    'model.num_encoder_layers': 3, 'model.max_len': 32, 'model.dropout_rate': 0.0,
    'model.attention_dropout_rate': 0.0, 'data.lines_per_document': 0, 'data.valid_fraction': 0.1,
    'data.max_len': 32, 'data.max_predictions': 5, 'data.batch_size': 16, 'data.eval_batches': 4,
    'data.short_seq_prob': 0.0, 'tokenizer.vocab_size': 120, 'train.num_steps': 300,
    'train.log_every': 20, 'train.eval_every': 20, 'train.checkpoint_every': 300,
    'optimizer.learning_rate': 2e-3, 'optimizer.warmup_steps': 20, 'optimizer.decay_steps': 300
}


def _ordered_documents(path, count=60, seed=0):
  """Documents whose k-th line draws its words from word group k: the order of two consecutive
  segments shows in their words, so sentence order can be learnt in a few steps."""
  rng = random.Random(seed)
  groups = [[f'{c}{v}' for v in 'aeiou'] for c in 'bdgkmpt']  # 7 groups of 5 syllables
  docs = []
  for _ in range(count):
    first = rng.randrange(2)
    lines = [
        ' '.join(rng.choice(groups[k])
                 for _ in range(rng.randint(4, 6)))
        for k in range(first, first + 6)
    ]
    docs.append('\n'.join(lines))
  path.write_text('\n\n'.join(docs) + '\n')
  return str(path)


def _metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope='module')
def albert_workdir(tmp_path_factory):
  from experiments.configs import albert_pretrain_small
  from transformer_jax.workflows import bert
  root = tmp_path_factory.mktemp('albert')
  config = albert_pretrain_small.get_config()
  for key, value in dict(SHRINK, **{'data.paths': _ordered_documents(root / 'text.txt')}).items():
    set_path(config, key, value)
  workdir = str(root / 'work')
  results = bert.pretrain(config, workdir)
  return workdir, results


def test_pretraining_lowers_mlm_and_sop_loss(albert_workdir):
  workdir, results = albert_workdir
  metrics = _metrics(workdir)
  mlm = [m['train/loss'] for m in metrics if 'train/loss' in m]
  held_out = [m['eval/loss'] for m in metrics if 'eval/loss' in m]
  sop = [m['eval/sop_loss'] for m in metrics if 'eval/sop_loss' in m]
  print(f'ALBERT (shrunk) pretraining, {len(mlm)} logs: MLM loss {mlm[0]:.3f} -> {mlm[-1]:.3f} '
        f'(held out {held_out[0]:.3f} -> {held_out[-1]:.3f}), SOP loss (held out) {sop[0]:.3f} '
        f"-> {sop[-1]:.3f}, SOP accuracy {results['eval_sop_accuracy']:.3f}")
  # Each log averages 20 steps of 80 masked tokens: a 10% fall is far outside their noise.
  assert mlm[-1] < 0.9 * mlm[0] and held_out[-1] < 0.9 * held_out[0]
  assert sop[-1] < sop[0] and sop[-1] < 0.6  # below chance (ln 2 = 0.69)
  from transformer_jax.workflows.bert import restore_pretrained
  cfg, params, _ = restore_pretrained(workdir)
  assert (cfg.embedding_size, cfg.emb_dim, cfg.share_layers) == (32, 64, True)
  assert list(params['encoder']) == ['shared_layer'] and results['params'] == _count(params)


def test_finetuning_from_the_albert_workdir(albert_workdir, tmp_path):
  from experiments.configs import sst2_albert
  from transformer_jax.workflows import bert
  pretrained, _ = albert_workdir
  rows = [(1, 'ba be bi'), (0, 'tu to ta'), (1, 'bo bu ba'), (0, 'ti te to')] * 6
  (tmp_path / 'train.tsv').write_text('label\tsentence\n' + ''.join(f'{y}\t{s}\n' for y, s in rows))
  (tmp_path / 'dev.tsv').write_text('label\tsentence\n' + ''.join(f'{y}\t{s}\n' for y, s in rows))
  config = sst2_albert.get_config()
  for key, value in {
      'init.bert_workdir': pretrained, 'data.dir': str(tmp_path), 'data.max_len': 16,
      'data.batch_size': 8, 'model.dropout_rate': 0.0, 'model.attention_dropout_rate': 0.0,
      'train.num_steps': 24, 'train.log_every': 8, 'train.eval_every': 0,
      'train.checkpoint_every': 0, 'optimizer.learning_rate': 3e-3, 'optimizer.warmup_steps': 2,
      'optimizer.decay_steps': 24
  }.items():
    set_path(config, key, value)
  workdir = str(tmp_path / 'fine')
  results = bert.finetune(config, workdir)
  # The model is the pretrained ALBERT (one shared layer, E-wide embedding) with a new 2-way
  # classifier in place of the MLM and SOP heads.
  _, params, _ = bert.restore_pretrained(pretrained)
  heads = ('mlm_transform', 'mlm_norm', 'mlm_bias', 'sentence_head')
  encoder = _count({k: v for k, v in params.items() if k not in heads})
  assert results['params'] == encoder + 64 * 2 + 2
  print(f"fine-tuned ALBERT: dev accuracy {results['dev_accuracy']:.3f}")
  assert results['dev_accuracy'] >= 0.75
