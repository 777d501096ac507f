r"""A small ALBERT pretrained with MLM + sentence-order prediction on local English text.

  python -m experiments.bert --config=experiments/configs/albert_pretrain_small.py \
      --workdir=/tmp/albert_small
  # then fine-tune it on SST-2:
  python -m experiments.bert --config=experiments/configs/sst2_albert.py --workdir=/tmp/sst2_al \
      --config.init.bert_workdir=/tmp/albert_small

ALBERT's two parameter savings on bert_pretrain_small.py's data (the English side of Multi30k,
8 lines a "document", and Tiny Shakespeare; WordPiece 8k trained into WORKDIR/vocab.txt; 2% of
the documents held out): a factorised embedding (8k x 64 token table, projected to the width
256) and one layer's parameters applied 6 times: 1.42M parameters (5.37M with 6 separate layers,
6.96M also without the factorisation, as BERT), with the compute of a 6-layer model.
Sentence-order prediction (swapped consecutive segments) instead of NSP; evaluation reports the
MLM accuracy ('accuracy') and the SOP loss and accuracy ('sop_loss', 'sop_accuracy') on the
held-out documents. 1,500 steps of 32 x 64 tokens: about 10 minutes on two CPU cores (2.8
steps/s).
"""

import ml_collections

from experiments.configs import bert_pretrain_small
from transformer_jax.models.bert import ALBERT_ARCHITECTURE


def get_config():
  # bert_pretrain_small.py's data and tokenizer, with SOP, half the batch and fewer steps.
  config = bert_pretrain_small.get_config()
  config.data.batch_size = 32
  config.data.sentence_task = 'sop'
  # ALBERT's architecture from its one definition beside albert_config(): BERT's switches plus
  # the tanh GELU and shared layers; embedding_size < emb_dim factorises the embedding.
  config.model = ml_collections.ConfigDict(
      dict(ALBERT_ARCHITECTURE, embedding_size=64, emb_dim=256, num_heads=4, mlp_dim=1024,
           num_encoder_layers=6, max_len=128, dropout_rate=0.1, attention_dropout_rate=0.1,
           dtype='float32', matmul_dtype='auto', param_dtype='float32', remat_policy='none',
           scan_layers=False, attention_implementation='auto'))
  config.optimizer.warmup_steps = 150
  config.optimizer.decay_steps = 1_500
  config.train.num_steps = 1_500
  config.train.eval_every = 250
  config.train.checkpoint_every = 500
  return config
