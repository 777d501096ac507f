"""Tokenize a corpus once into token shards (`python -m experiments.prepare`; workflows call
`prepare` for a small file on a run's first start).

1. The sources are cut into units (sources.py) and the validation split is chosen: a seeded draw
   of `valid_fraction` of the documents (each unit draws from (seed, unit)), the tail of a single
   file (`train_fraction`, nanoGPT's contiguous split), separate `valid_sources`, or a TFDS
   split.
2. The tokenizer is taken (`tokenizer_from`) or trained on a bounded sample of every unit
   (`sources.sample_text`) and saved in the output folder.
3. Each unit becomes one shard per split (shards.py) on an engine: worker processes on this
   machine ('local'), or tasks on a Ray cluster ('ray'). A unit's shard depends on the unit alone,
   so the bytes are the same for any worker count and either engine.
4. The manifest, last, lists every shard; its presence says the corpus is complete.

A run killed at any point and started again with the same arguments finishes the same corpus:
shards whose record is there are kept, anything half-written is under a temporary name and is
removed. Memory is each worker's block of text in flight (4 MB) and its tokenizer, not the
corpus. Progress goes to the log every few seconds, with tokens/s and an ETA from the bytes read.
"""

import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import time

import numpy as np
from absl import logging

from transformer_jax.corpus import engines, shards, sources, storage, tokenizers
from transformer_jax.errors import ConfigError, DataError

PLAN = 'plan.json'
ENCODE_BATCH_BYTES = 1 << 20  # text encoded per encode_batch call


@dataclasses.dataclass(frozen=True)
class Options:
  """Everything a preparation depends on (the output folder aside)."""
  sources: tuple[str, ...]
  tokenizer: str  # tokenizers.KINDS
  unit: str = 'documents'  # shards.UNITS: 'documents' (language models), 'lines' (BERT, T5)
  vocab_size: int = 8192
  tokenizer_from: str = ''  # a workdir, or the tokenizer's file or folder
  tokenizer_sample_bytes: int = 64 << 20
  lowercase: bool = True  # wordpiece
  model_type: str = 'unigram'  # sentencepiece
  max_sentences: int = 2_000_000  # sentencepiece's training sample
  documents: str = 'blank_lines'  # text files: sources.DOCUMENT_MODES
  text_field: str = 'text'
  invalid_utf8: str = 'skip'
  valid_fraction: float = 0.0  # a seeded draw of documents
  valid_sources: tuple[str, ...] = ()
  train_fraction: float = 0.0  # the tail of a single plain file validates
  tfds_split: str = 'train'
  tfds_valid_split: str = ''
  tfds_data_dir: str = ''
  max_examples: int = 0  # tfds: examples of the training split, 0 = all
  max_valid_examples: int = 0  # tfds: of the validation split
  unit_bytes: int = 64 << 20
  seed: int = 0
  dtype: str = ''  # uint16 or uint32; '' picks by vocabulary size

  def check(self):
    if not self.sources:
      raise ConfigError('no sources: pass --sources=FILE_GLOB_OR_FOLDER[,...] or tfds:NAME')
    tokenizers.check_kind(self.tokenizer)
    if self.unit not in shards.UNITS:
      raise ConfigError(f'unit must be one of {shards.UNITS}, got {self.unit!r}')
    sources.ReadOptions(self.documents, self.text_field, self.invalid_utf8).check()
    if not 0.0 <= self.valid_fraction < 1.0:
      raise ConfigError(f'valid_fraction must be in [0, 1), got {self.valid_fraction}')
    if self.train_fraction and not 0.0 < self.train_fraction < 1.0:
      raise ConfigError(f'train_fraction must be in (0, 1), got {self.train_fraction}')
    ways = [
        bool(self.valid_fraction),
        bool(self.valid_sources),
        bool(self.train_fraction),
        bool(self.tfds_valid_split)
    ]
    if sum(ways) > 1:
      raise ConfigError('choose one validation split: valid_fraction, valid_sources, '
                        'train_fraction or tfds_valid_split')
    if self.train_fraction and (len(self.sources) != 1 or sources.kind_of(self.sources[0]) != 'text'
                                or self.sources[0].endswith('.gz')):
      raise ConfigError('train_fraction (the tail of the text validates) needs one plain text '
                        'file; use valid_fraction for other sources')
    if self.tokenizer == 'char' and (self.unit != 'documents' or self.documents != 'whole'):
      raise ConfigError("a 'char' tokenizer reads the text as one stream: unit='documents' "
                        "with documents='whole'")
    if self.tokenizer == 'hf' and not self.tokenizer_from:
      raise ConfigError("tokenizer='hf' takes a Hugging Face folder: pass --tokenizer_from=DIR")
    if self.unit_bytes < 1 << 16:
      raise ConfigError(f'unit_bytes must be at least 65536, got {self.unit_bytes}')
    if self.dtype not in ('', 'uint16', 'uint32'):
      raise ConfigError(f"dtype must be '', uint16 or uint32, got {self.dtype!r}")

  @property
  def read(self) -> sources.ReadOptions:
    return sources.ReadOptions(self.documents, self.text_field, self.invalid_utf8)


@dataclasses.dataclass(frozen=True)
class UnitTask:
  """What a worker needs to turn one unit into its shards (plain data: it crosses processes)."""
  unit: sources.Unit
  root: str
  tokenizer_kind: str
  tokenizer_path: str  # a local copy
  lowercase: bool
  unit_mode: str
  read: sources.ReadOptions
  valid_fraction: float
  seed: int
  dtype: str
  vocab_size: int
  eos: int | None
  plan_id: str


# -- planning -----------------------------------------------------------------------------------


def plan_units(options: Options) -> list[sources.Unit]:
  """Every unit, training and validation, numbered in order."""
  if options.train_fraction:
    path = sources.expand(options.sources[0])[0]
    cut = sources.tail_split(path, options.train_fraction)
    ranges = [('train', r) for r in sources.byte_ranges(path, options.unit_bytes, 0, cut)]
    ranges += [('valid', r) for r in sources.byte_ranges(path, options.unit_bytes, cut)]
    if not ranges:
      raise DataError(f'{path} is empty')
    return [
        sources.Unit(index=i, kind='text', path=os.path.abspath(path), start=start, end=end,
                     split=split) for i, (split, (start, end)) in enumerate(ranges)
    ]
  tfds_args = dict(tfds_split=options.tfds_split, data_dir=options.tfds_data_dir,
                   max_examples=options.max_examples)
  drawn = options.valid_sources or options.tfds_valid_split
  units = sources.plan(list(options.sources), unit_bytes=options.unit_bytes,
                       split='train' if drawn or not options.valid_fraction else '', **tfds_args)
  valid = []
  if options.valid_sources:
    valid = sources.plan(list(options.valid_sources), unit_bytes=options.unit_bytes, split='valid',
                         **tfds_args)
  elif options.tfds_valid_split:
    valid = sources.plan(
        list(options.sources), unit_bytes=options.unit_bytes, split='valid',
        **dict(tfds_args, tfds_split=options.tfds_valid_split,
               max_examples=options.max_valid_examples))
  return [dataclasses.replace(u, index=i) for i, u in enumerate(units + valid)]


def _unit_bytes(unit: sources.Unit) -> int:
  """The unit's input bytes, for the progress line (an estimate for compressed files)."""
  if unit.kind == 'tfds' or unit.kind == 'parquet':
    return max(1, unit.end - unit.start)
  if unit.end >= 0:
    return unit.end - unit.start
  return os.path.getsize(unit.path)


def plan_id(options: Options, units: list[sources.Unit], tokenizer_sha: str) -> str:
  """SHA-256 of what decides the shards' bytes: sources' fingerprints, units, tokenizer, reading
  and splitting options, dtype."""
  files = sorted({u.path for u in units if u.kind != 'tfds'})
  identity = {
      'sources': [sources.fingerprint(p) for p in files], 'units': [u.to_json() for u in units],
      'tokenizer_sha256': tokenizer_sha, 'options': {
          k: v
          for k, v in dataclasses.asdict(options).items()
          if k not in ('tokenizer_sample_bytes', 'vocab_size', 'tokenizer_from', 'max_sentences')
      }
  }
  return hashlib.sha256(json.dumps(identity, sort_keys=True).encode('utf-8')).hexdigest()


# -- one unit -----------------------------------------------------------------------------------

_LOADED: dict = {}  # this worker's tokenizer, loaded once per (path, kind)


def _tokenizer(task: UnitTask):
  key = (task.tokenizer_path, task.tokenizer_kind)
  if key not in _LOADED:
    _LOADED.clear()
    _LOADED[key] = tokenizers.load(task.tokenizer_kind, task.tokenizer_path, task.lowercase)
  return _LOADED[key]


def _char_ids(tokenizer, text: str) -> np.ndarray:
  """A character tokenizer's ids of `text`, through a table of code points (no Python loop)."""
  codes = np.frombuffer(text.encode('utf-32-le'), np.uint32)
  table = getattr(tokenizer, '_code_table', None)
  if table is None:
    points = np.asarray([ord(c) for c in tokenizer.chars], np.int64)
    table = np.full(int(points.max()) + 1, -1, np.int64)
    table[points] = np.arange(len(points))
    tokenizer._code_table = table
  ids = np.where(codes < len(table), table[np.minimum(codes, len(table) - 1)], -1)
  if (ids < 0).any():
    bad = text[int(np.flatnonzero(ids < 0)[0])]
    raise DataError(f'character {bad!r} is not in the {tokenizer.vocab_size}-character '
                    'vocabulary (trained on a sample); prepare with a larger '
                    '--tokenizer_sample_bytes')
  return ids


def _batches(documents, budget: int = ENCODE_BATCH_BYTES):
  """Lists of documents of about `budget` characters (encode_batch's input)."""
  batch, size = [], 0
  for document in documents:
    batch.append(document)
    size += len(document)
    if size >= budget:
      yield batch
      batch, size = [], 0
  if batch:
    yield batch


def prepare_unit(task: UnitTask) -> list[dict]:
  """Reads, tokenizes and writes one unit; returns the records of its shards (train, valid).

  Runs in a worker process (or a Ray task): everything it needs is in `task`.
  """
  unit = task.unit
  tokenizer = _tokenizer(task)
  splits = [unit.split] if unit.split else ['train', 'valid']
  with_lines = task.unit_mode == 'lines'
  writers = {
      split:
          shards.ShardWriter(task.root, split, unit.index, np.dtype(task.dtype), task.vocab_size,
                             with_lines) for split in splits
  }
  draw = np.random.default_rng((task.seed, unit.index))
  invalid = sources.Invalid(task.read.invalid_utf8)
  try:
    for batch in _batches(sources.read_documents(unit, task.read, invalid)):
      targets = [
          unit.split or ('valid' if draw.random() < task.valid_fraction else 'train') for _ in batch
      ]
      if with_lines:
        _add_lines(tokenizer, batch, targets, writers)
      elif task.tokenizer_kind == 'char':
        for document, split in zip(batch, targets):
          writers[split].add(_char_ids(tokenizer, document))
      else:
        encoded = tokenizer.encode_batch(batch)
        for split, writer in writers.items():
          chosen = [ids for ids, target in zip(encoded, targets) if target == split]
          if chosen:
            writer.add_many(*_documents_and_eos(chosen, task.eos))
    return [
        writers[split].finish(unit.to_json(), task.plan_id, invalid.lines if i == 0 else 0)
        for i, split in enumerate(splits)
    ]
  except BaseException:
    for writer in writers.values():
      writer.discard()
    raise


def _documents_and_eos(encoded: list, eos: int | None) -> tuple[np.ndarray, np.ndarray]:
  """(all ids, each followed by `eos` where there is one; each document's length) of a batch of
  id lists, built without a Python step per token."""
  lengths = np.fromiter(map(len, encoded), np.int64, count=len(encoded))
  flat = np.fromiter(itertools.chain.from_iterable(encoded), np.int64, count=int(lengths.sum()))
  if eos is None:
    return flat, lengths
  lengths += 1
  ids = np.empty(int(lengths.sum()), np.int64)
  ends = np.cumsum(lengths) - 1
  keep = np.ones(len(ids), bool)
  keep[ends] = False
  ids[ends] = eos
  ids[keep] = flat
  return ids, lengths


def _add_lines(tokenizer, documents: list[str], targets: list[str], writers: dict):
  """'lines' corpora: every non-empty line of each document encoded alone; lines that encode
  to nothing and documents left with no line are dropped (as BERT's reader does)."""
  lines = [[line.strip() for line in doc.split('\n') if line.strip()] for doc in documents]
  flat = [line for doc in lines for line in doc]
  encoded = tokenizer.encode_batch(flat) if flat else []
  per_split = {split: ([], [], []) for split in writers}  # lines' ids, their lengths, documents'
  k = 0
  for doc, split in zip(lines, targets):
    kept = [ids for ids in encoded[k:k + len(doc)] if len(ids)]
    k += len(doc)
    if kept:
      ids, line_lengths, document_lengths = per_split[split]
      ids += kept
      line_lengths += map(len, kept)
      document_lengths.append(sum(map(len, kept)))
  for split, (ids, line_lengths, document_lengths) in per_split.items():
    if ids:
      flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, count=sum(line_lengths))
      writers[split].add_many(flat, document_lengths, line_lengths)


# -- the whole corpus ---------------------------------------------------------------------------


def _prepare_tokenizer(options: Options, output: str, units: list) -> tuple[str, str]:
  """(local path of the tokenizer, its SHA-256): the output folder's copy when a killed run
  left one, else taken or trained and saved there."""
  name = tokenizers.FILE_NAMES[options.tokenizer]
  remote = storage.is_remote(output)
  local_root = tempfile.mkdtemp(prefix='transformer_jax-tokenizer-') if remote else output
  local = os.path.join(storage.local_path(local_root), name)
  target = storage.join(output, name)
  if remote and storage.exists(target):
    _download(target, local, options.tokenizer)
  if not os.path.exists(local):
    if options.tokenizer_from:
      tokenizers.copy(options.tokenizer_from, options.tokenizer, local)
      logging.info('prepare: tokenizer %s copied from %s', options.tokenizer,
                   options.tokenizer_from)
    else:
      start = time.time()
      sample = list(
          sources.sample_text(units, options.read, options.tokenizer_sample_bytes,
                              valid_fraction=options.valid_fraction, seed=options.seed))
      if not any(text.strip() for text in sample):
        raise DataError(f'{", ".join(options.sources)}: no text to train a tokenizer on (the '
                        'sources are empty)')
      tokenizers.train(options.tokenizer, sample, options.vocab_size, local,
                       lowercase=options.lowercase, model_type=options.model_type,
                       max_sentences=options.max_sentences)
      logging.info('prepare: trained the %s tokenizer on a sample of up to %s of text (%.0f s)',
                   options.tokenizer, _size(options.tokenizer_sample_bytes),
                   time.time() - start)
    if remote:
      _upload(local, target)
  else:
    logging.info('prepare: reusing the tokenizer in %s', target)
  return local, tokenizers.sha256(local)


def _download(remote: str, local: str, kind: str):
  if tokenizers.FILE_NAMES[kind].endswith(('.json', '.model', '.txt')):
    with open(local, 'wb') as f:
      f.write(storage.read_bytes(remote))
    return
  os.makedirs(local, exist_ok=True)
  for name in storage.listdir(remote):
    with open(os.path.join(local, name), 'wb') as f:
      f.write(storage.read_bytes(storage.join(remote, name)))


def _upload(local: str, remote: str):
  if os.path.isdir(local):
    for name in sorted(os.listdir(local)):
      storage.write_bytes_atomically(storage.join(remote, name),
                                     open(os.path.join(local, name), 'rb').read())
  else:
    storage.write_bytes_atomically(remote, open(local, 'rb').read())


def _size(n: float) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if n < 1024 or unit == 'TiB':
      return f'{n:,.0f} {unit}' if unit == 'B' else f'{n:,.1f} {unit}'
    n /= 1024.0


def _duration(seconds: float) -> str:
  seconds = int(max(0, seconds))
  hours, rest = divmod(seconds, 3600)
  return f'{hours}h{rest // 60:02d}m' if hours else f'{rest // 60}m{rest % 60:02d}s'


class _Progress:
  """A log line every `every` seconds: shards, bytes read, tokens, tokens/s, ETA."""

  def __init__(self, total_units: int, total_bytes: int, every: float = 5.0):
    self.total_units, self.total_bytes, self.every = total_units, total_bytes, every
    self.start = self.last = time.time()
    self.units = self.bytes = self.tokens = 0

  def add(self, unit_bytes: int, tokens: int, force: bool = False):
    self.units += 1
    self.bytes += unit_bytes
    self.tokens += tokens
    now = time.time()
    if force or now - self.last >= self.every or self.units == self.total_units:
      self.last = now
      elapsed = max(now - self.start, 1e-9)
      left = (self.total_bytes - self.bytes) * elapsed / max(self.bytes, 1)
      logging.info(
          'prepare: %d/%d shards | %s of %s read (%.0f%%) | %s tokens | %s tokens/s | '
          'elapsed %s | ETA %s', self.units, self.total_units, _size(self.bytes),
          _size(self.total_bytes), 100.0 * self.bytes / max(self.total_bytes, 1),
          f'{self.tokens:,}', f'{self.tokens / elapsed:,.0f}', _duration(elapsed), _duration(left))


def prepare(options: Options, output: str, *, engine: str = 'local', workers: int = 0,
            ray_address: str = '') -> dict:
  """Prepares the corpus of `options` into `output` (a local folder or an fsspec path); returns
  its manifest. Returns at once when `output` already holds this corpus."""
  options.check()
  engines.check(engine)
  units = plan_units(options)
  storage.makedirs(output)
  _remove_staging(output)
  local_tokenizer, tokenizer_sha = _prepare_tokenizer(options, output, units)
  tokenizer = tokenizers.load(options.tokenizer, local_tokenizer, options.lowercase)
  identity = plan_id(options, units, tokenizer_sha)
  if storage.exists(storage.join(output, shards.MANIFEST)):
    manifest = shards.read_manifest(output)
    if manifest.get('plan') != identity:
      raise DataError(f'{output} holds a corpus prepared from other sources, options or '
                      'tokenizer; prepare into a new folder (or delete it)')
    logging.info('prepare: %s is already prepared (%s training tokens)', output,
                 f'{manifest["splits"]["train"]["tokens"]:,}')
    return manifest
  dtype = shards.token_dtype(tokenizer.vocab_size, options.dtype)
  eos = tokenizers.eos_id(options.tokenizer, tokenizer) if options.unit == 'documents' else None
  storage.write_bytes_atomically(
      storage.join(output, PLAN),
      json.dumps({'plan': identity, 'units': [u.to_json() for u in units]},
                 sort_keys=True).encode('utf-8'))
  tasks = [
      UnitTask(unit=unit, root=output, tokenizer_kind=options.tokenizer,
               tokenizer_path=local_tokenizer, lowercase=options.lowercase, unit_mode=options.unit,
               read=options.read, valid_fraction=options.valid_fraction, seed=options.seed,
               dtype=dtype.str, vocab_size=tokenizer.vocab_size, eos=eos, plan_id=identity)
      for unit in units
  ]
  records = {}
  todo = []
  for task in tasks:
    found = _finished(task, dtype.itemsize)
    if found is None:
      todo.append(task)
    else:
      records[task.unit.index] = found
  if records:
    logging.info('prepare: %d of %d shards were finished by an earlier run; %d to go', len(records),
                 len(tasks), len(todo))
  progress = _Progress(len(todo), sum(_unit_bytes(t.unit) for t in todo))
  for task, result in engines.run(prepare_unit, todo, engine=engine, workers=workers,
                                  ray_address=ray_address):
    records[task.unit.index] = result
    progress.add(_unit_bytes(task.unit), sum(r['tokens'] for r in result))
  manifest = _manifest(options, units, records, identity, tokenizer, tokenizer_sha, dtype, eos)
  if not manifest['splits']['train']['tokens']:
    raise DataError(f'{", ".join(options.sources)}: no text to train on (every document is '
                    'empty or held out)')
  storage.write_bytes_atomically(storage.join(output, shards.MANIFEST),
                                 json.dumps(manifest, indent=1, sort_keys=True).encode('utf-8'))
  train = manifest['splits']['train']
  logging.info('prepare: %s ready: %s training tokens in %d shards, %s validation tokens', output,
               f'{train["tokens"]:,}', len(train['shards']),
               f'{manifest["splits"]["valid"]["tokens"]:,}')
  return manifest


def _finished(task: UnitTask, itemsize: int) -> list[dict] | None:
  """The records of a unit's shards when an earlier run finished them all for this plan."""
  unit = task.unit
  found = []
  for split in ([unit.split] if unit.split else ['train', 'valid']):
    record = shards.read_record(task.root, shards.shard_name(split, unit.index))
    if (record is None or record.get('plan') != task.plan_id or
        not shards.is_complete(task.root, record, itemsize)):
      return None
    found.append(record)
  return found


def _remove_staging(output: str):
  """Temporary files a killed run left behind (never visible under a shard's name)."""
  if storage.is_remote(output):
    return  # staged in the local temporary folder, not beside the shards
  for folder in [output] + [storage.join(output, s) for s in shards.SPLITS]:
    for name in storage.listdir(folder):
      if storage.is_staging_name(name):
        path = storage.join(folder, name)
        if os.path.isdir(path):
          shutil.rmtree(path, ignore_errors=True)
        else:
          storage.remove(path)


def _manifest(options: Options, units, records: dict, identity: str, tokenizer, tokenizer_sha,
              dtype, eos) -> dict:
  splits = {}
  invalid = 0
  for split in shards.SPLITS:
    entries = []
    for unit in units:
      for record in records[unit.index]:
        if record['name'].startswith(split + '/'):
          entries.append({k: v for k, v in record.items() if k not in ('unit', 'plan')})
    splits[split] = {
        'tokens': sum(e['tokens'] for e in entries),
        'documents': sum(e['documents'] for e in entries),
        'lines': sum(e['lines'] or 0 for e in entries) if options.unit == 'lines' else None,
        'shards': entries
    }
    invalid += sum(e['invalid_utf8_lines'] for e in entries)
  files = sorted({u.path for u in units if u.kind != 'tfds'})
  return {
      'format':
          shards.FORMAT, 'version':
              shards.VERSION, 'plan':
                  identity, 'tokenizer': {
                      'kind': options.tokenizer, 'file': tokenizers.FILE_NAMES[options.tokenizer],
                      'sha256': tokenizer_sha, 'vocab_size': int(tokenizer.vocab_size),
                      'lowercase': options.lowercase
                  }, 'dtype':
                      dtype.str, 'unit':
                          options.unit, 'eos_id':
                              eos, 'block_tokens':
                                  shards.BLOCK_TOKENS, 'documents':
                                      options.documents,
      'sources': [sources.fingerprint(p) for p in files] +
                 [{'path': f'tfds:{u.path}'} for u in units if u.kind == 'tfds'][:1],
      'split': {
          'valid_fraction': options.valid_fraction, 'train_fraction': options.train_fraction,
          'valid_sources': list(options.valid_sources), 'tfds_split': options.tfds_split,
          'tfds_valid_split': options.tfds_valid_split, 'seed': options.seed
      }, 'invalid_utf8_lines_skipped':
          invalid, 'splits':
              splits
  }
