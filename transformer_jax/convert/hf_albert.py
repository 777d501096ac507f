"""Hugging Face ALBERT checkpoints <-> `Bert` config and params (ALBERT switches on).

    # a directory with config.json and model.safetensors (or pytorch_model.bin)
    cfg, params, heads = load_hf_albert('/path/to/albert')
    out = Bert(cfg, **heads).apply({'params': params}, tokens)
    # and back (heads: the `Bert` attributes the params were trained with, hf_bert.bert_heads)
    hf_config, state = albert_config_to_hf(cfg, **heads), export_albert_state_dict(cfg, params)

ALBERT is our `Bert` with a factorised embedding (cfg.embedding_size E, projected to the width D
by HF's `encoder.embedding_hidden_mapping_in`) and one layer shared by every layer
(cfg.share_layers: params['encoder']['shared_layer'] is HF's
`encoder.albert_layer_groups.0.albert_layers.0`). Reads `AlbertModel` checkpoints (encoder +
pooler) and the heads of `AlbertForPreTraining` (MLM + SOP), `AlbertForMaskedLM` (MLM, no
pooler) and `AlbertForSequenceClassification` ('albert.'-prefixed names). HF's `nn.Linear`
weights are [out, in]: transposed to our [in, out] kernels, the attention projections' head axis
unflattened. Only num_hidden_groups = inner_group_num = 1 (every released ALBERT) has a `Bert`
equivalent; other layouts are refused. The tokenizer (SentencePiece spiece.model) is not read.

Export writes the HF class that holds exactly the params' heads (`albert_architecture`);
import(export(params)) == params bit for bit.
"""

from typing import Any, Mapping

import numpy as np
from absl import logging

from transformer_jax.convert.hf_bert import bare_names as _bert_bare_names
from transformer_jax.convert.hf_bert import bert_heads, factorised
from transformer_jax.convert.hf_files import (HFModel, read_hf_config, read_state_dict,
                                              refuse_switches)
from transformer_jax.convert.name_table import (ParamReader, Table, params_from_table, same,
                                                state_from_table, transpose)
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.bert import albert_config

# HF 'gelu' is the exact erf form; the *_new/_fast/_pytorch_tanh names are the tanh approximation.
_ACTIVATIONS = {
    'gelu': 'gelu_exact', 'gelu_new': 'gelu', 'gelu_fast': 'gelu', 'gelu_pytorch_tanh': 'gelu',
    'relu': 'relu', 'silu': 'silu', 'swish': 'silu'
}
_HF_ACTIVATIONS = {'gelu_exact': 'gelu', 'gelu': 'gelu_new', 'relu': 'relu', 'silu': 'silu'}
_PREFIX = 'albert.'
# HF's one layer group holding one layer: our shared layer.
_SHARED = 'encoder.albert_layer_groups.0.albert_layers.0'
_HEAD_PREFIXES = ('predictions.', 'sop_classifier.', 'classifier.')


def albert_config_from_hf(hf_config: Mapping[str, Any],
                          **overrides) -> tuple[TransformerConfig, int]:
  """(our config, type_vocab_size) for an HF `AlbertConfig` dict; `overrides` win."""
  c = dict(hf_config)
  model_type = c.get('model_type', 'albert')
  if model_type != 'albert':
    hint = (' (a BERT directory: load it with convert.hf_bert.load_hf_bert)'
            if model_type == 'bert' else '')
    raise ConfigError(f"config.json has model_type={model_type!r}; the ALBERT importer reads "
                      f"only 'albert'{hint}")
  activation = c.get('hidden_act', 'gelu_new')
  if activation not in _ACTIVATIONS:
    raise ConfigError(f'config.json hidden_act={activation!r} is not supported; supported: '
                      f'{sorted(_ACTIVATIONS)}')
  if c.get('position_embedding_type', 'absolute') != 'absolute':
    raise ConfigError(f"config.json position_embedding_type={c['position_embedding_type']!r} "
                      "is not supported (need 'absolute')")
  groups, inner = int(c.get('num_hidden_groups', 1)), int(c.get('inner_group_num', 1))
  if (groups, inner) != (1, 1):
    raise ConfigError(f'config.json has num_hidden_groups={groups} and inner_group_num={inner}; '
                      'only 1 and 1 (one layer shared by every layer, as every released ALBERT) '
                      'are supported')
  try:
    values = dict(vocab_size=int(c['vocab_size']), embedding_size=int(c['embedding_size']),
                  emb_dim=int(c['hidden_size']), num_heads=int(c['num_attention_heads']),
                  mlp_dim=int(c['intermediate_size']), num_encoder_layers=int(
                      c['num_hidden_layers']), max_len=int(c['max_position_embeddings']),
                  norm_epsilon=float(c.get('layer_norm_eps',
                                           1e-12)), activation=_ACTIVATIONS[activation],
                  dropout_rate=float(c.get('hidden_dropout_prob', 0.0)),
                  attention_dropout_rate=float(c.get('attention_probs_dropout_prob', 0.0)),
                  embed_init_std=float(c.get('initializer_range', 0.02)))
  except KeyError as e:
    raise ConfigError(f'config.json lacks {e.args[0]!r}, needed for an ALBERT model') from None
  values.update(overrides)
  return albert_config(**values), int(c.get('type_vocab_size', 2))


def _check_albert_expressible(cfg: TransformerConfig) -> None:
  """One ConfigError naming the first switch of `cfg` no HF ALBERT has."""
  if not cfg.share_layers:
    raise ConfigError(
        f'an ALBERT checkpoint holds one layer shared by all {cfg.num_encoder_layers} layers, '
        'but the config has share_layers=False (separate layers): keep share_layers=True')
  if cfg.embedding_size is None:
    raise ConfigError('an ALBERT checkpoint has a factorised embedding (embedding_size and a '
                      'projection), but the config has embedding_size=None: set it')
  refuse_switches(
      'ALBERT', cfg,
      dict(position='learned', norm_type='layernorm', norm_position='post', embedding_norm=True,
           activation=tuple(_HF_ACTIVATIONS), use_bias=True, tie_output=True,
           num_kv_heads=cfg.num_heads, scale_embeddings=False, scale_attention_scores=True,
           rescale_tied_output=False))
  if cfg.head_dim * cfg.num_heads != cfg.emb_dim:
    raise ConfigError(f'ALBERT cannot express head_dim={cfg.head_dim} with num_heads='
                      f'{cfg.num_heads} and emb_dim={cfg.emb_dim} (it needs heads x head_dim = '
                      'emb_dim)')


def _table(cfg: TransformerConfig, type_vocab_size: int, heads: dict, pooler: bool = True) -> Table:
  """HF name (no prefix) -> (our param path, HF shape, HF array -> ours, our array -> HF's).

  BERT's entries under ALBERT's names, at the embedding width E where ALBERT factorises: too
  many names and widths differ to derive it from `hf_bert.encoder_table`.
  """
  e, m, h, d, w = cfg.emb_dim, cfg.mlp_dim, cfg.num_heads, cfg.head_dim, cfg.embedding_size
  table = {}

  def linear(hf, path, out, inp, kernel=(transpose, transpose), bias=(same, same)):
    table[f'{hf}.weight'] = (path + ('kernel',), (out, inp), *kernel)
    table[f'{hf}.bias'] = (path + ('bias',), (out,), *bias)

  def norm(hf, path, width):
    table[f'{hf}.weight'] = (path + ('scale',), (width,), same, same)
    table[f'{hf}.bias'] = (path + ('bias',), (width,), same, same)

  table['embeddings.word_embeddings.weight'] = (('token_embed', 'embedding'), (cfg.vocab_size, w),
                                                same, same)
  table['embeddings.position_embeddings.weight'] = (('input_embedding', 'position_embedding',
                                                     'embedding'), (cfg.max_len, w), same, same)
  table['embeddings.token_type_embeddings.weight'] = (('segment_embedding',), (type_vocab_size, w),
                                                      same, same)
  norm('embeddings.LayerNorm', ('input_embedding', 'embedding_norm'), w)
  linear('encoder.embedding_hidden_mapping_in', ('input_embedding', 'projection'), e, w)
  ours = ('encoder', 'shared_layer')
  for name in ('query', 'key', 'value'):
    linear(
        f'{_SHARED}.attention.{name}', ours + ('self_attention', name), h * d, e,
        kernel=(lambda x: transpose(x).reshape(e, h, d), lambda k: transpose(k.reshape(e, h * d))),
        bias=(lambda b: b.reshape(h, d), lambda b: b.reshape(h * d)))
  linear(f'{_SHARED}.attention.dense', ours + ('self_attention', 'out'), e, h * d,
         kernel=(lambda x: transpose(x).reshape(h, d, e), lambda k: transpose(k.reshape(h * d, e))))
  norm(f'{_SHARED}.attention.LayerNorm', ours + ('self_attention_norm',), e)
  linear(f'{_SHARED}.ffn', ours + ('mlp', 'wi'), m, e)
  linear(f'{_SHARED}.ffn_output', ours + ('mlp', 'wo'), e, m)
  norm(f'{_SHARED}.full_layer_layer_norm', ours + ('mlp_norm',), e)
  if pooler:
    linear('pooler', ('pooler',), e, e)
  if heads.get('mlm'):
    linear('predictions.dense', ('mlm_transform',), w, e)
    norm('predictions.LayerNorm', ('mlm_norm',), w)
    table['predictions.bias'] = (('mlm_bias',), (cfg.vocab_size,), same, same)
  if heads.get('sentence_classes'):
    linear('sop_classifier.classifier', ('sentence_head',), heads['sentence_classes'], e)
  if heads.get('num_labels'):
    linear('classifier', ('classifier',), heads['num_labels'], e)
  return table


def _bare_names(state: Mapping[str, Any]) -> tuple[dict, dict]:
  """(bare name -> array, bare name -> name in the file), as `hf_bert.bare_names`: no
  'albert.' prefix, TF-era LayerNorm.gamma/beta renamed, buffers and the tied decoder dropped."""
  return _bert_bare_names(state, _PREFIX, head='predictions.')


def detect_heads(state: Mapping[str, Any]) -> dict:
  """The `Bert` head attributes an ALBERT checkpoint's names and shapes imply."""
  arrays, _ = _bare_names(state)
  heads = {'mlm': 'predictions.dense.weight' in arrays, 'sentence_classes': 0, 'num_labels': 0}
  if 'sop_classifier.classifier.weight' in arrays:
    heads['sentence_classes'] = int(arrays['sop_classifier.classifier.weight'].shape[0])
  if 'classifier.weight' in arrays:
    heads['num_labels'] = int(arrays['classifier.weight'].shape[0])
  return heads


def convert_albert_state_dict(state: Mapping[str, Any], cfg: TransformerConfig,
                              type_vocab_size: int = 2, heads: dict | None = None) -> dict:
  """Our `Bert` params from an HF ALBERT state dict (names optionally 'albert.'-prefixed).

  `heads` (default: detected) says which head weights to expect. Raises one ConfigError naming
  a config ALBERT cannot express, or unknown, missing or wrongly shaped parameters.
  """
  _check_albert_expressible(cfg)
  heads = detect_heads(state) if heads is None else heads
  arrays, original = _bare_names(state)
  # AlbertForMaskedLM has no pooler: it is then left out (fine-tuning initialises it afresh).
  table = _table(cfg, type_vocab_size, heads, pooler='pooler.weight' in arrays)
  return params_from_table(table, arrays, original, dtype=cfg.param_dtype,
                           what=f'an ALBERT with one shared layer and heads {heads}')


def load_hf_albert(directory: str, **overrides) -> tuple[TransformerConfig, dict, dict]:
  """(config, params, heads) for the HF ALBERT checkpoint in `directory`.

  `heads` is {'type_vocab_size', 'mlm', 'sentence_classes', 'num_labels'}: the `Bert`
  attributes matching the weights. `overrides` go to the config (e.g. dropout_rate=0.0).
  """
  model = load(directory, **overrides)
  return model.config, model.params, model.heads


def load(directory: str, **overrides) -> HFModel:
  """The HF ALBERT folder `directory` (families.py's converter interface; the SentencePiece
  tokenizer is the caller's to load)."""
  hf_config = read_hf_config(directory, 'config.json and model.safetensors')
  cfg, type_vocab_size = albert_config_from_hf(hf_config, **overrides)
  _check_albert_expressible(cfg)  # before the weights are read
  state = read_state_dict(directory)
  heads = detect_heads(state)
  params = convert_albert_state_dict(state, cfg, type_vocab_size, heads)
  logging.info(
      'imported ALBERT from %s: %d applications of one shared layer, %d heads, width %d, '
      'embedding width %d, vocab %d, heads %s', directory, cfg.num_encoder_layers, cfg.num_heads,
      cfg.emb_dim, cfg.embedding_size, cfg.vocab_size, heads)
  return HFModel(cfg, params, heads=dict(heads, type_vocab_size=type_vocab_size))


# -- export -------------------------------------------------------------------------------------

# The heads of our params (`hf_bert.bert_heads` reads them the same way for ALBERT).
albert_heads = bert_heads


def albert_architecture(mlm: bool = True, sentence_classes: int = 2, num_labels: int = 0) -> str:
  """The HF class that holds exactly these heads (and so loads every exported weight):

    MLM + 2-way sentence-order head -> AlbertForPreTraining
    MLM alone                       -> AlbertForMaskedLM
    a classifier alone (fine-tuned) -> AlbertForSequenceClassification
    no head                         -> AlbertModel
  Other combinations (e.g. SOP without MLM) have no HF class: a ConfigError naming them.
  """
  heads = (bool(mlm), int(sentence_classes), int(num_labels))
  table = {(True, 2, 0): 'AlbertForPreTraining', (True, 0, 0): 'AlbertForMaskedLM',
           (False, 0, 0): 'AlbertModel'}
  if heads in table:
    return table[heads]
  if not mlm and not sentence_classes:
    return 'AlbertForSequenceClassification'
  raise ConfigError(f'no Hugging Face ALBERT class holds the heads mlm={mlm}, sentence_classes='
                    f'{sentence_classes}, num_labels={num_labels} together')


def albert_config_to_hf(cfg: TransformerConfig, type_vocab_size: int = 2, mlm: bool = True,
                        sentence_classes: int = 2, num_labels: int = 0) -> dict:
  """The config.json dict of the HF ALBERT class (`albert_architecture`) computing what
  `Bert(cfg, type_vocab_size, mlm, sentence_classes, num_labels)` computes.

  Raises one ConfigError naming the first switch ALBERT has no equivalent for (an unshared or
  unfactorised config is a BERT: export it with hf_bert). HF masks padding through
  `attention_mask`, where `Bert` masks ids equal to [PAD] (0).
  """
  _check_albert_expressible(cfg)
  architecture = albert_architecture(mlm, sentence_classes, num_labels)
  config = {
      'model_type': 'albert', 'architectures': [architecture], 'vocab_size': cfg.vocab_size,
      'embedding_size': cfg.embedding_size, 'hidden_size': cfg.emb_dim,
      'num_hidden_layers': cfg.num_encoder_layers, 'num_hidden_groups': 1, 'inner_group_num': 1,
      'num_attention_heads': cfg.num_heads, 'intermediate_size': cfg.mlp_dim,
      'hidden_act': _HF_ACTIVATIONS[cfg.activation], 'hidden_dropout_prob': cfg.dropout_rate,
      'attention_probs_dropout_prob': cfg.attention_dropout_rate,
      'classifier_dropout_prob': cfg.dropout_rate, 'max_position_embeddings': cfg.max_len,
      'type_vocab_size': int(type_vocab_size), 'initializer_range': cfg.embed_init_std or 0.02,
      'layer_norm_eps': cfg.norm_epsilon, 'pad_token_id': 0, 'tie_word_embeddings': True,
      'dtype': 'float32'
  }
  if architecture == 'AlbertForSequenceClassification':
    config['id2label'] = {str(i): f'LABEL_{i}' for i in range(num_labels)}
    config['label2id'] = {f'LABEL_{i}': i for i in range(num_labels)}
  return config


def export_albert_state_dict(cfg: TransformerConfig, params) -> dict[str, np.ndarray]:
  """HF state dict (name -> contiguous float32 array) of our ALBERT `Bert` params, named as the
  class `albert_architecture(**heads)` saves them: encoder and pooler 'albert.'-prefixed (bare
  for `AlbertModel`), heads ('predictions.*', 'sop_classifier.*', 'classifier.*') not; the MLM
  decoder is tied (weight to the word embeddings, bias to predictions.bias), so not written.

  The inverse of `convert_albert_state_dict`: importing the result gives `params` back bit for
  bit (as float32). Raises ConfigError for a config ALBERT cannot express or params that do not
  fit.
  """
  _check_albert_expressible(cfg)
  heads = bert_heads(params)
  prefix = '' if albert_architecture(heads['mlm'], heads['sentence_classes'],
                                     heads['num_labels']) == 'AlbertModel' else _PREFIX
  # AlbertForMaskedLM checkpoints imported here have no pooler.
  table = _table(cfg, heads['type_vocab_size'], heads, pooler='pooler' in params)
  state = state_from_table(table, ParamReader(params, 'ALBERT'))
  return {('' if name.startswith(_HEAD_PREFIXES) else prefix) + name: value
          for name, value in state.items()}


def exporters(heads: dict | None = None, special_ids: dict | None = None):
  """(config_to_hf, export_state_dict) for params holding `heads` (families.py's converter
  interface)."""
  del special_ids
  heads = dict(heads or {})
  return lambda cfg: albert_config_to_hf(cfg, **heads), export_albert_state_dict


def claims(cfg: TransformerConfig, byte_level: bool = False) -> bool:
  """Whether an export of the encoder `cfg` is ALBERT's: a factorised embedding or shared
  layers. With a byte-level BPE tokenizer no HF class computes it: one ConfigError line."""
  if not factorised(cfg):
    return False
  if byte_level:
    raise ConfigError('an ALBERT (embedding_size or share_layers set) with RoBERTa\'s '
                      'byte-level BPE has no Hugging Face class: ALBERT tokenizers number '
                      'their ids as WordPiece does (pretrain with tokenizer.type=wordpiece)')
  return True


# families.py's converter interface: our config of a config.json dict.
config_from_hf = albert_config_from_hf
