"""SentencePiece subword tokenizer with the project's fixed special ids.

Every model, batcher and decoder in the project relies on these ids, so they are
module constants rather than something read from each tokenizer file.
"""

import io
import os
import random
import re
from collections.abc import Callable, Iterable, Sequence

from absl import logging
import numpy as np
import sentencepiece as spm

from transformer_jax.errors import DataError
from transformer_jax.files import write_atomically
from transformer_jax.special_tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID


class SentencePieceEncoding:
  """Text to ids with a SentencePiece processor (`self.processor`): what this project's
  tokenizer and an imported model's tokenizer.model (hf_tokenizer) share."""

  processor: spm.SentencePieceProcessor

  def encode(self, text: str) -> list[int]:
    """Returns the subword ids of `text`, without EOS (batching adds it)."""
    return self.processor.encode(text, out_type=int)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Encodes many texts at once; SentencePiece spreads the work over threads."""
    return self.processor.encode(list(texts), out_type=int)


class Tokenizer(SentencePieceEncoding):
  """Turns text into subword ids and back."""

  def __init__(self, processor: spm.SentencePieceProcessor):
    self.processor = processor
    # A file trained elsewhere with other special ids would silently corrupt training
    # (e.g. padding that the loss does not mask), so refuse it early.
    actual = (processor.pad_id(), processor.eos_id(), processor.bos_id(), processor.unk_id())
    if actual != (PAD_ID, EOS_ID, BOS_ID, UNK_ID):
      raise DataError(f'tokenizer has special ids pad/eos/bos/unk = {actual}, expected '
                      f'{(PAD_ID, EOS_ID, BOS_ID, UNK_ID)}; train it with this project')

  @classmethod
  def from_serialized(cls, serialized_proto: bytes) -> 'Tokenizer':
    """Builds a tokenizer from the bytes of a SentencePiece model file."""
    processor = spm.SentencePieceProcessor()
    try:
      processor.LoadFromSerializedProto(serialized_proto)
    except (RuntimeError, OSError) as e:
      raise DataError(f'not a valid SentencePiece model: {e}') from None
    return cls(processor)

  @classmethod
  def from_file(cls, path: str) -> 'Tokenizer':
    """Loads a SentencePiece model file written by `train_tokenizer`."""
    if not os.path.isfile(path):
      raise DataError(f'tokenizer model {path} is missing from the workdir; rerun training with '
                      'the same config and data to recreate it (it is trained automatically '
                      'when absent, and the result is deterministic)')
    with open(path, 'rb') as f:
      serialized = f.read()
    try:
      return cls.from_serialized(serialized)
    except DataError as e:
      raise DataError(f'{path}: {e}; delete it to have it trained again') from None

  @property
  def vocab_size(self) -> int:
    return self.processor.get_piece_size()

  @property
  def serialized_proto(self) -> bytes:
    """The model file's bytes, e.g. to store the tokenizer inside a checkpoint."""
    return self.processor.serialized_model_proto()

  def _clean_ids(self, ids: Iterable[int]) -> list[int]:
    """Cuts at the first EOS and removes PAD and BOS, as a model's output needs."""
    if hasattr(ids, '__array__'):  # A NumPy or JAX array: convert in one go, not per element.
      ids = np.asarray(ids).reshape(-1).tolist()
    cleaned = []
    for i in map(int, ids):
      if i == EOS_ID:
        break
      if i in (PAD_ID, BOS_ID):
        continue
      # Models often round the vocabulary up to a multiple of 128 for speed, so they
      # can emit ids the tokenizer does not know; show those as unknown.
      cleaned.append(i if 0 <= i < self.vocab_size else UNK_ID)
    return cleaned

  def decode(self, ids: Iterable[int]) -> str:
    """Turns ids back into text, stopping at the first EOS and ignoring PAD and BOS."""
    return self.processor.decode(self._clean_ids(ids))

  def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
    """Decodes each row of `batch` (a list of id lists or a 2-D array)."""
    return self.processor.decode([self._clean_ids(ids) for ids in batch])


def _sample_sentences(texts: Iterable[str], max_sentences: int, seed: int) -> list[str]:
  """Keeps at most `max_sentences` non-empty texts, a uniform sample if there are more.

  Reservoir sampling reads the corpus once with bounded memory, and a fixed seed
  makes the sample (and so the trained tokenizer) the same on every run.
  """
  rng = random.Random(seed)
  sample: list[str] = []
  seen = 0
  for text in texts:
    if not text:
      continue
    seen += 1
    if len(sample) < max_sentences:
      sample.append(text)
    else:
      slot = rng.randrange(seen)
      if slot < max_sentences:
        sample[slot] = text
  if seen > max_sentences:
    logging.info('tokenizer: training on %d of %d sentences', max_sentences, seen)
  return sample


def train_tokenizer(texts: Iterable[str], model_path: str, vocab_size: int, *,
                    model_type: str = 'unigram', character_coverage: float = 1.0,
                    max_sentences: int = 2_000_000, seed: int = 0) -> Tokenizer:
  """Trains a SentencePiece model on `texts`, saves it to `model_path`, returns it.

  `character_coverage` below 1.0 (e.g. 0.9995) maps the rarest characters to UNK,
  which helps scripts with huge alphabets; 1.0 keeps every character seen.
  """
  sentences = _sample_sentences(texts, max_sentences, seed)
  if not sentences:
    raise DataError(f'cannot train the tokenizer {model_path}: the training text is empty')
  model = io.BytesIO()
  # SentencePiece keeps a global random generator (used by some model types).
  spm.set_random_generator_seed(seed)
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        pad_id=PAD_ID,
        eos_id=EOS_ID,
        bos_id=BOS_ID,
        unk_id=UNK_ID,
        # We sampled already; a second, unseeded sample would break determinism.
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=1,  # SentencePiece's progress lines drown everything else.
    )
  except RuntimeError as e:
    too_high = re.search(r'Vocabulary size too high.*', str(e))
    if too_high:
      raise DataError(f'cannot train the tokenizer {model_path} with vocab_size={vocab_size} '
                      f'on {len(sentences)} sentences: {too_high.group(0)} Use a smaller '
                      'vocab_size or more text') from None
    raise DataError(f'cannot train the tokenizer {model_path}: {e}') from None
  write_atomically(model_path, model.getvalue())
  tokenizer = Tokenizer.from_serialized(model.getvalue())
  logging.info('trained a %s tokenizer with %d pieces on %d sentences, saved to %s', model_type,
               tokenizer.vocab_size, len(sentences), model_path)
  return tokenizer


def load_or_train_tokenizer(model_path: str, texts_fn: Callable[[], Iterable[str]], vocab_size: int,
                            **kwargs) -> Tokenizer:
  """Loads `model_path` if it exists, else trains it on `texts_fn()` and saves it.

  `texts_fn` is a function so that the (possibly large) corpus is only read when
  a tokenizer really has to be trained. `kwargs` go to `train_tokenizer`.
  """
  if os.path.isfile(model_path):
    tokenizer = Tokenizer.from_file(model_path)
    logging.info('reusing tokenizer %s (%d pieces)', model_path, tokenizer.vocab_size)
    if tokenizer.vocab_size != vocab_size:
      logging.warning(
          'tokenizer %s has %d pieces but vocab_size=%d was requested; using the '
          'existing file', model_path, tokenizer.vocab_size, vocab_size)
    return tokenizer
  logging.info('tokenizer %s not found, training one', model_path)
  return train_tokenizer(texts_fn(), model_path, vocab_size, **kwargs)
