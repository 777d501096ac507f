"""Multi30k (task 1) English -> German from plain-text parallel files.

  python -m experiments.translate --config=experiments/configs/multi30k.py \
      --config.data.dir=../shared/data/multi30k --workdir=/tmp/m30k
Direction by config: --config.data.src_lang=de --config.data.tgt_lang=en.
A 3+3-layer, 256-wide Transformer: sized for the 29k training pairs and a 2-core CPU budget.
"""

from experiments.configs.translate_common import translate_config


def get_config():
  config = translate_config()
  config.data.source = 'files'
  config.data.dir = '../shared/data/multi30k'
  config.data.valid_prefix = 'val'
  config.data.max_len = 64
  config.data.batch_tokens = 4096
  config.tokenizer.vocab_size = 8000
  config.model.update(
      dict(emb_dim=256, num_heads=4, mlp_dim=1024, num_encoder_layers=3, num_decoder_layers=3,
           dropout_rate=0.1, attention_dropout_rate=0.1))
  config.loss.label_smoothing = 0.1
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 800
  config.train.num_steps = 10_000
  config.train.log_every = 100
  config.train.eval_every = 2_000
  config.train.checkpoint_every = 250
  config.train.keep_checkpoints = 6
  config.eval.beam_size = 4
  config.eval.alpha = 0.6
  config.eval.average_last = 6
  config.eval.test_prefix = 'test_2016_flickr'
  return config
