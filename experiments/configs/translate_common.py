"""Defaults shared by the translation configs: the original Transformer's choices."""

import ml_collections

from experiments.configs.common import base_config


def translate_config() -> ml_collections.ConfigDict:
  config = base_config()
  # Trained by experiments.translate (transformer_jax/workflows/experiment_kinds.py); span
  # corruption and text-to-text fine-tuning too.
  config.experiment = 'translation'
  config.data = ml_collections.ConfigDict()
  config.data.source = 'files'  # 'files' (parallel text), 'tfds', or 'numbers' (embedded)
  config.data.dir = ''  # for 'files': {dir}/{prefix}.{lang}[.gz]
  config.data.tfds_name = ''  # for 'tfds', e.g. 'wmt14_translate/de-en'
  config.data.tfds_data_dir = ''
  config.data.src_lang = 'en'
  config.data.tgt_lang = 'de'
  config.data.train_prefix = 'train'
  config.data.valid_prefix = 'val'
  config.data.max_len = 128  # tokens incl. EOS; longer pairs are filtered or truncated
  config.data.overflow = 'filter'  # 'filter' or 'truncate'
  config.data.batch_tokens = 4096  # padded tokens per batch (source or target side)
  # True: several pairs per row of max_len rounded up to 8 (segment ids and positions per pair,
  # data/packing.py); one batch shape, train and eval, and less padding. On Multi30k it trained
  # 1.15x the tokens per second of buckets and reached higher BLEU in the same time
  # (docs/packing.md). False: length buckets (data.buckets). Span corruption ignores it.
  config.data.pack = True
  config.data.buckets = ()  # pack=False: () = 8, 16, 24, 32, 48, ..., max_len; (L,): one shape
  config.data.skip_invalid_utf8 = False
  config.data.max_train_examples = 0  # 0 = all (span corruption: chunks)
  # T5's recipes (transformer_jax/data/span_corruption.py); the defaults leave translation as is.
  config.data.source_prefix = ''  # text-to-text: e.g. 'translate English to German: ' on sources
  config.data.task = 'translation'  # or 'span_corruption': pretrain on plain text (T5)
  config.data.text_path = ''  # span_corruption: a UTF-8 text file (.gz too), one passage a line
  config.data.valid_text_path = ''  # span_corruption: held-out text; '' = the end of text_path
  config.data.valid_fraction = 0.05  # span_corruption without valid_text_path: lines held out
  config.data.noise_density = 0.15  # span_corruption: share of tokens cut out
  config.data.mean_noise_span_length = 3.0  # span_corruption: mean tokens per cut-out span

  config.tokenizer = ml_collections.ConfigDict()
  config.tokenizer.vocab_size = 8000
  config.tokenizer.joint = True  # one SentencePiece model for both languages
  config.tokenizer.model_type = 'unigram'
  config.tokenizer.max_sentences = 2_000_000
  # T5's sentinels: extra ids on top of the SentencePiece pieces, sentinel i = model vocabulary
  # size - 1 - i (span corruption needs them; T5 has 100, written '<extra_id_i>').
  config.tokenizer.num_sentinels = 0

  config.model = ml_collections.ConfigDict(
      dict(emb_dim=512, num_heads=8, mlp_dim=2048, num_encoder_layers=6, num_decoder_layers=6,
           dropout_rate=0.1, attention_dropout_rate=0.1, norm_type='layernorm',
           norm_position='post', position='sinusoidal', activation='relu', use_bias=True,
           share_embeddings=True, tie_output=True, scale_embeddings=True, dtype='float32',
           matmul_dtype='auto', param_dtype='float32', remat_policy='none', scan_layers=False,
           attention_implementation='auto'))

  # Fine-tuning a pretrained T5 (text to text; workflows/t5_init.py): at most one of
  #   workdir: a span-corruption (or other T5) workdir of this workflow: its latest params, its
  #     spm.model and sentinels, its model config (config.model must agree on every shape);
  #   hf_dir: a Hugging Face T5 directory (config.json, model.safetensors, tokenizer.json or
  #     spiece.model): its weights, tokenizer and model config (config.model gives dropout etc.).
  # Applied at step 0 only: a rerun resumes from the run's own checkpoints.
  config.init = ml_collections.ConfigDict({'workdir': '', 'hf_dir': ''})

  config.loss = ml_collections.ConfigDict({'label_smoothing': 0.1})

  config.eval = ml_collections.ConfigDict()
  config.eval.beam_size = 4
  config.eval.alpha = 0.6
  config.eval.decode_rows = 64
  config.eval.bleu_sentences = 0  # validation sentences scored with BLEU; 0 = all
  config.eval.test_prefix = ''  # e.g. 'test_2016_flickr': BLEU on it after training
  config.eval.average_last = 0  # >1: average the last k checkpoints if validation BLEU agrees

  config.optimizer.learning_rate = 1e-3
  config.optimizer.schedule = 'rsqrt'
  config.optimizer.warmup_steps = 4_000
  return config
