"""Token classification (tagging) for the one trainer: a per-token head on BERT's hidden states.

Batches (data/conll.py): 'inputs', 'segments', 'labels' int32[B, T], 'weights' float32[B, T],
weight 1 on each word's first sub-word and 0 elsewhere ([CLS], [SEP], continuation sub-words,
padding). The loss is the mean cross-entropy over the weighted positions only, and 'weight'
counts them, so the trainer's eval 'accuracy' is the token (word) accuracy. `evaluate` adds the
accuracy per gold tag (the fraction of words with that tag predicted correctly): entity-free, no
span matching, so it needs no B-/I- scheme.
"""

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model_config import TransformerConfig
from transformer_jax.parallel import sharding
from transformer_jax.tasks.bert import BertHeadTask, bert_model_flops


class TokenClassificationTask(BertHeadTask):
  """Cross-entropy of `Bert`'s token head over the labelled sub-words."""
  output, head_size = 'token_logits', 'num_token_labels'

  def __init__(self, cfg: TransformerConfig, label_names: list[str], *, type_vocab_size: int = 2,
               eval_batches=()):
    self.label_names = list(label_names)
    super().__init__(cfg, len(self.label_names), type_vocab_size=type_vocab_size)
    self.eval_batches = list(eval_batches)  # for the per-tag accuracy
    self._tag_counts = jax.jit(self._per_tag_counts)

  def _per_tag_counts(self, params, batch):
    """[2, labels]: (correct, total) labelled words per gold tag."""
    predicted = jnp.argmax(self.logits(params, batch), axis=-1)
    gold = jax.nn.one_hot(batch['labels'], self.num_labels) * batch['weights'][..., None]
    hits = gold * (predicted == batch['labels'])[..., None]
    return jnp.stack([hits.sum(axis=(0, 1)), gold.sum(axis=(0, 1))])

  def model_flops(self, params, batch) -> float:
    return bert_model_flops(self.cfg, params, batch, token_heads=('token_classifier',),
                            unused=('pooler',))

  def evaluate(self, context, params, step: int) -> dict[str, float]:
    """'accuracy_<tag>' per tag that occurs in the held-out batches."""
    if not self.eval_batches:
      return {}
    with sharding.use_mesh(context.mesh):
      counts = [self._tag_counts(params, context.to_global(b)) for b in self.eval_batches]
    correct, total = np.sum(np.asarray(jax.device_get(counts)), axis=0)
    return {
        f'accuracy_{name}': float(c / t)
        for name, c, t in zip(self.label_names, correct, total)
        if t > 0
    }
