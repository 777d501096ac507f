"""GPT-2 small (124M shape) on lm1b with a 32k SentencePiece vocabulary: the accelerator run.

Tokenize the corpus once, on a machine with cores to spare (a worker per core; `--engine=ray`
on a cluster), into a folder every host can read (local disk or gs://):

  python -m experiments.prepare --sources=tfds:lm1b --tfds_data_dir=~/tensorflow_datasets \
      --tfds_split=train --tfds_valid_split=test --tokenizer=sentencepiece --vocab_size=32000 \
      --output=gs://BUCKET/lm1b_spm32k

then train from it (each host reads only its rows' windows; a resume tokenizes nothing):

  python -m experiments.lm --config=experiments/configs/gpt2_small.py --workdir=/tmp/gpt2 \
      --config.data.source=prepared --config.data.prepared=gs://BUCKET/lm1b_spm32k

Without the first step the run prepares lm1b into WORKDIR/corpus itself (one process, on its
first start). 12 layers, 12 heads, 768 wide, context 1024; lm1b's sentences are joined with EOS
into one stream and cut into 1024-token windows. Sized for a TPU/GPU host: on a CPU use it only
shrunk (the tests run it at a tiny size on mock data and on prepared shards with fsdp).
"""

from experiments.configs.lm_common import lm_config


def get_config():
  config = lm_config()
  config.data.source = 'tfds'
  config.data.tfds_name = 'lm1b'
  config.data.tfds_feature = 'text'
  config.data.train_split = 'train'
  config.data.valid_split = 'test'  # lm1b has no validation split
  config.data.max_valid_examples = 20_000
  config.data.block_size = 1024
  config.data.batch_size = 64  # 64k tokens per step on one accelerator; raise with the mesh
  config.data.eval_batches = 20
  config.tokenizer.type = 'sentencepiece'
  config.tokenizer.vocab_size = 32_000
  config.tokenizer.model_type = 'unigram'
  config.tokenizer.max_sentences = 2_000_000
  config.model.update(
      dict(emb_dim=768, num_heads=12, mlp_dim=3072, num_decoder_layers=12, dropout_rate=0.0,
           attention_dropout_rate=0.0, dtype='bfloat16'))
  config.eval.sample_prompt = 'The'
  config.eval.sample_tokens = 64
  config.eval.top_p = 0.95
  config.optimizer.learning_rate = 6e-4
  config.optimizer.end_learning_rate = 6e-5
  config.optimizer.warmup_steps = 2_000
  config.optimizer.decay_steps = 100_000
  config.optimizer.b2 = 0.95
  config.optimizer.weight_decay = 0.1
  config.train.num_steps = 100_000
  config.train.log_every = 100
  config.train.eval_every = 2_000
  config.train.checkpoint_every = 2_000
  return config
