"""WMT'14 English -> German from TFDS with the base model of "Attention Is All You Need".

  python -m experiments.translate --config=experiments/configs/wmt14.py --workdir=gs://.../wmt

Data: tfds `wmt14_translate/de-en` (prepare it once with `tfds build wmt14_translate/de-en
--data_dir=DIR` on a machine with internet, then set --config.data.tfds_data_dir=DIR).
Model: 6+6 layers, 512 wide, 8 heads, FFN 2048, Post-LN, sinusoidal positions, shared 32k
vocabulary; 100k steps of ~25k source + 25k target tokens as in the paper (base model).
Meant for a TPU/GPU mesh: the batch is global and split over data x fsdp.
"""

from experiments.configs.translate_common import translate_config


def get_config():
  config = translate_config()
  config.data.source = 'tfds'
  config.data.tfds_name = 'wmt14_translate/de-en'
  config.data.train_prefix = 'train'
  config.data.valid_prefix = 'validation'
  config.data.max_len = 256
  config.data.batch_tokens = 32_768
  config.tokenizer.vocab_size = 32_000
  config.tokenizer.max_sentences = 5_000_000
  config.model.update(
      dict(emb_dim=512, num_heads=8, mlp_dim=2048, num_encoder_layers=6, num_decoder_layers=6,
           dropout_rate=0.1, attention_dropout_rate=0.1))
  config.optimizer.learning_rate = 7e-4  # ~ 512^-0.5 * 4000^-0.5 * 2, the paper's peak
  config.optimizer.warmup_steps = 4_000
  config.optimizer.b2 = 0.98
  config.train.num_steps = 100_000
  config.train.log_every = 200
  config.train.eval_every = 5_000
  config.train.checkpoint_every = 5_000
  config.eval.beam_size = 4
  config.eval.alpha = 0.6
  config.eval.bleu_sentences = 1_000
  config.eval.average_last = 5
  config.eval.test_prefix = 'test'
  return config
