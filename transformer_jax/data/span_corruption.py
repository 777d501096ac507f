"""T5's span-corruption objective and text-to-text inputs (Raffel et al. 2020, section 3.1.4).

Span corruption turns unlabelled text into (inputs, targets) pairs for an encoder-decoder:
about 15% of the tokens, in spans of mean length 3, are cut out of the input, each span replaced
by one sentinel; the target lists the sentinels, each followed by the tokens it replaced:

    original: Thank you for inviting me to your party last week .
    inputs:   Thank you <X> me to your party <Y> week . </s>
    targets:  <X> for inviting <Y> last <Z> </s>

Conventions, those of T5's code (t5.data.preprocessors.span_corruption and
random_spans_noise_mask):
  - Sentinel i is id `vocab_size - 1 - i` of the model vocabulary: the sentinels are the top
    `num_sentinels` ids, above the SentencePiece pieces (the model vocabulary is the tokenizer's
    size + num_sentinels; `SentinelTokenizer` writes them as '<extra_id_i>' like T5's).
  - The noise mask has round(length * noise_density) noise tokens in
    round(noise tokens / mean span length) spans; noise and non-noise span lengths are random
    segmentations; the spans alternate non-noise, noise, ..., ending with a noise span.
  - Targets: for each noise span i, sentinel i then its tokens; then, only when the text ends
    with non-noise tokens, one more sentinel standing for that tail (T5's targets replace every
    non-noise span by a sentinel, so this happens exactly there: in the paper's example above,
    <Z>; with T5's mask, which ends with noise, never except for a 1-token text); then EOS.
    Inputs end with EOS too.
  - A document's token stream is packed and split into chunks of a fixed length before
    corruption (T5's reduce_concat_tokens + split_tokens), the length chosen so that the
    corrupted inputs fill `max_len` (T5's random_spans_helper).

Two training batchers: `SpanCorruptionBatcher` here, over chunks in memory (text tokenized at
start), and `span_corruption_stream.SpanCorruptionSteps`, over a token stream read on demand (a
prepared corpus's split: memory and start time do not grow with the corpus). Everything is
deterministic given a seed (numpy Generators).
"""

import re
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from transformer_jax.data import batching
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.special_tokens import BOS_ID, EOS_ID, PAD_ID

NOISE_DENSITY = 0.15
MEAN_NOISE_SPAN_LENGTH = 3.0
NUM_SENTINELS = 100  # T5's extra ids

# -- the noise mask -----------------------------------------------------------------------------


def check_noise(noise_density: float, mean_noise_span_length: float) -> None:
  """ConfigError unless 0 < noise_density < 1 and mean_noise_span_length >= 1."""
  if not 0.0 < noise_density < 1.0:
    raise ConfigError(f'noise_density must be in (0, 1), got {noise_density}')
  if not mean_noise_span_length >= 1.0:
    raise ConfigError(f'mean_noise_span_length must be at least 1, got {mean_noise_span_length}')


def noise_counts(length: int, noise_density: float = NOISE_DENSITY,
                 mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> tuple[int, int]:
  """(noise tokens, noise spans) of a `length`-token text, T5's counts.

  round() halves to even, as tf.round does. At least one noise and one non-noise token and one
  span (T5 avoids the degenerate masks so, treating a 1-token text as 2 tokens); at most as
  many spans as non-noise tokens (T5 would fail there: each noise span needs a non-noise span
  before it).
  """
  length = max(int(length), 2)
  num_noise = min(max(round(length * noise_density), 1), length - 1)
  num_spans = max(round(num_noise / mean_noise_span_length), 1)
  return num_noise, min(num_spans, length - num_noise)


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
  """Lengths of a uniformly random split of `num_items` into `num_segments` non-empty parts.

  T5's _random_segmentation: a shuffled indicator of which of the num_items - 1 gaps start a
  new segment.
  """
  first_in_segment = np.zeros(num_items, np.int64)
  first_in_segment[1:] = rng.permutation(np.arange(num_items - 1) < num_segments - 1)
  return np.bincount(np.cumsum(first_in_segment), minlength=num_segments)


def random_spans_noise_mask(length: int, rng: np.random.Generator,
                            noise_density: float = NOISE_DENSITY,
                            mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> np.ndarray:
  """Boolean [length] mask, True on noise: T5's random_spans_noise_mask.

  Non-noise and noise spans alternate, starting with non-noise, so each noise span follows
  some kept context. A 1-token text is masked as 2 tokens and cropped (no noise left).
  """
  check_noise(noise_density, mean_noise_span_length)
  if length < 1:
    return np.zeros(0, bool)
  padded = max(length, 2)
  num_noise, num_spans = noise_counts(padded, noise_density, mean_noise_span_length)
  noise_lengths = _random_segmentation(num_noise, num_spans, rng)
  nonnoise_lengths = _random_segmentation(padded - num_noise, num_spans, rng)
  interleaved = np.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(-1)
  span_starts = np.cumsum(interleaved)[:-1]
  span_number = np.zeros(padded, np.int64)
  span_number[span_starts] = 1
  is_noise = np.cumsum(span_number) % 2 == 1
  return is_noise[:length]


# -- inputs and targets -------------------------------------------------------------------------


def sentinel_id(i: int, vocab_size: int) -> int:
  """The id of sentinel i: the model vocabulary's last ids, counting down (T5's extra ids)."""
  return vocab_size - 1 - i


def corrupt_spans(tokens: Sequence[int], noise_mask: Sequence[bool], *, vocab_size: int,
                  num_sentinels: int = NUM_SENTINELS,
                  eos_id: int = EOS_ID) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, targets) int32 of `tokens` with the noise spans of `noise_mask` cut out.

  Inputs: the tokens with each noise span replaced by its sentinel, then EOS. Targets: for each
  noise span i, sentinel i followed by the span's tokens; a final sentinel when the text ends
  with non-noise tokens; then EOS (the module docstring says why). `vocab_size` is the model's
  (tokenizer + sentinels). DataError if the spans need more than `num_sentinels` sentinels.

  Any mask works, also one that starts with noise (T5's masks never do; T5's code would then
  start the targets with the span's tokens and no sentinel): sentinel i always means the same
  span in inputs and targets.
  """
  tokens = np.asarray(tokens, np.int32).reshape(-1)
  mask = np.asarray(noise_mask, bool).reshape(-1)
  if tokens.shape != mask.shape:
    raise ValueError(f'tokens {tokens.shape} and noise_mask {mask.shape} differ in length')
  previous_is_noise = np.concatenate([[False], mask[:-1]])
  first_noise = mask & ~previous_is_noise
  num_spans = int(first_noise.sum())
  final_sentinel = len(mask) > 0 and not mask[-1]
  if num_spans + final_sentinel > num_sentinels:
    raise DataError(f'a text of {len(tokens)} tokens needs {num_spans + final_sentinel} '
                    f'sentinels ({num_spans} noise spans' +
                    (' and a final one' if final_sentinel else '') +
                    f') but there are only {num_sentinels}; use shorter chunks (data.max_len) '
                    'or more sentinels (tokenizer.num_sentinels)')
  sentinels = sentinel_id(np.arange(num_spans + 1), vocab_size).astype(np.int32)

  # Inputs: the first token of each noise span becomes its sentinel; the rest of it goes.
  span_of = np.cumsum(first_noise) - 1
  inputs = np.where(first_noise, sentinels[np.maximum(span_of, 0)], tokens)[~(mask & ~first_noise)]

  # Targets: the noise tokens in order, each span shifted right by the sentinels before it.
  noise_tokens, starts = tokens[mask], first_noise[mask]
  where = np.arange(len(noise_tokens)) + np.cumsum(starts)
  targets = np.empty(len(noise_tokens) + num_spans, np.int32)
  targets[where] = noise_tokens
  targets[where[starts] - 1] = sentinels[:num_spans]
  tail = [sentinels[num_spans]] if final_sentinel else []
  return (np.concatenate([inputs,
                          [eos_id]]).astype(np.int32), np.concatenate([targets, tail,
                                                                       [eos_id]]).astype(np.int32))


def span_corruption(tokens: Sequence[int], rng: np.random.Generator, *, vocab_size: int,
                    num_sentinels: int = NUM_SENTINELS, noise_density: float = NOISE_DENSITY,
                    mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH,
                    eos_id: int = EOS_ID) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, targets) of `tokens` under a fresh T5 noise mask drawn from `rng`."""
  mask = random_spans_noise_mask(len(tokens), rng, noise_density, mean_noise_span_length)
  return corrupt_spans(tokens, mask, vocab_size=vocab_size, num_sentinels=num_sentinels,
                       eos_id=eos_id)


def corrupted_lengths(length: int, noise_density: float = NOISE_DENSITY,
                      mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> tuple[int, int]:
  """(inputs, targets) lengths, EOS included, of any corruption of a `length`-token text.

  They depend on the length only, so every chunk of one length gives the same shapes.
  """
  if length < 1:
    return 1, 1
  if length == 1:  # no noise: the token, then a final sentinel in the targets
    return 2, 2
  num_noise, num_spans = noise_counts(length, noise_density, mean_noise_span_length)
  return length - num_noise + num_spans + 1, num_noise + num_spans + 1


def chunk_length(max_len: int, noise_density: float = NOISE_DENSITY,
                 mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> int:
  """The longest text whose corrupted inputs and targets (EOS included) fit in `max_len`.

  T5's random_spans_helper: the raw chunks are longer than the model's inputs by the noise
  tokens the sentinels replace, so that the corrupted inputs fill the input length.
  """
  check_noise(noise_density, mean_noise_span_length)
  if max_len < 2:
    raise ConfigError(f'max_len must be at least 2 for span corruption, got {max_len}')
  length = 1
  # Both lengths grow by 0 or 1 per token: the first one that does not fit ends the search.
  while max(corrupted_lengths(length + 1, noise_density, mean_noise_span_length)) <= max_len:
    length += 1
  return length


# -- documents to examples ----------------------------------------------------------------------


def pack_and_split(documents: Iterable[Sequence[int]], length: int) -> list[np.ndarray]:
  """Concatenates the documents' token ids and cuts the stream into `length`-token chunks.

  T5's reduce_concat_tokens + split_tokens: a long text yields many examples and short lines
  are packed together, so no chunk is mostly padding. The last chunk keeps the remainder
  (shorter; none if the stream is empty).
  """
  if length < 1:
    raise ConfigError(f'chunk length must be positive, got {length}')
  parts = [np.asarray(d, np.int32).reshape(-1) for d in documents]
  stream = np.concatenate(parts) if parts else np.zeros(0, np.int32)
  return [stream[start:start + length] for start in range(0, len(stream), length)]


def targets_length(max_len: int, noise_density: float = NOISE_DENSITY,
                   mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> int:
  """The longest targets (EOS included) of chunks cut for `max_len`, rounded up to a multiple
  of 8: batches of targets need no more columns (29 -> 32 for max_len 128), so the decoder and
  the output projection run on a quarter of the input length, not all of it."""
  length = chunk_length(max_len, noise_density, mean_noise_span_length)
  longest = max(
      corrupted_lengths(n, noise_density, mean_noise_span_length)[1] for n in range(1, length + 1))
  return min(max_len, -(-longest // 8) * 8)


def crop_targets(batch: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
  """`batch` with its 'targets' cut to `length` columns (only padding goes: every target of
  these chunks fits), so that a batch is [rows, input length] + [rows, length]."""
  if batch['targets'].shape[1] > length:
    batch = dict(batch, targets=batch['targets'][:, :length])
  return batch


class CroppedTargets:
  """An evaluation batcher whose batches' targets are cut to `length` columns (crop_targets)."""

  def __init__(self, batcher, length: int):
    self.batcher, self.length = batcher, length

  @property
  def num_examples(self) -> int:
    return self.batcher.num_examples

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return (crop_targets(batch, self.length) for batch in self.batcher)


def corrupt_chunks(
    chunks: Sequence[np.ndarray], seed, *, vocab_size: int, num_sentinels: int = NUM_SENTINELS,
    noise_density: float = NOISE_DENSITY, mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH
) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """(inputs, targets) of every chunk, in order, with masks drawn from one Generator(seed).

  `seed` is anything `np.random.default_rng` takes, e.g. (run seed, epoch).
  """
  rng = np.random.default_rng(seed)
  inputs, targets = [], []
  for chunk in chunks:
    source, target = span_corruption(chunk, rng, vocab_size=vocab_size, num_sentinels=num_sentinels,
                                     noise_density=noise_density,
                                     mean_noise_span_length=mean_noise_span_length)
    inputs.append(source)
    targets.append(target)
  return inputs, targets


class SpanCorruptionBatcher:
  """Training batches of span-corrupted chunks, corrupted afresh every epoch.

  Each epoch's pairs are `corrupt_chunks(chunks, (seed, epoch))` batched by a
  `batching.BucketedBatcher`, so a small text repeated for many epochs shows the model new
  masks each time (as RoBERTa's dynamic masking does for BERT), and the position to save is
  still {'epoch', 'position'}: the batches of an epoch are a pure function of (seed, epoch).
  Every epoch has the same number of batches (corrupted lengths depend on chunk lengths only).
  With `targets_length`, the targets of every batch are cut to that many columns
  (`crop_targets`): the bucket fits the inputs, the targets are much shorter.
  """

  def __init__(self, chunks: Sequence[np.ndarray], *, seed: int, vocab_size: int,
               num_sentinels: int = NUM_SENTINELS, noise_density: float = NOISE_DENSITY,
               mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH,
               targets_length: int | None = None, **batcher_kwargs):
    """`batcher_kwargs` go to BucketedBatcher (batch_tokens, buckets, multiple_of, ...)."""
    if not len(chunks):
      raise DataError('there is no text to corrupt: the training text has no tokens')
    self._chunks, self._seed, self._targets_length = list(chunks), int(seed), targets_length
    self._corrupt = dict(vocab_size=vocab_size, num_sentinels=num_sentinels,
                         noise_density=noise_density, mean_noise_span_length=mean_noise_span_length)
    self._batcher_kwargs = batcher_kwargs
    self._epoch, self._position = 0, 0
    self._batcher_epoch, self._batcher = None, None
    self._epoch_batcher(0)  # checks the settings now, and gives the sizes below

  def _epoch_batcher(self, epoch: int) -> batching.BucketedBatcher:
    if self._batcher_epoch != epoch:
      inputs, targets = corrupt_chunks(self._chunks, (self._seed, epoch), **self._corrupt)
      self._batcher = batching.BucketedBatcher(inputs, targets, seed=self._seed, shuffle=True,
                                               **self._batcher_kwargs)
      self._batcher_epoch = epoch
    return self._batcher

  @property
  def num_examples(self) -> int:
    return len(self._chunks)

  @property
  def num_batches_per_epoch(self) -> int:
    return self._batcher.num_batches_per_epoch

  @property
  def global_rows(self) -> list[int]:
    return self._batcher.global_rows

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    """Endless; shares the position with the batcher, like BucketedBatcher's iterator."""
    while True:
      epoch = self._epoch
      batcher = self._epoch_batcher(epoch)
      batcher.restore({'epoch': epoch, 'position': self._position})
      for batch in batcher:
        state = batcher.state()
        self._epoch, self._position = state['epoch'], state['position']
        yield batch if self._targets_length is None else crop_targets(batch, self._targets_length)
        if self._epoch != epoch:
          break  # the next epoch has new masks: corrupt again

  def state(self) -> dict[str, int]:
    return {'epoch': self._epoch, 'position': self._position}

  def restore(self, state: dict[str, int]) -> None:
    """Restores a position from `state()` (checked against this data's epoch size)."""
    batcher = self._epoch_batcher(self._epoch)
    batcher.restore(state)  # validates, and rolls a position at the end into the next epoch
    state = batcher.state()
    self._epoch, self._position = state['epoch'], state['position']


# -- tokenizers for text-to-text models ---------------------------------------------------------

_SENTINEL_TEXT = re.compile(r'<extra_id_(\d+)>')


class SentinelTokenizer:
  """A tokenizer with `num_sentinels` extra ids on top: the model vocabulary of a T5.

  vocab_size = the base tokenizer's + num_sentinels; sentinel i is id vocab_size - 1 - i and
  reads and writes as '<extra_id_i>' (T5's spelling), so corrupted text can be typed in
  (`--mode=translate`) and model outputs show which span they fill.
  """

  def __init__(self, base, num_sentinels: int = NUM_SENTINELS):
    if num_sentinels < 1:
      raise ConfigError(f'num_sentinels must be positive, got {num_sentinels}')
    self.base, self.num_sentinels = base, int(num_sentinels)

  @property
  def vocab_size(self) -> int:
    return self.base.vocab_size + self.num_sentinels

  @property
  def serialized_proto(self) -> bytes:
    return self.base.serialized_proto

  def sentinel_id(self, i: int) -> int:
    return sentinel_id(i, self.vocab_size)

  def sentinel_index(self, token_id: int) -> int | None:
    """i for sentinel i's id, else None."""
    i = self.vocab_size - 1 - int(token_id)
    return i if 0 <= i < self.num_sentinels else None

  def encode(self, text: str) -> list[int]:
    """Subword ids of `text`, '<extra_id_i>' (i < num_sentinels) as sentinel i; no EOS."""
    ids, start = [], 0
    for match in _SENTINEL_TEXT.finditer(text):
      i = int(match.group(1))
      if i >= self.num_sentinels:
        continue  # not a sentinel of this vocabulary: plain text
      if text[start:match.start()].strip():
        ids += self.base.encode(text[start:match.start()])
      ids.append(self.sentinel_id(i))
      start = match.end()
    if text[start:].strip() or not ids:
      ids += self.base.encode(text[start:])
    return ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    if not any('<extra_id_' in t for t in texts):  # the common case: SentencePiece's threads
      return self.base.encode_batch(texts)
    return [self.encode(t) for t in texts]

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids` up to the first EOS, PAD and BOS dropped, sentinels as '<extra_id_i>'."""
    if hasattr(ids, '__array__'):
      ids = np.asarray(ids).reshape(-1).tolist()
    parts, run = [], []
    for token in map(int, ids):
      if token == EOS_ID:
        break
      if token in (PAD_ID, BOS_ID):
        continue
      i = self.sentinel_index(token)
      if i is None:
        run.append(token)
        continue
      if run:
        parts.append(self.base.decode(run))
        run = []
      parts.append(f'<extra_id_{i}>')
    if run:
      parts.append(self.base.decode(run))
    return ' '.join(part for part in parts if part)

  def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
    return [self.decode(ids) for ids in batch]


class PrefixedTokenizer:
  """Prepends a task prefix (e.g. 'translate English to German: ') to every text it encodes.

  T5 casts every task as text to text and tells the tasks apart by such a prefix on the input.
  Wrapping the source tokenizer puts it on the source at every use: training and validation
  batches, the sentences translated for BLEU, and --mode=translate. Decoding is the base's.
  """

  def __init__(self, base, prefix: str):
    self.base, self.prefix = base, prefix

  @property
  def vocab_size(self) -> int:
    return self.base.vocab_size

  @property
  def serialized_proto(self) -> bytes:
    return self.base.serialized_proto

  def encode(self, text: str) -> list[int]:
    return self.base.encode(self.prefix + text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self.base.encode_batch([self.prefix + t for t in texts])

  def decode(self, ids: Iterable[int]) -> str:
    return self.base.decode(ids)

  def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
    return self.base.decode_batch(batch)
