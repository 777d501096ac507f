"""BERT and its successors: a bidirectional Transformer encoder with pretraining and
classification heads.

    tokens + segments + learned positions (width E) -> LayerNorm (-> projection E -> D)
        -> N Post-LN self-attention blocks (N separate layers, or one shared layer applied N times)
        -> hidden [B, T, D]
        -> pooler: tanh(dense(hidden[:, 0]))                       (the [CLS] vector)
    heads: masked LM   dense D -> E -> GELU -> LayerNorm -> tied embedding^T + bias (at masked
                       positions)
           sentence    2-way on the pooled vector (next-sentence or sentence-order prediction)
           classifier  dropout -> dense on the pooled vector (fine-tuning)
           token       dropout -> dense on every position's hidden vector (tagging)

The encoder is the translation encoder's `TransformerStack` (bidirectional, padding-masked); the
switches in `bert_config` make it BERT's (Devlin et al. 2019). E = D for BERT and RoBERTa.
ALBERT (Lan et al. 2019, `albert_config`) is this class with its two parameter savings switched
on: a factorised embedding (cfg.embedding_size = E < D) and cross-layer sharing
(cfg.share_layers), trained with sentence-order prediction. Which heads exist is a module
attribute, so BERT (MLM + NSP), RoBERTa (MLM only) and ALBERT (MLM + SOP; the same 2-way head,
trained on different pairs) share this one class.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.layers.blocks import ACTIVATION_AXES, InputEmbedding, TransformerStack
from transformer_jax.layers.dense import DenseGeneral
from transformer_jax.layers.embedding import Embed
from transformer_jax.layers.position import packed_positions
from transformer_jax.layers.feedforward import _ACTIVATIONS
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig
from transformer_jax.special_tokens import PAD_ID
from transformer_jax.layers.normalization import make_norm

# BERT's architecture, whatever its size: Post-LN with a normalised embedding sum, learned
# positions, exact GELU, biases, tied MLM output, N(0, 0.02) init. Written once: the experiment
# configs (experiments/configs/bert_common.py) take it from here.
BERT_ARCHITECTURE = dict(norm_type='layernorm', norm_position='post', norm_epsilon=1e-12,
                         embedding_norm=True, position='learned', activation='gelu_exact',
                         use_bias=True, tie_output=True, scale_embeddings=False,
                         embed_init_std=0.02)
# BERT-base's sizes (110M), the default of `bert_config`.
BERT_BASE = dict(vocab_size=30522, emb_dim=768, num_heads=12, mlp_dim=3072, num_encoder_layers=12,
                 num_decoder_layers=0, max_len=512, dropout_rate=0.1, attention_dropout_rate=0.1)


def bert_config(**overrides) -> TransformerConfig:
  """BERT-base by default (110M); override sizes for smaller models."""
  return TransformerConfig(**{**BERT_BASE, **BERT_ARCHITECTURE, **overrides})


# RoBERTa (Liu et al. 2019) keeps BERT's architecture; its differences are in the data (byte-level
# BPE, dynamic masking, full-sentence inputs, no NSP) and in the LayerNorm epsilon (1e-5).
ROBERTA_ARCHITECTURE = dict(BERT_ARCHITECTURE, norm_epsilon=1e-5)
# RoBERTa-base's sizes (125M): BERT-base's with its byte-level vocabulary.
ROBERTA_BASE = dict(BERT_BASE, vocab_size=50265)

# ALBERT's switches beside BERT's: tanh-approximated GELU (HF 'gelu_new'), one layer's parameters
# shared by every layer. The embedding width (embedding_size) is a size, set by albert_config.
ALBERT_ARCHITECTURE = dict(BERT_ARCHITECTURE, activation='gelu', share_layers=True)
# ALBERT-base's sizes (albert-base-v2): E = 128, D = 768, 12 heads, 12 applications of one
# shared layer, no dropout (v2).
ALBERT_BASE = dict(BERT_BASE, vocab_size=30000, embedding_size=128, dropout_rate=0.0,
                   attention_dropout_rate=0.0)


def albert_config(**overrides) -> TransformerConfig:
  """ALBERT-base (albert-base-v2, 11.7M parameters with the pooler) by default: E = 128, D = 768,
  12 heads, 12 applications of one shared layer, no dropout (v2); override sizes for smaller
  models."""
  return TransformerConfig(**{**ALBERT_BASE, **ALBERT_ARCHITECTURE, **overrides})


def roberta_config(**overrides) -> TransformerConfig:
  """RoBERTa-base by default (125M); override sizes for smaller models.

  max_len counts usable positions (512); HF's table has 514 rows because its positions start
  at padding_idx + 1 (convert/hf_roberta.py handles that offset).
  """
  return TransformerConfig(**{**ROBERTA_BASE, **ROBERTA_ARCHITECTURE, **overrides})


def bert_heads(params) -> dict:
  """The `Bert` attributes {'type_vocab_size', 'mlm', 'sentence_classes', 'num_labels'} that
  `params` were built with (what a converter's `load` gives as `HFModel.heads`)."""
  shape = lambda name, axis: int(jnp.shape(params[name]['kernel'])[axis]) if name in params else 0
  if 'segment_embedding' not in params:
    raise ConfigError('params lack segment_embedding: not the parameters of a Bert model')
  return {
      'type_vocab_size': int(jnp.shape(params['segment_embedding'])[0]),
      'mlm': 'mlm_transform' in params, 'sentence_classes': shape('sentence_head', 1),
      'num_labels': shape('classifier', 1)
  }


def _dense(cfg: TransformerConfig, features: int, axes, name: str) -> DenseGeneral:
  # BERT initialises every linear layer with N(0, 0.02), like its embeddings.
  return DenseGeneral((features,), axes, use_bias=True, dtype=cfg.dtype,
                      param_dtype=cfg.param_dtype, kernel_layout=cfg.kernel_layout,
                      kernel_init=nn.initializers.normal(cfg.embed_init_std or 0.02), name=name)


class Bert(nn.Module):
  """Encoder + pooler + the configured heads; returns a dict of outputs.

  Attributes:
    cfg: the encoder (uses cfg.num_encoder_layers; cfg.max_len is the position table size).
    type_vocab_size: number of segment ids (2: sentence A / sentence B).
    mlm: build the masked-LM head.
    sentence_classes: > 0 builds the 2-way NSP/SOP head on the pooled vector.
    num_labels: > 0 builds a sequence-classification head on the pooled vector.
    num_token_labels: > 0 builds a per-token classification head on the final hidden states
      (logits [B, T, num_token_labels], e.g. CoNLL tagging).
  """
  cfg: TransformerConfig
  type_vocab_size: int = 2
  mlm: bool = True
  sentence_classes: int = 2
  num_labels: int = 0
  num_token_labels: int = 0

  def setup(self):
    cfg = self.cfg
    if cfg.rescale_tied_output:  # a switch of T5's; refuse it rather than ignore it
      raise ConfigError('model config: rescale_tied_output is T5\'s (the encoder-decoder); '
                        'set it to False for this model')
    # The embedding width E: ALBERT's factorised embedding_size, else the model width.
    width = cfg.emb_dim if cfg.embedding_size is None else cfg.embedding_size
    self.token_embed = Embed(cfg.vocab_size, width, cfg.dtype, cfg.param_dtype,
                             stddev=cfg.embed_init_std)
    # A handful of rows: replicated (None), never split over the 'vocab' mesh axis.
    self.segment_embedding = self.param(
        'segment_embedding',
        nn.with_logical_partitioning(nn.initializers.normal(cfg.embed_init_std or 0.02),
                                     (None, 'embed')), (self.type_vocab_size, width),
        cfg.param_dtype)
    factorised = cfg.embedding_size is not None
    self.input_embedding = InputEmbedding(cfg, self.token_embed, factorised=factorised)
    self.encoder = TransformerStack(cfg, cfg.num_encoder_layers, causal=False)
    self.pooler = _dense(cfg, cfg.emb_dim, ('embed', 'mlp'), 'pooler')
    if self.mlm:
      # D -> E: back to the (tied) embedding's width (ALBERT's head; E = D otherwise).
      self.mlm_transform = _dense(cfg, width, ('embed', 'mlp'), 'mlm_transform')
      self.mlm_norm = make_norm(cfg, 'mlm_norm')
      self.mlm_bias = self.param(
          'mlm_bias', nn.with_logical_partitioning(nn.initializers.zeros_init(), ('vocab',)),
          (cfg.vocab_size,), cfg.param_dtype)
    if self.sentence_classes:
      self.sentence_head = _dense(cfg, self.sentence_classes, ('embed', None), 'sentence_head')
    if self.num_labels:
      self.classifier_dropout = nn.Dropout(cfg.dropout_rate)
      self.classifier = _dense(cfg, self.num_labels, ('embed', None), 'classifier')
    if self.num_token_labels:
      self.token_classifier_dropout = nn.Dropout(cfg.dropout_rate)
      self.token_classifier = _dense(cfg, self.num_token_labels, ('embed', None),
                                     'token_classifier')

  def encode(self, tokens, segments=None, valid=None, *, segment_ids=None, positions=None,
             deterministic: bool = True):
    """(hidden [B, T, D], pooled [B, D]). `valid` [B, T] marks real tokens (default != PAD).

    `segments` are BERT's token types (sentence A / B). Packed rows (several examples a row,
    `data/bert_pretrain.py`) pass `segment_ids` [B, T] (which example a token belongs to: 1, 2,
    ...; 0 on padding) and `positions` [B, T] restarting at 0 per example (derived from the ids
    when omitted): attention stays within each example, whose padding needs no mask. `pooled`
    reads row position 0, the first example's [CLS].
    """
    cfg = self.cfg
    if segment_ids is not None and positions is None:
      positions = packed_positions(segment_ids)
    if valid is None and segment_ids is None:
      valid = tokens != PAD_ID
    if segments is None:
      segments = jnp.zeros_like(tokens)
    # Whole feature rows for the lookup (`Embed.__call__` says why).
    segment_table = nn.with_logical_constraint(self.segment_embedding, (None, None))
    segment = jnp.take(segment_table, segments, axis=0).astype(cfg.dtype)
    if positions is None:
      positions = jnp.arange(tokens.shape[1])
    x = self.input_embedding(tokens, positions, extra=segment, deterministic=deterministic)
    # Keys only: every query (padding ones too, as in BERT) attends to the real tokens, so no
    # row is fully masked and padded positions never influence real ones.
    mask = None if valid is None else valid[:, None, None, :]
    hidden = self.encoder(x, self_mask=mask, positions=positions, segment_ids=segment_ids,
                          deterministic=deterministic)
    hidden = nn.with_logical_constraint(hidden, ACTIVATION_AXES)
    pooled = jnp.tanh(self.pooler(hidden[:, 0]))
    return hidden, nn.with_logical_constraint(pooled, ('batch', 'embed'))

  def mlm_features(self, hidden, positions):
    """The MLM head's features [B, P, E] at `positions` [B, P] only (the vocabulary projection
    is the most expensive layer, and only the ~15% masked positions are scored)."""
    gathered = jnp.take_along_axis(hidden, positions[..., None], axis=1)
    h = _ACTIVATIONS[self.cfg.activation](self.mlm_transform(gathered))
    # Back to the residual layout (features on 'embed', not 'mlp'=tensor) before the tied
    # output matmul: without it XLA's partitioner returns wrong gradients on
    # data x fsdp x tensor meshes (tests/test_mesh.py caught a 3% grad-norm error).
    h = nn.with_logical_constraint(h, ACTIVATION_AXES)
    return self.mlm_norm(h)

  def mlm_logits(self, hidden, positions):
    """Vocabulary logits [B, P, V] (float32) at `positions` [B, P]."""
    h = self.mlm_features(hidden, positions)
    logits = self.token_embed.attend(h) + self.mlm_bias.astype(h.dtype)
    return nn.with_logical_constraint(logits, ('batch', 'length', 'vocab')).astype(jnp.float32)

  def __call__(self, tokens, segments=None, *, valid=None, mlm_positions=None, segment_ids=None,
               positions=None, deterministic: bool = True) -> dict[str, jax.Array]:
    """{'hidden', 'pooled'} plus, for the built heads, 'mlm_logits' (when `mlm_positions` is
    given), 'sentence_logits' and 'class_logits' ([B, classes], float32) and 'token_logits'
    ([B, T, token labels], float32). Packed rows: `segment_ids`, `positions` as `encode`."""
    return self._outputs(tokens, segments, valid, mlm_positions, (segment_ids, positions),
                         deterministic, project=True)

  def features(self, tokens, segments=None, *, valid=None, mlm_positions=None, segment_ids=None,
               positions=None, deterministic: bool = True) -> dict[str, jax.Array]:
    """As `__call__`, with the MLM head stopped before its vocabulary projection:
    'mlm_features' [B, P, E], 'mlm_embedding' [V, E] and 'mlm_bias' [V] instead of
    'mlm_logits' (for `losses.projected_cross_entropy_sums`)."""
    return self._outputs(tokens, segments, valid, mlm_positions, (segment_ids, positions),
                         deterministic, project=False)

  def _outputs(self, tokens, segments, valid, mlm_positions, packing, deterministic: bool,
               project: bool) -> dict[str, jax.Array]:
    hidden, pooled = self.encode(tokens, segments, valid, segment_ids=packing[0],
                                 positions=packing[1], deterministic=deterministic)
    out = {'hidden': hidden, 'pooled': pooled}
    if self.mlm and mlm_positions is not None:
      if project:
        out['mlm_logits'] = self.mlm_logits(hidden, mlm_positions)
      else:
        out['mlm_features'] = self.mlm_features(hidden, mlm_positions)
        out['mlm_embedding'], out['mlm_bias'] = self.token_embed.embedding, self.mlm_bias
    if self.sentence_classes:
      out['sentence_logits'] = self.sentence_head(pooled).astype(jnp.float32)
    if self.num_labels:
      x = self.classifier_dropout(pooled, deterministic=deterministic)
      out['class_logits'] = self.classifier(x).astype(jnp.float32)
    if self.num_token_labels:
      x = self.token_classifier_dropout(hidden, deterministic=deterministic)
      logits = self.token_classifier(x).astype(jnp.float32)
      out['token_logits'] = nn.with_logical_constraint(logits, ('batch', 'length', None))
    return out
