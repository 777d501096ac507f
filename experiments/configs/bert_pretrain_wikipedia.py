r"""BERT-base pretraining (MLM + NSP) on TFDS English Wikipedia, for a cluster.

  python -m experiments.bert --config=experiments/configs/bert_pretrain_wikipedia.py \
      --workdir=gs://bucket/bert_base --config.data.tfds_data_dir=gs://bucket/tensorflow_datasets

BERT-base (12 layers, 768 wide, 12 heads), sequence 128, batch 256, 1M steps, lr 1e-4 with
10k warmup steps and linear decay (Devlin et al. 2019, phase 1). A Wikipedia article is a
document; its lines (paragraphs) are the sentences NSP pairs are cut from. The WordPiece
vocabulary (30k) is trained on the first data.max_train_examples articles unless
tokenizer.vocab_file points at a vocab.txt. Held-out articles
(Wikipedia has only a 'train' split) are the last 1%; training uses the first 99%.

That reads every article into memory and tokenizes it at every start, resumes included. For the
whole of Wikipedia, tokenize it once into token shards (`--unit=lines`: each paragraph a line,
each article a document; a WordPiece of 30,522 trained on a 256 MB sample, or
--tokenizer_from=vocab.txt to keep a BERT vocabulary; 0.1% of the articles held out by a seeded
draw; a worker per core, or --engine=ray on a cluster), then train from the folder:

  python -m experiments.prepare --sources=tfds:wikipedia/20230601.en --text_field=text \
      --tfds_split=train --tfds_data_dir=gs://bucket/tensorflow_datasets --unit=lines \
      --tokenizer=wordpiece --vocab_size=30522 --tokenizer_sample_mb=256 \
      --valid_fraction=0.001 --output=gs://bucket/wikipedia_wordpiece
  python -m experiments.bert --config=experiments/configs/bert_pretrain_wikipedia.py \
      --workdir=gs://bucket/bert_base --config.data.source=prepared \
      --config.data.prepared=gs://bucket/wikipedia_wordpiece

The run copies the corpus's vocab.txt into the workdir (and checks it on every resume); nothing
is tokenized at start, and the rows read only the lines they take from the shards. The
data.tfds_* and max_*_examples keys are not read then (tokenizer.lowercase must be the
corpus's, True unless it was prepared with --nolowercase).
"""

from experiments.configs.bert_common import pretrain_config


def get_config():
  config = pretrain_config()
  config.data.source = 'tfds'
  config.data.tfds_name = 'wikipedia/20230601.en'
  config.data.tfds_feature = 'text'
  config.data.train_split = 'train[:99%]'
  config.data.valid_split = 'train[99%:]'
  config.data.max_train_examples = 0
  config.data.max_valid_examples = 2_000
  config.data.max_len = 128
  config.data.max_predictions = 20
  config.data.batch_size = 256
  config.data.eval_batches = 50
  config.tokenizer.vocab_size = 30_522
  config.mesh.data = -1
  config.mesh.fsdp = 1
  return config
