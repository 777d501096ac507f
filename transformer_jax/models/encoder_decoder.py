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


def shift_right(targets: jnp.ndarray, start_id: int = PAD_ID) -> jnp.ndarray:
  """Decoder inputs: the targets delayed by one step, starting with `start_id` (teacher forcing)."""
  start = jnp.full(targets.shape[:1] + (1,), start_id, targets.dtype)
  return jnp.concatenate([start, targets[:, :-1]], axis=1)


class EncoderDecoder(nn.Module):
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
                                       dtype=cfg.dtype, param_dtype=cfg.param_dtype)

  def encode(self, inputs, *, deterministic: bool = True):
    """inputs [B, S] (0 = padding) -> encoded [B, S, D]."""
    valid = inputs != PAD_ID
    x = self.encoder_input(inputs, jnp.arange(inputs.shape[1]), deterministic=deterministic)
    return self.encoder(x, self_mask=make_padding_mask(valid, valid), deterministic=deterministic)

  def decode(self, encoded, inputs, decoder_tokens, *, deterministic: bool = True):
    """Logits [B, T, V] (float32) for decoder input tokens [B, T] given the encoded source."""
    y = self.output_features(
        self.decoder_features(encoded, inputs, decoder_tokens, deterministic=deterministic))
    logits = self.target_embed.attend(y) if self.cfg.tie_output else self.logits_dense(y)
    logits = nn.with_logical_constraint(logits, ('batch', 'length', 'vocab'))
    return logits.astype(jnp.float32)

  def decoder_features(self, encoded, inputs, decoder_tokens, *, deterministic: bool = True):
    """The decoder's final features [B, T, D] for decoder input tokens [B, T].

    Training passes the whole shifted target; decode mode passes one token a call. Only
    causality is needed on the decoder side: targets are right-padded, so a real query never
    sees a padded key, and padded queries carry no loss. The decoder's self-attention is causal
    by construction (no [T, T] mask is passed: the attention kernels apply causality
    themselves, and in decode mode the KV cache's mask does); the cross-attention hides padded
    source tokens.
    """
    positions = self.decoder_positions(decoder_tokens.shape[1])
    cross_mask = (inputs != PAD_ID)[:, None, None, :]
    y = self.decoder_input(decoder_tokens, positions, deterministic=deterministic)
    return self.decoder(y, encoded, cross_mask=cross_mask, positions=positions,
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

  def __call__(self, inputs, targets, *, deterministic: bool = True):
    """Teacher-forced logits [B, T, V] for source `inputs` [B, S] and `targets` [B, T]."""
    encoded = self.encode(inputs, deterministic=deterministic)
    return self.decode(encoded, inputs, shift_right(targets), deterministic=deterministic)

  def features_and_embedding(self, inputs, targets, *, deterministic: bool = True):
    """Teacher-forced (decoder features [B, T, D], `output_embedding()`): the training loss
    projects them onto the vocabulary itself (`losses.projected_cross_entropy_sums`, a slice
    at a time when the table is cache-sized). The features are `output_features`: those the
    logits of `decode` are projected from."""
    encoded = self.encode(inputs, deterministic=deterministic)
    features = self.decoder_features(encoded, inputs, shift_right(targets),
                                     deterministic=deterministic)
    return self.output_features(features), self.output_embedding()
