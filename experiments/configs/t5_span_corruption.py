r"""T5 v1.1-style span-corruption pretraining on local text (Raffel et al. 2020, section 3.1.4).

  python -m experiments.translate --config=experiments/configs/t5_span_corruption.py \
      --workdir=/tmp/t5_span
  # the English side of Multi30k instead of Tiny Shakespeare:
  python -m experiments.translate --config=experiments/configs/t5_span_corruption.py \
      --config.data.text_path=../shared/data/multi30k/train.en.gz \
      --config.data.valid_text_path=../shared/data/multi30k/val.en.gz --workdir=/tmp/t5_span_m30k
  # any corpus, tokenized once into token shards (lines, a SentencePiece model trained on a
  # sample of it, 0.5% of the lines held out), then read from them: nothing is tokenized at the
  # start or on resume, and memory and start time do not grow with the corpus
  python -m experiments.prepare --sources='books/*.txt' --output=/data/books_t5 --unit=lines \
      --documents=lines --tokenizer=sentencepiece --vocab_size=32000 --valid_fraction=0.005
  python -m experiments.translate --config=experiments/configs/t5_span_corruption.py \
      --config.data.prepared=/data/books_t5 --config.data.text_path= \
      --config.tokenizer.vocab_size=32000 --workdir=/tmp/t5_books
  # the trained model fills in the spans of any text ('<extra_id_i>' is sentinel i):
  echo "First Citizen: Before we <extra_id_0> any further, hear me <extra_id_1>." | \
      python -m experiments.translate --workdir=/tmp/t5_span --mode=translate

Tiny Shakespeare (the last 5% of its lines held out) is tokenized (a 2,000-piece SentencePiece
model trained on it, plus T5's 100 sentinels on top of the vocabulary), packed and cut into
141-token chunks; 15% of each chunk's tokens, in spans of mean length 3, are replaced by
sentinels (128 input tokens with EOS), and the model learns to write out the missing spans
(29 target tokens, batched as 32). The masks are drawn anew each epoch. Validation: loss on the
held-out chunks, and greedy fill-ins of 32 of them in the log (their BLEU and exact match are
logged too; the sentinels count as words there, so BLEU starts high and says little).

From a prepared corpus (data.prepared, a folder or any fsspec URL such as gs://...; it replaces
data.text_path, which must then be ''): the corpus's SentencePiece model becomes the workdir's
spm.model (copied on the first run, checked against the corpus on every later one), chunk i of a
split is its token stream's [141 i, 141 (i + 1)), exactly the chunks the text path cuts from the
same lines, and batch s is a pure function of (seed, s): its rows are chunks in an order drawn
per epoch, each with a mask of its own per epoch. Validation: the first data.valid_chunks chunks
of the corpus's 'valid' split. Pass tokenizer.vocab_size as prepared (--vocab_size) so that the
planner sizes the model as the run will.

Model: T5 v1.1's design (`T5_V1_1_ARCHITECTURE`: pre-RMSNorm, relative position buckets,
gated-GELU feed-forward, no biases, unscaled N(0, 1) embeddings, attention logits not divided
by sqrt(head_dim), an output layer of its own), no dropout in pretraining, at 2+2 layers and
128 wide: 1.3M parameters. 3,000 steps of 16 chunks take 3.5 minutes on an idle 2-core CPU
(6.5 on a busy one); the validation loss falls from 7.3 to 4.3 (perplexity 75), the fill-ins
are still mostly frequent words: pretraining that shows needs far more compute than this.
"""

from experiments.configs.translate_common import translate_config
from transformer_jax.models.encoder_decoder import T5_V1_1_ARCHITECTURE

TEXT_PATH = '../shared/data/tinyshakespeare/input.txt'  # from the repository root


def get_config():
  config = translate_config()
  config.data.task = 'span_corruption'
  # A corpus of `python -m experiments.prepare --unit=lines --tokenizer=sentencepiece`, read
  # from its shards instead of data.text_path.
  config.data.prepared = ''
  config.data.valid_chunks = 1_024  # prepared: held-out chunks validated, 0 = the whole split
  # Tiny Shakespeare; clear it (--config.data.text_path=) to read data.prepared instead.
  config.data.text_path = TEXT_PATH
  config.data.valid_fraction = 0.05
  config.data.noise_density = 0.15
  config.data.mean_noise_span_length = 3.0
  config.data.max_len = 128  # corrupted inputs, EOS included: 141-token chunks
  config.data.pack = False  # chunks fill max_len already: length buckets, one of them
  config.data.buckets = (128,)  # every chunk but the last fills it: one shape, one compilation
  config.data.batch_tokens = 2048  # 16 chunks a batch
  config.tokenizer.vocab_size = 2_000
  config.tokenizer.num_sentinels = 100
  config.model.update(T5_V1_1_ARCHITECTURE)
  config.model.update(
      dict(emb_dim=128, num_heads=4, mlp_dim=256, num_encoder_layers=2, num_decoder_layers=2,
           dropout_rate=0.0, attention_dropout_rate=0.0))
  config.loss.label_smoothing = 0.0
  config.optimizer.learning_rate = 2e-3
  config.optimizer.warmup_steps = 300
  config.train.num_steps = 3_000
  config.train.log_every = 50
  config.train.eval_every = 500
  config.train.checkpoint_every = 500
  config.train.eval_max_batches = 0
  config.eval.beam_size = 1
  config.eval.bleu_sentences = 32  # held-out chunks whose spans are filled in greedily, logged
  config.eval.test_prefix = ''
  return config
