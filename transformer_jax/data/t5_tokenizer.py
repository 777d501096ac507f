"""A Hugging Face T5 tokenizer as the translation workflow uses one (T5's ids, its sentinels).

Fine-tuning a pretrained T5 from a Hugging Face directory (init.hf_dir, workflows/t5_init.py)
tokenizes with the checkpoint's own tokenizer: its tokenizer.json (`hf_tokenizer.HFTokenizer`),
or a bare spiece.model under the sentinel ids transformers adds on top. `load_hf_t5_tokenizer`
reads either and checks that pad and eos are T5's (and the project's) 0 and 1.
"""

import json
import os

import numpy as np
import sentencepiece as spm

from transformer_jax.data import span_corruption
from transformer_jax.data.hf_tokenizer import HFTokenizer
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.special_tokens import EOS_ID, PAD_ID

# The tokenizer files an HF T5 directory may hold: tokenizer.json is read first.
SPIECE_MODEL, TOKENIZER_JSON = 'spiece.model', 'tokenizer.json'


class HFT5Tokenizer:
  """A Hugging Face T5 tokenizer as the translation workflow uses one.

  T5's ids are pad 0, eos 1, unk 2 and the sentinels '<extra_id_i>' at the top of the
  vocabulary (id vocab_size - 1 - i); the batcher and decoding here rely on PAD_ID 0 and
  EOS_ID 1, which agree, while BOS_ID 2 is T5's unk, so decoding must not drop it as the
  project's own tokenizers do. `base` is a `data/hf_tokenizer.HFTokenizer` (tokenizer.json,
  which lists the sentinels) or a bare spiece.model under `num_sentinels` extra ids, as
  transformers adds them.
  """

  def __init__(self, base, num_sentinels: int = 0):
    self.base, self.num_sentinels = base, int(num_sentinels)
    self._encoder = (span_corruption.SentinelTokenizer(base, self.num_sentinels)
                     if self.num_sentinels else base)

  def __repr__(self) -> str:
    return f'HFT5Tokenizer({self.base!r}, num_sentinels={self.num_sentinels})'

  @property
  def vocab_size(self) -> int:
    return self.base.vocab_size + self.num_sentinels

  @property
  def sentinels(self) -> int:
    """How many T5 sentinels the vocabulary ends with ('<extra_id_i>' at id vocab_size - 1 - i):
    those on top of a bare spiece.model, or those a tokenizer.json lists there."""
    if self.num_sentinels or not hasattr(self.base, 'token_to_id'):  # a bare spiece.model
      return self.num_sentinels
    count = 0
    while self.base.token_to_id(f'<extra_id_{count}>') == self.vocab_size - 1 - count:
      count += 1
    return count

  def encode(self, text: str) -> list[int]:
    """Ids of `text` ('<extra_id_i>' as sentinel i), no EOS: the batcher appends it."""
    return self._encoder.encode(text)

  def encode_batch(self, texts) -> list[list[int]]:
    return self._encoder.encode_batch(texts)

  def decode(self, ids) -> str:
    """Text of `ids` up to the first EOS, without PAD and ids beyond the tokenizer (rows a
    checkpoint's embedding has on top, e.g. t5-small's last 28)."""
    if hasattr(ids, '__array__'):  # a NumPy or JAX array: convert in one go
      ids = np.asarray(ids).reshape(-1).tolist()
    kept = []
    for token in map(int, ids):
      if token == EOS_ID:
        break
      if token != PAD_ID and 0 <= token < self.vocab_size:
        kept.append(token)
    if not self.num_sentinels:
      return self.base.decode(kept)
    # As transformers decodes the sentinels it adds: each as its text, the pieces between them
    # as the SentencePiece model writes them, with the space a word-initial piece stands for.
    parts, run = [], []

    def flush():
      if run:
        space = ' ' if parts and self.base.starts_word(run[0]) else ''
        parts.append(space + self.base.decode(run))
        run.clear()

    for token in kept:
      if token < self.base.vocab_size:
        run.append(token)
        continue
      flush()
      parts.append(f'<extra_id_{self.vocab_size - 1 - token}>')
    flush()
    return ''.join(parts)

  def decode_batch(self, batch) -> list[str]:
    return [self.decode(ids) for ids in batch]


class _SentencePieceIds:
  """A bare spiece.model with its own ids (T5's: pad 0, eos 1, unk 2, no bos)."""

  def __init__(self, path: str):
    self.processor = spm.SentencePieceProcessor()
    try:
      with open(path, 'rb') as f:
        self.processor.LoadFromSerializedProto(f.read())
    except (OSError, RuntimeError) as e:
      raise DataError(f'cannot read {path} as a SentencePiece model: {e}') from None
    self.pad_id, self.eos_id = self.processor.pad_id(), self.processor.eos_id()

  def __repr__(self) -> str:
    return f'SentencePiece({self.vocab_size} pieces)'

  @property
  def vocab_size(self) -> int:
    return self.processor.get_piece_size()

  def encode(self, text: str) -> list[int]:
    return self.processor.encode(text, out_type=int)

  def encode_batch(self, texts) -> list[list[int]]:
    return self.processor.encode(list(texts), out_type=int)

  def decode(self, ids: list[int]) -> str:
    return self.processor.decode(ids)

  def starts_word(self, i: int) -> bool:
    """Whether piece `i` begins a word ('▁' first: a space before it in running text)."""
    return self.processor.id_to_piece(i).startswith('\u2581')


def load_hf_t5_tokenizer(directory: str, *, copied: bool = False) -> HFT5Tokenizer:
  """The T5 tokenizer of an HF directory (or of its copy in a workdir, `copied`):
  tokenizer.json, else spiece.model with tokenizer_config.json's extra_ids (100 if unnamed)
  as sentinels. ConfigError unless its pad and eos are T5's 0 and 1."""
  path = lambda name: os.path.join(directory, name)
  if os.path.isfile(path(TOKENIZER_JSON)):
    base, count = HFTokenizer.from_dir(directory), 0
  elif os.path.isfile(path(SPIECE_MODEL)):
    base, count = _SentencePieceIds(path(SPIECE_MODEL)), 100
    if os.path.isfile(path('tokenizer_config.json')):
      with open(path('tokenizer_config.json'), encoding='utf-8') as f:
        count = int(json.load(f).get('extra_ids', count))
  elif copied:
    raise ConfigError(f'{directory} holds no {TOKENIZER_JSON} or {SPIECE_MODEL}: a fine-tuning '
                      'run copies init.hf_dir\'s tokenizer files there before its first step; '
                      'copy them back from there')
  else:
    raise ConfigError(f'init.hf_dir {directory} has no {TOKENIZER_JSON} or {SPIECE_MODEL}: put '
                      "the checkpoint's T5 tokenizer beside it (tokenizer.save_pretrained)")
  if (base.pad_id, base.eos_id) != (PAD_ID, EOS_ID):
    raise ConfigError(f'the tokenizer in {directory} has pad id {base.pad_id} and eos id '
                      f'{base.eos_id}; a T5 tokenizer has pad {PAD_ID} and eos {EOS_ID}')
  return HFT5Tokenizer(base, count)
