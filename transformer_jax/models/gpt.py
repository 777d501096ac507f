"""GPT: a decoder-only Transformer language model (Radford et al. 2018/2019).

    tokens -> embed (+ learned positions) -> N causal self-attention blocks -> final norm
           -> logits over the vocabulary (tied to the embedding)

No encoder and no cross-attention: the same `TransformerStack` as the translation decoder with
`cross_attention=False`. By config it is GPT-2 (learned positions, Pre-LayerNorm, GELU, tied
embeddings, biases), OPT (GPT-2's with ReLU) or LLaMA-style (rotary positions, RMSNorm, SwiGLU,
grouped-query attention, no biases): see `gpt2_config`, `opt_config` and `llama_config`, and their
switches GPT2_ARCHITECTURE, OPT_ARCHITECTURE and LLAMA_ARCHITECTURE. convert/hf_gpt2.py,
convert/hf_opt.py and convert/hf_llama.py map them to Hugging Face's models.
"""

import flax.linen as nn
import jax.numpy as jnp

from transformer_jax.layers.blocks import InputEmbedding, StepPositions, TransformerStack
from transformer_jax.layers.dense import DenseGeneral
from transformer_jax.layers.embedding import Embed
from transformer_jax.layers.position import packed_positions
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig

# GPT-2's architecture, whatever its size: learned positions, Pre-LN, tanh-GELU, biases, tied
# output embedding, N(0, 0.02) init. Experiment configs (experiments/configs/lm_common.py) take
# these switches from here, so the preset is written once.
GPT2_ARCHITECTURE = dict(norm_type='layernorm', norm_position='pre', norm_epsilon=1e-5,
                         position='learned', activation='gelu', use_bias=True, tie_output=True,
                         scale_embeddings=False, embed_init_std=0.02)
# GPT-2 small's sizes (124M), the default of `gpt2_config`.
GPT2_SMALL = dict(vocab_size=50257, emb_dim=768, num_heads=12, mlp_dim=3072, num_encoder_layers=0,
                  num_decoder_layers=12, max_len=1024, dropout_rate=0.1, attention_dropout_rate=0.1)

# OPT's architecture (Zhang et al. 2022), whatever its size: GPT-2's switches with ReLU in the
# MLP. Its checkpoints' position table starts two rows late, a layout convert/hf_opt.py handles,
# not a switch. The OPT importer gives these switches and
# experiments/configs/opt_shakespeare.py trains them; a model with them exports as OPT.
OPT_ARCHITECTURE = dict(GPT2_ARCHITECTURE, activation='relu')
# OPT-125m's sizes, the default of `opt_config`.
OPT_125M = dict(vocab_size=50272, emb_dim=768, num_heads=12, mlp_dim=3072, num_encoder_layers=0,
                num_decoder_layers=12, max_len=2048, dropout_rate=0.1, attention_dropout_rate=0.0)

# LLaMA's architecture (Touvron et al. 2023), whatever its size: rotary positions (rotate-half,
# base 10000), Pre-RMSNorm, SwiGLU, no biases, an untied output projection, unscaled embeddings,
# N(0, 0.02) init. Sizes, grouped-query heads and dropout are each config's own. Experiment
# configs (experiments/configs/llama_shakespeare.py) and the HF importer
# (convert/hf_llama.py) take these switches from here.
LLAMA_ARCHITECTURE = dict(norm_type='rmsnorm', norm_position='pre', norm_epsilon=1e-5,
                          position='rotary', rotary_base=10000.0, activation='swiglu',
                          use_bias=False, tie_output=False, scale_embeddings=False,
                          embed_init_std=0.02)
# The sizes of `llama_config`'s default: a small model, 8 layers of width 512.
LLAMA_SMALL = dict(vocab_size=32000, emb_dim=512, num_heads=8, num_kv_heads=2, mlp_dim=1408,
                   num_encoder_layers=0, num_decoder_layers=8, max_len=1024, dropout_rate=0.0,
                   attention_dropout_rate=0.0)


def gpt2_config(**overrides) -> TransformerConfig:
  """GPT-2 small (124M) by default; override sizes for smaller models."""
  return TransformerConfig(**{**GPT2_SMALL, **GPT2_ARCHITECTURE, **overrides})


def opt_config(**overrides) -> TransformerConfig:
  """OPT-125m by default; override sizes for smaller models."""
  return TransformerConfig(**{**OPT_125M, **OPT_ARCHITECTURE, **overrides})


def llama_config(**overrides) -> TransformerConfig:
  """LLaMA-style: rotary positions, RMSNorm, SwiGLU, grouped-query attention, no biases.

  A small model by default (8 layers, width 512); override sizes for others.
  """
  return TransformerConfig(**{**LLAMA_SMALL, **LLAMA_ARCHITECTURE, **overrides})


class GPT(nn.Module):
  """Causal language model: logits [B, T, V] (float32) for tokens [B, T].

  Uses `cfg.num_decoder_layers` layers. In decode mode (cfg.decode) each call continues from
  the KV cache: pass the prompt once (prefill), then one token per call.

  Packed rows (several documents per row; `data/lm.py`) pass `segment_ids` [B, T] (1, 2, ... per
  document, 0 on padding) and `positions` [B, T] (restarting at 0 per document; derived from
  the ids when omitted): a token attends only to earlier tokens of its own document, and
  learned, sinusoidal and rotary positions count from its document's start, so each document is
  computed exactly as it would be alone in a row.
  """
  cfg: TransformerConfig

  def setup(self):
    cfg = self.cfg
    if cfg.rescale_tied_output:  # a switch of T5's; refuse it rather than ignore it
      raise ConfigError('model config: rescale_tied_output is T5\'s (the encoder-decoder); '
                        'set it to False for this model')
    self.embed = Embed(cfg.vocab_size, cfg.emb_dim, cfg.dtype, cfg.param_dtype,
                       stddev=cfg.embed_init_std, name='token_embed')
    self.positions = StepPositions(cfg)
    self.input_embedding = InputEmbedding(cfg, self.embed)
    self.stack = TransformerStack(cfg, cfg.num_decoder_layers, causal=True)
    if not cfg.tie_output:
      self.lm_head = DenseGeneral((cfg.vocab_size,), ('embed', 'vocab'), use_bias=False,
                                  dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                  kernel_layout=cfg.kernel_layout)

  def __call__(self, tokens, *, segment_ids=None, positions=None, deterministic: bool = True):
    """Logits [B, T, V] (float32) for tokens [B, T]."""
    x = self.features(tokens, segment_ids=segment_ids, positions=positions,
                      deterministic=deterministic)
    logits = self.embed.attend(x) if self.cfg.tie_output else self.lm_head(x)
    logits = nn.with_logical_constraint(logits, ('batch', 'length', 'vocab'))
    return logits.astype(jnp.float32)

  def features_and_embedding(self, tokens, *, segment_ids=None, positions=None,
                             deterministic: bool = True):
    """(final features [B, T, D], `output_embedding()`): for a loss that projects onto the
    vocabulary itself, a slice at a time (`losses.projected_cross_entropy_sums`)."""
    features = self.features(tokens, segment_ids=segment_ids, positions=positions,
                             deterministic=deterministic)
    return features, self.output_embedding()

  def features(self, tokens, *, segment_ids=None, positions=None, deterministic: bool = True):
    """The final layer's features [B, T, D], before the vocabulary projection."""
    if segment_ids is not None and positions is None:
      positions = packed_positions(segment_ids)
    if positions is None:
      positions = self.positions(*tokens.shape)
    # No [T, T] mask: the stack's attention is causal by construction (the kernels apply
    # causality themselves and may skip hidden blocks; a mask would reach a flash kernel as a
    # score-sized bias). In decode mode the KV cache's mask provides it.
    x = self.input_embedding(tokens, positions, deterministic=deterministic)
    return self.stack(x, positions=positions, segment_ids=segment_ids, deterministic=deterministic)

  def output_embedding(self) -> jnp.ndarray:
    """The [V, D] matrix the logits score features against (tied table or output kernel)."""
    if self.cfg.tie_output:
      return self.embed.embedding
    return nn.meta.unbox(self.lm_head.variables['params']['kernel']).T
