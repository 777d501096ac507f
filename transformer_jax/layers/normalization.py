"""LayerNorm and RMSNorm, chosen by config, with the scale named on the 'embed' axis."""

import flax.linen as nn

from transformer_jax.model_config import TransformerConfig


def make_norm(cfg: TransformerConfig, name: str) -> nn.Module:
  """LayerNorm (centre and scale, with bias) or RMSNorm (scale only, as in T5/LLaMA).

  Statistics are computed in float32 whatever the compute dtype: a bf16 variance loses too
  many bits.
  """
  ones = nn.with_logical_partitioning(nn.initializers.ones_init(), ('embed',))
  if cfg.norm_type == 'rmsnorm':
    return nn.RMSNorm(epsilon=cfg.norm_epsilon, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                      scale_init=ones, name=name)
  zeros = nn.with_logical_partitioning(nn.initializers.zeros_init(), ('embed',))
  return nn.LayerNorm(epsilon=cfg.norm_epsilon, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                      use_bias=True, scale_init=ones, bias_init=zeros, name=name)
