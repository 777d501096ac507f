"""Hugging Face BERT checkpoints -> `Bert` config, params and WordPiece tokenizer.

    # a directory with config.json, model.safetensors (or pytorch_model.bin) and vocab.txt
    cfg, params, tokenizer, heads = load_hf_bert('/path/to/bert')
    out = Bert(cfg, **heads).apply({'params': params}, tokens)

Reads `BertModel` checkpoints (encoder + pooler) and the heads of `BertForPreTraining`,
`BertForMaskedLM` and `BertForSequenceClassification` when present ('bert.'-prefixed names).
HF's `nn.Linear` weights are [out, in]: transposed to our [in, out] kernels, and the attention
projections' head axis unflattened (HF orders columns head-major, as our (heads, head_dim)).
Weights come from `safetensors`, or `pytorch_model.bin` via `torch.load(weights_only=True)`.
"""

import json
import os
import re
from typing import Any, Callable, Mapping

import numpy as np
from absl import logging

from transformer_jax.convert.hf_gpt2 import read_state_dict
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.bert import bert_config

# HF 'gelu' is the exact erf form; the *_new/_fast/_pytorch_tanh names are the tanh approximation.
_ACTIVATIONS = {
    'gelu': 'gelu_exact', 'gelu_new': 'gelu', 'gelu_fast': 'gelu', 'gelu_pytorch_tanh': 'gelu',
    'relu': 'relu', 'silu': 'silu', 'swish': 'silu'
}
_PREFIX = 'bert.'
_BUFFERS = ('embeddings.position_ids', 'embeddings.token_type_ids')


def bert_config_from_hf(hf_config: Mapping[str, Any], **overrides) -> tuple[TransformerConfig, int]:
  """(our config, type_vocab_size) for an HF `BertConfig` dict; `overrides` win."""
  c = dict(hf_config)
  if c.get('model_type', 'bert') != 'bert':
    raise ConfigError(f"config.json has model_type={c['model_type']!r}; only 'bert' is supported")
  activation = c.get('hidden_act', 'gelu')
  if activation not in _ACTIVATIONS:
    raise ConfigError(f'config.json hidden_act={activation!r} is not supported; supported: '
                      f'{sorted(_ACTIVATIONS)}')
  if c.get('position_embedding_type', 'absolute') != 'absolute':
    raise ConfigError(f"config.json position_embedding_type={c['position_embedding_type']!r} "
                      "is not supported (need 'absolute')")
  if c.get('is_decoder') or c.get('add_cross_attention'):
    raise ConfigError('config.json describes a BERT decoder (is_decoder/add_cross_attention); '
                      'only the bidirectional encoder is supported')
  try:
    values = dict(vocab_size=int(c['vocab_size']), emb_dim=int(c['hidden_size']),
                  num_heads=int(c['num_attention_heads']), mlp_dim=int(c['intermediate_size']),
                  num_encoder_layers=int(c['num_hidden_layers']),
                  max_len=int(c['max_position_embeddings']),
                  norm_epsilon=float(c.get('layer_norm_eps',
                                           1e-12)), activation=_ACTIVATIONS[activation],
                  dropout_rate=float(c.get('hidden_dropout_prob', 0.1)),
                  attention_dropout_rate=float(c.get('attention_probs_dropout_prob', 0.1)),
                  embed_init_std=float(c.get('initializer_range', 0.02)))
  except KeyError as e:
    raise ConfigError(f'config.json lacks {e.args[0]!r}, needed for a BERT model') from None
  values.update(overrides)
  return bert_config(**values), int(c.get('type_vocab_size', 2))


def _linear(w):
  return np.ascontiguousarray(w.T)


def _table(cfg: TransformerConfig, type_vocab_size: int, num_layers: int, heads: dict,
           pooler: bool = True) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], Callable]]:
  """HF name (no prefix) -> (our param path, HF shape, HF array -> our array)."""
  e, m, h, d = cfg.emb_dim, cfg.mlp_dim, cfg.num_heads, cfg.head_dim
  same = lambda x: x
  table = {}

  def linear(hf, path, out, inp, kernel=_linear, bias=same):
    table[f'{hf}.weight'] = (path + ('kernel',), (out, inp), kernel)
    table[f'{hf}.bias'] = (path + ('bias',), (out,), bias)

  def norm(hf, path):
    table[f'{hf}.weight'] = (path + ('scale',), (e,), same)
    table[f'{hf}.bias'] = (path + ('bias',), (e,), same)

  table['embeddings.word_embeddings.weight'] = (('token_embed', 'embedding'), (cfg.vocab_size, e),
                                                same)
  table['embeddings.position_embeddings.weight'] = (('input_embedding', 'position_embedding',
                                                     'embedding'), (cfg.max_len, e), same)
  table['embeddings.token_type_embeddings.weight'] = (('segment_embedding',), (type_vocab_size, e),
                                                      same)
  norm('embeddings.LayerNorm', ('input_embedding', 'embedding_norm'))
  for i in range(num_layers):
    hf, ours = f'encoder.layer.{i}', ('encoder', f'layer_{i}')
    for name in ('query', 'key', 'value'):
      linear(f'{hf}.attention.self.{name}', ours + ('self_attention', name), h * d, e,
             kernel=lambda w: _linear(w).reshape(e, h, d), bias=lambda b: b.reshape(h, d))
    linear(f'{hf}.attention.output.dense', ours + ('self_attention', 'out'), e, h * d,
           kernel=lambda w: _linear(w).reshape(h, d, e))
    norm(f'{hf}.attention.output.LayerNorm', ours + ('self_attention_norm',))
    linear(f'{hf}.intermediate.dense', ours + ('mlp', 'wi'), m, e)
    linear(f'{hf}.output.dense', ours + ('mlp', 'wo'), e, m)
    norm(f'{hf}.output.LayerNorm', ours + ('mlp_norm',))
  if pooler:
    linear('pooler.dense', ('pooler',), e, e)
  if heads.get('mlm'):
    linear('cls.predictions.transform.dense', ('mlm_transform',), e, e)
    norm('cls.predictions.transform.LayerNorm', ('mlm_norm',))
    table['cls.predictions.bias'] = (('mlm_bias',), (cfg.vocab_size,), same)
  if heads.get('sentence_classes'):
    linear('cls.seq_relationship', ('sentence_head',), heads['sentence_classes'], e)
  if heads.get('num_labels'):
    linear('classifier', ('classifier',), heads['num_labels'], e)
  return table


def _bare_names(state: Mapping[str, Any]) -> tuple[dict, dict]:
  """(bare name -> array, bare name -> name in the file): no 'bert.' prefix, TF-era
  LayerNorm.gamma/beta renamed, buffers and the tied (or duplicated) decoder dropped."""
  arrays, original = {}, {}
  for name, value in state.items():
    bare = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
    bare = re.sub(r'LayerNorm\.gamma$', 'LayerNorm.weight', bare)
    bare = re.sub(r'LayerNorm\.beta$', 'LayerNorm.bias', bare)
    if bare in _BUFFERS:
      continue
    if bare in arrays:
      raise ConfigError(f'checkpoint holds {name} both with and without the {_PREFIX!r} prefix')
    arrays[bare], original[bare] = np.asarray(value), name
  # The MLM decoder is tied to the word embeddings (weight) and shares the head's bias.
  decoder_w = arrays.pop('cls.predictions.decoder.weight', None)
  if decoder_w is not None and not np.array_equal(decoder_w,
                                                  arrays.get('embeddings.word_embeddings.weight')):
    raise ConfigError('cls.predictions.decoder.weight differs from the word embeddings: untied '
                      'MLM output layers are not supported')
  decoder_b = arrays.pop('cls.predictions.decoder.bias', None)
  if decoder_b is not None and 'cls.predictions.bias' not in arrays:
    arrays['cls.predictions.bias'] = decoder_b
    original['cls.predictions.bias'] = 'cls.predictions.decoder.bias'
  return arrays, original


def detect_heads(state: Mapping[str, Any]) -> dict:
  """The `Bert` head attributes a checkpoint's names and shapes imply."""
  arrays, _ = _bare_names(state)
  heads = {
      'mlm': 'cls.predictions.transform.dense.weight' in arrays, 'sentence_classes': 0,
      'num_labels': 0
  }
  if 'cls.seq_relationship.weight' in arrays:
    heads['sentence_classes'] = int(arrays['cls.seq_relationship.weight'].shape[0])
  if 'classifier.weight' in arrays:
    heads['num_labels'] = int(arrays['classifier.weight'].shape[0])
  return heads


def convert_bert_state_dict(state: Mapping[str, Any], cfg: TransformerConfig,
                            type_vocab_size: int = 2, heads: dict | None = None) -> dict:
  """Our `Bert` params from an HF BERT state dict (names optionally 'bert.'-prefixed).

  `heads` (default: detected) says which head weights to expect. Raises one ConfigError naming
  unknown, missing or wrongly shaped parameters.
  """
  heads = detect_heads(state) if heads is None else heads
  arrays, original = _bare_names(state)
  # BertForMaskedLM checkpoints have no pooler: it is then left out (a fine-tuning run
  # initialises it afresh).
  table = _table(cfg, type_vocab_size, cfg.num_encoder_layers, heads, pooler='pooler.dense.weight'
                 in arrays)
  unknown = sorted(original[k] for k in arrays if k not in table)
  if unknown:
    raise ConfigError(f'checkpoint has unknown parameter(s) {", ".join(unknown)}: not part of a '
                      f'BERT with {cfg.num_encoder_layers} layers and heads {heads}')
  missing = sorted(k for k in table if k not in arrays)
  if missing:
    shown = ', '.join(missing[:8]) + (f' (and {len(missing) - 8} more)' if len(missing) > 8 else '')
    raise ConfigError(f'checkpoint lacks parameter(s) {shown} that the config implies')
  dtype = np.dtype(cfg.param_dtype)
  params: dict = {}
  for name, (path, shape, convert) in table.items():
    value = arrays[name]
    if tuple(value.shape) != shape:
      raise ConfigError(f'{original[name]} has shape {tuple(value.shape)} but the config implies '
                        f'{shape}')
    node = params
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = np.ascontiguousarray(convert(value.astype(dtype)))
  return params


def load_hf_bert(directory: str, **overrides):
  """(config, params, tokenizer, heads) for the HF BERT checkpoint in `directory`.

  `heads` is {'type_vocab_size', 'mlm', 'sentence_classes', 'num_labels'}: the `Bert`
  attributes matching the weights. `overrides` go to the config (e.g. dropout_rate=0.0).
  """
  from transformer_jax.data.wordpiece import WordPieceTokenizer
  config_path = os.path.join(directory, 'config.json')
  if not os.path.exists(config_path):
    raise DataError(f'{config_path} does not exist: expected a Hugging Face BERT directory '
                    '(config.json, model.safetensors and vocab.txt)')
  with open(config_path) as f:
    hf_config = json.load(f)
  cfg, type_vocab_size = bert_config_from_hf(hf_config, **overrides)
  state = read_state_dict(directory)
  heads = detect_heads(state)
  params = convert_bert_state_dict(state, cfg, type_vocab_size, heads)
  lowercase = _lowercase(directory)
  tokenizer = WordPieceTokenizer.from_vocab(os.path.join(directory, 'vocab.txt'),
                                            lowercase=lowercase)
  if tokenizer.vocab_size != cfg.vocab_size:
    raise ConfigError(f'{directory}/vocab.txt has {tokenizer.vocab_size} tokens but config.json '
                      f'says vocab_size={cfg.vocab_size}')
  logging.info('imported BERT from %s: %d layers, %d heads, width %d, vocab %d, heads %s',
               directory, cfg.num_encoder_layers, cfg.num_heads, cfg.emb_dim, cfg.vocab_size, heads)
  return cfg, params, tokenizer, dict(heads, type_vocab_size=type_vocab_size)


def _lowercase(directory: str) -> bool:
  """tokenizer_config.json's do_lower_case (BERT's uncased checkpoints); default True."""
  path = os.path.join(directory, 'tokenizer_config.json')
  if os.path.exists(path):
    with open(path) as f:
      return bool(json.load(f).get('do_lower_case', True))
  return True
