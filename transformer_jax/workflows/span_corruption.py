"""Span-corruption pretraining in the translation workflow (data.task='span_corruption').

T5's objective (Raffel et al. 2020) on plain text, from one of two sources:
  - data.text_path: the non-empty lines of a text file, tokenized at start (a SentencePiece
    model trained on them on the first run), packed into chunks whose corrupted inputs fill
    data.max_len and each chunk turned into (inputs with spans cut out, the spans) by
    data/span_corruption.py, afresh each epoch, all in memory; validation on held-out text;
  - data.prepared: a corpus tokenized once by `python -m experiments.prepare --unit=lines
    --tokenizer=sentencepiece` (local or any fsspec URL), read from its token shards on
    demand: chunk i of a split is its stream's tokens [i * L, (i + 1) * L), the chunks
    `pack_and_split` gives on the same lines, and the training batches are step-indexed
    (`span_corruption_stream.SpanCorruptionSteps`), so nothing is tokenized at start or resume and
    memory and start time do not grow with the corpus. The corpus's SentencePiece model is the
    workdir's spm.model: copied there on the first run, checked against the corpus after.
From data.text_path, a run may continue the pretraining of a Hugging Face T5 (init.hf_dir;
workflows/t5_init.py): its tokenizer and sentinels instead of a trained one, its params at step 0.
The model vocabulary is the tokenizer's plus tokenizer.num_sentinels. The tokenizers, task and
trainer are the translation model's (workflows/translation_model.py); the translation workflow,
which imports this module, runs the training and evaluation.
"""

import os

import jax
from absl import logging

from transformer_jax.cli.workdir import save_config
from transformer_jax.corpus.reader import PreparedCorpus
from transformer_jax.data import batching, span_corruption, span_corruption_stream, text
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.workflows.t5_init import write_init_tokenizer
from transformer_jax.parallel.sharding import data_parallel_size
from transformer_jax.workflows.translation_model import SPM_MODEL, build, load_tokenizers
from transformer_jax.workflows.translation_sections import Translation

# Held-out chunks are corrupted with this stream; training epochs use (seed, epoch).
_VALID_STREAM = 2**32 - 1
_ENCODE_CHUNK = 8192  # lines tokenized at a time (SentencePiece's threads; bounded memory)


def load_text(config) -> tuple[list[str], list[str]]:
  """Span corruption's (training lines, held-out lines): the non-empty lines of data.text_path,
  and those of data.valid_text_path or else the last data.valid_fraction of them (the end of
  the text, so no passage is in both)."""
  data = Translation.of(config).data
  lines = [
      line for line in text.read_lines(data.text_path, skip_invalid_utf8=data.skip_invalid_utf8)
      if line
  ]
  if not lines:
    raise DataError(f'{data.text_path} has no text to pretrain on (every line is empty)')
  valid_path = data.valid_text_path
  if valid_path:
    valid = [
        line for line in text.read_lines(valid_path, skip_invalid_utf8=data.skip_invalid_utf8)
        if line
    ]
    if not valid:
      raise DataError(f'{valid_path} (data.valid_text_path) has no text (every line is empty)')
    return lines, valid
  fraction = data.valid_fraction
  held_out = max(1, round(len(lines) * fraction))
  if held_out >= len(lines):
    raise DataError(f'{data.text_path} has {len(lines)} non-empty lines: too few to hold out '
                    f'data.valid_fraction={fraction} of them for validation; use a longer text '
                    'or set data.valid_text_path')
  return lines[:-held_out], lines[-held_out:]


def text_chunks(config, tokenizer, lines: list[str]) -> list:
  """The lines' token ids packed into chunks whose corrupted inputs fill data.max_len."""
  data = Translation.of(config).data
  base = getattr(tokenizer, 'base', tokenizer)  # plain text: '<extra_id_0>' in it is just text
  length = span_corruption.chunk_length(data.max_len, **data.noise)
  documents = (ids for start in range(0, len(lines), _ENCODE_CHUNK)
               for ids in base.encode_batch(lines[start:start + _ENCODE_CHUNK]))
  return span_corruption.pack_and_split(documents, length)


def validate_span_corruption(config):
  """The span-corruption settings, before any text is read."""
  run = Translation.of(config)
  data, count = run.data, run.tokenizer.num_sentinels
  if count < 1:
    raise ConfigError('data.task=span_corruption needs sentinel ids: set tokenizer.num_sentinels '
                      '(T5 has 100)')
  if not run.tokenizer.joint:
    raise ConfigError('data.task=span_corruption needs one vocabulary for inputs and targets: '
                      'set tokenizer.joint=True')
  if data.text_path and data.prepared:
    raise ConfigError(f'data.text_path={data.text_path} and data.prepared={data.prepared} are '
                      'both set: span corruption reads one of them; to read the prepared corpus, '
                      'pass --config.data.text_path=')
  if not data.text_path and not data.prepared:
    raise ConfigError('data.text_path is empty: pass --config.data.text_path=FILE, a UTF-8 text '
                      'file (.gz too) to pretrain on, or --config.data.prepared=DIR, a corpus '
                      'prepared with python -m experiments.prepare --unit=lines')
  if data.prepared and data.valid_text_path:
    raise ConfigError('data.valid_text_path is for data.text_path; a prepared corpus validates on '
                      "its own 'valid' split: set it to ''")
  if data.source_prefix:
    raise ConfigError('data.source_prefix is for text-to-text translation; span corruption makes '
                      "its own inputs: set it to ''")
  if run.eval.test_prefix:
    raise ConfigError('eval.test_prefix names a translation test split; span corruption has '
                      "none (it validates on held-out text): set it to ''")
  if data.text_path and not data.valid_text_path and not 0 < data.valid_fraction < 1:
    raise ConfigError(f'data.valid_fraction must be in (0, 1), got {data.valid_fraction}')
  length = span_corruption.chunk_length(data.max_len, **data.noise)
  _, spans = span_corruption.noise_counts(length, **data.noise)
  if spans + 1 > count:  # + 1: a final sentinel when a chunk ends with kept tokens
    raise ConfigError(f'chunks of {length} tokens (data.max_len={data.max_len}) have {spans} '
                      f'noise spans but tokenizer.num_sentinels={count}: raise num_sentinels to '
                      f'{spans + 1} or lower max_len')


def span_corruption_data(config, workdir: str, pretrained=None):
  """(task, trainer, train batches, valid batches, valid pairs) for span-corruption pretraining,
  from data.text_path or data.prepared (the module docstring); continuing a pretrained T5's
  (`pretrained`: t5_init.init_config's, for a config it rewrote), its tokenizer files are
  copied into the workdir once the text is read, and no tokenizer is trained.

  Training chunks are corrupted afresh each epoch; the held-out chunks once, with their own
  stream, so every evaluation scores the same pairs. The validation pairs as text (sentinels
  written '<extra_id_i>') are what the task decodes for its BLEU and the sample fill-ins in the
  log.
  """
  run = Translation.of(config)
  if run.data.prepared:  # translation.validate refuses it with init.*
    return _prepared_data(run, workdir)
  return _text_data(run, workdir, pretrained)


def _text_data(run, workdir: str, pretrained=None):
  """data.text_path: the tokenizer is trained on the training lines (or is `pretrained`'s); the
  model vocabulary adds the sentinels; every chunk is in memory."""
  data = run.data
  train_lines, valid_lines = load_text(run)
  if pretrained is not None:  # the text is read: nothing is written before a bad path fails
    write_init_tokenizer(workdir, pretrained)
  tokenizers = load_tokenizers(run, workdir, (train_lines, ()))
  tokenizer = tokenizers[1]
  train_chunks = text_chunks(run, tokenizer, train_lines)
  if data.max_train_examples:
    train_chunks = train_chunks[:data.max_train_examples]
  valid_chunks = text_chunks(run, tokenizer, valid_lines)
  corrupt = _corruption(run, tokenizer)
  valid_src, valid_tgt, valid_pairs = _valid_pairs(run, tokenizer, valid_chunks)
  task, trainer, _ = build(run, workdir, valid_pairs=valid_pairs, tokenizers=tokenizers)

  batch_kwargs = dict(batch_tokens=data.batch_tokens,
                      buckets=batching.bucket_lengths(data.max_len, data.buckets),
                      process_index=jax.process_index(), process_count=jax.process_count())
  # Targets are ~a quarter of the inputs' length: batches carry only the columns they need.
  targets_length = span_corruption.targets_length(data.max_len, **data.noise)
  # Rows rounded to the run's first layout (kept when resumed on another: training/elastic.py).
  train_data = span_corruption.SpanCorruptionBatcher(train_chunks, seed=run.seed,
                                                     multiple_of=trainer.batch_multiple,
                                                     targets_length=targets_length, **corrupt,
                                                     **batch_kwargs)
  trainer.check_batch_rows(train_data.global_rows)  # before the first write
  save_config(run.config, workdir)
  valid_data = _valid_batches(run, trainer, valid_src, valid_tgt, targets_length, **batch_kwargs)
  logging.info(
      'span corruption: %d training chunks of <= %d tokens (%d lines) in %d batches/epoch of '
      '%d-token inputs and %d-token targets, masks drawn anew each epoch; valid: %d chunks (%d '
      'lines); vocabulary %d + %d sentinels', len(train_chunks),
      span_corruption.chunk_length(data.max_len, **data.noise), len(train_lines),
      train_data.num_batches_per_epoch, data.max_len, targets_length, len(valid_chunks),
      len(valid_lines), tokenizer.vocab_size - run.tokenizer.num_sentinels,
      run.tokenizer.num_sentinels)  # an HF T5 tokenizer lists its sentinels itself
  return task, trainer, train_data, valid_data, valid_pairs


def prepared_corpus(config, workdir: str) -> PreparedCorpus:
  """data.prepared opened (its manifest read, nothing else), with its SentencePiece model as the
  workdir's spm.model: copied there on the first run, checked against the corpus's SHA-256 on
  every later one (another tokenizer's ids would mean other tokens: one error line)."""
  run = Translation.of(config)
  corpus = PreparedCorpus(run.data.prepared)
  if corpus.unit != 'lines':
    raise DataError(f'{corpus.root} was prepared with --unit={corpus.unit}; span corruption reads '
                    'lines: prepare it with --unit=lines --documents=lines')
  if corpus.tokenizer_kind != 'sentencepiece':
    raise DataError(f'{corpus.root} was tokenized with a {corpus.tokenizer_kind} tokenizer; T5 '
                    'reads SentencePiece ids: prepare it with --tokenizer=sentencepiece')
  path = os.path.join(workdir, SPM_MODEL)
  if not os.path.exists(path):
    os.makedirs(workdir, exist_ok=True)
    try:
      corpus.copy_tokenizer(path)
    except FileNotFoundError:  # another process of this job copied it first: it is checked below
      if not os.path.exists(path):
        raise
  corpus.check_tokenizer(path)
  return corpus


def _prepared_data(run, workdir: str):
  """data.prepared: step-indexed training batches of the 'train' split's chunks, read from the
  shards as they are needed; validation on the first data.valid_chunks chunks of the 'valid'
  split (0: all), read and corrupted once."""
  data = run.data
  corpus = prepared_corpus(run, workdir)
  tokenizers = load_tokenizers(run, workdir)  # the corpus's spm.model: never trained here
  tokenizer = tokenizers[1]
  length = span_corruption.chunk_length(data.max_len, **data.noise)
  valid_split = corpus.split('valid')
  valid_chunks = list(span_corruption_stream.StreamChunks(valid_split, length, data.valid_chunks))
  if not valid_chunks:
    raise DataError(f'{corpus.root} has no validation tokens: prepare it with --valid_fraction '
                    'or --valid_sources')
  corrupt = _corruption(run, tokenizer)
  valid_src, valid_tgt, valid_pairs = _valid_pairs(run, tokenizer, valid_chunks)
  task, trainer, _ = build(run, workdir, valid_pairs=valid_pairs, tokenizers=tokenizers)

  process = dict(process_index=jax.process_index(), process_count=jax.process_count())
  train_split = corpus.split('train')
  # Rows rounded to the run's first layout (kept when resumed on another: training/elastic.py).
  train_data = span_corruption_stream.SpanCorruptionSteps(
      train_split, max_len=data.max_len, batch_tokens=data.batch_tokens, seed=run.seed,
      max_chunks=data.max_train_examples, multiple_of=trainer.batch_multiple, **corrupt, **process)
  trainer.check_batch_rows(train_data.global_rows)  # before the first write
  save_config(run.config, workdir)
  # One shape, as training's: inputs of max_len columns.
  valid_data = _valid_batches(run, trainer, valid_src, valid_tgt, train_data.targets_length,
                              batch_tokens=data.batch_tokens, buckets=[data.max_len], **process)
  logging.info(
      'span corruption from %s: %s training tokens, %d chunks of <= %d tokens in %.1f '
      'batches/epoch of %d rows of %d-token inputs and %d-token targets, read from the shards '
      'as needed, masks drawn anew each epoch; valid: %d chunks of %s tokens; vocabulary %d + '
      '%d sentinels', corpus.root, f'{len(train_split):,}', train_data.num_examples, length,
      train_data.num_batches_per_epoch, train_data.batch_size, data.max_len,
      train_data.targets_length, len(valid_chunks), f'{len(valid_split):,}',
      tokenizer.base.vocab_size, tokenizer.num_sentinels)
  return task, trainer, train_data, valid_data, valid_pairs


def _corruption(run, tokenizer) -> dict:
  """The keyword arguments of data/span_corruption.py's corruption for this run."""
  return dict(vocab_size=tokenizer.vocab_size, num_sentinels=run.tokenizer.num_sentinels,
              **run.data.noise)


def _valid_pairs(run, tokenizer, valid_chunks):
  """(inputs, targets, pairs as text) of the held-out chunks, corrupted once with their own
  stream; the text of the first eval.bleu_sentences (0: all) of them."""
  valid_src, valid_tgt = span_corruption.corrupt_chunks(valid_chunks, (run.seed, _VALID_STREAM),
                                                        **_corruption(run, tokenizer))
  shown = run.eval.bleu_sentences or len(valid_src)
  valid_pairs = (tokenizer.decode_batch(valid_src[:shown]),
                 tokenizer.decode_batch(valid_tgt[:shown]))
  return valid_src, valid_tgt, valid_pairs


def _valid_batches(run, trainer, valid_src, valid_tgt, targets_length: int, **batch_kwargs):
  """One ordered pass over the held-out pairs, rows split over this mesh, targets cropped."""
  return span_corruption.CroppedTargets(
      batching.BucketedBatcher(valid_src, valid_tgt, seed=run.seed, shuffle=False,
                               multiple_of=data_parallel_size(trainer.mesh), **batch_kwargs),
      targets_length)
