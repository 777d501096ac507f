"""transformer_jax: pure-functional Flax Transformers, jit-compiled and sharded over a Mesh.

Import what you need from its modules (importing the package itself stays cheap):
  transformer_jax.attention      masks, scaled dot-product and multi-head attention
  transformer_jax.blocks         residual blocks and stacks
  transformer_jax.models         EncoderDecoder, GPT
  transformer_jax.trainer        the one trainer
"""

__version__ = '0.1.0'
