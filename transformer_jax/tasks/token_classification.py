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

from transformer_jax.layers.losses import cross_entropy_sums
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.bert import Bert
from transformer_jax.parallel import sharding
from transformer_jax.tasks.bert import bert_model_flops


class TokenClassificationTask:
  """Cross-entropy of `Bert`'s token head over the labelled sub-words."""

  def __init__(self, cfg: TransformerConfig, label_names: list[str], *, type_vocab_size: int = 2,
               eval_batches=()):
    self.cfg, self.label_names = cfg, list(label_names)
    self.num_labels = len(self.label_names)
    self.model = Bert(cfg, type_vocab_size=type_vocab_size, mlm=False, sentence_classes=0,
                      num_token_labels=self.num_labels)
    self.eval_batches = list(eval_batches)  # for the per-tag accuracy
    self._tag_counts = jax.jit(self._per_tag_counts)

  def init_variables(self, rng):
    tokens = jnp.ones((1, min(8, self.cfg.max_len)), jnp.int32)
    return self.model.init({'params': rng, 'dropout': rng}, tokens, jnp.zeros_like(tokens))

  def logits(self, params, batch, rng=None, deterministic: bool = True):
    """[B, T, labels] float32."""
    rngs = None if deterministic else {'dropout': rng}
    return self.model.apply({'params': params}, batch['inputs'], batch['segments'],
                            deterministic=deterministic, rngs=rngs)['token_logits']

  def loss_fn(self, params, batch, rng, deterministic: bool):
    logits = self.logits(params, batch, rng, deterministic)
    _, nll, correct, weight = cross_entropy_sums(logits, batch['labels'], batch['weights'])
    return nll / jnp.maximum(weight, 1.0), {'loss': nll, 'correct': correct, 'weight': weight}

  def _per_tag_counts(self, params, batch):
    """[2, labels]: (correct, total) labelled words per gold tag."""
    predicted = jnp.argmax(self.logits(params, batch), axis=-1)
    gold = jax.nn.one_hot(batch['labels'], self.num_labels) * batch['weights'][..., None]
    hits = gold * (predicted == batch['labels'])[..., None]
    return jnp.stack([hits.sum(axis=(0, 1)), gold.sum(axis=(0, 1))])

  def count_tokens(self, batch) -> int:
    return int(np.count_nonzero(batch['inputs']))

  def count_slots(self, batch) -> int:
    return int(batch['inputs'].size)

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
