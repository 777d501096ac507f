"""Our configs, params and tokenizers -> a Hugging Face model directory `transformers` loads.

What the Hugging Face format asks, and nothing about workdirs (workflows/export.py reads a
trained workdir with each workflow's own functions and calls these):

  converters(family, heads, special_ids) -> (config_to_hf, export_state_dict) of a family of
      convert/families.py (encoders: the class holding exactly the params' heads,
      ...ForPreTraining, ...ForMaskedLM, ...ForSequenceClassification or ...Model);
  tokenizer_files(tokenizer, max_len) -> TokenizerFiles: a tokenizer as files an HF tokenizer
      class loads with the same ids: a character vocabulary as a `tokenizers` tokenizer.json
      (one token per character), SentencePiece as tokenizer.json (converted the way
      `transformers` converts it) plus the original tokenizer.model (T5's sentinels on top as
      '<extra_id_i>'), WordPiece as vocab.txt (BertTokenizer, the same lowercasing), a
      byte-level BPE (`data/hf_tokenizer.HFTokenizer`, RoBERTa's `RobertaTokenizer`) or an
      imported ALBERT's `AlbertTokenizer` as its own saved files;
  write_hf_directory(out_dir, hf_config, state_dict, tokenizer_writer): float32
      model.safetensors, config.json and the tokenizer files, written into a temporary
      sibling directory renamed into place: an error leaves nothing behind, and an existing
      non-empty output directory is refused, never overwritten.

SentencePiece language models saw every document after an EOS: prompts for the exported model
should start with its eos_token, as `data/lm.prompt_ids` does here.
"""

import dataclasses
import json
import os
import re
import shutil
import tempfile
from typing import Any, Callable

import numpy as np
import tokenizers
from absl import logging
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from transformer_jax.convert import families
from transformer_jax.data.albert_tokenizer import AlbertTokenizer
from transformer_jax.data.hf_tokenizer import HFTokenizer
from transformer_jax.data.lm import CharTokenizer
from transformer_jax.data.roberta_tokenizer import RobertaTokenizer
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.data.wordpiece import WordPieceTokenizer
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.special_tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID

CONFIG_FILE = 'config.json'
WEIGHTS_FILE = 'model.safetensors'
TOKENIZER_CONFIG_FILE = 'tokenizer_config.json'

# -- the directory ------------------------------------------------------------------------------


def check_out_dir(out_dir: str) -> str:
  """The absolute output path; ConfigError if it exists and is not an empty directory."""
  if not out_dir:
    raise ConfigError('--out is required: a new directory for the Hugging Face model')
  out_dir = os.path.abspath(os.path.expanduser(out_dir))
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
    raise ConfigError(f'{out_dir} exists and is not an empty directory: choose a new --out (an '
                      'export never overwrites files)')
  return out_dir


def write_hf_directory(out_dir: str, hf_config: dict, state_dict: dict[str, Any],
                       tokenizer_writer: Callable[[str], None] | None = None) -> str:
  """Writes config.json, model.safetensors and the tokenizer files (`tokenizer_writer(dir)`).

  All are written into a temporary sibling directory renamed to `out_dir` at the end, so on any
  error nothing is left half written. Refuses (ConfigError) an `out_dir` that exists and is not
  an empty directory. Returns the absolute `out_dir`.
  """
  out_dir = check_out_dir(out_dir)
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=f'.{os.path.basename(out_dir)}.tmp-')
  try:
    with open(os.path.join(tmp, CONFIG_FILE), 'w', encoding='utf-8') as f:
      json.dump(hf_config, f, indent=2, sort_keys=True)
      f.write('\n')
    # 'format': 'pt' is the metadata transformers requires of a safetensors checkpoint.
    save_file({k: np.ascontiguousarray(v) for k, v in state_dict.items()},
              os.path.join(tmp, WEIGHTS_FILE), metadata={'format': 'pt'})
    if tokenizer_writer is not None:
      tokenizer_writer(tmp)
    # mkdtemp makes an owner-only directory (and safetensors owner-only files): normal ones.
    os.chmod(tmp, 0o755)
    for name in os.listdir(tmp):
      os.chmod(os.path.join(tmp, name), 0o644)
    try:
      os.replace(tmp, out_dir)  # replaces an empty directory; fails on a non-empty one
    except OSError as error:
      raise ConfigError(f'cannot create {out_dir} ({error.strerror}): choose a new --out') from None
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  logging.info('wrote %s: %d tensors, %s', out_dir, len(state_dict), sorted(os.listdir(out_dir)))
  return out_dir


# -- tokenizers ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenizerFiles:
  """What an exported directory needs of a tokenizer: its size, the special ids config.json
  names (e.g. {'eos_token_id': 1}), and a function writing its files into a directory."""
  vocab_size: int
  special_ids: dict
  write: Callable[[str], None]


def _write_json(directory: str, name: str, value: dict) -> None:
  with open(os.path.join(directory, name), 'w', encoding='utf-8') as f:
    json.dump(value, f, indent=2, sort_keys=True, ensure_ascii=False)
    f.write('\n')


def char_tokenizer_files(tokenizer, max_len: int) -> TokenizerFiles:
  """`data/lm.CharTokenizer` as tokenizer.json: a `tokenizers` BPE model with no merges (so
  every character is one token, id = its index in the vocabulary), no normaliser or
  pre-tokeniser (text is taken as it is), decoded by joining the characters."""

  def write(directory: str):
    chars = tokenizer.chars
    vocab = {c: i for i, c in enumerate(chars)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    backend.save(os.path.join(directory, 'tokenizer.json'))
    _write_json(
        directory, TOKENIZER_CONFIG_FILE, {
            'tokenizer_class': 'PreTrainedTokenizerFast', 'clean_up_tokenization_spaces': False,
            'model_max_length': max_len
        })

  return TokenizerFiles(tokenizer.vocab_size, {}, write)


def sentencepiece_backend(serialized: bytes):
  """A `tokenizers.Tokenizer` encoding like the SentencePiece model `serialized` (its bytes).

  The conversion `transformers` applies to a tokenizer.model (convert_slow_tokenizer's
  SpmConverter.build_tokenizer_from_spm_proto), done here with `tokenizers` alone: the model's
  normaliser (precompiled charsmap, whitespace rules, dummy prefix), Unigram or BPE pieces
  (merges ranked by piece score), control and unknown pieces as special tokens.
  """
  try:
    # lazy: protobuf, which this module needs and sentencepiece does not, is optional
    from sentencepiece import sentencepiece_model_pb2
  except ImportError:
    raise ConfigError('exporting a SentencePiece tokenizer needs protobuf: pip install '
                      'protobuf') from None
  Piece = sentencepiece_model_pb2.ModelProto.SentencePiece  # piece types: NORMAL, CONTROL, ...
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(serialized)
  trainer, spec = proto.trainer_spec, proto.normalizer_spec
  pieces = list(proto.pieces)
  byte_fallback = trainer.byte_fallback
  user_defined = [p.piece for p in pieces if p.type == Piece.USER_DEFINED]
  if trainer.model_type == sentencepiece_model_pb2.TrainerSpec.UNIGRAM:
    model = models.Unigram([(p.piece, p.score) for p in pieces], unk_id=trainer.unk_id,
                           byte_fallback=byte_fallback)
  elif trainer.model_type == sentencepiece_model_pb2.TrainerSpec.BPE:
    normal = {p.piece: (p.score, i) for i, p in enumerate(pieces) if p.type == Piece.NORMAL}
    ranked = sorted((-score, i, token[:cut], token[cut:])
                    for token, (score, i) in normal.items()
                    for cut in range(1, len(token))
                    if token[:cut] in normal and token[cut:] in normal)
    merges = [(left, right) for _, _, left, right in ranked]
    model = models.BPE(vocab={p.piece: i for i, p in enumerate(pieces)}, merges=merges,
                       unk_token=pieces[trainer.unk_id].piece, fuse_unk=True,
                       byte_fallback=byte_fallback, dropout=None, ignore_merges=bool(user_defined))
  else:
    raise DataError('only Unigram and BPE SentencePiece models can be exported, not model_type '
                    f'{sentencepiece_model_pb2.TrainerSpec.ModelType.Name(trainer.model_type)}')
  backend = tokenizers.Tokenizer(model)
  steps = []
  if spec.precompiled_charsmap:
    steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
  if spec.remove_extra_whitespaces:  # spaces only: SentencePiece leaves newlines alone
    steps += [
        normalizers.Replace(Regex(r'\A +| +\z'), ''),
        normalizers.Replace(Regex(' {2,}'), ' ')
    ]
  if spec.escape_whitespaces:
    steps.append(normalizers.Replace(' ', '▁'))
  if spec.add_dummy_prefix:  # Metaspace skips the prefix of a text starting with '▁'; spm doesn't
    steps.append(normalizers.Replace(Regex(r'\A▁'), '▁▁'))
  backend.normalizer = normalizers.Sequence(steps)
  splitters = []
  if spec.add_dummy_prefix:
    splitters.append(pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='always',
                                              split=False))
  if user_defined:  # emitted whole and never merged
    pattern = '|'.join(map(re.escape, sorted(user_defined, key=len, reverse=True)))
    splitters.append(pre_tokenizers.Split(Regex(pattern), behavior='isolated'))
  if splitters:
    backend.pre_tokenizer = pre_tokenizers.Sequence(splitters)
  steps = [decoders.Replace('▁', ' ')]
  if byte_fallback:
    steps.append(decoders.ByteFallback())
  if spec.add_dummy_prefix:
    steps += [decoders.Fuse(), decoders.Strip(content=' ', left=1)]
  elif byte_fallback:
    steps.append(decoders.Fuse())
  backend.decoder = decoders.Sequence(steps)
  special = (Piece.CONTROL, Piece.UNKNOWN)
  backend.add_special_tokens(
      [AddedToken(p.piece, special=True, normalized=False) for p in pieces if p.type in special])
  return backend


def sentencepiece_tokenizer_files(tokenizer, max_len: int,
                                  num_sentinels: int = 0) -> TokenizerFiles:
  """`data/tokenizer.Tokenizer` (pad 0, eos 1, bos 2, unk 3) as tokenizer.json (see
  `sentencepiece_backend`), the original tokenizer.model, and a tokenizer_config.json naming
  the special pieces; adds no BOS/EOS by itself, as `Tokenizer.encode`.

  `num_sentinels` > 0 (a T5 vocabulary, data/span_corruption.SentinelTokenizer) appends the
  sentinels as special tokens '<extra_id_i>' with id vocab_size - 1 - i, T5's layout.
  """
  serialized = tokenizer.serialized_proto
  base_size = tokenizer.vocab_size
  sentinels = [f'<extra_id_{i}>' for i in reversed(range(num_sentinels))]  # ids base_size, ...

  def write(directory: str):
    backend = sentencepiece_backend(serialized)
    taken = [t for t in sentinels if backend.token_to_id(t) is not None]
    if taken:
      raise DataError(f'the SentencePiece model already has the piece {taken[0]}, which T5 '
                      'uses for a sentinel id on top of the vocabulary')
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in sentinels])
    backend.save(os.path.join(directory, 'tokenizer.json'))
    with open(os.path.join(directory, 'tokenizer.model'), 'wb') as f:
      f.write(serialized)
    piece = backend.id_to_token
    _write_json(
        directory, TOKENIZER_CONFIG_FILE,
        dict(tokenizer_class='PreTrainedTokenizerFast', pad_token=piece(PAD_ID),
             eos_token=piece(EOS_ID), bos_token=piece(BOS_ID), unk_token=piece(UNK_ID),
             add_bos_token=False, add_eos_token=False, clean_up_tokenization_spaces=False,
             model_max_length=max_len))

  return TokenizerFiles(base_size + num_sentinels,
                        {'pad_token_id': PAD_ID, 'eos_token_id': EOS_ID, 'bos_token_id': BOS_ID},
                        write)


def wordpiece_tokenizer_files(tokenizer, max_len: int) -> TokenizerFiles:
  """`data/wordpiece.WordPieceTokenizer` as vocab.txt + tokenizer_config.json for
  `BertTokenizer` (and BertTokenizerFast): the same ids and the same lowercasing."""

  def write(directory: str):
    tokenizer.save(os.path.join(directory, 'vocab.txt'))
    token = tokenizer.id_to_token
    _write_json(
        directory, TOKENIZER_CONFIG_FILE,
        dict(tokenizer_class='BertTokenizer', do_lower_case=bool(tokenizer.lowercase),
             strip_accents=None, tokenize_chinese_chars=True, pad_token=token(tokenizer.pad_id),
             unk_token=token(tokenizer.unk_id), cls_token=token(tokenizer.cls_id),
             sep_token=token(tokenizer.sep_id), mask_token=token(tokenizer.mask_id),
             clean_up_tokenization_spaces=False, model_max_length=max_len))

  return TokenizerFiles(tokenizer.vocab_size, {'pad_token_id': tokenizer.pad_id}, write)


def roberta_tokenizer_files(tokenizer, max_len: int) -> TokenizerFiles:
  """A `data/roberta_tokenizer.RobertaTokenizer`'s files (config.json's ids in HF's numbering)."""
  return TokenizerFiles(tokenizer.vocab_size, tokenizer.hf_special_ids,
                        lambda directory: tokenizer.save(directory, max_len))


def albert_tokenizer_files(tokenizer) -> TokenizerFiles:
  """A `data/albert_tokenizer.AlbertTokenizer` (an imported ALBERT's SentencePiece
  tokenizer.json): its own `save`, which transformers' AutoTokenizer reads with the same ids."""
  return TokenizerFiles(tokenizer.vocab_size, {'pad_token_id': tokenizer.pad_id}, tokenizer.save)


def hf_tokenizer_files(tokenizer) -> TokenizerFiles:
  """A `data/hf_tokenizer.HFTokenizer` (e.g. a workdir's byte-level BPE): its own `save`."""
  ids = {
      f'{name}_token_id': getattr(tokenizer, f'{name}_id', None) for name in ('bos', 'eos', 'pad')
  }
  return TokenizerFiles(tokenizer.vocab_size, {k: v for k, v in ids.items() if v is not None},
                        tokenizer.save)


def tokenizer_files(tokenizer, max_len: int) -> TokenizerFiles:
  """The files of any tokenizer of this package, by its class: `data/lm.CharTokenizer`,
  `data/tokenizer.Tokenizer` (SentencePiece), `data/wordpiece.WordPieceTokenizer`,
  `data/hf_tokenizer.HFTokenizer`, `data/roberta_tokenizer.RobertaTokenizer` or
  `data/albert_tokenizer.AlbertTokenizer`.

  A tokenizer with `num_sentinels` ids on top of its `base` (data/span_corruption's
  SentinelTokenizer, a T5 workflow's tokenizer) is its base's files plus T5's '<extra_id_i>'
  tokens; only a SentencePiece base can take them. Anything else: one ConfigError naming it.
  """
  base, sentinels = tokenizer, 0
  while hasattr(base, 'num_sentinels') and hasattr(base, 'base'):
    base, sentinels = base.base, sentinels + int(base.num_sentinels)
  if isinstance(base, Tokenizer):
    return sentencepiece_tokenizer_files(base, max_len, sentinels)
  writers = ((CharTokenizer, lambda t: char_tokenizer_files(t, max_len)),
             (WordPieceTokenizer, lambda t: wordpiece_tokenizer_files(t, max_len)),
             (HFTokenizer, hf_tokenizer_files), (RobertaTokenizer,
                                                 lambda t: roberta_tokenizer_files(t, max_len)),
             (AlbertTokenizer, albert_tokenizer_files))
  for kind, writer in writers:
    if isinstance(base, kind) and not sentinels:
      return writer(base)
  extra = f' with {sentinels} sentinel ids on top' if sentinels else ''
  raise ConfigError(f'cannot export the tokenizer {base!r}{extra}: a character, SentencePiece '
                    '(spm.model), WordPiece, byte-level BPE or Hugging Face tokenizer.json one '
                    'can be')


# -- model families -----------------------------------------------------------------------------


def converters(family: str, heads: dict | None = None, special_ids: dict | None = None):
  """(config_to_hf(cfg) -> dict, export_state_dict(cfg, params) -> dict) of the family called
  `family` (convert/families.py: `Family.exporters` says what `heads` and `special_ids` are)."""
  return families.named(family).exporters(heads, special_ids)
