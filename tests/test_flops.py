"""Model FLOPs (transformer_jax/flops.py, each task's `model_flops`) against the program: for
every model family, the FLOPs of the dot products in the jaxpr of the loss gradient, less the
masked half of causal attention that the formula does not count, equal the formula exactly."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from transformer_jax import flops
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models import albert_config, bert_config, gpt2_config, llama_config
from transformer_jax.tasks.bert import BertClassificationTask, BertPretrainTask
from transformer_jax.tasks.lm import LanguageModelTask
from transformer_jax.tasks.token_classification import TokenClassificationTask
from transformer_jax.tasks.translation import TranslationTask

B, T, S, P, V = 2, 24, 16, 5, 50
SIZES = dict(emb_dim=32, num_heads=4, mlp_dim=64, max_len=T, dropout_rate=0.0,
             attention_dropout_rate=0.0)


def dot_flops(jaxpr) -> int:
  """2 x output elements x contracted size of every dot_general, nested jaxprs included."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      (contracting, _), _ = eqn.params['dimension_numbers']
      lhs = eqn.invars[0].aval.shape
      total += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(
          np.prod([lhs[i] for i in contracting]))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          total += dot_flops(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          total += dot_flops(sub)
  return total


def program_flops(task, batch) -> int:
  params = nn.meta.unbox(task.init_variables(jax.random.key(0))['params'])
  loss = lambda p: task.loss_fn(p, batch, jax.random.key(1), True)[0]
  return params, dot_flops(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)


def tokens(length: int) -> np.ndarray:
  return np.random.default_rng(length).integers(3, V, (B, length)).astype(np.int32)


def causal_half(cfg, layers: int, length: int) -> float:
  return flops.attention(layers, B, length, length, flops.attention_width(cfg), causal=True)


@pytest.mark.parametrize('preset', [gpt2_config, llama_config])
def test_language_model(preset):
  cfg = preset(vocab_size=V, num_decoder_layers=2, **SIZES)
  task = LanguageModelTask(cfg)
  batch = {'inputs': tokens(T), 'targets': tokens(T)}
  params, measured = program_flops(task, batch)
  assert task.model_flops(params, batch) == measured - causal_half(cfg, 2, T)


def test_translation():
  cfg = TransformerConfig(vocab_size=V, num_encoder_layers=2, num_decoder_layers=3, **SIZES)
  task = TranslationTask(cfg)
  batch = {'inputs': tokens(S), 'targets': tokens(T)}
  params, measured = program_flops(task, batch)
  assert task.model_flops(params, batch) == measured - causal_half(cfg, 3, T)


def bert_batch() -> dict:
  inputs = tokens(T)
  batch = dict(inputs=inputs, segments=np.zeros_like(inputs), labels=np.zeros(B, np.int32))
  batch.update(weights=np.ones(B, np.float32), sentence_labels=np.zeros(B, np.int32))
  batch.update(mlm_positions=np.tile(np.arange(P, dtype=np.int32), (B, 1)), mlm_ids=inputs[:, :P],
               mlm_weights=np.ones((B, P), np.float32))
  return batch


@pytest.mark.parametrize('preset', [bert_config, albert_config])
def test_bert_pretraining(preset):
  """ALBERT: one shared layer applied num_encoder_layers times, a factorised embedding."""
  extra = dict(embedding_size=16) if preset is albert_config else {}
  task = BertPretrainTask(preset(vocab_size=V, num_encoder_layers=3, **SIZES, **extra))
  batch = bert_batch()
  params, measured = program_flops(task, batch)
  assert task.model_flops(params, batch) == measured


def test_bert_classification_and_tagging():
  cfg = bert_config(vocab_size=V, num_encoder_layers=2, **SIZES)
  batch = bert_batch()
  classify = BertClassificationTask(cfg, 3)
  params, measured = program_flops(classify, batch)
  assert classify.model_flops(params, batch) == measured
  tag = TokenClassificationTask(cfg, ['O', 'B-X', 'I-X'])
  batch = dict(batch, labels=tokens(T) % 3, weights=np.ones((B, T), np.float32))
  params, measured = program_flops(tag, batch)
  # Bert computes the pooled [CLS] features, which tagging never reads: XLA removes that dot.
  pooler = 2 * B * flops.kernel_parameters(params['pooler'])
  assert tag.model_flops(params, batch) == measured - pooler


def test_cpu_peak_and_nominal_peaks():
  cpu = jax.devices('cpu')[0]
  peak, source = flops.peak_flops_per_device(cpu, np.float32)
  assert peak > 1e9 and 'float32 matmul, the best seen on this machine' in source

  class Chip:
    platform, device_kind = 'gpu', 'NVIDIA H100 80GB HBM3'

  expected = (989e12, 'NVIDIA H100 80GB HBM3 nominal dense bf16: 989 TFLOP/s')
  assert flops.peak_flops_per_device(Chip(), None) == expected
  Chip.device_kind = 'Mystery chip'
  assert flops.peak_flops_per_device(Chip(), None)[0] is None
