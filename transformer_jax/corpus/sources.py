"""The text a corpus is prepared from, cut into units of work.

A source is a text file (plain or .gz), a glob or a folder of them, a JSON Lines file with a text
field (plain or .gz), a Parquet file (the format Hugging Face datasets ship; one unit per row
group), or a TFDS split (`tfds:NAME[/CONFIG]`, read through tensorflow-datasets). `plan` turns the
sources into `Unit`s: each is read, tokenized and written as one shard by one worker, so the
shards, and their order, depend on the sources and the unit size only, never on the number of
workers. A plain file larger than `unit_bytes` is cut into byte ranges at blank lines (at line
ends where a range holds none); a compressed file is one unit (it cannot be read from the
middle).

Documents in text files are separated by blank lines (`documents='blank_lines'`), or are one per
line ('lines'); 'whole' keeps a unit's text as it is (a character stream has no documents). Text
is read as UTF-8 with universal newlines; undecodable lines are skipped and counted, or refused
(`invalid_utf8='error'`), one line naming the file and byte.
"""

import dataclasses
import glob
import gzip
import hashlib
import json
import os
import re
from collections.abc import Iterator

import numpy as np

from transformer_jax.data import tfds_text
from transformer_jax.errors import ConfigError, DataError

DOCUMENT_MODES = ('blank_lines', 'lines', 'whole')
INVALID_UTF8 = ('skip', 'error')
TEXT_SUFFIXES = ('.txt', '.text', '.md', '')  # in folders: these, plain or .gz
JSONL_SUFFIXES = ('.jsonl', '.ndjson', '.jsonl.gz', '.ndjson.gz')
PARQUET_SUFFIXES = ('.parquet',)
_BOUNDARY_SEARCH = 1 << 20  # bytes read past a unit's nominal end to find a document boundary
READ_BLOCK = 4 << 20  # a unit is read in blocks of about this many bytes
_BLANK_LINES = re.compile(r'\n(?:[ \t\f\v]*\n)+')  # one or more blank lines


@dataclasses.dataclass(frozen=True)
class Unit:
  """One shard's worth of a source: a file's byte range, a whole compressed file, a Parquet row
  group or a slice of a TFDS split. `split` is 'train' or 'valid' where the whole unit goes to
  one split, '' where its documents are split by the seeded draw (`prepare`)."""
  index: int
  kind: str  # 'text', 'jsonl', 'parquet' or 'tfds'
  path: str  # the file; for 'tfds' the dataset name
  start: int = 0  # byte offset (text, jsonl), row group (parquet), first example (tfds)
  end: int = -1  # exclusive; -1: to the end
  split: str = ''
  tfds_split: str = ''
  data_dir: str = ''

  def describe(self) -> str:
    if self.kind == 'tfds':
      return f'tfds {self.path} {self.tfds_split}[{self.start}:{self.end}]'
    if self.kind == 'parquet':
      return f'{self.path} row group {self.start}'
    span = '' if (self.start, self.end) == (0, -1) else f' bytes [{self.start}, {self.end})'
    return f'{self.path}{span}'

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ReadOptions:
  """How a unit's text becomes documents."""
  documents: str = 'blank_lines'  # text files: one of DOCUMENT_MODES
  text_field: str = 'text'  # jsonl, parquet, tfds
  invalid_utf8: str = 'skip'  # one of INVALID_UTF8

  def check(self):
    if self.documents not in DOCUMENT_MODES:
      raise ConfigError(f'documents must be one of {DOCUMENT_MODES}, got {self.documents!r}')
    if self.invalid_utf8 not in INVALID_UTF8:
      raise ConfigError(f'invalid_utf8 must be one of {INVALID_UTF8}, got {self.invalid_utf8!r}')


# -- planning -----------------------------------------------------------------------------------


def kind_of(path: str) -> str:
  name = path.lower()
  if name.startswith('tfds:'):
    return 'tfds'
  if name.endswith(JSONL_SUFFIXES):
    return 'jsonl'
  if name.endswith(PARQUET_SUFFIXES):
    return 'parquet'
  return 'text'


def expand(source: str) -> list[str]:
  """The files a source names: itself, the matches of a glob, or a folder's files (recursively,
  hidden ones left out), sorted. A missing or empty source is a one-line error."""
  if source.startswith('tfds:'):
    return [source]
  if any(c in source for c in '*?['):
    found = sorted(p for p in glob.glob(source, recursive=True) if os.path.isfile(p))
    if not found:
      raise DataError(f'no file matches {source}')
    return found
  if os.path.isdir(source):
    found = []
    for root, dirs, names in os.walk(source):
      dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
      found += [os.path.join(root, n) for n in sorted(names) if not n.startswith('.')]
    if not found:
      raise DataError(f'folder {source} holds no files')
    return found
  if not os.path.isfile(source):
    raise DataError(f'source {source} does not exist (relative paths start from {os.getcwd()})')
  return [source]


def fingerprint(path: str) -> dict:
  """What identifies a source file's content without reading all of it: its size and the
  SHA-256 of its first and last MiB."""
  if path.startswith('tfds:'):
    return {'path': path}
  size = os.path.getsize(path)
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    digest.update(f.read(1 << 20))
    if size > 2 << 20:
      f.seek(size - (1 << 20))
      digest.update(f.read())
  return {'path': os.path.abspath(path), 'size': size, 'sha256_ends': digest.hexdigest()}


def _boundary(f, offset: int, size: int) -> int:
  """The first document boundary (after a blank line, else after a line end) at or after
  `offset` in the open binary file `f`; `size` if none follows."""
  if offset >= size:
    return size
  f.seek(max(0, offset - 1))
  data = f.read(_BOUNDARY_SEARCH)
  base = max(0, offset - 1)
  for pattern in (b'\n\n', b'\n\r\n'):
    at = data.find(pattern)
    if at >= 0:
      return base + at + len(pattern)
  at = data.find(b'\n')
  return size if at < 0 else base + at + 1


def byte_ranges(path: str, unit_bytes: int, start: int = 0, end: int | None = None) -> list:
  """[start, end) of `path` cut into ranges of about `unit_bytes`, each ending at a document
  boundary (`_boundary`: a blank line within 1 MiB of the nominal cut, else a line end), so no
  line, and no document shorter than 1 MiB, is split between two units."""
  size = os.path.getsize(path) if end is None else end
  ranges, position = [], start
  with open(path, 'rb') as f:
    while position < size:
      cut = min(size, _boundary(f, position + unit_bytes, size)) if unit_bytes else size
      ranges.append((position, cut))
      position = cut
  return ranges


def plan(sources: list[str], *, unit_bytes: int = 64 << 20, split: str = '',
         tfds_split: str = 'train', data_dir: str = '', max_examples: int = 0,
         tfds_unit_examples: int = 200_000) -> list[Unit]:
  """The units of `sources`, in order, numbered from 0. `split` tags every unit ('train',
  'valid'; '' leaves them to the seeded document draw)."""
  units: list[Unit] = []

  def add(**fields):
    units.append(Unit(index=len(units), split=split, **fields))

  for source in sources:
    for path in expand(source):
      kind = kind_of(path)
      if kind == 'tfds':
        name = path[len('tfds:'):]
        total = tfds_examples(name, tfds_split, data_dir)
        if total is None:  # no split metadata (TFDS's mock data): one unit reads it all
          add(kind=kind, path=name, end=max_examples or -1, tfds_split=tfds_split,
              data_dir=data_dir)
          continue
        if max_examples:
          total = min(total, max_examples)
        for start in range(0, total, tfds_unit_examples):
          add(kind=kind, path=name, start=start, end=min(total, start + tfds_unit_examples),
              tfds_split=tfds_split, data_dir=data_dir)
      elif kind == 'parquet':
        for group in range(_parquet_row_groups(path)):
          add(kind=kind, path=os.path.abspath(path), start=group, end=group + 1)
      elif path.endswith('.gz'):
        add(kind=kind, path=os.path.abspath(path))
      else:
        for start, end in byte_ranges(path, unit_bytes):
          add(kind=kind, path=os.path.abspath(path), start=start, end=end)
  return units


def tail_split(path: str, train_fraction: float) -> int:
  """The byte offset where the last (1 - train_fraction) of the characters of the plain text file
  `path` start, counted as `read_text` counts them (universal newlines): the contiguous
  train/validation split of a single-file corpus (nanoGPT's), computed in 16 MiB reads."""
  if not 0.0 < train_fraction < 1.0:
    raise DataError(f'train_fraction must be in (0, 1), got {train_fraction}')
  characters = _count_characters(path)
  return _offset_of_character(path, int(characters * train_fraction))


def _characters_in(block: bytes) -> int:
  """Characters of a UTF-8 block after universal newlines: code points (bytes that are not
  continuation bytes) less one for every CRLF."""
  continuation = 0
  if not block.isascii():
    continuation = int(np.count_nonzero((np.frombuffer(block, np.uint8) & 0xC0) == 0x80))
  return len(block) - continuation - block.count(b'\r\n')


def _read_blocks(path: str, block: int = 16 << 20) -> Iterator[tuple[int, bytes]]:
  """(offset, bytes) of `path` in blocks that end at a line end (or the file's end), so no
  character and no CRLF is split between two blocks."""
  with open(path, 'rb') as f:
    offset, carry = 0, b''
    while True:
      data = f.read(block)
      if not data:
        if carry:
          yield offset, carry
        return
      data = carry + data
      cut = data.rfind(b'\n') + 1
      if cut == 0:
        carry = data
        continue
      yield offset, data[:cut]
      offset += cut
      carry = data[cut:]


def _count_characters(path: str) -> int:
  return sum(_characters_in(data) for _, data in _read_blocks(path))


def _offset_of_character(path: str, target: int) -> int:
  """The byte offset of the `target`-th character (0-based, universal newlines)."""
  seen = 0
  for offset, data in _read_blocks(path):
    count = _characters_in(data)
    if seen + count <= target:
      seen += count
      continue
    text = data.decode('utf-8', errors='replace').replace('\r\n', '\n')
    prefix = text[:target - seen]
    # Back to bytes: the prefix's UTF-8 length plus one byte for every CRLF it had.
    raw = prefix.encode('utf-8')
    crlf = data[:len(raw) + prefix.count('\n')].count(b'\r\n')
    return offset + len(raw) + crlf
  return os.path.getsize(path)


# -- reading ------------------------------------------------------------------------------------


class Invalid:
  """Counts undecodable lines skipped in a unit (or refuses the first, `invalid_utf8='error'`)."""

  def __init__(self, policy: str):
    self.policy, self.lines = policy, 0

  def decode(self, data: bytes, where: str, offset: int) -> str:
    """`data` as text with universal newlines; undecodable lines dropped (counted) or refused."""
    try:
      text = data.decode('utf-8')
    except UnicodeDecodeError as e:
      if self.policy == 'error':
        at = offset + e.start
        raise DataError(f'{where}:{_line_of(where, at)}: invalid UTF-8 at byte {at} ({e.reason}: '
                        f'byte 0x{data[e.start]:02x}); fix or remove that line, or prepare with '
                        '--invalid_utf8=skip to drop such lines') from None
      kept = []
      for line in data.split(b'\n'):
        try:
          kept.append(line.decode('utf-8'))
        except UnicodeDecodeError:
          self.lines += 1
      text = '\n'.join(kept)
    return text.replace('\r\n', '\n').replace('\r', '\n')


def _line_of(path: str, offset: int) -> int | str:
  """The 1-based line of byte `offset` in the plain file `path` (for an error message)."""
  if path.endswith('.gz') or not os.path.isfile(path):
    return '?'
  lines = 1
  with open(path, 'rb') as f:
    while offset > 0:
      data = f.read(min(offset, 16 << 20))
      if not data:
        break
      lines += data.count(b'\n')
      offset -= len(data)
  return lines


def _unit_blocks(unit: Unit, blank_lines: bool = False,
                 block: int = READ_BLOCK) -> Iterator[tuple[int, bytes]]:
  """(offset, bytes) of a file unit in blocks of about `block` bytes, each ending where a
  document can end (`_last_boundary`: after a blank line where documents are separated by
  them, else after a line), so memory is a block, not the unit."""
  try:
    f = gzip.open(unit.path, 'rb') if unit.path.endswith('.gz') else open(unit.path, 'rb')
    with f:
      if not unit.path.endswith('.gz'):
        f.seek(unit.start)
      remaining = -1 if unit.end < 0 or unit.path.endswith('.gz') else unit.end - unit.start
      offset, carry = unit.start, b''
      while remaining:
        data = f.read(block if remaining < 0 else min(block, remaining))
        if not data:
          break
        remaining = remaining - len(data) if remaining > 0 else remaining
        data = carry + data
        cut = _last_boundary(data, blank_lines)
        if cut <= 0:
          carry = data
          continue
        yield offset, data[:cut]
        offset += cut
        carry = data[cut:]
      if carry:
        yield offset, carry
  except (OSError, EOFError) as e:
    raise DataError(f'{unit.path}: cannot read it ({e})') from None


def _last_boundary(data: bytes, blank_lines: bool) -> int:
  """The end of the last blank line in `data` (with `blank_lines`), else of its last line; 0 if
  there is none (the caller reads on)."""
  if blank_lines:
    return max(data.rfind(b'\n\n') + 2, data.rfind(b'\n\r\n') + 3, 0)
  return data.rfind(b'\n') + 1


def split_documents(text: str, mode: str) -> list[str]:
  """A text's documents: separated by blank lines, one per line, or the whole text."""
  if mode == 'whole':
    return [text] if text else []
  if mode == 'lines':
    return [line for line in text.split('\n') if line.strip()]
  # Line ends around a document are separators, not text: a document reads the same wherever
  # a unit or a block was cut (cuts fall at blank lines).
  return [doc.strip('\n') for doc in _BLANK_LINES.split(text) if doc.strip()]


def read_documents(unit: Unit, options: ReadOptions, invalid: Invalid) -> Iterator[str]:
  """The documents of `unit`, in order. Streams a TFDS slice or a Parquet row group; a file's
  byte range is read whole (a unit is about `unit_bytes`)."""
  if unit.kind == 'text':
    if options.documents == 'whole':  # one stream: the blocks' text joined as it is
      yield ''.join(invalid.decode(data, unit.path, offset) for offset, data in _unit_blocks(unit))
      return
    for offset, data in _unit_blocks(unit, blank_lines=options.documents == 'blank_lines'):
      yield from split_documents(invalid.decode(data, unit.path, offset), options.documents)
  elif unit.kind == 'jsonl':
    for offset, data in _unit_blocks(unit):
      for line in data.split(b'\n'):
        if not line.strip():
          continue
        try:
          record = json.loads(invalid.decode(line, unit.path, offset))
        except ValueError as e:
          raise DataError(f'{unit.path}: a line near byte {offset} is not JSON ({e})') from None
        value = record.get(options.text_field) if isinstance(record, dict) else None
        if not isinstance(value, str):
          raise DataError(f'{unit.path}: a record near byte {offset} has no text field '
                          f'{options.text_field!r}; set --text_field')
        if value.strip():
          yield value.replace('\r\n', '\n').replace('\r', '\n')
        offset += len(line) + 1
  elif unit.kind == 'parquet':
    yield from _parquet_documents(unit, options.text_field)
  else:
    yield from _tfds_documents(unit, options.text_field)


def _parquet_row_groups(path: str) -> int:
  try:
    import pyarrow.parquet as pq  # lazy: pyarrow is optional (the parquet extra)
  except ImportError:
    raise DataError(f'{path}: reading Parquet needs pyarrow: pip install -e ".[parquet]"') from None
  try:
    return pq.ParquetFile(path).num_row_groups
  except Exception as e:  # pyarrow's errors have no common base worth naming
    raise DataError(f'{path}: not a readable Parquet file ({str(e).splitlines()[0]})') from None


def _parquet_documents(unit: Unit, field: str) -> Iterator[str]:
  import pyarrow.parquet as pq  # lazy: optional (the parquet extra); _parquet_row_groups checked it
  table = pq.ParquetFile(unit.path).read_row_group(unit.start)
  if field not in table.column_names:
    raise DataError(f'{unit.path} has no column {field!r} (it has {table.column_names}); set '
                    '--text_field')
  for value in table.column(field).to_pylist():
    if isinstance(value, str) and value.strip():
      yield value.replace('\r\n', '\n').replace('\r', '\n')


def tfds_examples(name: str, split: str, data_dir: str) -> int | None:
  """Examples in a TFDS split, from the prepared dataset's metadata; None where it has none."""
  tfds = tfds_text.import_tfds()
  try:
    builder = tfds.builder(name, data_dir=data_dir or None)
  except Exception as e:  # tfds raises many kinds; the first line says which
    raise DataError(f'tfds {name}: {str(e).splitlines()[0]}') from None
  try:
    return int(builder.info.splits[split].num_examples)
  except (KeyError, ValueError, AttributeError):
    return None


def _tfds_documents(unit: Unit, field: str) -> Iterator[str]:
  tfds = tfds_text.import_tfds()
  split = unit.tfds_split if unit.end < 0 else f'{unit.tfds_split}[{unit.start}:{unit.end}]'
  for example in tfds.as_numpy(tfds_text.dataset(unit.path, split, unit.data_dir or None)):
    value = example[field]
    yield value.decode('utf-8') if isinstance(value, bytes) else str(value)  # empty ones too


def sample_text(units: list[Unit], options: ReadOptions, budget_bytes: int, *,
                valid_fraction: float = 0.0, seed: int = 0) -> Iterator[str]:
  """A bounded, deterministic sample of the training text to train a tokenizer on: the first
  training documents of every unit, about budget_bytes / (training units) of text from each,
  units in order. Validation units are left out, and so are the documents the seeded draw
  (`prepare_unit`'s, the same stream) holds out."""
  training = [u for u in units if u.split != 'valid']
  share = max(1, budget_bytes // max(1, len(training)))
  for unit in training:
    draw = np.random.default_rng((seed, unit.index))
    taken = 0
    for document in read_documents(unit, options, Invalid('skip')):
      if not unit.split and draw.random() < valid_fraction:
        continue
      yield document
      taken += len(document)
      if taken >= share:
        break
