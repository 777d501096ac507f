"""Language-model data: a character tokenizer, random training windows, fixed eval windows.

A language model reads one long token stream. Training batches are random windows of it,

    inputs  = tokens[i     : i + T]
    targets = tokens[i + 1 : i + T + 1]      (predict every next token)

with batch s drawn from np.random.default_rng((seed, s)), so the data position is just the step
number: a resumed run draws exactly the batches it would have drawn (as nanoGPT's `get_batch`,
but reproducible). Subword corpora (lm1b) are tokenized with SentencePiece, or with a byte-level
BPE (GPT-2's kind, `hf_tokenizer.HFTokenizer`), and their documents joined with EOS ('<|endoftext|>'
for the BPE), which also tells the model where a document ends.

Packing (config.data.pack): a window of a subword stream is already a full row, but it may hold
the ends and starts of several documents. With `pack_eos_id` set, every window also carries
'inputs_segment_ids' and 'inputs_positions' (`segment_ids_and_positions`): a new segment starts
at the window's first token and at every EOS, which plays BOS for the document after it (as a
generation's prompt [EOS] + text does), so attention never crosses a document boundary and
positions restart at each document. Nothing is padded and every target is still scored: the
target of a document's last token is the EOS that ends it. A character stream has no documents,
so it cannot be packed.
"""

import json
import os
from collections.abc import Iterable, Sequence

import numpy as np

from transformer_jax.data.batches import StepIndexedBatches
from transformer_jax.data.hf_tokenizer import HFTokenizer
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.special_tokens import EOS_ID
from transformer_jax.errors import DataError
from transformer_jax.files import write_atomically

Batch = dict[str, np.ndarray]

# -- text ---------------------------------------------------------------------------------------


def split_train_val(text: str, train_fraction: float = 0.9) -> tuple[str, str]:
  """The first `train_fraction` of the characters for training, the rest for validation.

  A contiguous split (as nanoGPT's) keeps validation text unseen: random windows of one
  shared stream would overlap the training windows.
  """
  if not 0.0 < train_fraction < 1.0:
    raise DataError(f'train_fraction must be in (0, 1), got {train_fraction}')
  cut = int(len(text) * train_fraction)
  return text[:cut], text[cut:]


def read_text(path: str) -> str:
  """The whole UTF-8 file as one string, with a one-line error if it cannot be read."""
  if not path:
    raise DataError('data.path is empty: pass --config.data.path=FILE (a UTF-8 text file)')
  try:
    with open(path, 'rb') as f:
      data = f.read()
    # Universal newlines, as text-mode open() gives.
    return data.decode('utf-8').replace('\r\n', '\n').replace('\r', '\n')
  except FileNotFoundError:
    raise DataError(f'text file {path} does not exist (relative paths start from '
                    f'{os.getcwd()})') from None
  except UnicodeDecodeError as e:  # name the line, as the parallel-text reader does
    line = data[:e.start].count(b'\n') + 1
    raise DataError(f'{path}:{line}: invalid UTF-8 ({e.reason}: byte 0x{data[e.start]:02x}); '
                    'fix or remove that line') from None
  except OSError as e:
    raise DataError(f'cannot read {path}: {e.strerror}') from None


# -- character tokenizer ------------------------------------------------------------------------


class CharTokenizer:
  """One token per character; the vocabulary is the sorted distinct characters of a text.

  There are no special tokens (nanoGPT's shakespeare_char: 65 symbols). A character outside
  the vocabulary raises a DataError naming it, unless `skip_unknown=True` drops it.
  """

  def __init__(self, chars: Sequence[str]):
    chars = list(chars)
    if not chars or any(len(c) != 1 for c in chars) or len(set(chars)) != len(chars):
      raise DataError('a character vocabulary must be a non-empty list of distinct characters')
    self.chars = chars
    self._ids = {c: i for i, c in enumerate(chars)}

  @classmethod
  def from_text(cls, text: str) -> 'CharTokenizer':
    if not text:
      raise DataError('cannot build a character vocabulary from empty text')
    return cls(sorted(set(text)))

  @property
  def vocab_size(self) -> int:
    return len(self.chars)

  def encode(self, text: str, *, skip_unknown: bool = False) -> list[int]:
    ids = []
    for position, char in enumerate(text):
      token = self._ids.get(char)
      if token is None:
        if skip_unknown:
          continue
        raise DataError(f'character {char!r} (at position {position}) is not in the '
                        f'{self.vocab_size}-character vocabulary of this model')
      ids.append(token)
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    if hasattr(ids, '__array__'):
      ids = np.asarray(ids).reshape(-1).tolist()
    return ''.join(self.chars[i] for i in ids)

  # -- persistence: a JSON list of characters next to the checkpoints

  def save(self, path: str):
    """Writes atomically, so a killed run never leaves half a vocabulary behind."""
    write_atomically(path, json.dumps({'type': 'char', 'chars': self.chars}, ensure_ascii=True))

  @classmethod
  def load(cls, path: str) -> 'CharTokenizer':
    try:
      with open(path, encoding='utf-8') as f:
        data = json.load(f)
    except FileNotFoundError:
      raise DataError(f'character vocabulary {path} is missing: train first') from None
    except (OSError, ValueError) as e:
      raise DataError(f'{path} is not a character vocabulary ({e}); delete it to rebuild') from None
    if not isinstance(data, dict) or data.get('type') != 'char':
      raise DataError(f'{path} is not a character vocabulary; delete it to rebuild')
    return cls(data['chars'])

  @classmethod
  def load_or_build(cls, path: str, text: str) -> 'CharTokenizer':
    """The saved vocabulary if `path` exists (a resumed run must keep its ids), else built
    from `text` and saved."""
    if os.path.exists(path):
      return cls.load(path)
    tokenizer = cls.from_text(text)
    tokenizer.save(path)
    return tokenizer


# -- what generation needs from any tokenizer ---------------------------------------------------


def lm_eos_id(tokenizer) -> int | None:
  """The id that ends a document: EOS for SentencePiece corpora, the tokenizer's own EOS for a
  Hugging Face one (GPT-2's '<|endoftext|>'), none for raw characters."""
  if isinstance(tokenizer, CharTokenizer):
    return None
  if isinstance(tokenizer, HFTokenizer):
    return tokenizer.eos_id
  return EOS_ID


def prompt_ids(tokenizer, text: str) -> list[int]:
  """Token ids a generation starts from.

  Subword corpora put EOS between documents, so a prompt starts after an EOS: the model
  then continues a fresh document. A Hugging Face tokenizer starts the way its model was
  trained: with BOS where it has one distinct from EOS (LLaMA's '<s>'), else with EOS (GPT-2's
  '<|endoftext|>', which is both). Character models have no such token; they need at least one
  character (nanoGPT starts from a newline).
  """
  if isinstance(tokenizer, CharTokenizer):
    ids = tokenizer.encode(text)
    if not ids:
      raise DataError('the prompt is empty: a character model needs at least one character, '
                      'e.g. --prompt="\\n"')
    return ids
  if isinstance(tokenizer, HFTokenizer):
    start = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    ids = ([] if start is None else [start]) + tokenizer.encode(text)
    if not ids:
      raise DataError('the prompt is empty and this tokenizer has no BOS or EOS to start from; '
                      'pass some text, e.g. --prompt="The"')
    return ids
  return [EOS_ID] + tokenizer.encode(text)


def encode_documents(tokenizer: Tokenizer | HFTokenizer, documents: Sequence[str]) -> np.ndarray:
  """Subword ids of every document, each followed by the tokenizer's EOS, as one stream."""
  eos = lm_eos_id(tokenizer)
  if eos is None:
    raise DataError(f'{tokenizer} has no EOS token to end documents with')
  pieces = []
  for start in range(0, len(documents), 10_000):  # bounded memory for the id lists
    for ids in tokenizer.encode_batch(documents[start:start + 10_000]):
      pieces.append(np.asarray(ids + [eos], dtype=token_dtype(tokenizer.vocab_size)))
  if not pieces:
    raise DataError('no documents to tokenize')
  return np.concatenate(pieces)


def token_dtype(vocab_size: int) -> np.dtype:
  """uint16 when the ids fit: it halves the memory of a large corpus."""
  return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


# -- batches -------------------------------------------------------------------------------------


def segment_ids_and_positions(inputs: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
  """(segment ids, positions), int32 of the shape of `inputs` [..., T], for windows of a stream
  of documents joined with `eos_id`.

  A segment starts at index 0 and at every EOS (the EOS that ends one document starts the next
  one's segment: it is that document's BOS). Segment ids count from 1 along each window; a
  token's position is its distance from the start of its segment. There is no padding in a
  window, so no id is 0. E.g. with EOS = 9:

    inputs       9 5 6 9 9 7
    segment ids  1 1 1 2 3 3
    positions    0 1 2 0 0 1
  """
  inputs = np.asarray(inputs)
  if inputs.ndim < 1 or inputs.shape[-1] < 1:
    raise DataError(f'windows must have at least one token, got shape {inputs.shape}')
  starts = inputs == eos_id  # a new array: setting its first column leaves `inputs` alone
  starts[..., 0] = True  # a window starting with EOS opens one segment there, not two
  segment_ids = np.cumsum(starts, axis=-1, dtype=np.int32)
  index = np.arange(inputs.shape[-1], dtype=np.int32)
  # The index of the latest segment start at or before each token (a running maximum).
  last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=-1)
  return segment_ids, (index - last_start).astype(np.int32)


def _windows(tokens, starts: np.ndarray, block_size: int, pack_eos_id: int | None = None) -> Batch:
  # Rows start + [0, T]: a prepared corpus's split reads just those tokens from its shards
  # (corpus/reader.py); an array gathers them with one fancy index. inputs and targets are views.
  if hasattr(tokens, 'windows'):
    chunk = tokens.windows(starts, block_size + 1)
  else:
    chunk = tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int32)
  batch = {'inputs': chunk[:, :-1], 'targets': chunk[:, 1:]}
  if pack_eos_id is not None:
    batch['inputs_segment_ids'], batch['inputs_positions'] = segment_ids_and_positions(
        batch['inputs'], pack_eos_id)
  return batch


def _check_length(tokens, block_size: int, what: str):
  if getattr(tokens, 'ndim', 1) != 1:
    raise DataError(f'{what} tokens must be one stream (1-D), got shape {tokens.shape}')
  if len(tokens) <= block_size:
    raise DataError(f'{what} text has {len(tokens)} tokens, fewer than block_size + 1 = '
                    f'{block_size + 1}; use more text or a smaller data.block_size')


class RandomWindows(StepIndexedBatches):
  """Endless training batches {'inputs', 'targets': int32[B, T]} of random windows of `tokens`:
  an array, or a prepared corpus's split (`corpus.reader.TokenSplit`), of which each process
  reads only its rows' windows.

  `batch_size` is the global batch; with several processes each yields its own contiguous
  slice of the same global draw, so the global batch does not depend on the process count.
  With `pack_eos_id` (the EOS that joins the documents), batches also have
  'inputs_segment_ids' and 'inputs_positions' (`segment_ids_and_positions`).
  """

  def __init__(self, tokens, *, block_size: int, batch_size: int, seed: int, process_index: int = 0,
               process_count: int = 1, pack_eos_id: int | None = None):
    tokens = tokens if hasattr(tokens, 'windows') else np.asarray(tokens)
    _check_length(tokens, block_size, 'training')
    self._init_rows(batch_size, process_index, process_count)
    self.tokens, self.block_size, self.batch_size, self.seed = tokens, block_size, batch_size, seed
    self.pack_eos_id = pack_eos_id

  def batch(self, step: int) -> Batch:
    """The global batch `step`'s rows for this process (a pure function of seed and step)."""
    rng = np.random.default_rng((self.seed, step))
    starts = rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)
    return _windows(self.tokens, starts[self._rows], self.block_size, self.pack_eos_id)


def eval_batches(tokens: np.ndarray, block_size: int, batch_size: int, num_batches: int, seed: int,
                 pack_eos_id: int | None = None) -> list[Batch]:
  """`num_batches` fixed random windows: the same ones at every evaluation, so eval losses
  compare across steps and runs. With `pack_eos_id`, segmented as `RandomWindows`'."""
  tokens = tokens if hasattr(tokens, 'windows') else np.asarray(tokens)
  _check_length(tokens, block_size, 'validation')
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(tokens) - block_size, size=(num_batches, batch_size))
  return [_windows(tokens, row, block_size, pack_eos_id) for row in starts]


# -- evaluation over a whole file ----------------------------------------------------------------


def sliding_windows(tokens: np.ndarray, window: int, stride: int) -> Batch:
  """Every next-token prediction of `tokens` exactly once, in windows of a fixed shape.

  Returns {'inputs', 'targets', 'weights'} of shape [num_windows, window]. Window k reads
  tokens[k * stride : k * stride + window] and predicts the token after each; the first
  window scores all its predictions, every later one only its last `stride` (the ones no
  earlier window scored), so each token from the second on is scored once, with at least
  window - stride + 1 tokens of left context (all of it in the first window). The last
  window is padded with id 0 where the stream ends, at weight 0: a causal model's
  predictions do not depend on what follows them, so the pad changes nothing scored.
  """
  tokens = np.asarray(tokens)
  if tokens.ndim != 1:
    raise DataError(f'tokens must be one stream (1-D), got shape {tokens.shape}')
  if not 1 <= stride <= window:
    raise DataError(f'the stride must be in [1, window = {window}], got {stride}')
  num_targets = len(tokens) - 1
  if num_targets < 1:
    raise DataError(f'the text has {len(tokens)} token(s): at least 2 are needed to score one')
  num_windows = 1 + -(-max(0, num_targets - window) // stride)  # ceil division
  starts = np.arange(num_windows) * stride
  offsets = starts[:, None] + np.arange(window)  # index of each input token
  valid = offsets < num_targets  # its target, offsets + 1, is inside the stream
  padded = np.concatenate([tokens, np.zeros(window + 1, tokens.dtype)]).astype(np.int32)
  inputs = np.where(valid, padded[offsets], 0)
  targets = np.where(valid, padded[offsets + 1], 0)
  scored = np.ones_like(valid)
  scored[1:, :window - stride] = False  # an earlier window scored these
  return {'inputs': inputs, 'targets': targets, 'weights': (valid & scored).astype(np.float32)}


class IncrementalDecoder:
  """Text of a growing list of token ids, piece by piece, for printing tokens as they come.

  Decoding one token at a time would cut a multi-byte character split over byte-level BPE
  tokens into replacement characters, and lose SentencePiece's word-initial spaces. So the
  whole list is decoded each time and only the new, settled end of it is returned; text
  ending in U+FFFD (an incomplete UTF-8 sequence) waits for the next token. The pieces join
  to tokenizer.decode(all ids).
  """

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.ids: list[int] = []
    self.emitted = ''

  def _take(self, text: str) -> str:
    if not text.startswith(self.emitted):
      # An earlier piece changed (a tokenizer that merges across tokens): print nothing now,
      # the rest comes when the text agrees again or at `finish`.
      return ''
    piece = text[len(self.emitted):]
    self.emitted = text
    return piece

  def push(self, token: int) -> str:
    """The new text that token `token` settles ('' while a character is incomplete)."""
    self.ids.append(int(token))
    return self._take(self.tokenizer.decode(self.ids).rstrip('\ufffd'))

  def finish(self) -> str:
    """What is left to print once no more tokens come."""
    text = self.tokenizer.decode(self.ids)
    if text.startswith(self.emitted):
      return self._take(text)
    return ''  # cannot unprint; the printed text already differs (see _take)
