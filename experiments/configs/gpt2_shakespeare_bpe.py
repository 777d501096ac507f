"""A small GPT-2 trained from scratch on Tiny Shakespeare with its own GPT-2 style byte-level BPE.

  python -m experiments.lm --config=experiments/configs/gpt2_shakespeare_bpe.py \
      --workdir=/tmp/gpt2_bpe --config.data.path=../shared/data/tinyshakespeare/input.txt
  python -m experiments.generate --workdir=/tmp/gpt2_bpe --prompt="ROMEO:" --max_new_tokens=200

The first run trains a 1,024-token byte-level BPE on the training text (GPT-2's tokenizer
recipe: its regex split, all 256 bytes, '<|endoftext|>' as the one special token) and saves it
as the Hugging Face folder <workdir>/tokenizer/ (transformers.AutoTokenizer reads it); reruns
resume with it. A token is ~3 characters here, so the 64-token context sees about as much text as
shakespeare_char.py's does in 192 characters. 4 layers, 4 heads, 128 wide: about 1M parameters,
minutes on a laptop CPU.
"""

from experiments.configs.lm_common import lm_config


def get_config():
  config = lm_config()
  config.data.source = 'file'
  config.data.path = '../shared/data/tinyshakespeare/input.txt'
  config.data.tfds_name = 'tiny_shakespeare'  # used with data.source='tfds'
  config.data.block_size = 64
  config.data.batch_size = 12
  config.data.eval_batches = 20
  config.tokenizer.type = 'byte_bpe'
  config.tokenizer.vocab_size = 1024
  config.model.update(
      dict(emb_dim=128, num_heads=4, mlp_dim=512, num_decoder_layers=4, dropout_rate=0.0,
           attention_dropout_rate=0.0))
  config.eval.sample_prompt = 'ROMEO:'
  config.eval.sample_tokens = 100
  config.optimizer.learning_rate = 1e-3
  config.optimizer.end_learning_rate = 1e-4
  config.optimizer.warmup_steps = 100
  config.optimizer.decay_steps = 2_000
  config.train.num_steps = 2_000
  config.train.log_every = 50
  config.train.eval_every = 250
  config.train.eval_max_batches = 20
  config.train.checkpoint_every = 500
  return config
