"""Residual blocks and layer stacks shared by the encoder-decoder, GPT and BERT.

One block class covers every layer in the family: self-attention, optional cross-attention,
feed-forward, each wrapped as a residual sublayer in Pre-LN or Post-LN form:
  Post-LN (Vaswani et al. 2017, BERT):  x = norm(x + dropout(f(x)))
  Pre-LN  (GPT-2, T5, LLaMA):           x = x + dropout(f(norm(x)))   (+ a final norm)
Pre-LN keeps an identity path from input to output, which is why deep stacks train without
warmup tricks; Post-LN normalises the sum and needs warmup but often ends slightly better.
"""

import functools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.layers.attention import MultiHeadAttention
from transformer_jax.layers.embedding import Embed
from transformer_jax.layers.feedforward import FeedForward
from transformer_jax.model_config import TransformerConfig
from transformer_jax.layers.normalization import make_norm
from transformer_jax.layers.position import (AbsolutePositionEmbedding, RelativePositionBias,
                                             relative_position_bias)

ACTIVATION_AXES = ('batch', 'length', 'embed')


class TransformerBlock(nn.Module):
  """Self-attention (+ cross-attention) + feed-forward, each a residual sublayer.

  Arguments may be passed positionally (nn.remat/nn.scan need that, and lifted transforms take
  arrays, not modules): `bias_table` is the stack's relative-position table [buckets, H], the
  array form of `bias_fn`. With `scan_carry` it returns (x, None), the carry/output pair
  nn.scan expects.
  """
  cfg: TransformerConfig
  cross_attention: bool = False
  scan_carry: bool = False
  causal: bool = False  # self-attention is causal (lets attention skip the hidden blocks)

  @nn.compact
  def __call__(self, x, encoded=None, self_mask=None, cross_mask=None, bias_table=None,
               positions=None, deterministic: bool = True, *, bias_fn=None):
    cfg = self.cfg
    if bias_table is not None:
      bias_fn = functools.partial(relative_position_bias, bias_table, bidirectional=not self.causal,
                                  max_distance=cfg.relative_max_distance, dtype=cfg.dtype)

    def residual(x, sublayer: Callable, name: str):
      norm = make_norm(cfg, f'{name}_norm')
      dropout = nn.Dropout(cfg.dropout_rate, name=f'{name}_dropout')
      if cfg.norm_position == 'pre':
        x = x + dropout(sublayer(norm(x)), deterministic=deterministic)
      else:
        x = norm(x + dropout(sublayer(x), deterministic=deterministic))
      return nn.with_logical_constraint(x, ACTIVATION_AXES)

    x = residual(
        x, lambda h: MultiHeadAttention(cfg, causal=self.causal, name='self_attention')
        (h, mask=self_mask, bias_fn=bias_fn, positions=positions, deterministic=deterministic),
        'self_attention')
    if self.cross_attention:
      x = residual(
          x, lambda h: MultiHeadAttention(cfg, name='cross_attention')
          (h, encoded, mask=cross_mask, deterministic=deterministic), 'cross_attention')
    x = residual(x, lambda h: FeedForward(cfg, name='mlp')(h, deterministic=deterministic), 'mlp')
    return (x, None) if self.scan_carry else x


class TransformerStack(nn.Module):
  """`num_layers` blocks; a shared T5 relative bias if configured; a final norm for Pre-LN."""
  cfg: TransformerConfig
  num_layers: int
  causal: bool
  cross_attention: bool = False

  @nn.compact
  def __call__(self, x, encoded=None, *, self_mask=None, cross_mask=None, positions=None,
               deterministic: bool = True):
    cfg = self.cfg
    bias_fn = None
    if cfg.position == 'relative':
      # One bias table per stack, shared by its layers (as in T5); attention calls it once it
      # knows the key positions (in decode mode: every slot of the KV cache).
      bias_fn = RelativePositionBias(cfg.num_heads, cfg.relative_buckets, cfg.relative_max_distance,
                                     bidirectional=not self.causal, dtype=cfg.dtype,
                                     param_dtype=cfg.param_dtype, name='relative_bias')
    remat = cfg.remat_policy != 'none' and not cfg.decode  # no backward pass when decoding
    if not (remat or cfg.scan_layers):
      for i in range(self.num_layers):
        x = TransformerBlock(cfg, self.cross_attention, causal=self.causal,
                             name=f'layer_{i}')(x, encoded, self_mask=self_mask,
                                                cross_mask=cross_mask, bias_fn=bias_fn,
                                                positions=positions, deterministic=deterministic)
    else:
      x = self._transformed_layers(x, encoded, self_mask, cross_mask, bias_fn, positions,
                                   deterministic, remat)
    if cfg.norm_position == 'pre':
      x = make_norm(cfg, 'final_norm')(x)
    return x

  def _transformed_layers(self, x, encoded, self_mask, cross_mask, bias_fn, positions,
                          deterministic, remat: bool):
    """The layers under nn.remat (per layer) and/or nn.scan (one traced layer, stacked params).

    Lifted transforms take arrays, not modules: a relative bias goes in as its table.
    """
    cfg = self.cfg
    bias_table = bias_fn.table if bias_fn is not None else None
    block = TransformerBlock
    if remat:
      # deterministic (argument 7, counting the module) must stay a Python bool.
      block = nn.remat(block, policy=getattr(jax.checkpoint_policies, cfg.remat_policy),
                       prevent_cse=not cfg.scan_layers, static_argnums=(7,))
    args = (encoded, self_mask, cross_mask, bias_table, positions, deterministic)
    if not cfg.scan_layers:
      for i in range(self.num_layers):
        x = block(cfg, self.cross_attention, causal=self.causal, name=f'layer_{i}')(x, *args)
      return x
    # The KV caches stack layers on axis 1: decoding helpers expect the row axis first.
    scanned = nn.scan(block, variable_axes={'params': 0, 'cache': 1, 'intermediates': 0},
                      split_rngs={'params': True,
                                  'dropout': True}, in_axes=(nn.broadcast,) * len(args),
                      length=self.num_layers, metadata_params={nn.PARTITION_NAME: 'layers'})
    x, _ = scanned(cfg, self.cross_attention, scan_carry=True, causal=self.causal,
                   name='layers')(x, *args)
    return x


class InputEmbedding(nn.Module):
  """tokens -> embedding (x sqrt(D) if configured) + absolute positions -> (norm) -> dropout."""
  cfg: TransformerConfig
  embed: Embed

  @nn.compact
  def __call__(self, tokens, positions, *, extra=None, deterministic: bool = True):
    cfg = self.cfg
    x = self.embed(tokens)
    if cfg.scale_embeddings:
      x = x * jnp.sqrt(jnp.asarray(cfg.emb_dim, x.dtype))
    if cfg.position in ('sinusoidal', 'learned'):
      x = AbsolutePositionEmbedding(cfg.position, cfg.max_len, cfg.dtype, cfg.param_dtype,
                                    name='position_embedding')(x, positions)
    if extra is not None:  # e.g. BERT's segment embeddings
      x = x + extra
    if cfg.embedding_norm:
      x = make_norm(cfg, 'embedding_norm')(x)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
    return nn.with_logical_constraint(x, ACTIVATION_AXES)


class StepPositions(nn.Module):
  """Positions of this call's tokens: 0..T-1, or in decode mode the next T after the cache.

  In decode mode the counter lives in the 'cache' collection (a scalar, shared by every row
  and beam), so positional encodings, rotary angles and cache writes all agree.
  """
  cfg: TransformerConfig

  @nn.compact
  def __call__(self, length: int) -> jnp.ndarray:
    if not self.cfg.decode:
      return jnp.arange(length)
    initialised = self.has_variable('cache', 'position')
    counter = self.variable('cache', 'position', lambda: jnp.zeros((), jnp.int32))
    if not initialised:  # the allocating call of a decode-mode init
      return jnp.arange(length)
    start = counter.value
    counter.value = start + length
    return start + jnp.arange(length)


def empty_cache(decode_model: nn.Module, *inputs) -> dict:
  """The zero-filled 'cache' collection of a decode-mode model, sized by full-length `inputs`.

  A decode-mode init on full-length inputs allocates the KV caches; their values start at zero,
  so tracing the shapes (`eval_shape`) is enough and no forward pass runs.
  """
  shapes = jax.eval_shape(decode_model.init, jax.random.key(0), *inputs)['cache']
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
