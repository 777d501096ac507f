"""A translation experiment from a config: data, tokenizers, task, trainer, evaluation.

`experiments/translate.py` (the command line) and `benchmarks/translate_multi30k.py` are thin
callers of these functions.

The same encoder-decoder also runs T5's recipes (Raffel et al. 2020), chosen by config:
  - data.task='span_corruption': pretraining on plain text (data.text_path, or a corpus
    prepared into token shards, data.prepared), each chunk of it turned into (inputs with spans
    cut out, the spans) by data/span_corruption.py, validated on held-out text; the model
    vocabulary is the tokenizer's plus tokenizer.num_sentinels (workflows/span_corruption.py).
  - data.source_prefix (e.g. 'translate English to German: '): text-to-text fine-tuning, the
    prefix on every source sentence at training, evaluation and translation.
  - init.workdir / init.hf_dir: text-to-text fine-tuning of a pretrained T5, a span-corruption
    workdir of this workflow or a Hugging Face T5 directory: its tokenizer (never retrained,
    copied into the workdir), its model config and, at step 0, its params
    (workflows/t5_init.py; the tokenizer of an HF directory: data/t5_tokenizer.py). With
    data.task='span_corruption' (from data.text_path), init.hf_dir continues its pretraining.
All are off by default (task 'translation', no prefix, no sentinels, no init), and then nothing
changes.

The layers, top down: this module composes the data, the recipes and the model;
workflows/span_corruption.py and workflows/t5_init.py import what they need of the model from
workflows/translation_model.py (tokenizers, model config, task and trainer), which imports
neither. No function is passed down to be called back. Every function takes the ml_collections
config or its record (workflows/translation_sections.py): `train_and_evaluate` and the command
line read the config once and pass the record down.
"""

import os

import jax
import numpy as np
import sacrebleu
from absl import logging

from transformer_jax.cli import validation
from transformer_jax.cli.workdir import save_config
from transformer_jax.data import batching, packing, span_corruption, text
from transformer_jax.data.numbers import make_numbers_splits
from transformer_jax.data.tfds_text import load_tfds_parallel
from transformer_jax.errors import ConfigError
from transformer_jax.files import write_atomically
from transformer_jax.model_config import model_config_from_dict
from transformer_jax.parallel import sharding
from transformer_jax.sections import Mesh, Train, section_of
from transformer_jax.tasks.translation import TranslationTask
from transformer_jax.training import trained_model
from transformer_jax.training.checkpointing import average_params
from transformer_jax.workflows.span_corruption import span_corruption_data, validate_span_corruption
from transformer_jax.workflows.t5_init import (init_config, planned_config, resumed_config,
                                               start_state, write_init_tokenizer)
from transformer_jax.workflows.translation_model import (build, build_task, load_tokenizers,
                                                         model_config)
from transformer_jax.workflows.translation_sections import WORKDIR, Translation

# -- data ---------------------------------------------------------------------------------------


def load_split(config, prefix: str) -> tuple[list[str], list[str]]:
  """Source/target sentences of one split, from the configured source."""
  run = Translation.of(config)
  data = run.data
  if data.source == 'numbers':
    splits = make_numbers_splits(seed=run.seed)
    names = {data.train_prefix: 'train', data.valid_prefix: 'valid', 'test': 'test'}
    if prefix not in names:
      raise ConfigError(f'the numbers corpus has splits {sorted(names)}, not {prefix!r}')
    return splits[names[prefix]]
  if data.source == 'files':
    if not data.dir:
      raise ConfigError('data.dir is empty: pass --config.data.dir=DIR holding '
                        f'{prefix}.{data.src_lang}[.gz] and {prefix}.{data.tgt_lang}[.gz]')
    src_path, tgt_path = text.find_parallel_files(data.dir, prefix, data.src_lang, data.tgt_lang)
    return text.read_parallel(src_path, tgt_path, skip_invalid_utf8=data.skip_invalid_utf8)
  if data.source == 'tfds':
    return load_tfds_parallel(data.tfds_name, prefix, data.src_lang, data.tgt_lang,
                              data_dir=data.tfds_data_dir or None)
  raise ConfigError(f"data.source must be 'files', 'tfds' or 'numbers', got {data.source!r}")


# -- composition --------------------------------------------------------------------------------


def validate(config):
  """Every check of a translation run, before anything is read or written.

  The model is checked with the requested vocabulary size: the real one is only known once
  the tokenizer exists, and checking first means a bad width or head count fails in seconds,
  not after reading the data and training a tokenizer. Batches are sized by the batcher to a
  multiple of data x fsdp (x accumulation steps), so no batch size is checked here. Returns
  the config's record.
  """
  run = Translation.of(config)
  if run.data.span_corruption:
    validate_span_corruption(run)
  if run.init.kind == WORKDIR and run.data.span_corruption:
    raise ConfigError(f'init.workdir={run.init.workdir} fine-tunes text to text; span corruption '
                      'continues from a Hugging Face T5 (init.hf_dir): rerun that workdir to '
                      'resume it, or export it (python -m experiments.export) and start from the '
                      'export')
  if run.init.kind and run.data.span_corruption and run.data.prepared:
    raise ConfigError(f'init.{run.init.kind} brings its own tokenizer, but data.prepared='
                      f'{run.data.prepared} holds ids of another: continue pretraining from text '
                      '(--config.data.prepared= --config.data.text_path=FILE)')
  model_config_from_dict(run.model, vocab_size=run.tokenizer.model_vocab_size,
                         max_len=run.data.max_len)
  validation.check_training(run.config)
  return run


def abstract_task(config, num_devices: int | None = None):
  """(task, {key: jax.ShapeDtypeStruct}) of the largest training batch, from the config alone.

  Nothing is read and no tokenizer is trained: the model has tokenizer.vocab_size (+ the
  sentinels) entries per language (fine-tuning: the model and vocabulary of the init source's
  config file, init.workdir's saved config or init.hf_dir's config.json; no weights read).
  The batch is the longest bucket's (the most attention work and activation memory), with as
  many rows as `BucketedBatcher` gives it: batch_tokens // length rounded down to a multiple of
  data x fsdp (x accumulation steps) over `num_devices` (default: jax's). Span corruption's
  targets are as short as its batches make them; from a prepared corpus its inputs are
  data.max_len long (`SpanCorruptionSteps`). Packed (data.pack), it is the one shape of
  every batch, [rows, data.max_len rounded up to 8], with the segment ids and positions of
  both streams.
  """
  run = planned_config(config)
  vocab = run.tokenizer.model_vocab_size
  model_cfg = model_config(run, vocab, vocab)
  task = TranslationTask(model_cfg, label_smoothing=run.loss.label_smoothing)
  num_devices = jax.device_count() if num_devices is None else num_devices
  mesh = section_of(run.config, 'mesh', Mesh)
  data, fsdp, _ = sharding.mesh_shape(mesh.as_dict(), num_devices)
  multiple_of = data * fsdp * section_of(run.config, 'train', Train).accumulation_steps
  if run.data.packed:
    length = packing.row_length(run.data.max_len)
    rows = packing.rows_per_batch(run.data.batch_tokens, length, multiple_of)
    shape = jax.ShapeDtypeStruct((rows, length), np.int32)
    return task, {
        f'{stream}{suffix}': shape for stream in ('inputs', 'targets')
        for suffix in ('', '_segment_ids', '_positions')
    }
  length = batching.bucket_lengths(run.data.max_len, run.data.buckets)[-1]
  if run.data.span_corruption and run.data.prepared:  # step-indexed rows of max_len, no buckets
    length = run.data.max_len
  rows = max(multiple_of, (run.data.batch_tokens // length) // multiple_of * multiple_of)
  targets = length
  if run.data.span_corruption:  # batches carry only the targets' columns
    targets = min(length, span_corruption.targets_length(run.data.max_len, **run.data.noise))
  shape = lambda columns: jax.ShapeDtypeStruct((rows, columns), np.int32)
  return task, {'inputs': shape(length), 'targets': shape(targets)}


def make_batcher(config, trainer, src_tok, tgt_tok, pairs, *, train: bool):
  """Training (endless, shuffled) or evaluation (one ordered pass) batches of the pairs:
  length buckets, or with data.pack one shape of packed rows (validation too, so the eval
  step compiles once). Pairs longer than data.max_len are filtered or truncated either way."""
  run = Translation.of(config)
  data = run.data
  src_ids, tgt_ids, _ = batching.encode_pairs(src_tok, tgt_tok, pairs[0], pairs[1], data.max_len,
                                              data.overflow)
  # Training rows are rounded to the run's first layout, kept when it resumes on another
  # (training/elastic.py); evaluation's to this mesh.
  kwargs = dict(
      batch_tokens=data.batch_tokens, seed=run.seed, shuffle=train,
      multiple_of=trainer.batch_multiple if train else sharding.data_parallel_size(trainer.mesh),
      process_index=jax.process_index(), process_count=jax.process_count())
  if data.packed:
    batcher = packing.PackedBatcher(src_ids, tgt_ids, length=packing.row_length(data.max_len),
                                    **kwargs)
  else:
    batcher = batching.BucketedBatcher(src_ids, tgt_ids,
                                       buckets=batching.bucket_lengths(data.max_len,
                                                                       data.buckets), **kwargs)
  if train:
    trainer.check_batch_rows(batcher.global_rows)
  return batcher


def padding_fraction(config, batcher, epoch: int = 0) -> float:
  """1 - tokens / slots over the global batches of `epoch` of `make_batcher`'s `batcher`:
  the share of its [rows, length] id slots, source and target, top-up rows included, that
  hold padding (the plan's, so without building a batch)."""
  if isinstance(batcher, packing.PackedBatcher):
    return batcher.plan_stats(epoch)['padding_fraction']
  data = Translation.of(config).data
  lengths = batching.bucket_lengths(data.max_len, data.buckets)
  slots = sum(len(indices) * lengths[bucket] for bucket, indices in batcher.epoch_batches(epoch))
  # Every example is in exactly one batch of the epoch.
  return 1.0 - batcher.num_tokens / (2 * slots)


def evaluate_test_set(config, workdir, task, mesh, params) -> dict:
  run = Translation.of(config)
  prefix = run.eval.test_prefix
  sources, references = load_split(run, prefix)
  hypotheses = task.translate(params, sources, mesh)
  bleu = sacrebleu.corpus_bleu(hypotheses, [references])
  out_path = os.path.join(workdir, f'{prefix}.{run.data.tgt_lang}.hyp')
  write_atomically(out_path, '\n'.join(hypotheses) + '\n')
  logging.info('%s: %s (translations in %s)', prefix, bleu, out_path)
  return {'bleu': bleu.score, 'hypotheses_path': out_path}


# -- modes --------------------------------------------------------------------------------------


def train_and_evaluate(config, workdir: str) -> dict:
  run = validate(config)
  state = None  # the trainer's own: a checkpoint's, or fresh (from init.*: `start_state`)
  pretrained = None
  if run.data.span_corruption:
    if run.init.kind:  # continued pretraining: the pretrained tokenizer's sentinels checked
      run, pretrained = init_config(run, workdir)
      validate_span_corruption(run)
    task, trainer, train_data, valid_data, valid_pairs = span_corruption_data(
        run, workdir, pretrained)
  else:
    train_pairs = load_split(run, run.data.train_prefix)
    if run.data.max_train_examples:
      train_pairs = tuple(side[:run.data.max_train_examples] for side in train_pairs)
    valid_pairs = load_split(run, run.data.valid_prefix)
    if run.init.kind:  # everything read and checked before the first write
      run, pretrained = init_config(run, workdir)
      write_init_tokenizer(workdir, pretrained)
    task, trainer, (src_tok, tgt_tok) = build(run, workdir, train_pairs, valid_pairs)
    train_data = make_batcher(run, trainer, src_tok, tgt_tok, train_pairs, train=True)
    valid_data = make_batcher(run, trainer, src_tok, tgt_tok, valid_pairs, train=False)
    save_config(run.config, workdir)  # after the checks of the batches against the mesh
    logging.info('train: %d pairs in %d batches/epoch; valid: %d pairs', train_data.num_examples,
                 train_data.num_batches_per_epoch, valid_data.num_examples)
  if pretrained is not None:
    state = start_state(trainer, train_data, pretrained)
  results = trainer.fit(train_data, lambda: iter(valid_data), state=state)
  if results.get('interrupted'):
    trainer.close()
    return results
  params = trainer.state.params
  if run.eval.average_last > 1:
    params, results['averaged'] = choose_average(run, task, trainer, valid_pairs, results)
  if run.eval.test_prefix:
    results['test_bleu'] = evaluate_test_set(run, workdir, task, trainer.mesh, params)['bleu']
  trainer.close()
  return results


def choose_average(config, task, trainer, valid_pairs, results):
  """Params of the last checkpoint or the average of the last k, whichever has the better
  validation BLEU (the test set plays no part in the choice)."""
  run = Translation.of(config)
  steps = trainer.checkpointer.all_steps()[-run.eval.average_last:]
  if len(steps) < 2:
    return trainer.state.params, False
  averaged = average_params(trainer.checkpointer, trainer.abstract_state, steps)
  sources, references = valid_pairs
  bleu_last = results.get('eval_bleu')
  if bleu_last is None or run.eval.bleu_sentences:
    bleu_last = sacrebleu.corpus_bleu(task.translate(trainer.state.params, sources, trainer.mesh),
                                      [references]).score
  bleu_avg = sacrebleu.corpus_bleu(task.translate(averaged, sources, trainer.mesh),
                                   [references]).score
  logging.info('validation BLEU: last checkpoint %.2f, average of steps %s %.2f', bleu_last, steps,
               bleu_avg)
  results['valid_bleu_last'], results['valid_bleu_averaged'] = bleu_last, bleu_avg
  if bleu_avg > bleu_last:
    return averaged, True
  return trainer.state.params, False


def target_tokenizer(config, workdir: str):
  """The target tokenizer a trained workdir saved: the one vocabulary of an export."""
  return load_tokenizers(config, workdir)[1]


def restore_for_inference(config, workdir: str):
  """The workdir's model for inference (`trained_model.TrainedModel`: task, params of the latest
  checkpoint, mesh); the params alone are read, and nothing is written.

  A fine-tuned workdir (init.*) is read with the model and tokenizer sections its training
  saved, whatever config is given: nothing of the init source is needed.
  """
  run = validate(config)
  if run.init.kind:
    run = resumed_config(run, workdir)
  task, _ = build_task(run, workdir)
  return trained_model.restore(run.config, task, workdir)
