"""The on-disk format of a prepared corpus: token shards, their indexes, records and the manifest.

    DIR/manifest.json               format, tokenizer (kind, file, SHA-256), dtype, unit, sources,
                                    split, and per split its shards with their counts and checksums
    DIR/<tokenizer file or folder>  the tokenizer the ids come from (tokenizers.FILE_NAMES)
    DIR/train/000012.tokens         the ids of unit 12's training documents, one after another,
                                    little-endian uint16 (vocabularies up to 65,536) or uint32
    DIR/train/000012.docs           int64 end offset (in tokens, exclusive) of every document
    DIR/train/000012.lines          int64 end offset of every line ('lines' corpora: BERT, T5)
    DIR/train/000012.json           the shard's record, written last: its presence says the shard
                                    is complete (the ledger a rerun resumes from)
    DIR/valid/...                   the same for the validation documents

What a document is depends on the corpus's `unit`: 'documents' (language models) stores each
document's ids followed by EOS where the tokenizer has one; 'lines' (BERT, T5) stores each
non-empty line's ids alone, with the lines' ends, and a document is its lines. Every file is
written to a temporary name and renamed (or uploaded) into place, so a reader never sees half of
one. The record holds the SHA-256 of each file and a CRC-32 of every BLOCK_TOKENS tokens: the
reader checks a block the first time it reads from it, so a corrupted shard is named as soon as
training touches it, without reading the whole corpus at start.
"""

import hashlib
import json
import os
import zlib

import numpy as np

from transformer_jax.corpus import storage
from transformer_jax.errors import DataError

FORMAT = 'transformer_jax.corpus'
VERSION = 1
MANIFEST = 'manifest.json'
BLOCK_TOKENS = 1 << 20
SPLITS = ('train', 'valid')
UNITS = ('documents', 'lines')
OFFSET_DTYPE = np.dtype('<i8')


def token_dtype(vocab_size: int, requested: str = '') -> np.dtype:
  """uint16 where every id fits, else uint32; a requested dtype too small is an error."""
  if requested:
    dtype = np.dtype(requested).newbyteorder('<')
    if dtype.kind != 'u' or vocab_size - 1 > np.iinfo(dtype).max:
      raise DataError(f'a vocabulary of {vocab_size:,} ids does not fit {requested} (ids up to '
                      f'{np.iinfo(dtype).max:,} if unsigned); use uint32')
    return dtype
  return np.dtype('<u2') if vocab_size <= 1 << 16 else np.dtype('<u4')


def shard_name(split: str, index: int) -> str:
  return f'{split}/{index:06d}'


class _File:
  """A local staging file written in appends, with its SHA-256 and per-block CRC-32s."""

  def __init__(self, final_path: str, block_bytes: int = 0):
    self.final_path = final_path
    self.staging = storage.staging_file(final_path)
    self.file = open(self.staging, 'wb')
    self.sha = hashlib.sha256()
    self.block_bytes, self.block_crcs, self._crc, self._in_block = block_bytes, [], 0, 0
    self.bytes = 0

  def write(self, data: bytes):
    self.file.write(data)
    self.sha.update(data)
    self.bytes += len(data)
    if not self.block_bytes:
      return
    view = memoryview(data)
    while len(view):
      take = min(len(view), self.block_bytes - self._in_block)
      self._crc = zlib.crc32(view[:take], self._crc)
      self._in_block += take
      view = view[take:]
      if self._in_block == self.block_bytes:
        self.block_crcs.append(self._crc)
        self._crc, self._in_block = 0, 0

  def close(self):
    if self.block_bytes and self._in_block:
      self.block_crcs.append(self._crc)
      self._crc, self._in_block = 0, 0
    self.file.flush()
    os.fsync(self.file.fileno())
    self.file.close()

  def publish(self):
    storage.write_file_atomically(self.final_path, self.staging)

  def discard(self):
    if not self.file.closed:
      self.file.close()
    if os.path.exists(self.staging):
      os.remove(self.staging)


class ShardWriter:
  """Writes one shard: `add` each document's ids (and its lines' lengths), then `finish`.

  Memory is the document being added, not the shard: ids go to the staging file as they come.
  Nothing appears under the shard's name until `finish` has written every file whole; the
  record, last, marks it complete. `discard` removes the staging files (a failed unit).
  """

  def __init__(self, root: str, split: str, index: int, dtype: np.dtype, vocab_size: int,
               with_lines: bool):
    self.name = shard_name(split, index)
    self.root, self.dtype, self.vocab_size = root, np.dtype(dtype), vocab_size
    base = storage.join(root, self.name)
    self.files = {
        'tokens': _File(base + '.tokens', BLOCK_TOKENS * self.dtype.itemsize),
        'docs': _File(base + '.docs')
    }
    if with_lines:
      self.files['lines'] = _File(base + '.lines')
    self.tokens = self.documents = self.lines = 0

  def add(self, ids, line_lengths=None):
    """One document: `ids` (a list or array of ints); `line_lengths` the token counts of its
    lines, in order, summing to len(ids) ('lines' corpora)."""
    ids = np.asarray(ids, np.int64)
    self.add_many(ids, np.asarray([ids.size]), line_lengths)

  def add_many(self, ids: np.ndarray, document_lengths: np.ndarray, line_lengths=None):
    """Documents one after another: `ids` all their ids, `document_lengths` each one's count
    (and, 'lines' corpora, `line_lengths` every line's). A batch at a time: the per-document cost
    of a write and a check is what made one document per call slower than nanoGPT's pass."""
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
      raise DataError(f'shard {self.name}: a token id outside the vocabulary of '
                      f'{self.vocab_size:,} (the tokenizer and the manifest disagree)')
    self.files['tokens'].write(ids.astype(self.dtype).tobytes())
    if 'lines' in self.files:
      ends = self.tokens + np.cumsum(np.asarray(line_lengths, np.int64))
      self.files['lines'].write(ends.astype(OFFSET_DTYPE).tobytes())
      self.lines += len(ends)
    ends = self.tokens + np.cumsum(np.asarray(document_lengths, np.int64))
    self.files['docs'].write(ends.astype(OFFSET_DTYPE).tobytes())
    self.tokens += ids.size
    self.documents += len(ends)

  def finish(self, unit: dict, plan_id: str, invalid_lines: int = 0) -> dict:
    """Publishes the files and the record; returns the record."""
    for f in self.files.values():
      f.close()
    for f in self.files.values():
      f.publish()
    record = {
        'name': self.name, 'tokens': self.tokens, 'documents': self.documents,
        'lines': self.lines if 'lines' in self.files else None,
        'sha256': {key: f.sha.hexdigest() for key, f in self.files.items()},
        'block_crc32': self.files['tokens'].block_crcs, 'unit': unit, 'plan': plan_id,
        'invalid_utf8_lines': invalid_lines
    }
    storage.write_bytes_atomically(storage.join(self.root, self.name + '.json'),
                                   json.dumps(record, sort_keys=True).encode('utf-8'))
    return record

  def discard(self):
    for f in self.files.values():
      f.discard()


def read_record(root: str, name: str) -> dict | None:
  """The record of shard `name`, or None where it is missing or unreadable (not finished)."""
  path = storage.join(root, name + '.json')
  if storage.size(path) < 0:
    return None
  try:
    record = json.loads(storage.read_bytes(path))
  except (DataError, ValueError):
    return None
  return record if isinstance(record, dict) else None


def is_complete(root: str, record: dict, itemsize: int) -> bool:
  """Whether every file of a recorded shard is there at its recorded size."""
  base = storage.join(root, record['name'])
  expected = {'tokens': record['tokens'] * itemsize, 'docs': record['documents'] * 8}
  if record.get('lines') is not None:
    expected['lines'] = record['lines'] * 8
  return all(storage.size(f'{base}.{key}') == value for key, value in expected.items())


def read_manifest(root: str) -> dict:
  """The manifest of the prepared corpus `root`; one error line if it is missing or foreign."""
  path = storage.join(root, MANIFEST)
  if storage.size(path) < 0:
    raise DataError(f'{root} is not a prepared corpus (no {MANIFEST}); prepare it with '
                    'python -m experiments.prepare')
  try:
    manifest = json.loads(storage.read_bytes(path))
  except ValueError as e:
    raise DataError(f'{path} is not valid JSON ({e}); prepare the corpus again') from None
  if not isinstance(manifest, dict) or manifest.get('format') != FORMAT:
    raise DataError(f'{path} is not a {FORMAT} manifest')
  if manifest.get('version') != VERSION:
    raise DataError(f'{path} has format version {manifest.get("version")}; this code reads '
                    f'version {VERSION}: prepare the corpus again')
  return manifest
