"""The encoder-decoder Transformer (Vaswani et al. 2017) for sequence-to-sequence tasks.

    source tokens -> embed + positions -> encoder stack (bidirectional) --> encoded
    target tokens (shifted right) -> embed + positions -> decoder stack (causal self-attention,
        cross-attention to `encoded`) -> logits over the target vocabulary

By config the same module is the original Transformer (Post-LN, sinusoidal, ReLU) or T5
(Raffel et al. 2020: `T5_V1_0_ARCHITECTURE`, `T5_V1_1_ARCHITECTURE`, `t5_config`), whose
checkpoints `convert/hf_t5.py` reads and writes.
"""

import flax.linen as nn
import jax.numpy as jnp

from transformer_jax.kernels.masks import make_padding_mask
from transformer_jax.layers.blocks import InputEmbedding, StepPositions, TransformerStack
from transformer_jax.layers.dense import DenseGeneral
from transformer_jax.layers.embedding import Embed
from transformer_jax.layers.position import packed_positions
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig
from transformer_jax.special_tokens import PAD_ID

# T5 (v1.0, Raffel et al. 2020), whatever its size: Pre-RMSNorm (eps 1e-6), a relative position
# bias (32 buckets, max distance 128; one table per stack, shared by its layers), ReLU MLP, no
# biases, no absolute positions, unscaled N(0, 1) embeddings shared by encoder and decoder and
# tied to the output (features * emb_dim**-0.5 first), attention logits not divided by
# sqrt(head_dim). The HF importer (convert/hf_t5.py) takes these switches from here.
T5_V1_0_ARCHITECTURE = dict(norm_type='rmsnorm', norm_position='pre', norm_epsilon=1e-6,
                            position='relative', relative_buckets=32, relative_max_distance=128,
                            activation='relu', use_bias=False, scale_embeddings=False,
                            embed_init_std=1.0, share_embeddings=True, tie_output=True,
                            rescale_tied_output=True, scale_attention_scores=False)
# T5 v1.1 (and mT5, Flan-T5): gated GELU (tanh form), an untied output projection with no
# rescale; otherwise as v1.0.
T5_V1_1_ARCHITECTURE = dict(T5_V1_0_ARCHITECTURE, activation='geglu', tie_output=False,
                            rescale_tied_output=False)
# The published "small" sizes: t5-small (60.5M parameters) and google/t5-v1_1-small (77.0M).
# T5 keeps head_dim 64 whatever the width (v1.1 small: 6 heads of 64 on a width of 512).
_T5_SMALL = {
    '1.0':
        dict(emb_dim=512, num_heads=8, head_dim=64, mlp_dim=2048, num_encoder_layers=6,
             num_decoder_layers=6),
    '1.1':
        dict(emb_dim=512, num_heads=6, head_dim=64, mlp_dim=1024, num_encoder_layers=8,
             num_decoder_layers=8),
}
T5_ARCHITECTURES = {'1.0': T5_V1_0_ARCHITECTURE, '1.1': T5_V1_1_ARCHITECTURE}


def t5_config(version: str = '1.1', **overrides) -> TransformerConfig:
  """T5 of `version` ('1.0' or '1.1'), by default its published small size (SentencePiece
  vocabulary of 32128, max_len 512, dropout 0.1); `overrides` change anything.

  T5's relative positions have no length limit: max_len only bounds what the data pipeline and
  decoding produce.
  """
  if version not in T5_ARCHITECTURES:
    raise ConfigError(f'T5 version must be one of {sorted(T5_ARCHITECTURES)}, got {version!r}')
  values = dict(vocab_size=32128, max_len=512, dropout_rate=0.1, attention_dropout_rate=0.1,
                **_T5_SMALL[version], **T5_ARCHITECTURES[version])
  values.update(overrides)
  return TransformerConfig(**values)


def shift_right(targets: jnp.ndarray, start_id: int = PAD_ID,
                segment_ids: jnp.ndarray | None = None) -> jnp.ndarray:
  """Decoder inputs: the targets delayed by one step, starting with `start_id` (teacher forcing).

  Packed rows (`segment_ids` [B, T]): every example starts with `start_id`, never with the last
  token of the example before it.
  """
  start = jnp.full(targets.shape[:1] + (1,), start_id, targets.dtype)
  shifted = jnp.concatenate([start, targets[:, :-1]], axis=1)
  if segment_ids is None:
    return shifted
  first = segment_ids != jnp.concatenate([jnp.zeros_like(segment_ids[:, :1]), segment_ids[:, :-1]],
                                         axis=1)
  return jnp.where(first, jnp.asarray(start_id, targets.dtype), shifted)


def _packed(segment_ids, positions):
  """(segment ids, positions) of a packed stream: positions derived from the ids if omitted."""
  if segment_ids is not None and positions is None:
    positions = packed_positions(segment_ids)
  return segment_ids, positions


class EncoderDecoder(nn.Module):
  """Encoder-decoder logits for (source, target) rows.

  Packed rows (several sentence pairs per row, `data/packing.py`) pass each side's segment ids
  [B, S] / [B, T] (pair k of a row is source segment k and target segment k; 0 on padding) and
  positions restarting at 0 per example (derived from the ids when omitted): the encoder attends
  within each source, the decoder within each target (causally), its cross-attention to that
  pair's source only, and every position encoding counts from the example's start.
  """
  cfg: TransformerConfig

  def setup(self):
    cfg = self.cfg
    if cfg.share_embeddings and cfg.source_vocab_size != cfg.vocab_size:
      raise ConfigError('share_embeddings=True needs source_vocab_size == vocab_size '
                        f'(got {cfg.source_vocab_size} and {cfg.vocab_size})')
    embed = lambda size, name: Embed(size, cfg.emb_dim, cfg.dtype, cfg.param_dtype, stddev=cfg.
                                     embed_init_std, name=name)
    self.target_embed = embed(cfg.vocab_size, 'target_embed')
    self.source_embed = (self.target_embed if cfg.share_embeddings else embed(
        cfg.source_vocab_size, 'source_embed'))
    # The encoder never decodes incrementally: it runs once per source sentence.
    encoder_cfg = cfg.replace(decode=False)
    self.encoder_input = InputEmbedding(encoder_cfg, self.source_embed)
    self.encoder = TransformerStack(encoder_cfg, cfg.num_encoder_layers, causal=False)
    self.decoder_positions = StepPositions(cfg)
    self.decoder_input = InputEmbedding(cfg, self.target_embed)
    self.decoder = TransformerStack(cfg, cfg.num_decoder_layers, causal=True, cross_attention=True)
    if not cfg.tie_output:
      self.logits_dense = DenseGeneral((cfg.vocab_size,), ('embed', 'vocab'), use_bias=False,
                                       dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                       kernel_layout=cfg.kernel_layout)

  def encode(self, inputs, *, segment_ids=None, positions=None, deterministic: bool = True):
    """inputs [B, S] (0 = padding) -> encoded [B, S, D]. Packed rows: `segment_ids` [B, S]
    (their padding, id 0, is hidden from every real token, so no padding mask is built)."""
    segment_ids, positions = _packed(segment_ids, positions)
    mask = None
    if segment_ids is None:
      valid = inputs != PAD_ID
      mask = make_padding_mask(valid, valid)
    if positions is None:
      positions = jnp.arange(inputs.shape[1])
    x = self.encoder_input(inputs, positions, deterministic=deterministic)
    return self.encoder(x, self_mask=mask, positions=positions, segment_ids=segment_ids,
                        deterministic=deterministic)

  def decode(self, encoded, inputs, decoder_tokens, *, deterministic: bool = True):
    """Logits [B, T, V] (float32) for decoder input tokens [B, T] given the encoded source."""
    y = self.output_features(
        self.decoder_features(encoded, inputs, decoder_tokens, deterministic=deterministic))
    logits = self.target_embed.attend(y) if self.cfg.tie_output else self.logits_dense(y)
    logits = nn.with_logical_constraint(logits, ('batch', 'length', 'vocab'))
    return logits.astype(jnp.float32)

  def decoder_features(self, encoded, inputs, decoder_tokens, *, segment_ids=None, positions=None,
                       inputs_segment_ids=None, deterministic: bool = True):
    """The decoder's final features [B, T, D] for decoder input tokens [B, T].

    Training passes the whole shifted target; decode mode passes one token a call. Only
    causality is needed on the decoder side: targets are right-padded, so a real query never
    sees a padded key, and padded queries carry no loss. The decoder's self-attention is causal
    by construction (no [T, T] mask is passed: the attention kernels apply causality
    themselves, and in decode mode the KV cache's mask does); the cross-attention hides padded
    source tokens. Packed rows pass the target side's `segment_ids` and `positions` and the
    source side's `inputs_segment_ids`, which replace the cross-attention's padding mask.
    """
    segment_ids, positions = _packed(segment_ids, positions)
    if positions is None:
      positions = self.decoder_positions(*decoder_tokens.shape)
    cross_mask = None
    if segment_ids is None:
      cross_mask = (inputs != PAD_ID)[:, None, None, :]
    y = self.decoder_input(decoder_tokens, positions, deterministic=deterministic)
    return self.decoder(y, encoded, cross_mask=cross_mask, positions=positions,
                        segment_ids=segment_ids, encoded_segment_ids=inputs_segment_ids,
                        deterministic=deterministic)

  def output_features(self, features: jnp.ndarray) -> jnp.ndarray:
    """What the output projection is applied to: the decoder's features, times emb_dim**-0.5
    with `rescale_tied_output` (T5 v1.0: its tied N(0, 1) embeddings would otherwise give
    logits sqrt(emb_dim) times too large)."""
    if self.cfg.rescale_tied_output:
      features = features * self.cfg.emb_dim**-0.5
    return features

  def output_embedding(self) -> jnp.ndarray:
    """The [V, D] matrix the logits score features against (tied table or output kernel)."""
    if self.cfg.tie_output:
      return self.target_embed.embedding
    return nn.meta.unbox(self.logits_dense.variables['params']['kernel']).T

  def __call__(self, inputs, targets, *, inputs_segment_ids=None, inputs_positions=None,
               targets_segment_ids=None, targets_positions=None, deterministic: bool = True):
    """Teacher-forced logits [B, T, V] for source `inputs` [B, S] and `targets` [B, T]."""
    features = self._teacher_forced_features(inputs, targets, inputs_segment_ids, inputs_positions,
                                             targets_segment_ids, targets_positions, deterministic)
    logits = self.target_embed.attend(features) if self.cfg.tie_output else self.logits_dense(
        features)
    logits = nn.with_logical_constraint(logits, ('batch', 'length', 'vocab'))
    return logits.astype(jnp.float32)

  def features_and_embedding(self, inputs, targets, *, inputs_segment_ids=None,
                             inputs_positions=None, targets_segment_ids=None,
                             targets_positions=None, deterministic: bool = True):
    """Teacher-forced (decoder features [B, T, D], `output_embedding()`): the training loss
    projects them onto the vocabulary itself (`losses.projected_cross_entropy_sums`, a slice
    at a time when the table is cache-sized). The features are `output_features`: those the
    logits of `decode` are projected from. Packed rows: both sides' segment ids and positions
    (the class docstring)."""
    features = self._teacher_forced_features(inputs, targets, inputs_segment_ids, inputs_positions,
                                             targets_segment_ids, targets_positions, deterministic)
    return features, self.output_embedding()

  def _teacher_forced_features(self, inputs, targets, inputs_segment_ids, inputs_positions,
                               targets_segment_ids, targets_positions, deterministic: bool):
    if (inputs_segment_ids is None) != (targets_segment_ids is None):
      raise ValueError('packed rows need the segment ids of both inputs and targets')
    encoded = self.encode(inputs, segment_ids=inputs_segment_ids, positions=inputs_positions,
                          deterministic=deterministic)
    features = self.decoder_features(encoded, inputs,
                                     shift_right(targets, segment_ids=targets_segment_ids),
                                     segment_ids=targets_segment_ids, positions=targets_positions,
                                     inputs_segment_ids=inputs_segment_ids,
                                     deterministic=deterministic)
    return self.output_features(features)
