"""A trained workdir -> a Hugging Face model directory that `transformers` loads as it is.

    python -m experiments.export --workdir=/tmp/sc --out=/tmp/sc_hf
    model = AutoModelForCausalLM.from_pretrained('/tmp/sc_hf')   # or AutoModelForMaskedLM, ...
    tokenizer = AutoTokenizer.from_pretrained('/tmp/sc_hf')      # the same ids as the workdir's

The workdir is read the way the workflow that wrote it reads it: its saved config
(cli/workdir.load_saved_config), the experiment it belongs to (workflows/experiment_kinds.py), its
model config and tokenizer from that experiment's workflow modules (workflows/lm.py, bert*.py,
translation_model.py), its params from the latest readable checkpoint
(training/checkpointing.restore_params_only: the optimizer state is not read, nothing is
written). convert/export.py knows the Hugging Face side. The family follows from the config,
before any weight is read:

  experiments.lm, GPT-2's switches (learned positions, Pre-LN, biases)  -> gpt2  (GPT2LMHeadModel)
  experiments.lm, OPT's: GPT-2's with ReLU (opt_shakespeare.py)         -> opt   (OPTForCausalLM)
  experiments.lm, rotary positions / RMSNorm / SwiGLU                   -> llama (LlamaForCausalLM)
  experiments.bert (pretraining or fine-tuning), by its heads: ...ForPreTraining, ...ForMaskedLM
  or ...ForSequenceClassification of
      albert   a factorised embedding (model.embedding_size) or shared layers (share_layers);
      roberta  RoBERTa's byte-level BPE (tokenizer.type='byte_bpe', or fine-tuned from an HF
               RoBERTa or such a workdir); pretrained with data.sentence_task 'full_sentences'
               or 'none' (RoBERTa has no sentence head);
      bert     otherwise (WordPiece);
  experiments.translate, T5's switches (relative positions, RMSNorm, Pre-LN, no biases, one
      shared vocabulary) -> t5 (T5ForConditionalGeneration); a span-corruption or text-to-text
      workdir keeps its sentinels ('<extra_id_i>') and data.source_prefix (config.json's
      task_specific_params, where T5 checkpoints keep it);
  anything else (e.g. the original post-LN sinusoidal Transformer, which no HF class computes)
      -> one ConfigError line naming the switch without an HF equivalent.
"""

import os

import numpy as np
from absl import logging

from transformer_jax.cli.workdir import load_saved_config
from transformer_jax.convert import families
from transformer_jax.convert.export import check_out_dir, tokenizer_files, write_hf_directory
from transformer_jax.errors import ConfigError
from transformer_jax.models.bert import bert_heads
from transformer_jax.training.checkpointing import restore_params_only
from transformer_jax.workflows import bert, bert_sections, experiment_kinds

# The vocabulary of the model checked before any file is read: the switches, not the sizes,
# decide what HF expresses.
STAND_IN_VOCAB_SIZE = 256


def _byte_level_bert(config) -> bool:
  """Whether a BERT-family workdir tokenizes with RoBERTa's byte-level BPE: its own
  tokenizer.type, or, fine-tuned, that of the model it started from."""
  if config.mode == 'pretrain':
    return bert.tokenizer_type(config) == 'byte_bpe'
  if config.init.hf_dir:
    return bert.hf_family(config.init.hf_dir).byte_level
  if config.init.bert_workdir:
    return bert.tokenizer_type(load_saved_config(config.init.bert_workdir)) == 'byte_bpe'
  return False  # init_model_config has refused it already


def family_of(kind: str, cfg, config) -> families.Family:
  """The HF family that computes what `cfg` computes; ConfigError naming the switch that has
  no HF equivalent (the family's exporter then checks the rest)."""
  family = families.exporting(kind, cfg, kind == families.ENCODER and _byte_level_bert(config))
  if kind == families.ENCODER_DECODER and not (config.tokenizer.joint and cfg.share_embeddings):
    raise ConfigError(f'{family.name} has one vocabulary and embedding shared by encoder and '
                      'decoder; this model was trained with tokenizer.joint=False or '
                      'model.share_embeddings=False')
  return family


def _expected_heads(config, type_vocab_size: int) -> dict:
  """The `Bert` heads a BERT-family config trains (for checks before the params are read)."""
  if config.mode == 'pretrain':
    sentence = bert.model_sentence_task(config.data.sentence_task) != 'none'
    return dict(type_vocab_size=type_vocab_size, mlm=True, sentence_classes=2 if sentence else 0,
                num_labels=0)
  return dict(type_vocab_size=type_vocab_size, mlm=False, sentence_classes=0,
              num_labels=bert_sections.FineTuning.of(config).data.num_labels)


def _embedding_rows(experiment: experiment_kinds.Experiment, params: dict) -> int:
  name = experiment.embedding
  try:
    return int(np.shape(params[name]['embedding'])[0])
  except (KeyError, TypeError):
    raise ConfigError(f'the checkpoint params lack {name}/embedding: not a model of this '
                      'workdir config') from None


def export_workdir(workdir: str, out_dir: str) -> str:
  """Writes the HF directory of a trained workdir to `out_dir`; returns the family's name
  (convert/families.py).

  The family and the config's HF expressibility are settled from config.json before any
  weight is read; then the tokenizer and the latest checkpoint's params are read and written.
  Raises one ConfigError line for an existing non-empty `out_dir`, a workdir without a
  checkpoint, a model no HF class computes, or a tokenizer larger than the model's embedding.
  """
  if not workdir:
    raise ConfigError('--workdir is required: a directory trained by experiments.lm, .bert or '
                      '.translate')
  workdir = os.path.abspath(os.path.expanduser(workdir))
  if not os.path.isdir(workdir):
    raise ConfigError(f'--workdir {workdir} does not exist')
  out_dir = check_out_dir(out_dir)
  config = load_saved_config(workdir)
  experiment = experiment_kinds.of_config(config)
  kind = experiment.kind
  draft, type_vocab_size = experiment.model_config(config, STAND_IN_VOCAB_SIZE)
  family = family_of(kind, draft, config)
  encoder = family.kind == families.ENCODER
  to_hf, _ = family.exporters(_expected_heads(config, type_vocab_size) if encoder else None)
  to_hf(draft)
  files = tokenizer_files(experiment.load_tokenizer(config, workdir), draft.max_len)
  params = restore_params_only(os.path.join(workdir, 'checkpoints'))
  rows = _embedding_rows(experiment, params)
  cfg, _ = experiment.model_config(config, rows)
  if files.vocab_size > rows:
    raise ConfigError(f'the tokenizer has {files.vocab_size} tokens but the model embedding '
                      f'has {rows} rows: ids >= {rows} would have no embedding')
  heads = None
  if encoder:
    heads = bert_heads(params)
  to_hf, export_state_dict = family.exporters(heads, files.special_ids)
  hf_config = to_hf(cfg)
  for key, value in files.special_ids.items():
    if hf_config.get(key) is None:
      hf_config[key] = value
  task_params = experiment.task_specific_params(config)
  if task_params:  # text-to-text: where T5 checkpoints keep the prefix their sources need
    hf_config['task_specific_params'] = task_params
  write_hf_directory(out_dir, hf_config, export_state_dict(cfg, params), files.write)
  logging.info('exported %s (%s) to %s', workdir, family.name, out_dir)
  return family.name
