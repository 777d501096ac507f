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

from transformer_jax.errors import ConfigError
from transformer_jax.layers.attention import MultiHeadAttention
from transformer_jax.layers.dense import DenseGeneral
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
  nn.scan expects. Packed rows pass `segment_ids` [B, T] (this stack's tokens) and, for
  cross-attention, `encoded_segment_ids` [B, S]: attention stays inside each example.
  """
  cfg: TransformerConfig
  cross_attention: bool = False
  scan_carry: bool = False
  causal: bool = False  # self-attention is causal (lets attention skip the hidden blocks)

  @nn.compact
  def __call__(self, x, encoded=None, self_mask=None, cross_mask=None, bias_table=None,
               positions=None, deterministic: bool = True, segment_ids=None,
               encoded_segment_ids=None, *, bias_fn=None):
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
        (h, mask=self_mask, bias_fn=bias_fn, positions=positions, segment_ids=segment_ids,
         deterministic=deterministic), 'self_attention')
    if self.cross_attention:
      x = residual(
          x, lambda h: MultiHeadAttention(cfg, name='cross_attention')
          (h, encoded, mask=cross_mask, segment_ids=segment_ids, context_segment_ids=
           encoded_segment_ids, deterministic=deterministic), 'cross_attention')
    x = residual(x, lambda h: FeedForward(cfg, name='mlp')(h, deterministic=deterministic), 'mlp')
    return (x, None) if self.scan_carry else x


class TransformerStack(nn.Module):
  """`num_layers` blocks; a shared T5 relative bias if configured; a final norm for Pre-LN.

  Params: 'layer_0' ... 'layer_{N-1}'; with scan_layers one stacked 'layers'; with share_layers
  (ALBERT) one 'shared_layer' applied N times, whatever remat_policy and scan_layers say.
  """
  cfg: TransformerConfig
  num_layers: int
  causal: bool
  cross_attention: bool = False

  @nn.compact
  def __call__(self, x, encoded=None, *, self_mask=None, cross_mask=None, positions=None,
               segment_ids=None, encoded_segment_ids=None, deterministic: bool = True):
    """x [B, T, D] (and `encoded` [B, S, D] for cross-attention) -> [B, T, D]. Packed rows:
    `segment_ids` [B, T] and `encoded_segment_ids` [B, S], positions [B, T]."""
    cfg = self.cfg
    segments = (segment_ids, encoded_segment_ids)
    bias_fn = None
    if cfg.position == 'relative':
      # One bias table per stack, shared by its layers (as in T5); attention calls it once it
      # knows the key positions (in decode mode: every slot of the KV cache).
      bias_fn = RelativePositionBias(cfg.num_heads, cfg.relative_buckets, cfg.relative_max_distance,
                                     bidirectional=not self.causal, dtype=cfg.dtype,
                                     param_dtype=cfg.param_dtype, name='relative_bias')
    remat = cfg.remat_policy != 'none' and not cfg.decode  # no backward pass when decoding
    if cfg.share_layers:
      x = self._shared_layer(x, encoded, self_mask, cross_mask, bias_fn, positions, deterministic,
                             remat, segments)
    elif not (remat or cfg.scan_layers):
      for i in range(self.num_layers):
        x = TransformerBlock(cfg, self.cross_attention, causal=self.causal,
                             name=f'layer_{i}')(x, encoded, self_mask=self_mask,
                                                cross_mask=cross_mask, bias_fn=bias_fn,
                                                positions=positions, deterministic=deterministic,
                                                segment_ids=segment_ids,
                                                encoded_segment_ids=encoded_segment_ids)
    else:
      x = self._transformed_layers(x, encoded, self_mask, cross_mask, bias_fn, positions,
                                   deterministic, remat, segments)
    if cfg.norm_position == 'pre':
      x = make_norm(cfg, 'final_norm')(x)
    return x

  def _block_class(self, remat: bool):
    """TransformerBlock, wrapped in nn.remat (with the configured policy) if `remat`."""
    cfg = self.cfg
    if not remat:
      return TransformerBlock
    # deterministic (argument 7, counting the module) must stay a Python bool.
    return nn.remat(TransformerBlock, policy=getattr(jax.checkpoint_policies, cfg.remat_policy),
                    prevent_cse=not cfg.scan_layers, static_argnums=(7,))

  def _shared_layer(self, x, encoded, self_mask, cross_mask, bias_fn, positions, deterministic,
                    remat: bool, segments):
    """ALBERT's cross-layer sharing: one block's parameters ('shared_layer') applied
    `num_layers` times, as a Python loop (one module called repeatedly) or, with scan_layers, an
    nn.scan whose params are broadcast to every step instead of stacked (the tree is the same
    either way, so checkpoints move freely between the two)."""
    cfg = self.cfg
    block = self._block_class(remat)
    args = (encoded, self_mask, cross_mask, bias_fn.table if bias_fn is not None else None,
            positions, deterministic, *segments)
    if not cfg.scan_layers:
      layer = block(cfg, self.cross_attention, causal=self.causal, name='shared_layer')
      for _ in range(self.num_layers):
        x = layer(x, *args)
      return x
    if self.num_layers == 0:
      return x
    scanned = nn.scan(block, variable_broadcast='params', variable_axes={'intermediates': 0},
                      split_rngs={'params': False, 'dropout': True},
                      in_axes=(nn.broadcast,) * len(args), length=self.num_layers)
    x, _ = scanned(cfg, self.cross_attention, scan_carry=True, causal=self.causal,
                   name='shared_layer')(x, *args)
    return x

  def _transformed_layers(self, x, encoded, self_mask, cross_mask, bias_fn, positions,
                          deterministic, remat: bool, segments):
    """The layers under nn.remat (per layer) and/or nn.scan (one traced layer, stacked params).

    Lifted transforms take arrays, not modules: a relative bias goes in as its table.
    """
    cfg = self.cfg
    bias_table = bias_fn.table if bias_fn is not None else None
    block = self._block_class(remat)
    args = (encoded, self_mask, cross_mask, bias_table, positions, deterministic, *segments)
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
  """tokens -> embedding (x sqrt(E) if configured) + absolute positions -> (norm) -> dropout
  (-> projection E -> D).

  E is the embedding table's width: emb_dim (D), or with ALBERT's factorised embedding
  (`factorised`, set by a model that builds its table cfg.embedding_size wide) E = embedding_size:
  every addend (positions, `extra`) is E wide too and the normalised sum is projected to D
  ('projection', HF ALBERT's embedding_hidden_mapping_in; there even when E = D).
  """
  cfg: TransformerConfig
  embed: Embed
  factorised: bool = False

  @nn.compact
  def __call__(self, tokens, positions, *, extra=None, deterministic: bool = True):
    cfg = self.cfg
    width = self.embed.features
    if cfg.embedding_size is not None and not self.factorised:
      # Refused rather than ignored: the model's output layers would not fit an E-wide table.
      raise ConfigError(f'model config: embedding_size={cfg.embedding_size} (a factorised '
                        'embedding) is implemented by Bert only; set it to None for this model')
    x = self.embed(tokens)
    if cfg.scale_embeddings:
      x = x * jnp.sqrt(jnp.asarray(width, x.dtype))
    if cfg.position in ('sinusoidal', 'learned'):
      x = AbsolutePositionEmbedding(cfg.position, cfg.max_len, cfg.dtype, cfg.param_dtype,
                                    name='position_embedding')(x, positions)
    if extra is not None:  # e.g. BERT's segment embeddings
      x = x + extra
    if cfg.embedding_norm:
      x = make_norm(cfg, 'embedding_norm')(x)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
    if self.factorised:
      x = DenseGeneral((cfg.emb_dim,), (None, 'embed'), dtype=cfg.dtype,
                       param_dtype=cfg.param_dtype, kernel_layout=cfg.kernel_layout,
                       kernel_init=nn.initializers.normal(cfg.embed_init_std or
                                                          0.02), name='projection')(x)
    return nn.with_logical_constraint(x, ACTIVATION_AXES)


class StepPositions(nn.Module):
  """Positions of this call's tokens: 0..T-1, or in decode mode the next T of every row.

  In decode mode each row keeps its own counter in the 'cache' collection (int32[B], the
  cache's slot for the row's next token), so rows of one batch may be at different points
  (prompts of different lengths: `set_cache_positions`), and positional encodings, rotary
  angles, cache writes and the cache mask all agree per row. Returns [T] outside decode mode
  (and on the allocating call), [B, T] in it.
  """
  cfg: TransformerConfig

  @nn.compact
  def __call__(self, batch: int, length: int) -> jnp.ndarray:
    if not self.cfg.decode:
      return jnp.arange(length)
    initialised = self.has_variable('cache', 'position')
    counter = self.variable('cache', 'position', lambda: jnp.zeros((batch,), jnp.int32))
    if not initialised:  # the allocating call of a decode-mode init
      return jnp.arange(length)
    start = counter.value
    counter.value = start + length
    return start[:, None] + jnp.arange(length)[None, :]


def empty_cache(decode_model: nn.Module, *inputs) -> dict:
  """The zero-filled 'cache' collection of a decode-mode model, sized by full-length `inputs`.

  A decode-mode init on full-length inputs allocates the KV caches; their values start at zero,
  so tracing the shapes (`eval_shape`) is enough and no forward pass runs.
  """
  shapes = jax.eval_shape(decode_model.init, jax.random.key(0), *inputs)['cache']
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def set_cache_positions(cache: dict, positions: jnp.ndarray) -> dict:
  """`cache` with every row's position counter (`StepPositions`) set to `positions` int32[B]:
  row i's next token goes to slot positions[i] and attends to slots 0..positions[i].

  A batch of prompts of different lengths is prefilled together up to the longest (the slots
  past a shorter prompt's end hold whatever its padding wrote); moving each row's counter back
  to its own length makes the next steps overwrite those slots before the mask ever shows them.
  """

  def set_leaf(path, leaf):
    if getattr(path[-1], 'key', None) == 'position':
      return jnp.broadcast_to(jnp.asarray(positions, leaf.dtype), leaf.shape)
    return leaf

  return jax.tree_util.tree_map_with_path(set_leaf, cache)
