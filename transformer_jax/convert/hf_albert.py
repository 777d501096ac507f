"""Hugging Face ALBERT checkpoints <-> `Bert` config and params (ALBERT switches on).

    # a directory with config.json and model.safetensors (or pytorch_model.bin)
    model = hf_albert.load('/path/to/albert')    # an HFModel: config, params, tokenizer, heads
    out = Bert(model.config, **model.heads).apply({'params': model.params}, tokens)
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
equivalent; other layouts are refused. The tokenizer is read from tokenizer.json
(data/albert_tokenizer.py); a folder with only the older spiece.model is imported without one.

Export writes the HF class that holds exactly the params' heads (`albert_architecture`);
import(export(params)) == params bit for bit.
"""

import os
from typing import Any, Mapping

import numpy as np
from absl import logging

from transformer_jax.convert import families
from transformer_jax.convert.hf_bert import (CONFIG_KEYS, EncoderNames, bare_names, bert_heads,
                                             check_encoder_expressible, detect_heads,
                                             encoder_architecture, encoder_config_to_hf,
                                             encoder_config_values, encoder_table,
                                             export_encoder_state, factorised)
from transformer_jax.convert.hf_files import HFModel, read_hf_config, read_state_dict
from transformer_jax.convert.name_table import Table, params_from_table
from transformer_jax.data.albert_tokenizer import AlbertTokenizer
from transformer_jax.data.hf_tokenizer import TOKENIZER_JSON
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.bert import albert_config

# HF's one layer group holding one layer is our shared layer.
NAMES = EncoderNames(
    prefix='albert.', layer='encoder.albert_layer_groups.0.albert_layers.0', sublayers={
        'query': 'attention.query', 'key': 'attention.key', 'value': 'attention.value',
        'out': 'attention.dense', 'self_attention_norm': 'attention.LayerNorm', 'wi': 'ffn',
        'wo': 'ffn_output', 'mlp_norm': 'full_layer_layer_norm'
    }, pooler='pooler', mlm_transform='predictions.dense', mlm_norm='predictions.LayerNorm',
    mlm='predictions.', sentence='sop_classifier.classifier', classifier='classifier')
# BERT's keys, the embedding width, and ALBERT's defaults (v2: no dropout).
_CONFIG_KEYS = {
    'vocab_size': CONFIG_KEYS['vocab_size'], 'embedding_size': ('embedding_size', int),
    **CONFIG_KEYS, 'dropout_rate': ('hidden_dropout_prob', float, 0.0),
    'attention_dropout_rate': ('attention_probs_dropout_prob', float, 0.0)
}


def albert_config_from_hf(hf_config: Mapping[str, Any],
                          **overrides) -> tuple[TransformerConfig, int]:
  """(our config, type_vocab_size) for an HF `AlbertConfig` dict; `overrides` win."""
  c = dict(hf_config)
  families.refuse_other_model_type(c, 'albert', 'ALBERT')
  groups, inner = int(c.get('num_hidden_groups', 1)), int(c.get('inner_group_num', 1))
  if (groups, inner) != (1, 1):
    raise ConfigError(f'config.json has num_hidden_groups={groups} and inner_group_num={inner}; '
                      'only 1 and 1 (one layer shared by every layer, as every released ALBERT) '
                      'are supported')
  values = encoder_config_values(c, 'ALBERT', _CONFIG_KEYS, activation='gelu_new')
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
  check_encoder_expressible(cfg, 'ALBERT')


def _table(cfg: TransformerConfig, type_vocab_size: int, heads: dict, pooler: bool = True) -> Table:
  """HF name (no prefix) -> (our param path, HF shape, HF array -> ours, our array -> HF's):
  BERT's entries under ALBERT's names, its one shared layer, and the projection of the
  embeddings (width E) to the layers' width."""
  t = encoder_table(cfg, type_vocab_size, heads, pooler, NAMES)
  t.linear('encoder.embedding_hidden_mapping_in', ('input_embedding', 'projection'), cfg.emb_dim,
           cfg.embedding_size)
  return t.table


def convert_albert_state_dict(state: Mapping[str, Any], cfg: TransformerConfig,
                              type_vocab_size: int = 2, heads: dict | None = None) -> dict:
  """Our `Bert` params from an HF ALBERT state dict (names optionally 'albert.'-prefixed).

  `heads` (default: detected) says which head weights to expect. Raises one ConfigError naming
  a config ALBERT cannot express, or unknown, missing or wrongly shaped parameters.
  """
  _check_albert_expressible(cfg)
  heads = detect_heads(state, NAMES) if heads is None else heads
  arrays, original = bare_names(state, NAMES)
  # AlbertForMaskedLM has no pooler: it is then left out (fine-tuning initialises it afresh).
  table = _table(cfg, type_vocab_size, heads, pooler='pooler.weight' in arrays)
  return params_from_table(table, arrays, original, dtype=cfg.param_dtype,
                           what=f'an ALBERT with one shared layer and heads {heads}')


def load(directory: str, **overrides) -> HFModel:
  """The HF ALBERT folder `directory` with its tokenizer when it holds a tokenizer.json (None
  otherwise: fill-mask and fine-tuning then refuse it) (families.py's converter interface)."""
  hf_config = read_hf_config(directory, 'config.json and model.safetensors')
  cfg, type_vocab_size = albert_config_from_hf(hf_config, **overrides)
  _check_albert_expressible(cfg)  # before the weights are read
  state = read_state_dict(directory)
  heads = detect_heads(state, NAMES)
  params = convert_albert_state_dict(state, cfg, type_vocab_size, heads)
  logging.info(
      'imported ALBERT from %s: %d applications of one shared layer, %d heads, width %d, '
      'embedding width %d, vocab %d, heads %s', directory, cfg.num_encoder_layers, cfg.num_heads,
      cfg.emb_dim, cfg.embedding_size, cfg.vocab_size, heads)
  tokenizer = None
  if os.path.isfile(os.path.join(directory, TOKENIZER_JSON)):
    tokenizer = AlbertTokenizer.from_dir(directory)
    if tokenizer.vocab_size > cfg.vocab_size:
      raise ConfigError(f'{directory}: the tokenizer has {tokenizer.vocab_size} tokens but '
                        f'config.json says vocab_size={cfg.vocab_size}')
  return HFModel(cfg, params, tokenizer, dict(heads, type_vocab_size=type_vocab_size))


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
  classes = {(True, 2, 0): 'AlbertForPreTraining', (True, 0, 0): 'AlbertForMaskedLM',
             (False, 0, 0): 'AlbertModel'}
  return encoder_architecture('ALBERT', classes, 'AlbertForSequenceClassification', mlm,
                              sentence_classes, num_labels)


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
  return dict(model_type='albert',
              **encoder_config_to_hf(cfg, type_vocab_size, architecture, num_labels,
                                     _CONFIG_KEYS), num_hidden_groups=1, inner_group_num=1,
              classifier_dropout_prob=cfg.dropout_rate, pad_token_id=0)


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
  architecture = albert_architecture(heads['mlm'], heads['sentence_classes'], heads['num_labels'])
  # AlbertForMaskedLM checkpoints imported here have no pooler.
  table = _table(cfg, heads['type_vocab_size'], heads, pooler='pooler' in params)
  return export_encoder_state(table, params, 'ALBERT', NAMES, architecture == 'AlbertModel')


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
