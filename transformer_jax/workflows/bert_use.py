"""Using a trained BERT-family workdir; experiments/bert.py's --mode picks one. Training
(pretrain, finetune) is workflows/bert.py, whose configs, tokenizers and restore functions these
modes read. Each reads the workdir's saved config and tokenizer, and refuses a workdir of the
wrong kind or without a checkpoint with one ConfigError line, writing nothing:
  predict    (`restore_classifier`, `classify`): class probabilities of sentences or pairs,
             batched and jitted over a few fixed length buckets.
  evaluate   (`evaluate_file`): accuracy (F1 and Matthews correlation for two classes) on a
             labelled TSV; predictions written to WORKDIR/predictions.tsv.
  fill_mask  (`restore_mlm`, `fill_mask`): top-k tokens for each [MASK], from a pretraining
             workdir or a Hugging Face folder of any encoder family (BERT, RoBERTa, ALBERT).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from transformer_jax.cli.workdir import load_saved_config
from transformer_jax.convert import families
from transformer_jax.data.classification import (default_buckets, encode_rows, make_batch, read_tsv,
                                                 row_length)
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.files import write_atomically
from transformer_jax.models.bert import Bert, bert_heads
from transformer_jax.training import trained_model
from transformer_jax.workflows import bert, bert_sections
from transformer_jax.workflows.bert_finetuning import classification_data, classification_task

PREDICTIONS_FILE = 'predictions.tsv'  # --mode=evaluate: WORKDIR/predictions.tsv


def _saved_config_of(workdir: str, expected: str, use: str):
  """The workdir's saved config if it was trained with config.mode == `expected` and has a
  checkpoint; else one ConfigError line. Reads only (no Trainer is built before this passes)."""
  if not os.path.isfile(os.path.join(workdir, 'config.json')):
    raise ConfigError(f'{workdir} has no config.json: {use} needs a workdir that '
                      f"'experiments.bert --mode={expected}' trained")
  config = load_saved_config(workdir)
  mode = bert_sections.mode_of(config)
  if mode != expected:
    what = f'a BERT {mode} workdir' if mode in bert.MODES else 'not a BERT workdir'
    raise ConfigError(f'{workdir} is {what} (config.mode={mode!r}); {use} needs one that '
                      f"'experiments.bert --mode={expected}' trained")
  directory = os.path.join(workdir, 'checkpoints')
  if not os.path.isdir(directory) or not any(n.isdigit() for n in os.listdir(directory)):
    raise ConfigError(f'no checkpoint in {directory}: train first (experiments.bert '
                      f'--mode={expected} --workdir={workdir})')
  return config


def restore_classifier(workdir: str):
  """(saved config read as bert_sections.FineTuning, task, params, tokenizer) of a fine-tuned
  sentence-classification workdir's latest checkpoint."""
  saved = bert_sections.FineTuning.of(_saved_config_of(workdir, 'finetune', 'predict/evaluate'))
  classification_data(saved)  # a tagging workdir is refused before its tokenizer is read
  tokenizer = bert.finetune_tokenizer(saved, workdir)
  cfg, type_vocab_size = bert.init_model_config(saved)
  task = classification_task(saved, cfg, type_vocab_size)
  params = jax.device_get(trained_model.restore(saved.config, task, workdir).params)
  return saved, task, params, tokenizer


def _padded(rows, chosen, buckets, batch_size):
  zeros = np.zeros(len(chosen))
  return make_batch([rows[i] for i in chosen], zeros, zeros, buckets, batch_size)


def classify(task, params, tokenizer, texts: list, *, batch_size: int = 32) -> np.ndarray:
  """Class probabilities [N, C] (float32) of strings or (first, second) pairs.

  Rows are sorted by length and padded to fixed [batch_size, bucket] shapes (buckets 16, 32,
  ... up to the model's position table), so one compile per bucket serves any number of lines;
  longer inputs are truncated and counted in a log line.
  """
  max_len = task.cfg.max_len
  rows, truncated = encode_rows(tokenizer, texts, max_len)
  if truncated:
    logging.warning('%d of %d inputs were longer than the model\'s %d tokens: truncated', truncated,
                    len(rows), max_len)
  buckets = default_buckets(max_len)
  probabilities = jax.jit(lambda p, inputs, segments: jax.nn.softmax(
      task.logits(p, {'inputs': inputs, 'segments': segments}), axis=-1))
  out = np.zeros((len(rows), task.num_labels), np.float32)
  order = np.argsort([row_length(r) for r in rows], kind='stable')
  for start in range(0, len(order), batch_size):
    chosen = order[start:start + batch_size]
    batch = _padded(rows, chosen, buckets, batch_size)
    probs = probabilities(params, batch['inputs'], batch['segments'])
    out[chosen] = np.asarray(probs)[:len(chosen)]
  return out


def parse_lines(lines: list[str], pairs: bool) -> list:
  """Input lines -> texts: a pair model's lines are 'first<TAB>second' (DataError naming a line
  without a tab), a single-sentence model's whole lines."""
  if not pairs:
    return list(lines)
  texts = []
  for n, line in enumerate(lines, start=1):
    if '\t' not in line:
      raise DataError(f'input line {n} has no tab: this model classifies sentence pairs, one '
                      "'first<TAB>second' per line")
    first, second = line.split('\t', 1)
    texts.append((first, second))
  return texts


def binary_scores(labels: np.ndarray, predictions: np.ndarray) -> dict[str, float]:
  """F1 of class 1 and Matthews correlation (0 when a marginal is empty, as scikit-learn)."""
  tp = float(np.sum((predictions == 1) & (labels == 1)))
  tn = float(np.sum((predictions == 0) & (labels == 0)))
  fp = float(np.sum((predictions == 1) & (labels == 0)))
  fn = float(np.sum((predictions == 0) & (labels == 1)))
  f1 = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0
  denominator = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
  mcc = (tp * tn - fp * fn) / denominator if denominator else 0.0
  return {'f1': f1, 'mcc': float(mcc)}


def evaluate_file(workdir: str, test_path: str, *, batch_size: int = 32) -> dict:
  """Scores a fine-tuned workdir on a labelled TSV (read as its training data was: the saved
  config's text and label columns); writes WORKDIR/predictions.tsv atomically."""
  if not test_path:
    raise ConfigError('--mode=evaluate needs a labelled TSV: --config.data.test=FILE')
  saved, task, params, tokenizer = restore_classifier(workdir)
  data = saved.data
  names = data.class_names()
  texts, labels = read_tsv(test_path, data.text_columns, data.label_column, data.label_names)
  labels = np.asarray(labels)
  bad = sorted({int(y) for y in labels if not 0 <= y < task.num_labels})
  if bad:
    raise ConfigError(f'{test_path}: labels {bad[:5]} are outside the model\'s {task.num_labels} '
                      'classes')
  probs = classify(task, params, tokenizer, texts, batch_size=batch_size)
  predictions = probs.argmax(-1)
  results = {'examples': int(len(labels)), 'accuracy': float(np.mean(predictions == labels))}
  if task.num_labels == 2:
    results.update(binary_scores(labels, predictions))
  lines = ['index\tlabel\tprediction\tprobability'] + [
      f'{i}\t{names[y]}\t{names[p]}\t{probs[i, p]:.6f}'
      for i, (y, p) in enumerate(zip(labels, predictions))
  ]
  write_atomically(os.path.join(workdir, PREDICTIONS_FILE), '\n'.join(lines) + '\n')
  return results


def restore_mlm(workdir: str = '', hf_dir: str = ''):
  """(model, params, tokenizer) with the MLM head: a pretraining workdir's latest checkpoint or
  a Hugging Face folder of any encoder family of the registry (convert/families.py) holding the
  masked-LM head and its tokenizer."""
  if bool(workdir) == bool(hf_dir):
    raise ConfigError('fill_mask reads one model: --workdir=PRETRAINING_WORKDIR or --hf_dir=DIR')
  if hf_dir:
    family = families.of_directory(hf_dir, families.ENCODER)
    imported = family.load(hf_dir)
    cfg, params, tokenizer, heads = (imported.config, imported.params, imported.tokenizer,
                                     imported.heads)
    if not heads['mlm']:
      raise ConfigError(f'{hf_dir} has no masked-LM head: fill_mask needs a {family.name} '
                        'checkpoint saved with it (a *ForMaskedLM or *ForPreTraining class)')
    if tokenizer is None:
      raise ConfigError(f'{hf_dir} has no tokenizer this {family.name} import reads: save it '
                        'beside the model (tokenizer.save_pretrained(DIR))')
  else:
    _saved_config_of(workdir, 'pretrain', 'fill_mask')
    cfg, params, tokenizer = bert.restore_pretrained(workdir)
    heads = bert_heads(params)
  model = Bert(cfg, **heads)
  if 'pooler' not in params:  # *ForMaskedLM have none; the MLM logits never read it
    e = cfg.emb_dim
    pooler = {'kernel': np.zeros((e, e), np.float32), 'bias': np.zeros(e, np.float32)}
    params = {**params, 'pooler': pooler}
  return model, params, tokenizer


def fill_mask(model, params, tokenizer, lines: list[str], *, top_k: int = 5,
              batch_size: int = 16) -> list[list[list[tuple[int, float]]]]:
  """For each line, for each [MASK] in it, the top_k (token id, probability) pairs, best first.

  Lines are encoded as [CLS] line [SEP] (cut to the model's length); the softmax is over the
  whole vocabulary at each mask position, as transformers' fill-mask pipeline.
  """
  max_len = model.cfg.max_len
  rows, truncated = encode_rows(tokenizer, list(lines), max_len)
  if truncated:
    logging.warning('%d of %d lines were longer than the model\'s %d tokens: truncated', truncated,
                    len(rows), max_len)
  buckets = default_buckets(max_len)

  @jax.jit
  def top(p, inputs, positions):
    logits = model.apply({'params': p}, inputs, jnp.zeros_like(inputs),
                         mlm_positions=positions)['mlm_logits']
    return jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)

  out = []
  for start in range(0, len(rows), batch_size):
    chunk = list(range(start, min(start + batch_size, len(rows))))
    batch = _padded(rows, chunk, buckets, batch_size)['inputs']
    masks = [np.flatnonzero(rows[i] == tokenizer.mask_id) for i in chunk]
    most = max([len(m) for m in masks] + [1])
    width = next(b for b in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, most] if b >= most)
    positions = np.zeros((batch_size, width), np.int32)
    for i, m in enumerate(masks):
      positions[i, :len(m)] = m
    probs, ids = jax.device_get(top(params, batch, positions))
    for i, m in enumerate(masks):
      out.append([
          [(int(ids[i, j, k]), float(probs[i, j, k])) for k in range(top_k)] for j in range(len(m))
      ])
  return out
