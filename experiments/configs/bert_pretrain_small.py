r"""A small BERT (4 layers, 256 wide) pretrained with MLM + NSP on local English text.

  python -m experiments.bert --config=experiments/configs/bert_pretrain_small.py --workdir=/tmp/bp
  # other objectives on the same model: MLM only, one document per row | sentence order
  #   --config.data.sentence_task=none   |   --config.data.sentence_task=sop
  # RoBERTa and ALBERT themselves: roberta_pretrain_small.py, albert_pretrain_small.py

The English side of Multi30k (one caption per line; every 8 lines make a "document") and Tiny
Shakespeare (speeches separated by blank lines). 2% of the documents are held out: evaluation
reports the MLM accuracy ('accuracy') and NSP accuracy ('nsp_accuracy') on them. WordPiece
(8k) is trained on the training documents and saved as WORKDIR/vocab.txt.
"""

from experiments.configs.bert_common import pretrain_config


def get_config():
  config = pretrain_config()
  config.data.source = 'files'
  config.data.paths = ('../shared/data/multi30k/train.en.gz,'
                       '../shared/data/tinyshakespeare/input.txt')
  config.data.lines_per_document = 8
  config.data.valid_fraction = 0.02
  config.data.max_len = 64
  config.data.max_predictions = 10
  config.data.batch_size = 64
  config.data.eval_batches = 20
  config.data.sentence_task = 'nsp'
  config.tokenizer.vocab_size = 8000
  config.model.update(
      dict(emb_dim=256, num_heads=4, mlp_dim=1024, num_encoder_layers=4, max_len=128))
  config.optimizer.learning_rate = 5e-4
  config.optimizer.warmup_steps = 300
  config.optimizer.decay_steps = 5_000
  config.train.num_steps = 5_000
  config.train.eval_every = 500
  config.train.checkpoint_every = 1_000
  config.train.log_every = 50
  return config
