"""BERT pretraining data: sentence pairs (NSP / SOP), single segments, and dynamic MLM masks.

Documents are lists of sentence lines (`sentence_task` names the input format):
  nsp:  an example starts at a random line of a random document; A = consecutive lines from
        there (about half the budget); B = the lines that follow (label 0) or, half the time,
        lines from another document (label 1; Devlin et al. 2019);
  sop:  as nsp, but A and B are always consecutive; half the time they are swapped (label 1;
        ALBERT, Lan et al. 2020);
  none: one segment of consecutive lines from a random line of a random document, up to the
        budget and never past the document's end: like RoBERTa's DOC-SENTENCES (Liu et al.
        2019, section 4.2). Rows are sampled, so a line may be seen in several rows or in none
        within a given number of steps;
  full_sentences: RoBERTa's FULL-SENTENCES. All lines, document after document, are packed once
        into rows of at most max_len - 2 tokens: each row holds whole consecutive lines and
        crosses document boundaries, with a separator token (the tokenizer's sep_id, RoBERTa's
        extra </s>) between the last line of one document and the first of the next. No line is
        split across rows and none is lost: each appears in exactly one row (a line longer than
        a row is cut to the row and counted in `truncated_lines`). Every epoch feeds every row
        once, in an order drawn from (seed, epoch).
Then 15% of the non-special tokens are selected (at most max_predictions); of those 80% become
[MASK], 10% a random token, 10% stay unchanged, and the model predicts the originals.

Packing (PretrainOptions.pack, config.data.pack; only for 'none' and 'full_sentences', whose rows
carry no sentence label: the NSP/SOP head reads one [CLS] per row). Each row of max_len tokens
holds several complete examples, each its own '[CLS] ... [SEP]' (RoBERTa's '<s> ... </s>': what
the tokenizer's build_pair makes of one segment), with 'inputs_segment_ids' (1, 2, ... along the
row, 0 on the padding at its end) and 'inputs_positions' (restarting at 0 for every example), so
the model attends within an example only and gives each its own positions: an example sees what
it would see alone in a row, without the padding.
  none: examples are drawn as without packing (make_pair: a random document's consecutive lines
        from a random line, sometimes with a shorter budget) and placed greedily: a draw that
        does not fit in the rest of a row closes it, and the next row starts with that draw;
  full_sentences: each document is cut into chunks of whole consecutive lines of at most
        max_len - 2 tokens, and each chunk is its own example, so attention never crosses a
        document boundary: RoBERTa's DOC-SENTENCES input (Liu et al. 2019, section 4.2), which
        the paper found slightly better than FULL-SENTENCES but set aside because inputs near a
        document's end are short (it grew the batch size to make up for them); packed, those
        short chunks share rows instead of padding them. The chunks are packed once into rows
        (best-fit decreasing on their lengths, so rows come out nearly full;
        `packing.pack_lengths`), and every epoch feeds every row once in an order drawn from
        (seed, epoch), as the unpacked rows.
Masks are drawn per example, exactly as for an unpacked example (never on special tokens, at
most max_predictions each); a row's predictions share `row_predictions` slots
(round(max_len * mask_rate) plus max_len / 16, rounded up, for each example's count being
rounded up; no fewer than max_predictions). Should a row of many short examples use them all,
its last examples get fewer masks (the ones that fit).

Batch s is a pure function of (seed, s) (np.random.default_rng((seed, s))), so masks are drawn
anew for every batch (dynamic masking, as RoBERTa) and a resumed run sees exactly the batches it
would have seen: the data position is just the step.

The documents are a list of documents of int32 id arrays (tokenized in memory), or a view of a
prepared corpus's split (transformer_jax/corpus/reader.Documents, any size), whose lines are
read from the token shards only when a row takes them. Both are read through a `LineIndex`
(data/bert_lines.py, with the row plans below):
every line has a global index (document after document), so an example's first line is a draw
of one index among all lines, located by a search in the documents' first lines, and
full_sentences plans its rows from the line lengths alone, as line ranges. Nothing is kept per
line but an int64 (its end), so start-up memory does not grow with Python objects per line; the
same token content gives the same batches from either input.
"""

import dataclasses
import gzip

import numpy as np
from absl import logging

from transformer_jax.data.batches import StepIndexedBatches
from transformer_jax.data.bert_lines import (LineIndex, line_index, pack_lengths_flat, plan_rows,
                                             row_tokens)
from transformer_jax.errors import DataError

Batch = dict[str, np.ndarray]
# The input formats of the module docstring; nsp and sop train the 2-way sentence head.
SENTENCE_TASKS = ('nsp', 'sop', 'none', 'full_sentences')
PAIR_TASKS = ('nsp', 'sop')


@dataclasses.dataclass(frozen=True)
class PretrainOptions:
  max_len: int = 128
  max_predictions: int = 20
  mask_rate: float = 0.15
  sentence_task: str = 'nsp'  # one of SENTENCE_TASKS
  # A shorter target length sometimes, so short inputs are seen (not with full_sentences, whose
  # rows are packed once, as RoBERTa's).
  short_seq_prob: float = 0.1
  mask_token_rate: float = 0.8  # of the selected tokens: [MASK]
  random_token_rate: float = 0.1  # ... a random token; the rest stay unchanged
  pack: bool = False  # several examples per row (module docstring); 'none', 'full_sentences'

  @property
  def row_predictions(self) -> int:
    """Prediction slots per row (the width of 'mlm_positions'): max_predictions, or with pack
    round(max_len * mask_rate) plus ceil(max_len / 16) of slack for the rounding up of each
    packed example's count, never fewer than max_predictions."""
    if not self.pack:
      return self.max_predictions
    return max(self.max_predictions,
               int(round(self.max_len * self.mask_rate)) + -(-self.max_len // 16))


# -- documents ----------------------------------------------------------------------------------


def text_to_document(text: str) -> list[str]:
  """A document's non-empty lines."""
  return [line.strip() for line in text.splitlines() if line.strip()]


def read_documents(path: str, lines_per_document: int = 0) -> list[list[str]]:
  """Documents of a UTF-8 (optionally .gz) file: blank lines separate them. With
  `lines_per_document` > 0, runs of that many lines also end a document (for files, like
  caption lists, without blank lines)."""
  opener = gzip.open if path.endswith('.gz') else open
  try:
    with opener(path, 'rt', encoding='utf-8') as f:
      text = f.read()
  except FileNotFoundError:
    raise DataError(f'text file {path} does not exist') from None
  except (UnicodeDecodeError, OSError) as e:
    raise DataError(f'cannot read {path}: {e}') from None
  documents, current = [], []
  for line in text.splitlines():
    line = line.strip()
    if line:
      current.append(line)
    if current and (not line or (lines_per_document and len(current) >= lines_per_document)):
      documents.append(current)
      current = []
  if current:
    documents.append(current)
  if not documents:
    raise DataError(f'{path} has no text')
  return documents


def split_documents(documents: list[list[str]], valid_fraction: float,
                    seed: int) -> tuple[list[list[str]], list[list[str]]]:
  """(train, held-out): a seeded random `valid_fraction` of the documents is held out whole,
  so no held-out line is ever a training line."""
  if not 0.0 < valid_fraction < 1.0:
    raise DataError(f'data.valid_fraction must be in (0, 1), got {valid_fraction}')
  if len(documents) < 2:
    raise DataError(f'need at least 2 documents to hold some out, got {len(documents)}; '
                    'separate documents by blank lines or set data.lines_per_document')
  order = np.random.default_rng(seed).permutation(len(documents))
  num_valid = min(max(1, int(round(len(documents) * valid_fraction))), len(documents) - 1)
  held = set(order[:num_valid].tolist())
  return ([d for i, d in enumerate(documents) if i not in held],
          [d for i, d in enumerate(documents) if i in held])


def tokenize_documents(tokenizer, documents: list[list[str]]) -> list[list[np.ndarray]]:
  """Each line as an int32 id array; empty lines (after tokenization) dropped."""
  lines = [line for doc in documents for line in doc]
  ids = tokenizer.encode_batch(lines)
  out, k = [], 0
  for doc in documents:
    encoded = [np.asarray(x, np.int32) for x in ids[k:k + len(doc)] if x]
    k += len(doc)
    if encoded:
      out.append(encoded)
  return out


# -- examples -----------------------------------------------------------------------------------


def _fit(lines: LineIndex, start: int, stop: int, budget: int) -> int:
  """The end of the lines from `start` (before `stop`) that fit `budget` tokens together, always
  past `start`: a first line longer than the budget is taken whole (build_pair cuts it). Reads
  lengths only, a window of budget + 1 lines at a time (more fit only if some are empty)."""
  end, total = start, 0
  while end < stop:
    sums = total + np.cumsum(lines.lengths(end, min(stop, end + budget + 1)))
    fit = int(np.searchsorted(sums, budget, side='right'))  # sums never decrease
    if fit < len(sums):
      return max(end + fit, start + 1)
    end, total = end + len(sums), int(sums[-1])
  return max(end, start + 1)


def _take_lines(lines: LineIndex, document: tuple[int, int], start: int,
                budget: int) -> tuple[list[int], int]:
  """Lines of `document` (first line, count) from its line `start` while they fit `budget`
  tokens (always at least one); (ids, the next line in the document)."""
  first, count = document
  end = _fit(lines, first + start, first + count, budget)
  return lines.tokens(first + start, end).tolist(), end - first


def _consecutive(lines: LineIndex, document: tuple[int, int], line: int,
                 budget: int) -> tuple[list[int], list[int]]:
  """Consecutive text (A, B) from the document's `line`: A about half the budget; B the lines
  after it.

  Near a document's end A gives up lines so that one follows; a one-line remainder is cut
  in two. Either way every anchor can make a genuine pair, so labels stay balanced.
  """
  first, count = document
  a, after = _take_lines(lines, document, line, max(budget // 2, 1))
  if after >= count and after - line > 1:  # keep a line for B
    after -= 1
    a = a[:len(a) - int(lines.lengths(first + after, first + after + 1)[0])]
  if after < count:
    return a, _take_lines(lines, document, after, max(budget - len(a), 1))[0]
  cut = max(len(a) // 2, 1)
  return a[:cut], (a[cut:] or list(a))


def make_pair(documents, doc_index: int, line: int, options: PretrainOptions,
              rng: np.random.Generator) -> tuple[list[int], list[int] | None, int]:
  """(segment A ids, segment B ids or None, sentence label) for an example starting at line
  `line` of document `doc_index` (of a list of documents, a prepared corpus's view or a
  `LineIndex`); label 0 = genuine order, 1 = random (NSP) / swapped (SOP)."""
  lines = line_index(documents)
  document = lines.document(doc_index)
  if options.sentence_task == 'full_sentences':  # rows packed once, not sampled per example
    raise DataError("sentence_task='full_sentences' rows are packed by PretrainBatches "
                    '(pack_full_sentences), not drawn by make_pair')
  if options.sentence_task == 'none':
    budget = options.max_len - 2
    if rng.random() < options.short_seq_prob:
      budget = int(rng.integers(2, budget + 1))
    return _take_lines(lines, document, line, budget)[0], None, 0
  budget = options.max_len - 3
  if rng.random() < options.short_seq_prob:
    budget = int(rng.integers(2, budget + 1))
  a, b = _consecutive(lines, document, line, budget)
  label = 0
  if options.sentence_task == 'nsp':
    if rng.random() < 0.5 and lines.num_documents > 1:
      other = int(rng.integers(lines.num_documents - 1))
      other += other >= doc_index  # any document but this one
      other_document = lines.document(other)
      start = int(rng.integers(other_document[1]))
      b = _take_lines(lines, other_document, start, max(budget - len(a), 1))[0]
      label = 1
  elif rng.random() < 0.5:  # sop: the same consecutive text, in swapped order
    a, b, label = b, a, 1
  return a, b, label


def mask_tokens(ids: np.ndarray, special: np.ndarray, vocab_size: int, mask_id: int,
                options: PretrainOptions, rng: np.random.Generator, random_ids: np.ndarray,
                limit: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(masked ids, positions [P], original ids [P]) for one sequence: round(mask_rate * n) of
  its n non-special tokens (at least 1, at most max_predictions and `limit`: the prediction
  slots a packed row has left), in position order."""
  candidates = np.flatnonzero(~np.isin(ids, special))
  most = options.max_predictions if limit is None else min(options.max_predictions, limit)
  count = min(most, max(1, int(round(len(candidates) * options.mask_rate))))
  count = min(count, len(candidates))
  positions = np.sort(rng.choice(candidates, size=count, replace=False))
  originals = ids[positions].copy()
  masked = ids.copy()
  roll = rng.random(count)
  to_mask = roll < options.mask_token_rate
  to_random = (roll >= options.mask_token_rate) & (roll < options.mask_token_rate +
                                                   options.random_token_rate)
  masked[positions[to_mask]] = mask_id
  masked[positions[to_random]] = random_ids[rng.integers(len(random_ids), size=to_random.sum())]
  return masked, positions, originals


class PretrainBatches(StepIndexedBatches):
  """Endless pretraining batches; batch s is a pure function of (seed, s).

  {'inputs', 'segments': int32[B, max_len], 'mlm_positions', 'mlm_ids': int32[B, P],
   'mlm_weights': float32[B, P], 'sentence_labels': int32[B]} (this process's rows of the
  global batch), P = options.row_predictions. With options.pack also 'inputs_segment_ids' and
  'inputs_positions' int32[B, max_len] (module docstring), and 'sentence_labels' all 0.
  """

  def __init__(self, documents, tokenizer, options: PretrainOptions, *, batch_size: int, seed: int,
               process_index: int = 0, process_count: int = 1):
    """`documents`: a list of documents of id arrays, or a prepared corpus's `Documents` view
    (module docstring); the same ids give the same batches."""
    if not documents:
      raise DataError('no documents with text to pretrain on')
    self._init_rows(batch_size, process_index, process_count)
    if options.max_len < 8:
      raise DataError(f'data.max_len={options.max_len} is too short for sentence pairs')
    if options.sentence_task not in SENTENCE_TASKS:
      raise DataError(f'sentence_task must be one of {SENTENCE_TASKS}, got '
                      f'{options.sentence_task!r}')
    if options.pack and options.sentence_task in PAIR_TASKS:
      raise DataError(f'sentence_task={options.sentence_task!r} cannot be packed: its sentence '
                      'head reads one [CLS] per row')
    self.documents, self.tokenizer, self.options = documents, tokenizer, options
    self.batch_size, self.seed = batch_size, seed
    # An example starts at a global line drawn uniformly, so each line is equally likely.
    self.lines = line_index(documents)
    if not self.lines.num_lines:
      raise DataError('no documents with text to pretrain on')
    self._special = np.asarray(tokenizer.special_ids, np.int32)
    self._random_ids = np.setdiff1d(np.arange(tokenizer.vocab_size, dtype=np.int32), self._special)
    self._num_rows, self.truncated_lines = 0, 0
    self.examples = []  # full_sentences with pack: (ids, token types) of every chunk
    budget = options.max_len - 2
    if options.sentence_task == 'full_sentences' and options.pack:
      self._chunks, self.truncated_lines = plan_rows(self.lines, budget, per_document=True)
      self.examples = _Chunks(self)
      # A chunk's tokens are its lines' (each cut to the budget), and its example's length
      # build_pair's for that many tokens: the rows are packed without reading a token.
      capped = np.cumsum(np.minimum(self.lines.lengths(0, self.lines.num_lines), budget))
      tokens = np.diff(np.concatenate([[0], capped])[self._chunks])
      made = [
          len(tokenizer.build_pair([0] * n, None, options.max_len)[0]) for n in range(budget + 1)
      ]
      lengths = np.asarray(made, np.int64)[tokens]
      self._pack_offsets, self._pack_members = pack_lengths_flat(lengths, options.max_len)
      self._num_rows = len(self._pack_offsets) - 1
      padding = 1 - lengths.sum() / max(1, self._num_rows * options.max_len)
      logging.info(
          'document chunks: %d lines in %d chunks of whole lines, packed into %d rows of %d '
          'tokens, %.1f%% padding (%d lines cut to fit)', self.lines.num_lines, len(lengths),
          self._num_rows, options.max_len, 100 * padding, self.truncated_lines)
    elif options.sentence_task == 'full_sentences':
      self._row_bounds, self.truncated_lines = plan_rows(self.lines, budget, per_document=False)
      self._num_rows = len(self._row_bounds) - 1
      logging.info(
          'full sentences: %d lines packed into %d rows of at most %d tokens (%d lines '
          'cut to fit)', self.lines.num_lines, self._num_rows, options.max_len,
          self.truncated_lines)
    self._order = (-1, None)  # (epoch, its row order): the last one used

  @property
  def rows_per_epoch(self) -> int:
    """full_sentences: the number of packed rows, each fed once per epoch."""
    return self._num_rows

  def row_index(self, k: int) -> int:
    """full_sentences: the packed row fed as global row `k` (= step * batch_size + r): epoch
    k // rows_per_epoch visits every row once, in an order drawn from (seed, epoch)."""
    epoch, position = divmod(k, self._num_rows)
    if self._order[0] != epoch:
      order = np.random.default_rng((self.seed, epoch, 1)).permutation(self._num_rows)
      self._order = (epoch, order)
    return int(self._order[1][position])

  def full_sentences_row(self, r: int) -> np.ndarray:
    """full_sentences without pack: the ids of row r, read when it is fed."""
    a, b = self._row_bounds[r:r + 2]
    return row_tokens(self.lines, int(a), int(b), self.options.max_len - 2, self.tokenizer.sep_id)

  def chunk_example(self, c: int) -> tuple[np.ndarray, np.ndarray]:
    """full_sentences with pack: (ids, token types) of document chunk c, read when it is fed."""
    a, b = self._chunks[c:c + 2]
    chunk = row_tokens(self.lines, int(a), int(b), self.options.max_len - 2, None)
    ids, types = self.tokenizer.build_pair(chunk.tolist(), None, self.options.max_len)
    return np.asarray(ids, np.int32), np.asarray(types, np.int32)

  def _draw(self, rng: np.random.Generator) -> tuple:
    """(A ids, B ids or None, sentence label) of an example from a random (document, line)."""
    d, line = self.lines.locate(int(rng.integers(self.lines.num_lines)))
    return make_pair(self.lines, d, line, self.options, rng)

  def _mask(self, ids, rng: np.random.Generator, limit: int | None = None) -> tuple:
    tok = self.tokenizer
    return mask_tokens(np.asarray(ids, np.int32), self._special, tok.vocab_size, tok.mask_id,
                       self.options, rng, self._random_ids, limit)

  def example(self, rng: np.random.Generator, k: int = 0) -> tuple:
    """(masked ids, segments, positions, originals, sentence label) of one row; `k` is the
    global row index (used by full_sentences only)."""
    o = self.options
    if o.sentence_task == 'full_sentences':
      a, b, label = self.full_sentences_row(self.row_index(k)), None, 0
    else:
      a, b, label = self._draw(rng)
    ids, segments = self.tokenizer.build_pair(a, b, o.max_len)
    masked, positions, originals = self._mask(ids, rng)
    return masked, np.asarray(segments, np.int32), positions, originals, label

  def _packed_batch(self, step: int) -> Batch:
    """The global packed batch `step` (module docstring), all rows."""
    o, tok = self.options, self.tokenizer
    rng = np.random.default_rng((self.seed, step))
    b, length, p = self.batch_size, o.max_len, o.row_predictions
    out = {
        key: np.zeros((b, length), np.int32)
        for key in ('inputs', 'segments', 'inputs_segment_ids', 'inputs_positions')
    }
    out.update(mlm_positions=np.zeros((b, p), np.int32), mlm_ids=np.zeros((b, p), np.int32),
               mlm_weights=np.zeros((b, p), np.float32), sentence_labels=np.zeros((b,), np.int32))
    pending = None  # 'none': the draw that closed the previous row, which starts this one
    for row in range(b):
      used = predicted = segment = 0
      if o.sentence_task == 'full_sentences':
        r = self.row_index(step * b + row)
        members = self._pack_members[self._pack_offsets[r]:self._pack_offsets[r + 1]]
        examples = (self.chunk_example(int(c)) for c in members)
      while True:
        if o.sentence_task == 'full_sentences':
          example = next(examples, None)
          if example is None:
            break
        else:
          if pending is None:
            ids, types = tok.build_pair(self._draw(rng)[0], None, length)
            pending = np.asarray(ids, np.int32), np.asarray(types, np.int32)
          example = pending
          if used and used + len(example[0]) > length:
            break  # the draw starts the next row
          pending = None
        ids, types = example
        masked, positions, originals = self._mask(ids, rng, limit=p - predicted)
        span, picks = slice(used, used + len(ids)), slice(predicted, predicted + len(positions))
        segment += 1
        out['inputs'][row, span] = masked
        out['segments'][row, span] = types
        out['inputs_segment_ids'][row, span] = segment
        out['inputs_positions'][row, span] = np.arange(len(ids))
        out['mlm_positions'][row, picks] = positions + used
        out['mlm_ids'][row, picks] = originals
        out['mlm_weights'][row, picks] = 1.0
        used, predicted = used + len(ids), predicted + len(positions)
    return out

  def batch(self, step: int) -> Batch:
    o = self.options
    if o.pack:
      return {k: v[self._rows] for k, v in self._packed_batch(step).items()}
    rng = np.random.default_rng((self.seed, step))
    b, p = self.batch_size, o.max_predictions
    out = {
        'inputs': np.zeros((b, o.max_len), np.int32), 'segments': np.zeros(
            (b, o.max_len), np.int32), 'mlm_positions': np.zeros((b, p), np.int32),
        'mlm_ids': np.zeros((b, p), np.int32), 'mlm_weights': np.zeros(
            (b, p), np.float32), 'sentence_labels': np.zeros((b,), np.int32)
    }
    for row in range(b):
      ids, segments, positions, originals, label = self.example(rng, step * b + row)
      out['inputs'][row, :len(ids)] = ids
      out['segments'][row, :len(ids)] = segments
      out['mlm_positions'][row, :len(positions)] = positions
      out['mlm_ids'][row, :len(positions)] = originals
      out['mlm_weights'][row, :len(positions)] = 1.0
      out['sentence_labels'][row] = label
    return {k: v[self._rows] for k, v in out.items()}


class _Chunks:
  """PretrainBatches.examples with full_sentences and pack: example c is the (ids, token types)
  of document chunk c, made from its lines when asked (a list of them would hold the corpus)."""

  def __init__(self, batches: PretrainBatches):
    self._batches = batches

  def __len__(self) -> int:
    return len(self._batches._chunks) - 1

  def __getitem__(self, c: int) -> tuple[np.ndarray, np.ndarray]:
    if not 0 <= c < len(self):
      raise IndexError(c)
    return self._batches.chunk_example(c)
