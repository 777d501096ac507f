"""BERT tasks for the one trainer: masked-LM (+ NSP/SOP) pretraining and sequence classification.

Pretraining batches (data/bert_pretrain.py): 'inputs', 'segments' [B, T]; 'mlm_positions',
'mlm_ids', 'mlm_weights' [B, P] (the masked positions, their original ids, 1/0 for real/padded
predictions); 'sentence_labels' [B] (0 = B follows A / in order, 1 = random / swapped).
Packed pretraining rows (data.pack) add 'inputs_segment_ids' and 'inputs_positions' [B, T]
(several examples a row; no sentence task then).
Classification batches (data/classification.py): 'inputs', 'segments', 'labels', 'weights'.

The trainer divides every metric sum by 'weight'. For pretraining that is the number of masked
tokens (so 'loss'/'accuracy' are the MLM figures); the sentence task's accuracy has a different
denominator and is measured by `evaluate` on the same held-out batches.
"""

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.parallel import sharding
from transformer_jax.layers.losses import cross_entropy_sums, projected_cross_entropy_sums
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.bert import Bert
from transformer_jax import flops

SENTENCE_TASKS = ('nsp', 'sop', 'none')


def _count_tokens(batch) -> int:
  return int(np.count_nonzero(batch['inputs']))  # non-[PAD] input tokens


def _count_slots(batch) -> int:
  return int(batch['inputs'].size)  # the trainer's padding fraction: 1 - tokens / slots


def bert_model_flops(cfg: TransformerConfig, params, batch, *, token_heads=(), unused=(),
                     mlm: bool = False) -> float:
  """Model FLOPs of a step on `batch` (transformer_jax/flops.py): the encoder and `token_heads`
  on every position, the MLM head and its tied output on the masked positions, the other heads
  (pooler, sentence and class heads) once per row; modules in `unused` feed no loss (XLA
  removes them)."""
  shape = batch['inputs'].shape
  length, positions = shape[-1], int(np.prod(shape))
  per_position = (
      flops.stack_parameters(params['encoder'], cfg.num_encoder_layers, cfg.share_layers) +
      flops.kernel_parameters(params.get('input_embedding', {})) +
      sum(flops.kernel_parameters(params[head]) for head in token_heads))
  counted = {'encoder', 'input_embedding', 'mlm_transform', *token_heads, *unused}
  per_row = flops.kernel_parameters({k: v for k, v in params.items() if k not in counted})
  total = flops.dense(per_position, positions) + flops.dense(per_row, positions // length)
  if mlm:
    table = params['token_embed']['embedding']
    per_masked = flops.kernel_parameters(params['mlm_transform']) + int(np.prod(table.shape))
    total += flops.dense(per_masked, int(np.prod(batch['mlm_positions'].shape)))
  return total + flops.attention(cfg.num_encoder_layers, positions // length, length, length,
                                 flops.attention_width(cfg), causal=False)


def packing_arguments(batch) -> dict:
  """The model's packed-row keywords (segment ids, positions) from a batch that has them."""
  if 'inputs_segment_ids' not in batch:
    return {}
  return {'segment_ids': batch['inputs_segment_ids'], 'positions': batch['inputs_positions']}


class BertPretrainTask:
  """Masked-LM loss (+ the 2-way sentence loss for NSP or SOP); loss = MLM mean + sentence mean."""

  def __init__(self, cfg: TransformerConfig, *, sentence_task: str = 'nsp',
               type_vocab_size: int = 2, eval_batches=()):
    self.cfg, self.sentence_task = cfg, sentence_task
    self.model = Bert(cfg, type_vocab_size=type_vocab_size, mlm=True,
                      sentence_classes=0 if sentence_task == 'none' else 2)
    self.eval_batches = list(eval_batches)  # held-out batches for the sentence-task accuracy
    self._eval_fn = jax.jit(self._sentence_sums)

  def init_variables(self, rng):
    t = min(8, self.cfg.max_len)
    tokens = jnp.ones((1, t), jnp.int32)
    return self.model.init({'params': rng, 'dropout': rng}, tokens, jnp.zeros_like(tokens),
                           mlm_positions=jnp.zeros((1, 2), jnp.int32))

  def _apply(self, params, batch, rng, deterministic, method=None):
    rngs = None if deterministic else {'dropout': rng}
    return self.model.apply({'params': params}, batch['inputs'], batch['segments'],
                            mlm_positions=batch['mlm_positions'], deterministic=deterministic,
                            rngs=rngs, method=method, **packing_arguments(batch))

  def loss_fn(self, params, batch, rng, deterministic: bool):
    out = self._apply(params, batch, rng, deterministic, method=Bert.features)
    _, nll, correct, weight = projected_cross_entropy_sums(out['mlm_features'],
                                                           out['mlm_embedding'], batch['mlm_ids'],
                                                           batch['mlm_weights'],
                                                           bias=out['mlm_bias'])
    loss = nll / jnp.maximum(weight, 1.0)
    if self.sentence_task != 'none':
      s_nll = cross_entropy_sums(out['sentence_logits'], batch['sentence_labels'],
                                 jnp.ones(batch['sentence_labels'].shape, jnp.float32))[1]
      loss = loss + s_nll / batch['sentence_labels'].shape[0]
    return loss, {'loss': nll, 'correct': correct, 'weight': weight}

  def _sentence_sums(self, params, batch):
    out = self._apply(params, batch, None, True)
    _, nll, correct, weight = cross_entropy_sums(
        out['sentence_logits'], batch['sentence_labels'],
        jnp.ones(batch['sentence_labels'].shape, jnp.float32))
    return jnp.stack([nll, correct, weight])

  def count_tokens(self, batch) -> int:
    return _count_tokens(batch)

  def count_slots(self, batch) -> int:
    return _count_slots(batch)

  def model_flops(self, params, batch) -> float:
    unused = ('pooler',) if self.sentence_task == 'none' else ()  # no sentence head reads it
    return bert_model_flops(self.cfg, params, batch, mlm=True, unused=unused)

  def evaluate(self, context, params, step: int) -> dict[str, float]:
    """Sentence-task (NSP/SOP) loss and accuracy on the held-out batches."""
    if self.sentence_task == 'none' or not self.eval_batches:
      return {}
    with sharding.use_mesh(context.mesh):
      sums = [self._eval_fn(params, context.to_global(b)) for b in self.eval_batches]
    nll, correct, weight = np.sum(np.asarray(jax.device_get(sums)), axis=0)
    return {
        f'{self.sentence_task}_loss': float(nll / max(weight, 1.0)),
        f'{self.sentence_task}_accuracy': float(correct / max(weight, 1.0))
    }


class BertHeadTask:
  """Fine-tuning through one of `Bert`'s heads: the cross-entropy of its logits (the model
  output named `output`) at the batch's labels, weighted by 'weights'; 'weight' sums those, so
  the trainer's eval 'accuracy' is the accuracy of what is weighted (examples, or words)."""
  output: str  # 'class_logits' or 'token_logits'
  head_size: str  # the `Bert` field that gives the head its num_labels outputs

  def __init__(self, cfg: TransformerConfig, num_labels: int, *, type_vocab_size: int = 2):
    self.cfg, self.num_labels = cfg, num_labels
    self.model = Bert(cfg, type_vocab_size=type_vocab_size, mlm=False, sentence_classes=0,
                      **{self.head_size: num_labels})

  def init_variables(self, rng):
    tokens = jnp.ones((1, min(8, self.cfg.max_len)), jnp.int32)
    return self.model.init({'params': rng, 'dropout': rng}, tokens, jnp.zeros_like(tokens))

  def logits(self, params, batch, rng=None, deterministic: bool = True):
    """The head's float32 logits: [B, labels] per example, or [B, T, labels] per token."""
    rngs = None if deterministic else {'dropout': rng}
    return self.model.apply({'params': params}, batch['inputs'], batch['segments'],
                            deterministic=deterministic, rngs=rngs)[self.output]

  def loss_fn(self, params, batch, rng, deterministic: bool):
    logits = self.logits(params, batch, rng, deterministic)
    _, nll, correct, weight = cross_entropy_sums(logits, batch['labels'], batch['weights'])
    return nll / jnp.maximum(weight, 1.0), {'loss': nll, 'correct': correct, 'weight': weight}

  def count_tokens(self, batch) -> int:
    return _count_tokens(batch)

  def count_slots(self, batch) -> int:
    return _count_slots(batch)


class BertClassificationTask(BertHeadTask):
  """Cross-entropy of the [CLS]-pooled classifier; 'weight' counts examples, so the trainer's
  eval 'accuracy' is the classification accuracy."""
  output, head_size = 'class_logits', 'num_labels'

  def model_flops(self, params, batch) -> float:
    return bert_model_flops(self.cfg, params, batch)

  def evaluate(self, context, params, step: int) -> dict[str, float]:
    return {}
