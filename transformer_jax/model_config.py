"""One frozen config describes every model in the family.

The original Transformer, T5, GPT-2, LLaMA and BERT differ in a handful of switches (where the
norm goes, which norm, which position encoding, which activation, biases or not); the blocks read
those switches, so one set of modules expresses them all.
"""

import dataclasses
from typing import Any

import jax.numpy as jnp

from transformer_jax import precision
from transformer_jax.errors import ConfigError

NORM_TYPES = ('layernorm', 'rmsnorm')
NORM_POSITIONS = ('pre', 'post')
POSITION_TYPES = ('sinusoidal', 'learned', 'rotary', 'relative', 'none')
ACTIVATIONS = ('relu', 'gelu', 'gelu_exact', 'silu', 'swiglu', 'geglu', 'reglu')
ATTENTION_IMPLEMENTATIONS = ('auto', 'reference', 'chunked', 'xla', 'cudnn', 'pallas')
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}
# Rematerialisation policies (names in jax.checkpoint_policies): what each layer keeps from the
# forward pass for the backward pass; everything else is recomputed. 'none' = no remat.
REMAT_POLICIES = ('none', 'nothing_saveable', 'dots_saveable', 'dots_with_no_batch_dims_saveable',
                  'everything_saveable')
# How dense kernels are stored: [in, out] (training, checkpoints) or [out, in] (PyTorch's Linear;
# a decoding loop of many rows on XLA:CPU reads it faster, layers/dense.py).
KERNEL_LAYOUTS = ('in_out', 'out_in')
# Fields that change how a model trains or runs, not its parameters: a run that starts from a
# pretrained model (an import, a workdir) takes these from its own config.model and every other
# field from the pretrained model (`model_section`).
RUNTIME_FIELDS = ('dropout_rate', 'attention_dropout_rate', 'dtype', 'param_dtype', 'matmul_dtype',
                  'remat_policy', 'scan_layers', 'attention_implementation')


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyperparameters shared by the encoder-decoder, GPT and BERT models."""
  vocab_size: int = 8000
  # Encoder-decoder only: the source vocabulary (None: the same size as the target's).
  source_vocab_size: int | None = None
  share_embeddings: bool = True  # source and target share one embedding table
  tie_output: bool = True  # output logits use the (target) embedding matrix
  # T5 (v1.0): the decoder's features are multiplied by emb_dim**-0.5 before the tied output
  # projection. Its embeddings are unscaled N(0, 1) rows, so without this the tied logits
  # would be sqrt(emb_dim) times too large. Needs tie_output.
  rescale_tied_output: bool = False
  emb_dim: int = 512
  # ALBERT's factorised embedding (Lan et al. 2019): token/position/segment tables of width
  # embedding_size (E), normalised there, then projected E -> emb_dim (D); the MLM head maps back
  # D -> E before its tied output. V x E + E x D instead of V x D parameters. None: E = D, no
  # projection (an E equal to D still has one, as in HF's ALBERT). Bert only (the other models
  # refuse it).
  embedding_size: int | None = None
  num_heads: int = 8
  num_kv_heads: int | None = None  # grouped-query attention (None: num_heads)
  head_dim: int | None = None  # None: emb_dim // num_heads
  mlp_dim: int = 2048
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  # ALBERT's cross-layer sharing: each stack holds ONE layer's parameters ('shared_layer'),
  # applied num_*_layers times (a deep model with one layer's parameter count). Not with a KV
  # cache (decode): one layer's cache cannot serve every application.
  share_layers: bool = False
  max_len: int = 256
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  norm_type: str = 'layernorm'
  norm_position: str = 'post'  # 'post' = original Transformer/BERT, 'pre' = GPT-2/T5
  norm_epsilon: float = 1e-6
  embedding_norm: bool = False  # BERT normalises the summed embeddings
  position: str = 'sinusoidal'
  relative_buckets: int = 32
  relative_max_distance: int = 128
  rotary_base: float = 10000.0
  activation: str = 'relu'
  use_bias: bool = True
  scale_embeddings: bool = True  # multiply token embeddings by sqrt(their width, emb_dim)
  embed_init_std: float | None = None  # None = 1/sqrt(emb_dim); GPT-2 and BERT use 0.02
  attention_implementation: str = 'auto'
  # Attention logits are q.k / sqrt(head_dim) (Vaswani et al.); False: plain q.k, as T5 (its
  # query projection absorbs the scale). Every attention implementation honours it.
  scale_attention_scores: bool = True
  dtype: Any = jnp.float32  # compute dtype
  param_dtype: Any = jnp.float32
  # The matmuls' dtype where it differs from `dtype` (None: `dtype`): bfloat16 with a float32
  # `dtype` is the CPU precision policy (precision.py): the matmuls in bf16, everything else
  # float32. From a config section, 'auto' picks it per machine.
  matmul_dtype: Any = None
  decode: bool = False  # autoregressive decoding with a KV cache
  # Efficiency switches (blocks.TransformerStack): remat each layer with this policy; run the
  # identical layers as one nn.scan (params stacked under 'layers', see scan_layout.py).
  remat_policy: str = 'none'
  scan_layers: bool = False
  # 'in_out' or 'out_in' (KERNEL_LAYOUTS): the dense kernels' layout. Params are trained and
  # saved 'in_out'; generation converts them for a decoding loop where 'out_in' is faster
  # (tasks/lm.py, layers/kernel_layout.py).
  kernel_layout: str = 'in_out'

  # Quantities that default to a value derived from others. Each has one name: a None given for
  # it is resolved here, so `cfg.head_dim` is always the head width; `replace` derives it again
  # from the new values unless it was given explicitly.
  _DERIVED = ('num_kv_heads', 'head_dim', 'source_vocab_size')

  def __post_init__(self):
    derived = frozenset(name for name in self._DERIVED if getattr(self, name) is None)
    object.__setattr__(self, '_derived', derived)
    if 'head_dim' in derived:
      if self.num_heads > 0 and self.emb_dim % self.num_heads:
        raise ConfigError(f'model config: emb_dim={self.emb_dim} is not divisible by num_heads='
                          f'{self.num_heads}; choose a width that is a multiple of the head '
                          'count (or set head_dim)')
      object.__setattr__(self, 'head_dim', self.emb_dim // max(self.num_heads, 1))
    if 'num_kv_heads' in derived:
      object.__setattr__(self, 'num_kv_heads', self.num_heads)
    if 'source_vocab_size' in derived:
      object.__setattr__(self, 'source_vocab_size', self.vocab_size)
    self.validate()

  def validate(self) -> None:
    """Raises ConfigError, with what to change, for inconsistent values."""

    def check(ok, message):
      if not ok:
        raise ConfigError(f'model config: {message}')

    for name in ('vocab_size', 'emb_dim', 'num_heads', 'mlp_dim', 'max_len'):
      check(getattr(self, name) > 0, f'{name} must be positive, got {getattr(self, name)}')
    check(self.num_encoder_layers >= 0 and self.num_decoder_layers >= 0,
          'layer counts must be >= 0')
    check(self.embedding_size is None or self.embedding_size > 0,
          f'embedding_size must be positive or None (= emb_dim), got {self.embedding_size}')
    check(
        not (self.share_layers and self.decode),
        'share_layers=True cannot decode with a KV cache (one shared layer would hold the '
        'cache of every application); decode with an unshared model')
    check(self.head_dim > 0 and self.num_kv_heads > 0 and self.source_vocab_size > 0,
          'head_dim, num_kv_heads and source_vocab_size must be positive')
    check(self.num_heads % self.num_kv_heads == 0,
          f'num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}')
    check(self.norm_type in NORM_TYPES,
          f'norm_type must be one of {NORM_TYPES}, got {self.norm_type!r}')
    check(self.norm_position in NORM_POSITIONS,
          f'norm_position must be one of {NORM_POSITIONS}, got {self.norm_position!r}')
    check(self.position in POSITION_TYPES,
          f'position must be one of {POSITION_TYPES}, got {self.position!r}')
    check(self.activation in ACTIVATIONS,
          f'activation must be one of {ACTIVATIONS}, got {self.activation!r}')
    check(
        self.attention_implementation in ATTENTION_IMPLEMENTATIONS,
        f'attention_implementation must be one of {ATTENTION_IMPLEMENTATIONS}, '
        f'got {self.attention_implementation!r}')
    check(self.position != 'rotary' or self.head_dim % 2 == 0,
          'rotary positions need an even head_dim')
    check(
        self.position != 'relative' or
        (self.relative_buckets >= 4 and self.relative_max_distance > self.relative_buckets // 2),
        'relative positions need relative_buckets >= 4 and relative_max_distance > '
        f'relative_buckets // 2 (got {self.relative_buckets} and {self.relative_max_distance})')
    check(
        not self.rescale_tied_output or self.tie_output,
        'rescale_tied_output=True rescales the features before a tied output projection; '
        'it needs tie_output=True')
    check(self.remat_policy in REMAT_POLICIES,
          f'remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}')
    check(self.kernel_layout in KERNEL_LAYOUTS,
          f'kernel_layout must be one of {KERNEL_LAYOUTS}, got {self.kernel_layout!r}')
    check(self.matmul_dtype is None or jnp.dtype(self.matmul_dtype) in (jnp.float32, jnp.bfloat16),
          f'matmul_dtype must be None, float32 or bfloat16, got {self.matmul_dtype!r}')
    check(0.0 <= self.dropout_rate < 1.0 and 0.0 <= self.attention_dropout_rate < 1.0,
          'dropout rates must be in [0, 1)')

  def replace(self, **changes) -> 'TransformerConfig':
    """A copy with `changes`; derived quantities not given are derived again."""
    changes = {**{name: None for name in self._derived}, **changes}
    return dataclasses.replace(self, **changes)


def model_config_from_dict(values: dict, **overrides) -> TransformerConfig:
  """Builds a TransformerConfig from an ml_collections/dict section, naming unknown keys."""
  values = dict(values)
  values.update(overrides)
  return TransformerConfig(**_typed(values))


def model_section(cfg: TransformerConfig, runtime=None, leave_out=()) -> dict:
  """A config.model section describing `cfg` (every field but `decode` and `leave_out`, dtypes by
  name), whose RUNTIME_FIELDS are those `runtime` (a config.model section) sets: the model section
  a run starting from a pretrained model saves, so that its workdir is read without that model."""
  values = {
      f.name: getattr(cfg, f.name)
      for f in dataclasses.fields(cfg)
      if f.name not in ('decode',) + tuple(leave_out)
  }
  values.update(dtype=jnp.dtype(cfg.dtype).name, param_dtype=jnp.dtype(cfg.param_dtype).name,
                matmul_dtype=jnp.dtype(cfg.matmul_dtype).name if cfg.matmul_dtype else 'none')
  values.update({k: runtime[k] for k in RUNTIME_FIELDS if runtime and k in runtime})
  return values


def with_overrides(cfg: TransformerConfig, section) -> TransformerConfig:
  """`cfg` (a saved or imported model's config) with a config.model section's fields replacing
  its own: the fine-tuning overrides. Settings are resolved as in `model_config_from_dict`
  (matmul_dtype='auto' is decided on this machine, not taken from where `cfg` was trained)."""
  return cfg.replace(**_typed(dict(section)))


def _typed(values: dict) -> dict:
  """`values` with unknown keys named, matmul_dtype's setting resolved and dtypes by name
  replaced by the dtypes."""
  known = {f.name for f in dataclasses.fields(TransformerConfig)}
  unknown = sorted(set(values) - known)
  if unknown:
    raise ConfigError(f'unknown model config key(s) {unknown}; known keys: {sorted(known)}')
  if values.get('kernel_layout', 'in_out') != 'in_out':
    # Checkpoints and the Hugging Face converters hold kernels [in, out]; a square one would be
    # read transposed without an error. Generation converts a copy where [out, in] is faster.
    raise ConfigError(f"model.kernel_layout={values['kernel_layout']!r}: experiments train and "
                      "save 'in_out'; generation picks the decoding layout by itself")
  if 'matmul_dtype' in values and (isinstance(values['matmul_dtype'], str) or
                                   values['matmul_dtype'] is None):
    # 'auto', 'none', 'float32' or 'bfloat16': the CPU precision policy decides (precision.py).
    values['matmul_dtype'] = precision.resolve(values['matmul_dtype']).matmul_dtype
  for key in ('dtype', 'param_dtype', 'matmul_dtype'):
    if isinstance(values.get(key), str):
      if values[key] not in DTYPES:
        raise ConfigError(f'model.{key} must be one of {sorted(DTYPES)}, got {values[key]!r}')
      values[key] = DTYPES[values[key]]
  return values
