"""The embedded default: English -> German numbers in words, generated on the fly.

No download and no files: "she bought forty-five thousand seventy-six flowers" ->
"sie kaufte fünf und vierzig tausend sechs und siebzig blumen". German says the units before
the tens, so the model must learn a reordering, not a word-for-word copy. Test numbers never
occur in training. A small model learns it in a few minutes on a laptop CPU.
"""

from experiments.configs.translate_common import translate_config


def get_config():
  config = translate_config()
  config.data.source = 'numbers'
  config.data.valid_prefix = 'valid'
  config.data.max_len = 48
  config.data.batch_tokens = 2048
  config.tokenizer.vocab_size = 128
  config.model.update(
      dict(emb_dim=128, num_heads=4, mlp_dim=512, num_encoder_layers=2, num_decoder_layers=2,
           dropout_rate=0.0, attention_dropout_rate=0.0))
  config.loss.label_smoothing = 0.0
  config.optimizer.learning_rate = 2e-3
  config.optimizer.warmup_steps = 200
  config.train.num_steps = 1_200
  config.train.log_every = 50
  config.train.eval_every = 400
  config.train.checkpoint_every = 400
  config.eval.beam_size = 1
  config.eval.bleu_sentences = 500
  config.eval.test_prefix = 'test'
  return config
