r"""Fine-tune an ALBERT pretrained here (albert_pretrain_small.py) on SST-2.

  python -m experiments.bert --config=experiments/configs/albert_pretrain_small.py \
      --workdir=/tmp/albert_small
  python -m experiments.bert --config=experiments/configs/sst2_albert.py --workdir=/tmp/sst2_al \
      --config.init.bert_workdir=/tmp/albert_small

sst2_minilm.py's recipe (max_len 64, batch 32, lr 5e-5 with 10% warmup then linear decay,
2 epochs) with init.hf_dir left empty, so the pretraining workdir (its vocab.txt, its saved
config: factorised embedding, shared layer) is what fine-tuning starts from; the classifier on
the pooled [CLS] vector is new. A small model from scratch learns faster with a larger rate:
try --config.optimizer.learning_rate=1e-4.
"""

from experiments.configs.sst2_minilm import get_config as sst2_config


def get_config():
  config = sst2_config()
  config.init.hf_dir = ''  # never the MiniLM checkpoint: the ALBERT workdir instead
  config.init.bert_workdir = ''  # required: --config.init.bert_workdir=WORKDIR
  return config
