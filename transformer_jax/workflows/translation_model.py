"""The model a translation config describes: its tokenizers, its model config, its task and trainer.

The translation workflow (workflows/translation.py) and the two T5 recipes it runs, span-corruption
pretraining (workflows/span_corruption.py) and fine-tuning a pretrained T5 (workflows/t5_init.py),
all build their model here. This module imports none of them: each imports it, and
translation.py, above the three, composes them; nothing is handed back up as a callback.

What shapes the model besides config.model is applied here too: the init source (init.workdir
or init.hf_dir: a pretrained T5's tokenizer and, from an HF directory, its model config) and the
sentinel ids (tokenizer.num_sentinels, T5's '<extra_id_i>') on top of the tokenizer's vocabulary.
Every function takes the ml_collections config or its record, read by
workflows/translation_sections.py.
"""

import os

from transformer_jax.data import span_corruption, tokenizer as tok
from transformer_jax.data.t5_tokenizer import load_hf_t5_tokenizer
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig, model_config_from_dict
from transformer_jax.sections import value_of
from transformer_jax.tasks.translation import TranslationTask
from transformer_jax.training.trainer import Trainer
from transformer_jax.workflows.translation_sections import HF_DIR, WORKDIR, Translation

# A translation workdir's joint SentencePiece model (init.workdir's is copied under this name),
# and the workdir folder an init.hf_dir's tokenizer files are copied into.
SPM_MODEL = 'spm.model'
HF_TOKENIZER_DIR = 'hf_tokenizer'

# -- what the config asks for -------------------------------------------------------------------


def init_source(config) -> tuple[str, str]:
  """(WORKDIR or HF_DIR, path) of the pretrained T5 a run starts from; ('', '') for none
  (also for configs saved before config.init existed)."""
  return Translation.of(config).init.source


def requested_vocab_size(config) -> int:
  """The model vocabulary the config asks for: tokenizer.vocab_size plus the sentinels."""
  return Translation.of(config).tokenizer.model_vocab_size


# -- tokenizers ---------------------------------------------------------------------------------


def load_tokenizers(config, workdir: str, train_pairs=None):
  """(source, target) SentencePiece tokenizers, trained on the training text on first run.

  A fine-tuning run (init.*) never trains one: it reads the pretrained model's, which
  workflows/t5_init.write_init_tokenizer copied into the workdir (spm.model, or the
  HF_TOKENIZER_DIR folder).
  """
  run = Translation.of(config)
  kind = run.init.kind
  if kind == HF_DIR:
    tokenizer = load_hf_t5_tokenizer(os.path.join(workdir, HF_TOKENIZER_DIR), copied=True)
    # Its sentinels are its own top ids already (tokenizer.num_sentinels counts them).
    return text_to_text_tokenizers(run, tokenizer, tokenizer, add_sentinels=False)
  if kind == WORKDIR:
    if not os.path.isfile(os.path.join(workdir, SPM_MODEL)):
      raise ConfigError(f'no {SPM_MODEL} in {workdir}: a fine-tuning run copies init.workdir\'s '
                        'there before its first step; copy it back from there')
    train_pairs = None
  t = run.tokenizer

  def texts(*sides):

    def read():  # called only when the model file is missing
      if train_pairs is None:
        raise ConfigError(f'no tokenizer model (spm*.model) in {workdir}: training writes it; '
                          'train first, or if this workdir was trained, rerun its training '
                          'command (the tokenizer is retrained identically) or copy it back')
      # The tokenizer learns the text as the model sees it: sources with their prefix.
      prefix = {0: run.data.source_prefix, 1: ''}
      return (prefix[side] + s for side in sides for s in train_pairs[side])

    return read

  kwargs = dict(vocab_size=t.vocab_size, model_type=t.model_type, max_sentences=t.max_sentences)
  if t.joint:
    shared = tok.load_or_train_tokenizer(os.path.join(workdir, SPM_MODEL), texts(0, 1), **kwargs)
    src_tok = tgt_tok = shared
  else:
    src_tok = tok.load_or_train_tokenizer(os.path.join(workdir, 'spm.src.model'), texts(0),
                                          **kwargs)
    tgt_tok = tok.load_or_train_tokenizer(os.path.join(workdir, 'spm.tgt.model'), texts(1),
                                          **kwargs)
  return text_to_text_tokenizers(run, src_tok, tgt_tok)


def text_to_text_tokenizers(config, src_tok, tgt_tok, add_sentinels: bool = True):
  """The SentencePiece tokenizers as the model sees them: with tokenizer.num_sentinels extra
  ids on top (T5's sentinels, so the model vocabulary is the tokenizer's plus those; not with
  `add_sentinels` False: a tokenizer that has them), and with data.source_prefix on every source
  text. Unchanged when both are off."""
  run = Translation.of(config)
  count = run.tokenizer.num_sentinels if add_sentinels else 0
  if count:
    shared = src_tok is tgt_tok
    tgt_tok = span_corruption.SentinelTokenizer(tgt_tok, count)
    src_tok = tgt_tok if shared else span_corruption.SentinelTokenizer(src_tok, count)
  prefix = run.data.source_prefix
  if prefix:
    src_tok = span_corruption.PrefixedTokenizer(src_tok, prefix)
  return src_tok, tgt_tok


# -- model, task and trainer --------------------------------------------------------------------


def model_config(config, src_vocab_size: int, tgt_vocab_size: int) -> TransformerConfig:
  """The model for tokenizers of these sizes: sized to them, or, fine-tuning an HF T5, the
  checkpoint's (config.model as workflows/t5_init.init_config wrote it), whose embedding may
  have rows the tokenizer does not use (t5-small: 32,128 for 32,100 ids) but not fewer."""
  run = Translation.of(config)
  if run.init.kind == HF_DIR:
    cfg = model_config_from_dict(run.model, max_len=run.data.max_len)
    if tgt_vocab_size > cfg.vocab_size:
      raise ConfigError(f'the tokenizer has {tgt_vocab_size} ids but the model\'s embedding has '
                        f'{cfg.vocab_size} rows: use the tokenizer saved with the checkpoint')
    return cfg
  joint = run.tokenizer.joint
  # One table for both languages needs one vocabulary (TransformerConfig shares by default).
  shared = value_of(run.model, 'share_embeddings', bool, True, 'model.share_embeddings')
  return model_config_from_dict(run.model, vocab_size=tgt_vocab_size, max_len=run.data.max_len,
                                source_vocab_size=None if joint else src_vocab_size,
                                share_embeddings=shared and joint)


def build_task(config, workdir: str, train_pairs=None, valid_pairs=((), ()), tokenizers=None):
  """(task, (source tokenizer, target tokenizer)) for `config` (the model sized to the
  tokenizers, sentinels included); `tokenizers` = (source, target) from `load_tokenizers` if
  already loaded."""
  run = Translation.of(config)
  src_tok, tgt_tok = tokenizers or load_tokenizers(run, workdir, train_pairs)
  model_cfg = model_config(run, src_tok.vocab_size, tgt_tok.vocab_size)
  bleu_n = run.eval.bleu_sentences or len(valid_pairs[0])
  task = TranslationTask(model_cfg, label_smoothing=run.loss.label_smoothing,
                         beam_size=run.eval.beam_size, alpha=run.eval.alpha,
                         decode_rows=run.eval.decode_rows, src_tokenizer=src_tok,
                         tgt_tokenizer=tgt_tok, eval_sources=valid_pairs[0][:bleu_n],
                         eval_references=valid_pairs[1][:bleu_n])
  return task, (src_tok, tgt_tok)


def build(config, workdir: str, train_pairs=None, valid_pairs=((), ()), tokenizers=None):
  """Task, trainer and (source, target) tokenizers for `config`, as `build_task`."""
  run = Translation.of(config)
  task, tokenizers = build_task(run, workdir, train_pairs, valid_pairs, tokenizers)
  return task, Trainer(run.config, task, workdir), tokenizers
