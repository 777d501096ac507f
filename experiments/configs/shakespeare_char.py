"""The "baby" character-level GPT on Tiny Shakespeare (nanoGPT's CPU shakespeare_char run).

  python -m experiments.lm --config=experiments/configs/shakespeare_char.py --workdir=/tmp/sc \
      --config.data.path=../shared/data/tinyshakespeare/input.txt
  # or from TFDS (train/validation splits of the same text):
  python -m experiments.lm --config=experiments/configs/shakespeare_char.py --workdir=/tmp/sc \
      --config.data.source=tfds
  python -m experiments.generate --workdir=/tmp/sc --prompt="ROMEO:" --max_new_tokens=500

4 layers, 4 heads, 128 wide, context 64, batch 12, 2,000 steps: about 0.8M parameters and
minutes on a laptop CPU; validation loss about 1.88 (nats per character).
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
  config.tokenizer.type = 'char'
  config.model.update(
      dict(emb_dim=128, num_heads=4, mlp_dim=512, num_decoder_layers=4, dropout_rate=0.0,
           attention_dropout_rate=0.0))
  config.optimizer.learning_rate = 1e-3
  config.optimizer.end_learning_rate = 1e-4
  config.optimizer.warmup_steps = 100
  config.optimizer.decay_steps = 2_000
  config.optimizer.b2 = 0.99
  config.optimizer.weight_decay = 0.1
  config.optimizer.grad_clip_norm = 1.0
  config.train.num_steps = 2_000
  config.train.log_every = 50
  config.train.eval_every = 250
  config.train.eval_max_batches = 20
  config.train.checkpoint_every = 500
  return config
