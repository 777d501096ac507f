"""Defaults shared by the BERT-family configs: pretraining (MLM + NSP/SOP, or RoBERTa's MLM on
full sentences) and fine-tuning."""

import ml_collections

from experiments.configs.common import base_config
from transformer_jax.models.bert import BERT_ARCHITECTURE


def _bert_adamw(config, *, learning_rate: float, warmup_steps: int, decay_steps: int):
  """BERT's AdamW: warmup then linear decay to 0, betas (0.9, 0.999), eps 1e-6, decay 0.01."""
  config.optimizer.update(
      dict(schedule='linear', learning_rate=learning_rate, warmup_steps=warmup_steps,
           decay_steps=decay_steps, end_learning_rate=0.0, b1=0.9, b2=0.999, eps=1e-6,
           weight_decay=0.01, grad_clip_norm=1.0))


def pretrain_config() -> ml_collections.ConfigDict:
  """BERT pretraining: Post-LN encoder, exact GELU, LayerNorm eps 1e-12, learned positions."""
  config = base_config()
  # Trained by experiments.bert (transformer_jax/workflows/experiment_kinds.py).
  config.experiment = 'encoder'
  config.mode = 'pretrain'
  config.data = ml_collections.ConfigDict()
  config.data.source = 'files'  # 'files' (local text), 'tfds' or 'prepared'
  # 'prepared': a folder of `python -m experiments.prepare --unit=lines` (local or gs://), read
  # from its token shards; its tokenizer becomes the workdir's.
  config.data.prepared = ''
  # 'files': comma-separated UTF-8 text files (.gz ok); one sentence per line, documents
  # separated by blank lines; data.lines_per_document > 0 cuts files without blank lines.
  config.data.paths = ''
  config.data.lines_per_document = 0
  config.data.valid_fraction = 0.02  # 'files': documents held out for evaluation
  config.data.tfds_name = ''  # 'tfds': e.g. 'wikipedia/20230601.en'
  config.data.tfds_feature = 'text'
  config.data.tfds_data_dir = ''
  config.data.train_split = 'train'
  config.data.valid_split = 'validation'
  config.data.max_train_examples = 0
  config.data.max_valid_examples = 0
  config.data.max_len = 128  # tokens per sequence, [CLS] and [SEP]s included
  config.data.max_predictions = 20  # masked positions scored per sequence (15% of 128 = 19)
  config.data.mask_rate = 0.15  # selected tokens: 80% [MASK], 10% random, 10% unchanged
  # 'nsp' (BERT), 'sop' (ALBERT), 'none' (one-document rows, like RoBERTa's DOC-SENTENCES) or
  # 'full_sentences' (RoBERTa's: rows packed across documents with a separator between them).
  config.data.sentence_task = 'nsp'
  config.data.type_vocab_size = 2  # segment ids (sentence A / B); RoBERTa has 1 (no token types)
  config.data.short_seq_prob = 0.1  # sometimes shorter sequences, as BERT's data generator
  # Several complete [CLS] ... [SEP] examples per row, each attending only to itself, with its
  # own positions (data/bert_pretrain.py). For sentence_task 'none' and 'full_sentences' only
  # (with 'full_sentences' every example stays inside one document). A packed row's masked
  # positions get round(max_len * mask_rate) + ceil(max_len / 16) slots (>= max_predictions).
  config.data.pack = False
  config.data.batch_size = 32
  config.data.eval_batches = 20

  config.tokenizer = ml_collections.ConfigDict()
  # 'wordpiece' (BERT's; WORKDIR/vocab.txt) or 'byte_bpe' (RoBERTa's byte-level BPE with <s>,
  # <pad>, </s>, <unk>, <mask>; WORKDIR/tokenizer/, HF files), trained on the training text.
  config.tokenizer.type = 'wordpiece'
  config.tokenizer.vocab_file = ''  # wordpiece: a BERT vocab.txt; '' = train on the corpus
  config.tokenizer.vocab_size = 8000
  config.tokenizer.lowercase = True  # wordpiece only (byte-level BPE keeps the text as it is)

  # BERT's architecture from its one definition beside bert_config(); BERT-base sizes.
  config.model = ml_collections.ConfigDict(
      dict(BERT_ARCHITECTURE, emb_dim=768, num_heads=12, mlp_dim=3072, num_encoder_layers=12,
           max_len=512, dropout_rate=0.1, attention_dropout_rate=0.1, dtype='float32',
           matmul_dtype='auto', param_dtype='float32', remat_policy='none', scan_layers=False,
           attention_implementation='auto'))

  # Continue pretraining a Hugging Face BERT, ALBERT or RoBERTa folder (its tokenizer saved
  # beside it): its config.json replaces config.model (dropout, dtypes, remat and attention stay
  # this config's), its tokenizer the trained one, its weights the params at step 0
  # (transformer_jax/workflows/bert_continue.py). '' = from scratch.
  config.init = ml_collections.ConfigDict({'hf_dir': ''})

  _bert_adamw(config, learning_rate=1e-4, warmup_steps=10_000, decay_steps=1_000_000)
  config.train.num_steps = 1_000_000
  config.train.eval_every = 10_000
  config.train.checkpoint_every = 10_000
  config.train.log_every = 100
  return config


def finetune_config() -> ml_collections.ConfigDict:
  """Sentence (or sentence-pair) classification from a pretrained BERT (GLUE-style recipe)."""
  config = base_config()
  # Trained by experiments.bert (transformer_jax/workflows/experiment_kinds.py).
  config.experiment = 'encoder'
  config.mode = 'finetune'
  config.init = ml_collections.ConfigDict()
  config.init.hf_dir = ''  # a Hugging Face BERT directory (config.json, weights, vocab)
  config.init.bert_workdir = ''  # or a pretraining workdir of ours
  config.data = ml_collections.ConfigDict()
  config.data.source = 'tsv'  # 'tsv' (DIR/train.tsv, DIR/dev.tsv) or 'tfds' (glue/sst2)
  config.data.dir = ''
  config.data.tfds_name = 'glue/sst2'
  config.data.tfds_data_dir = ''
  config.data.num_labels = 2
  config.data.max_len = 64
  config.data.batch_size = 32
  config.data.max_train_examples = 0  # 0 = all
  # Must stay False: the classifier reads one [CLS] per row, so rows hold one example each.
  config.data.pack = False
  # TSV columns (header names or 0-based positions): () = the one column named sentence,
  # content or text; two columns = sentence pairs (segment ids 0 and 1), e.g. ('sentence1',
  # 'sentence2') for RTE. label_column '' = the column named 'label'.
  config.data.text_columns = ()
  config.data.label_column = ''
  # Class names, index = label id: printed by --mode=predict, and how TSV labels given as names
  # (MNLI's 'entailment') map to ids. () = '0', '1', ...
  config.data.label_names = ()
  config.data.train_file = 'train.tsv'
  config.data.dev_file = 'dev.tsv'
  config.data.test = ''  # --mode=evaluate: a labelled TSV in the training files' format
  # Overrides of the pretrained model's config (dropout while fine-tuning).
  config.model = ml_collections.ConfigDict(
      dict(dropout_rate=0.1, attention_dropout_rate=0.1, dtype='float32', matmul_dtype='auto',
           remat_policy='none', attention_implementation='auto'))
  _bert_adamw(config, learning_rate=5e-5, warmup_steps=400, decay_steps=4_000)
  config.train.num_steps = 4_000
  config.train.eval_every = 500
  config.train.checkpoint_every = 1_000
  config.train.keep_checkpoints = 1
  config.train.log_every = 100
  return config
