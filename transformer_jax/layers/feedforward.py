"""The position-wise feed-forward network: D -> mlp_dim -> D, plain or gated."""

import functools

import flax.linen as nn
import jax

from transformer_jax.layers.dense import DenseGeneral
from transformer_jax.model_config import TransformerConfig

# tanh-approximate GELU is what GPT-2 and BERT's reference code use; 'gelu_exact' is erf-based.
_ACTIVATIONS = {
    'relu': jax.nn.relu,
    'gelu': functools.partial(jax.nn.gelu, approximate=True),
    'gelu_exact': functools.partial(jax.nn.gelu, approximate=False),
    'silu': jax.nn.silu,
}
# Gated variants (Shazeer 2020): act(x W0) * (x W1). SwiGLU is LLaMA's, GeGLU T5.1.1's.
_GATED = {'swiglu': 'silu', 'geglu': 'gelu', 'reglu': 'relu'}


class FeedForward(nn.Module):
  cfg: TransformerConfig

  @nn.compact
  def __call__(self, x, *, deterministic: bool = True):
    cfg = self.cfg
    dense = functools.partial(DenseGeneral, use_bias=cfg.use_bias, dtype=cfg.dtype,
                              matmul_dtype=cfg.matmul_dtype, param_dtype=cfg.param_dtype,
                              kernel_layout=cfg.kernel_layout)
    if cfg.activation in _GATED:
      act = _ACTIVATIONS[_GATED[cfg.activation]]
      gate = dense((cfg.mlp_dim,), ('embed', 'mlp'), name='wi_gate')(x)
      up = dense((cfg.mlp_dim,), ('embed', 'mlp'), name='wi_up')(x)
      hidden = act(gate) * up
    else:
      hidden = _ACTIVATIONS[cfg.activation](dense((cfg.mlp_dim,), ('embed', 'mlp'), name='wi')(x))
    hidden = nn.with_logical_constraint(hidden, ('batch', 'length', 'mlp'))
    return dense((cfg.emb_dim,), ('mlp', 'embed'), name='wo')(hidden)
