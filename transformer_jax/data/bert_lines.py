"""Pretraining documents as lines by global index, and the rows planned from their lengths.

BERT-family pretraining (data/bert_pretrain.py) reads its documents through a `LineIndex`: every
line has a global index, document after document, and only its token end (an int64) is kept,
whether the documents are id arrays in memory or a prepared corpus's split read from the token
shards. RoBERTa's FULL-SENTENCES rows and the per-document chunks of packed pretraining are
planned from the line lengths alone (`plan_rows`, as line ranges) and made into ids when a row
is fed (`row_tokens`); `pack_lengths_flat` packs the chunks into rows with arrays.
"""

import array

import numpy as np

from transformer_jax.errors import DataError

# Lines (or chunks) whose values go to Python lists at a time in the planning passes below, so
# that those lists stay a few MB whatever the corpus.
_PASS_ITEMS = 1 << 20


class LineIndex:
  """The lines of pretraining documents by global index, document after document (module
  docstring): what PretrainBatches reads, whichever input the documents are.

  `documents`: a list of documents, each a list of id arrays; or a prepared corpus's split as
  `corpus.reader.Documents` (taken by its attributes, as data/ never imports corpus/:
  `line_starts`, `line_counts`, `line_ends`, `split.tokens(start, stop)`), whose ids are read
  from the shards a range of lines at a time. Kept: each line's token end (int64), each
  document's first line and line count.
  """

  def __init__(self, documents):
    if hasattr(documents, 'line_ends'):
      self._split, self._lines = documents.split, None
      self.ends = np.asarray(documents.line_ends, np.int64)
      self.starts = np.asarray(documents.line_starts, np.int64)
      self.counts = np.asarray(documents.line_counts, np.int64)
    else:
      self._split, self._lines = None, [line for doc in documents for line in doc]
      self.counts = np.fromiter(map(len, documents), np.int64, len(documents))
      self.starts = np.cumsum(self.counts) - self.counts
      self.ends = np.cumsum(np.fromiter(map(len, self._lines), np.int64, len(self._lines)))
    self.num_lines, self.num_documents = len(self.ends), len(self.counts)

  def offset(self, k: int) -> int:
    """Token offset where line k starts (where the line before ends)."""
    return int(self.ends[k - 1]) if k else 0

  def lengths(self, start: int, stop: int) -> np.ndarray:
    """int64 token counts of lines [start, stop)."""
    return np.diff(self.ends[start:stop], prepend=self.offset(start))

  def tokens(self, start: int, stop: int) -> np.ndarray:
    """int32 ids of lines [start, stop), one after another (one read from the shards)."""
    if self._lines is None:
      return self._split.tokens(self.offset(start), self.offset(stop)).astype(np.int32)
    if stop <= start:
      return np.zeros(0, np.int32)
    return np.concatenate(self._lines[start:stop]).astype(np.int32)

  def document(self, d: int) -> tuple[int, int]:
    """(global index of document d's first line, its line count)."""
    return int(self.starts[d]), int(self.counts[d])

  def locate(self, k: int) -> tuple[int, int]:
    """(document, line in it) of global line k. The last document starting at or before k: an
    empty document starts where the next one does, so it is never the one found."""
    d = int(np.searchsorted(self.starts, k, side='right')) - 1
    return d, k - int(self.starts[d])

  def first_lines(self, start: int, stop: int) -> np.ndarray:
    """bool per line of [start, stop): whether it is the first line of its document."""
    flags = np.zeros(max(stop - start, 0), bool)
    lo, hi = np.searchsorted(self.starts, [start, stop])
    flags[self.starts[lo:hi] - start] = True
    return flags


def line_index(documents) -> LineIndex:
  """`documents` as a LineIndex (itself if it is one)."""
  return documents if isinstance(documents, LineIndex) else LineIndex(documents)


# -- rows planned from line lengths -------------------------------------------------------------


def plan_rows(lines: LineIndex, budget: int, per_document: bool) -> tuple[np.ndarray, int]:
  """(bounds, truncated lines): the rows of `pack_full_sentences` (per_document False) or the
  chunks of `document_chunks` (True) as line ranges, row r = lines [bounds[r], bounds[r + 1]),
  planned from the line lengths alone (no token is read); `row_tokens` makes a row's ids.

  Whole lines go to the current row while they fit `budget` tokens, a line longer than that
  counting as `budget` (it is cut); a line that does not fit starts the next row. Across
  documents a separator goes before a document's first line unless the row is still empty,
  and counts against the budget; per document a document's first line always starts a row.

  One Python loop over every line, at start: 0.1-0.2 s per million lines (measured on 2 shared
  cores of an AMD EPYC: 2M lines of 1-120 tokens, 126-token rows), plus 8 bytes per line while
  it runs: 10-20 s for a corpus of 100M lines.
  """
  bounds = array.array('q', [0] if lines.num_lines else [])
  length = truncated = 0
  for lo in range(0, lines.num_lines, _PASS_ITEMS):
    hi = min(lines.num_lines, lo + _PASS_ITEMS)
    sizes = lines.lengths(lo, hi)
    truncated += int(np.count_nonzero(sizes > budget))
    items = zip(range(lo, hi),
                np.minimum(sizes, budget).tolist(),
                lines.first_lines(lo, hi).tolist())
    if per_document:
      for k, size, first in items:
        if (first and k) or (length and length + size > budget):
          bounds.append(k)
          length = size
        else:
          length += size
    else:
      for k, size, first in items:
        boundary = 1 if first and length else 0
        if length and length + boundary + size > budget:
          bounds.append(k)
          length = size
        else:
          length += boundary + size
  if lines.num_lines:
    bounds.append(lines.num_lines)
  return np.asarray(bounds, np.int64), truncated


def row_tokens(lines: LineIndex, start: int, stop: int, budget: int,
               separator: int | None) -> np.ndarray:
  """int32 ids of the planned row of lines [start, stop) (`plan_rows`): each line cut to
  `budget` tokens, and `separator` (None: chunks, which hold one document) before a document's
  first line unless the row is still empty."""
  ids = lines.tokens(start, stop)
  if stop - start == 1:
    return ids[:budget]
  firsts = (lines.first_lines(start, stop) if separator is not None else np.zeros(
      stop - start, bool)).tolist()
  pieces, at, length = [], 0, 0
  for size, first in zip(lines.lengths(start, stop).tolist(), firsts):
    line = ids[at:at + size][:budget]
    at += size
    if first and length:
      pieces.append(np.asarray([separator], np.int32))
      length += 1
    pieces.append(line)
    length += len(line)
  return np.concatenate(pieces) if pieces else np.zeros(0, np.int32)


def pack_full_sentences(documents, budget: int, separator: int) -> tuple[list[np.ndarray], int]:
  """(rows, truncated lines): RoBERTa's FULL-SENTENCES packing of `documents` in order.

  Whole lines are appended to the current row while they fit `budget` tokens; a line that does
  not fit starts the next row. When a line is the first of a new document and the row already
  holds text, `separator` goes between them (and counts against the budget). A line longer than
  `budget` gets a row of its own, cut to `budget` tokens. (PretrainBatches keeps the plan,
  `plan_rows`, and makes a row's ids when it is fed.)
  """
  lines = line_index(documents)
  bounds, truncated = plan_rows(lines, budget, per_document=False)
  return [
      row_tokens(lines, int(a), int(b), budget, separator) for a, b in zip(bounds[:-1], bounds[1:])
  ], truncated


def document_chunks(documents, budget: int) -> tuple[list[np.ndarray], int]:
  """(chunks, truncated lines): each document cut into chunks of whole consecutive lines of at
  most `budget` tokens, in order; no chunk spans two documents. A line longer than `budget` is
  a chunk of its own, cut to `budget` tokens (counted)."""
  lines = line_index(documents)
  bounds, truncated = plan_rows(lines, budget, per_document=True)
  return [row_tokens(lines, int(a), int(b), budget, None) for a, b in zip(bounds[:-1], bounds[1:])
         ], truncated


def pack_lengths_flat(lengths, capacity: int) -> tuple[np.ndarray, np.ndarray]:
  """`packing.pack_lengths`'s rows as arrays (offsets, members): row r holds the items
  members[offsets[r]:offsets[r + 1]], in index order; rows in order of creation.

  The same best-fit decreasing (each item, longest first and by index on a tie, goes into the
  fullest row it fits, else a new row), with arrays where pack_lengths keeps a list per row and
  a sort key per item: a corpus's millions of document chunks cost a few int64 each. A Python
  loop over the items: about 0.4 s per million (the machine of `plan_rows`), 3x faster than
  pack_lengths.
  """
  lengths = np.asarray(lengths, np.int64)
  if ((lengths < 1) | (lengths > capacity)).any():
    raise DataError(f'items to pack must have 1 to {capacity} tokens')
  order = np.argsort(-lengths, kind='stable')
  row_of = np.empty(len(lengths), np.int64)
  free = [array.array('q') for _ in range(capacity + 1)]  # free[c]: rows with c slots left
  held = 0  # bit c set: free[c] holds a row (the fullest row that fits is the lowest bit >= n)
  rows = 0
  for lo in range(0, len(order), _PASS_ITEMS):
    items = order[lo:lo + _PASS_ITEMS]
    placed = array.array('q')
    for n in lengths[items].tolist():
      above = held >> n
      if above:
        room = n + (above & -above).bit_length() - 1
        row = free[room].pop()
        if not free[room]:
          held ^= 1 << room
      else:
        row, room, rows = rows, capacity, rows + 1
      placed.append(row)
      free[room - n].append(row)
      held |= 1 << (room - n)
    row_of[items] = np.asarray(placed, np.int64)
  members = np.argsort(row_of, kind='stable')
  offsets = np.concatenate([[0], np.cumsum(np.bincount(row_of, minlength=rows))])
  return offsets.astype(np.int64), members.astype(np.int64)
