"""A small character-level LLaMA on Tiny Shakespeare: shakespeare_char.py's run, LLaMA's blocks.

  python -m experiments.lm --config=experiments/configs/llama_shakespeare.py --workdir=/tmp/llama
  python -m experiments.generate --workdir=/tmp/llama --prompt="ROMEO:" --max_new_tokens=500

The data (../shared/data/tinyshakespeare/input.txt, first 90% to train), character tokenizer,
context 64, batch 12, optimizer and 2,000 steps are shakespeare_char.py's, so the two
architectures compare directly. The model is LLaMA's (models/gpt.py LLAMA_ARCHITECTURE): rotary
positions, RMSNorm, SwiGLU, no biases, an untied output head, and grouped-query attention with 4
query heads sharing 2 key/value heads. 4 layers, width 128, SwiGLU width 384 (three matrices of
128 x 384 match the GPT's two of 128 x 512): 0.80M parameters, as the baby GPT's 0.81M.

On a 2-core CPU it trains in under 2 minutes to a validation loss of 1.65 nats per character;
shakespeare_char.py's GPT, run the same way, reached 1.79.
"""

import ml_collections

from experiments.configs import shakespeare_char
from transformer_jax.models.gpt import LLAMA_ARCHITECTURE


def get_config():
  config = shakespeare_char.get_config()
  # The whole model section anew: lm_common's is GPT-2's (learned positions, LayerNorm, ...).
  config.model = ml_collections.ConfigDict(
      dict(LLAMA_ARCHITECTURE, emb_dim=128, num_heads=4, num_kv_heads=2, mlp_dim=384,
           num_decoder_layers=4, dropout_rate=0.0, attention_dropout_rate=0.0, dtype='float32',
           matmul_dtype='auto', param_dtype='float32', remat_policy='none', scan_layers=False,
           attention_implementation='auto'))
  return config
