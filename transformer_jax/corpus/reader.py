"""Reading a prepared corpus: the token stream of a split, windows of it, its documents and lines.

`PreparedCorpus(path)` reads the manifest (a few KB) and nothing else: opening a corpus costs the
same for 10 MB and for 100 GB. `corpus.split('train')` is a `TokenSplit`, the split's shards seen
as one stream of `len(split)` tokens:

    split.windows(starts, length)   int32[len(starts), length]: tokens[s : s + length] per start
    split.tokens(start, stop)       one range
    split.document_bounds()         int64 end offsets of every document (the shards' indexes)
    split.line_bounds()             the same for lines ('lines' corpora)

Reads touch only the bytes asked for: each call maps the shards it needs with `np.memmap` and
drops the maps when it returns, so the pages it touched are not held by the process (a map kept
open makes RSS grow with every page ever read: nanoGPT #287), and with several processes each
reads only the rows it feeds. On a remote store (gs://, any fsspec path) the same calls read
byte ranges. The first read from a block of BLOCK_TOKENS tokens checks that block's CRC-32
against the shard's record: a corrupted or truncated shard is an error naming it.
"""

import os
import shutil
import tempfile
import zlib

import numpy as np

from transformer_jax.corpus import shards, storage, tokenizers
from transformer_jax.errors import DataError


class TokenSplit:
  """One split of a prepared corpus as one token stream (module docstring)."""

  def __init__(self, root: str, name: str, entry: dict, dtype: np.dtype, block_tokens: int):
    self.root, self.name, self.dtype, self.block_tokens = root, name, np.dtype(dtype), block_tokens
    self.shards = [s for s in entry['shards'] if s['tokens']]
    self.shard_names = [s['name'] for s in self.shards]
    counts = np.asarray([s['tokens'] for s in self.shards], np.int64)
    self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    self.num_tokens = int(self.starts[-1])
    self.num_documents = int(sum(s['documents'] for s in self.shards))
    self._checked = [np.zeros(len(s['block_crc32']), bool) for s in self.shards]
    self._bounds: dict[str, np.ndarray] = {}
    for i, shard in enumerate(self.shards):  # a truncated file fails here, before training
      expected = shard['tokens'] * self.dtype.itemsize
      found = storage.size(self._path(i, 'tokens'))
      if found != expected:
        raise DataError(f'shard {self._path(i, "tokens")} has {found} bytes, its record says '
                        f'{expected}: the corpus is damaged; prepare it again')

  def __len__(self) -> int:
    return self.num_tokens

  def _path(self, shard: int, kind: str) -> str:
    return storage.join(self.root, f'{self.shard_names[shard]}.{kind}')

  def _read(self, shard: int, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of one shard (shard-local offsets), blocks checked on first read."""
    self._check_blocks(shard, start, stop)
    path = self._path(shard, 'tokens')
    item = self.dtype.itemsize
    if storage.is_remote(path):
      return np.frombuffer(storage.read_range(path, start * item, stop * item), self.dtype)
    mapped = np.memmap(storage.local_path(path), self.dtype, 'r')
    out = np.array(mapped[start:stop])
    del mapped
    return out

  def _check_blocks(self, shard: int, start: int, stop: int):
    checked = self._checked[shard]
    first, last = start // self.block_tokens, max(start, stop - 1) // self.block_tokens
    for block in range(first, min(last, len(checked) - 1) + 1):
      if checked[block]:
        continue
      lo = block * self.block_tokens
      hi = min(lo + self.block_tokens, self.shards[shard]['tokens'])
      path = self._path(shard, 'tokens')
      item = self.dtype.itemsize
      data = storage.read_range(path, lo * item, hi * item)
      if zlib.crc32(data) != self.shards[shard]['block_crc32'][block]:
        raise DataError(f'shard {path} is corrupted: tokens {lo:,}-{hi:,} fail their checksum; '
                        'prepare the corpus again')
      checked[block] = True

  def tokens(self, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of the split's stream, across shard boundaries."""
    if not 0 <= start <= stop <= self.num_tokens:
      raise IndexError(f'tokens [{start}, {stop}) outside a split of {self.num_tokens}')
    pieces = []
    shard = int(np.searchsorted(self.starts, start, side='right')) - 1
    while start < stop:
      end = min(stop, int(self.starts[shard + 1]))
      pieces.append(
          self._read(shard, start - int(self.starts[shard]), end - int(self.starts[shard])))
      start, shard = end, shard + 1
    return np.concatenate(pieces) if len(pieces) != 1 else pieces[0]

  def windows(self, starts, length: int) -> np.ndarray:
    """int32[len(starts), length]: the stream's tokens from each start."""
    starts = np.asarray(starts, np.int64).reshape(-1)
    out = np.empty((len(starts), length), np.int32)
    for row, start in enumerate(starts):
      out[row] = self.tokens(int(start), int(start) + length)
    return out

  def _offsets(self, kind: str) -> np.ndarray:
    """The stream's end offsets of every document or line (global), read once and kept: 8
    bytes each (BERT's sampling needs them all)."""
    if kind not in self._bounds:
      parts = []
      for i in range(len(self.shards)):
        raw = storage.read_bytes(self._path(i, kind))
        parts.append(np.frombuffer(raw, shards.OFFSET_DTYPE).astype(np.int64) + self.starts[i])
      self._bounds[kind] = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return self._bounds[kind]

  def document_bounds(self) -> np.ndarray:
    return self._offsets('docs')

  def documents(self) -> 'Documents':
    """The split's documents of lines ('lines' corpora: BERT)."""
    return Documents(self)

  def line_bounds(self) -> np.ndarray:
    if self.shards and self.shards[0].get('lines') is None:
      raise DataError(f'{self.root} was prepared with unit=documents: it has no line index '
                      '(BERT and T5 need unit=lines)')
    return self._offsets('lines')


class Documents:
  """The documents of a 'lines' split, as BERT's batcher reads a list of documents of lines:
  `len(documents)`, `documents[d]` (a `Document`: `len(doc)` lines, `doc[i]` an int32 array of
  line i's ids, read from the shards when asked), and the line index: `line_starts[d]` is the
  global index of document d's first line (`num_lines` in all), so a line can be drawn by its
  global index without a table of every (document, line)."""

  def __init__(self, split: TokenSplit):
    self.split = split
    self.line_ends = split.line_bounds()
    self.num_lines = len(self.line_ends)
    # Each document's token end is some line's end: its line count follows from a search.
    doc_ends = split.document_bounds()
    last_lines = np.searchsorted(self.line_ends, doc_ends, side='left')  # the doc's last line
    self.line_starts = np.concatenate([[0], last_lines + 1])[:len(doc_ends)].astype(np.int64)
    self.line_counts = (last_lines + 1 - self.line_starts).astype(np.int64)

  def __len__(self) -> int:
    return len(self.line_starts)

  def line(self, k: int) -> np.ndarray:
    """Global line k's ids, int32."""
    start = int(self.line_ends[k - 1]) if k else 0
    return self.split.tokens(start, int(self.line_ends[k])).astype(np.int32)

  def __getitem__(self, d: int) -> 'Document':
    return Document(self, int(self.line_starts[d]), int(self.line_counts[d]))


class Document:
  """Lines [first, first + count) of a `Documents` view."""

  def __init__(self, documents: Documents, first: int, count: int):
    self.documents, self.first, self.count = documents, first, count

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, i: int) -> np.ndarray:
    if not 0 <= i < self.count:
      raise IndexError(i)
    return self.documents.line(self.first + i)

  def __iter__(self):
    return (self[i] for i in range(self.count))


class PreparedCorpus:
  """A prepared corpus folder (local or remote): its manifest, tokenizer and splits."""

  def __init__(self, root: str):
    self.root = root
    self.manifest = shards.read_manifest(root)
    self.dtype = np.dtype(self.manifest['dtype'])
    self.unit = self.manifest['unit']
    self.eos_id = self.manifest['eos_id']
    self._splits: dict[str, TokenSplit] = {}

  @property
  def tokenizer_kind(self) -> str:
    return self.manifest['tokenizer']['kind']

  @property
  def tokenizer_path(self) -> str:
    return storage.join(self.root, self.manifest['tokenizer']['file'])

  @property
  def vocab_size(self) -> int:
    return int(self.manifest['tokenizer']['vocab_size'])

  def split(self, name: str) -> TokenSplit:
    if name not in self._splits:
      entry = self.manifest['splits'].get(name)
      if entry is None:
        raise DataError(f'{self.root} has no {name!r} split')
      self._splits[name] = TokenSplit(self.root, name, entry, self.dtype,
                                      int(self.manifest['block_tokens']))
    return self._splits[name]

  def copy_tokenizer(self, path: str):
    """Writes the corpus's tokenizer to the local `path` (a workdir's), whole or not at all;
    where another process of the job wrote it first, checks that one."""
    source = self.tokenizer_path
    folder = os.path.dirname(os.path.abspath(path))
    staging = tempfile.mkdtemp(dir=folder, prefix=f'.{os.path.basename(path)}.tmp-')
    try:
      if self.manifest['tokenizer']['file'].endswith(('.json', '.model', '.txt')):
        target = os.path.join(staging, 'file')
        with open(target, 'wb') as f:
          f.write(storage.read_bytes(source))
      else:
        target = os.path.join(staging, 'folder')
        os.makedirs(target)
        for name in storage.listdir(source):
          with open(os.path.join(target, name), 'wb') as f:
            f.write(storage.read_bytes(storage.join(source, name)))
      try:
        os.replace(target, path)
      except OSError:  # a folder another process put there first
        if not os.path.exists(path):
          raise
    finally:
      shutil.rmtree(staging, ignore_errors=True)
    self.check_tokenizer(path)

  def check_tokenizer(self, path: str, kind: str | None = None):
    """DataError unless the tokenizer at `path` (a workdir's) is the one the ids came from."""
    kind = kind or self.tokenizer_kind
    if kind != self.tokenizer_kind:
      raise DataError(f'{self.root} was tokenized with a {self.tokenizer_kind} tokenizer, not '
                      f'{kind}')
    found = tokenizers.sha256(path)
    if found != self.manifest['tokenizer']['sha256']:
      raise DataError(f'the tokenizer {path} is not the one {self.root} was prepared with '
                      '(SHA-256 differs): its ids would mean other tokens; use the corpus\'s '
                      'tokenizer or prepare the corpus again')
