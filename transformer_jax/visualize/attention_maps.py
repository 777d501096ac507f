"""Attention weights read from the model itself, labelled with their tokens.

Every `MultiHeadAttention` sows its softmax weights [B, H, T, S] into the 'intermediates'
collection when that collection is mutable (and then always uses the weight-returning reference
attention, whatever `attention_implementation` says). `collect_attention` runs one forward pass
that way; nothing here re-implements attention.
"""

import collections
import dataclasses
import functools
import re
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import sentencepiece as spm
from jax.experimental import multihost_utils

from transformer_jax.data import lm as lm_data
from transformer_jax.errors import DataError
from transformer_jax.special_tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID

WEIGHTS_NAME = 'attention_weights'  # what MultiHeadAttention sows


@dataclasses.dataclass
class AttentionMap:
  """The weights of one attention module for one sequence, with what its axes mean."""
  name: str  # module path, e.g. 'decoder/layer_1/cross_attention'
  weights: np.ndarray  # [H, T, S]; each row (a query) sums to 1 over the keys it may see
  queries: list[str]  # T row labels
  keys: list[str]  # S column labels
  query_axis: str = 'query'
  key_axis: str = 'key'

  @property
  def layer(self) -> str:
    """The module path without its last part: 'decoder/layer_1'."""
    return self.name.rsplit('/', 1)[0] if '/' in self.name else self.name

  @property
  def kind(self) -> str:
    """The stack and attention type without the layer: 'decoder/cross_attention'."""
    return '/'.join(p for p in self.name.split('/') if not _LAYER.fullmatch(p))


_LAYER = re.compile(r'layer_(\d+)')
_STACK_ORDER = {'encoder': 0, 'decoder': 1}
_ATTENTION_ORDER = {'self_attention': 0, 'cross_attention': 1}


def _module_order(name: str):
  """Encoder before decoder, layer 2 before layer 10, self- before cross-attention."""
  key = []
  for part in name.split('/'):
    layer = _LAYER.fullmatch(part)
    if layer:
      key.append((1, int(layer.group(1)), ''))
    else:
      key.append((0, _STACK_ORDER.get(part, _ATTENTION_ORDER.get(part, 2)), part))
  return key


@functools.partial(jax.jit, static_argnames=('model', 'method'))
def _sown_weights(model: nn.Module, params, args, method: str | None):
  _, state = model.apply({'params': params}, *args, method=method, mutable=['intermediates'])
  return state['intermediates']


def collect_attention(model: nn.Module, params, *args,
                      method: str | None = None) -> dict[str, np.ndarray]:
  """{module path: float32 [B, H, T, S]} from one deterministic forward pass, in model order.

  `args` are the model's (or `method`'s, named by a string) positional inputs. The pass is
  jit-compiled (once per model, method and input shapes) and replicated, not split over a
  mesh: it is a handful of rows.
  """
  with nn.logical_axis_rules(()):
    sown = _sown_weights(model, params, tuple(args), method)
  if jax.process_count() > 1:  # the output may be split over hosts: gather it everywhere
    sown = multihost_utils.process_allgather(sown, tiled=True)
  sown = jax.device_get(sown)
  found = {}
  for path, values in jax.tree_util.tree_flatten_with_path(
      sown, is_leaf=lambda x: isinstance(x, tuple))[0]:
    names = [getattr(p, 'key', str(p)) for p in path]
    if not names or names[-1] != WEIGHTS_NAME:
      continue
    modules = names[:-1]
    for i, value in enumerate(values):  # a module called twice sows twice
      value = np.asarray(value, np.float32)
      suffix = '' if len(values) == 1 else f'#{i}'
      if 'layers' in modules and value.ndim == 5:  # nn.scan stacked the layers: [L, B, H, T, S]
        at = modules.index('layers')
        for layer, per_layer in enumerate(value):
          renamed = modules[:at] + [f'layer_{layer}'] + modules[at + 1:]
          found['/'.join(renamed) + suffix] = per_layer
      else:
        found['/'.join(modules) + suffix] = value
  if not found:
    raise ValueError(f'{type(model).__name__} sowed no {WEIGHTS_NAME!r}: does it use '
                     'transformer_jax.layers.attention.MultiHeadAttention?')
  return {name: found[name] for name in sorted(found, key=_module_order)}


# ---------------------------------------------------------------------------------------------
# Token labels


def _visible(text: str) -> str:
  """A label that shows whitespace instead of being blank."""
  return (text.replace('\n', '\\n').replace('\t', '\\t').replace(' ', '␣') or '∅')


class TokenLabeler:
  """Readable labels for token ids: SentencePiece pieces ('▁' starts a word), WordPiece tokens
  or characters."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self._pieces = None
    proto = getattr(tokenizer, 'serialized_proto', None)
    if proto is not None:
      processor = spm.SentencePieceProcessor()
      processor.LoadFromSerializedProto(proto)
      self._pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]

  def __call__(self, ids: Sequence[int]) -> list[str]:
    ids = [int(i) for i in ids]
    if hasattr(self.tokenizer, 'id_to_token'):  # WordPiece: '##' continues a word
      return [self.tokenizer.id_to_token(i) for i in ids]
    if self._pieces is None:  # a character vocabulary: no special ids
      chars = getattr(self.tokenizer, 'chars', None)
      return [
          _visible(chars[i] if chars and 0 <= i < len(chars) else self.tokenizer.decode([i]))
          for i in ids
      ]
    special = {PAD_ID: '<pad>', EOS_ID: '</s>', BOS_ID: '<s>', UNK_ID: '<unk>'}
    return [special.get(i) or (self._pieces[i] if i < len(self._pieces) else '<unk>') for i in ids]


def _crop(weights: np.ndarray, rows: int, cols: int) -> np.ndarray:
  return weights[:, :rows, :cols]


# ---------------------------------------------------------------------------------------------
# Model runs with labelled axes


def translation_attention(model, params, src_tokenizer, tgt_tokenizer, source: str, target: str,
                          max_len: int | None = None) -> list[AttentionMap]:
  """Encoder self-, decoder self- and cross-attention of an `EncoderDecoder` for one pair.

  The target is teacher-forced (as in training): decoder position i reads the previous target
  token ('<s>' first) and predicts target token i, so decoder rows are labelled with the token
  they predict and decoder self-attention columns with the token each position reads.
  """
  max_len = max_len or model.cfg.max_len
  src = src_tokenizer.encode(source)[:max_len - 1] + [EOS_ID]
  tgt = tgt_tokenizer.encode(target)[:max_len - 1] + [EOS_ID]
  src_labels, tgt_labels = TokenLabeler(src_tokenizer)(src), TokenLabeler(tgt_tokenizer)(tgt)
  read_labels = ['<s>'] + tgt_labels[:-1]
  raw = collect_attention(model, params, jnp.asarray([src], jnp.int32), jnp.asarray([tgt],
                                                                                    jnp.int32))
  maps = []
  for name, weights in raw.items():
    if name.startswith('encoder'):
      rows, cols, axes = src_labels, src_labels, ('source token', 'source token')
    elif 'cross_attention' in name:
      rows, cols, axes = tgt_labels, src_labels, ('predicting target token', 'source token')
    else:
      rows, cols, axes = tgt_labels, read_labels, ('predicting target token', 'target token read')
    maps.append(AttentionMap(name, _crop(weights[0], len(rows), len(cols)), rows, cols, *axes))
  return maps


def lm_attention(model, params, tokenizer, text: str, *,
                 ids: Sequence[int] | None = None) -> list[AttentionMap]:
  """Causal self-attention of a `GPT` reading `text` (or the given token `ids`)."""
  if ids is None:
    ids = lm_data.prompt_ids(tokenizer, text)  # what generation feeds: EOS first for subwords
  ids = list(ids)
  if len(ids) > model.cfg.max_len:
    raise DataError(f'the text is {len(ids)} tokens but the model reads at most '
                    f'{model.cfg.max_len}; shorten it')
  labels = TokenLabeler(tokenizer)(ids)
  raw = collect_attention(model, params, jnp.asarray([ids], jnp.int32))
  return [
      AttentionMap(name, w[0], labels, labels, 'query token', 'key token')
      for name, w in raw.items()
  ]


def encoder_attention(model, params, tokenizer, ids: Sequence[int], *args,
                      method: str | None = None) -> list[AttentionMap]:
  """Bidirectional self-attention of an encoder-only model (e.g. BERT) over token `ids`.

  `args` are the model's further inputs after the token ids (e.g. segment ids).
  """
  labels = TokenLabeler(tokenizer)(ids)
  raw = collect_attention(model, params, jnp.asarray([list(ids)], jnp.int32), *args, method=method)
  return [
      AttentionMap(name, w[0], labels, labels, 'query token', 'key token')
      for name, w in raw.items()
  ]


# ---------------------------------------------------------------------------------------------
# Grouping for pictures


def group_by_layer(maps: Sequence[AttentionMap]) -> dict[str, list[AttentionMap]]:
  """{'encoder/layer_0': [self], 'decoder/layer_0': [self, cross], ...}, in model order."""
  groups = collections.OrderedDict()
  for amap in maps:
    groups.setdefault(amap.layer, []).append(amap)
  return groups


def group_by_kind(maps: Sequence[AttentionMap]) -> dict[str, list[AttentionMap]]:
  """{'encoder/self_attention': [layer 0, layer 1, ...], ...}: one overview per stack and type."""
  groups = collections.OrderedDict()
  for amap in maps:
    groups.setdefault(amap.kind, []).append(amap)
  return groups
