"""Defaults shared by the language-model configs: a GPT-2 style decoder-only model."""

import ml_collections

from experiments.configs.common import base_config
from transformer_jax.models.gpt import GPT2_ARCHITECTURE


def lm_config() -> ml_collections.ConfigDict:
  config = base_config()
  # Trained by experiments.lm (transformer_jax/workflows/experiment_kinds.py).
  config.experiment = 'lm'
  config.data = ml_collections.ConfigDict()
  config.data.source = 'file'  # 'file' (one text file), 'tfds' or 'prepared'
  config.data.path = ''  # for 'file': a UTF-8 text file
  # for 'prepared': a folder of `python -m experiments.prepare` (local or gs://); 'file' and
  # 'tfds' are prepared the same way into WORKDIR/corpus on the first run
  config.data.prepared = ''
  config.data.train_fraction = 0.9  # for 'file': the first 90% trains, the last 10% validates
  config.data.tfds_name = ''  # for 'tfds', e.g. 'tiny_shakespeare' or 'lm1b'
  config.data.tfds_feature = 'text'
  config.data.tfds_data_dir = ''
  config.data.train_split = 'train'
  config.data.valid_split = 'validation'
  config.data.max_train_examples = 0  # for 'tfds': 0 = all documents
  config.data.max_valid_examples = 0
  config.data.block_size = 256  # context length (tokens per window; the model's max_len)
  config.data.batch_size = 64  # windows per global batch
  config.data.eval_batches = 20  # fixed validation batches, the same at every evaluation
  # Documents as attention segments: every window also carries segment ids and per-document
  # positions from the EOS ids that join the documents, so no token attends to another document.
  # Needs a subword tokenizer ('sentencepiece' or 'byte_bpe'); 'char' text has no documents.
  config.data.pack = False

  config.tokenizer = ml_collections.ConfigDict()
  # 'char', 'sentencepiece' or 'byte_bpe' (GPT-2's byte-level BPE, saved as the Hugging Face
  # folder tokenizer/ in the workdir; documents joined with '<|endoftext|>').
  config.tokenizer.type = 'char'
  # For 'sentencepiece' and 'byte_bpe' (>= 257); a char vocabulary sizes itself.
  config.tokenizer.vocab_size = 256
  config.tokenizer.model_type = 'unigram'  # for 'sentencepiece'
  config.tokenizer.max_sentences = 2_000_000  # for 'sentencepiece'

  # GPT-2's architecture (learned positions, Pre-LN, tanh-GELU, tied output, init std 0.02),
  # from its one definition beside gpt2_config(); sizes and dropout are this config's own.
  config.model = ml_collections.ConfigDict(
      dict(GPT2_ARCHITECTURE, emb_dim=384, num_heads=6, mlp_dim=1536, num_decoder_layers=6,
           dropout_rate=0.2, attention_dropout_rate=0.2, dtype='float32', matmul_dtype='auto',
           param_dtype='float32', remat_policy='none', scan_layers=False,
           attention_implementation='auto'))

  # Continue pretraining a Hugging Face causal LM (GPT-2, LLaMA, OPT: a folder with config.json,
  # weights and tokenizer; workflows/lm_init.py) instead of training from scratch: its config
  # replaces the model section (config.model keeps only dropout, dtypes and memory switches), its
  # tokenizer tokenizes data.* (tokenizer.* is not trained) and its weights are step 0.
  config.init = ml_collections.ConfigDict()
  config.init.hf_dir = ''

  # Samples written at every evaluation (fixed prompt and seed, so steps compare).
  config.eval = ml_collections.ConfigDict()
  config.eval.sample_prompt = '\n'
  config.eval.sample_tokens = 200
  config.eval.temperature = 0.8
  config.eval.top_k = 200
  config.eval.top_p = 1.0

  # nanoGPT's AdamW: warmup, cosine decay to a tenth, beta2 0.99, decoupled weight decay.
  config.optimizer.schedule = 'cosine'
  config.optimizer.learning_rate = 1e-3
  config.optimizer.end_learning_rate = 1e-4
  config.optimizer.warmup_steps = 100
  config.optimizer.decay_steps = 5_000
  config.optimizer.b1 = 0.9
  config.optimizer.b2 = 0.99
  config.optimizer.eps = 1e-8
  config.optimizer.weight_decay = 0.1
  config.optimizer.grad_clip_norm = 1.0
  config.train.num_steps = 5_000
  config.train.eval_every = 250
  config.train.checkpoint_every = 1_000
  config.train.log_every = 50
  config.train.eval_max_batches = 0  # data.eval_batches already bounds evaluation
  return config
