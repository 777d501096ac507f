r"""Fine-tune a BERT, RoBERTa or ALBERT tagger (one label per word) on CoNLL-style files, e.g.
CoNLL-2003 NER.

  python -m experiments.bert --config=experiments/configs/conll_tagging.py --workdir=/tmp/ner \
      --config.init.hf_dir=/path/to/bert-base-cased \
      --config.data.train=conll2003/train.txt --config.data.dev=conll2003/valid.txt
  # or from a pretraining workdir of ours:
  #   --config.init.hf_dir= --config.init.bert_workdir=/tmp/bp

Files: word and tag per line (the tag is the last column, so CoNLL-2003's `word POS chunk NER`
lines work as they are), a blank line between sentences, -DOCSTART- lines skipped. Each word's
label sits on its first sub-word (each word split as it reads inside a sentence: RoBERTa's after
a space); the others are left out of the loss. Reports token accuracy (`eval accuracy`) and the
accuracy per tag at every evaluation. Three epochs of CoNLL-2003's 14k sentences at batch 32
(~1,320 steps), lr 5e-5, 10% warmup, linear decay.
"""

from experiments.configs.bert_common import finetune_config


def get_config():
  config = finetune_config()
  # The sentence-classification keys have no meaning here (the tags come from data.train).
  for key in ('dir', 'tfds_name', 'tfds_data_dir', 'num_labels', 'text_columns', 'label_column',
              'label_names', 'train_file', 'dev_file', 'max_train_examples'):
    if key in config.data:
      del config.data[key]
  config.data.task = 'token_classification'  # experiments.bert dispatches on it
  config.data.source = 'conll'
  config.data.train = ''  # CoNLL file of training sentences
  config.data.dev = ''  # CoNLL file of held-out sentences (their tags must occur in train)
  config.data.max_len = 128  # sub-words per sentence, [CLS] and [SEP] included
  config.data.batch_size = 32
  config.optimizer.learning_rate = 5e-5
  config.optimizer.warmup_steps = 130
  config.optimizer.decay_steps = 1_320
  config.train.num_steps = 1_320
  config.train.eval_every = 400
  config.train.checkpoint_every = 400
  return config
