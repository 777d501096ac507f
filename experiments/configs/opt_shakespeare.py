"""A small OPT trained from scratch on Tiny Shakespeare: gpt2_shakespeare_bpe.py with ReLU.

  python -m experiments.lm --config=experiments/configs/opt_shakespeare.py \
      --workdir=/tmp/opt --config.data.path=../shared/data/tinyshakespeare/input.txt
  python -m experiments.generate --workdir=/tmp/opt --prompt="ROMEO:" --max_new_tokens=200
  python -m experiments.export --workdir=/tmp/opt --out=/tmp/opt_hf   # an OPTForCausalLM

The data, 1,024-token byte-level BPE (trained on the first run, saved as <workdir>/tokenizer/),
64-token context, batch 12, sizes (4 layers, 4 heads, 128 wide, MLP 512), optimizer and 2,000
steps are gpt2_shakespeare_bpe.py's, so the two compare directly. The model's switches are OPT's
(models/gpt.py OPT_ARCHITECTURE, what the OPT importer gives): GPT-2's learned positions, Pre-LN,
biases and tied output with ReLU in the MLP. A model with them is an OPT, and
experiments.export writes it as Hugging Face's OPTForCausalLM (its position table two rows
longer, as OPT's checkpoints have it).

On a 2-core Xeon (bf16 matmuls, the CPU shared with other jobs) it trained in 2 min 34 s to a
validation loss of 3.889 nats per token; gpt2_shakespeare_bpe.py, run the same way on the same
day, reached 3.846 (2026-12-08).
"""

from experiments.configs import gpt2_shakespeare_bpe
from transformer_jax.models.gpt import OPT_ARCHITECTURE


def get_config():
  config = gpt2_shakespeare_bpe.get_config()
  # Only the architecture's switches change: the sizes, dropout and dtypes stay the run's.
  config.model.update(OPT_ARCHITECTURE)
  return config
