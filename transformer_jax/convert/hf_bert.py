"""Hugging Face BERT checkpoints <-> `Bert` config, params and WordPiece tokenizer.

    # a directory with config.json, model.safetensors (or pytorch_model.bin) and vocab.txt
    cfg, params, tokenizer, heads = load_hf_bert('/path/to/bert')
    out = Bert(cfg, **heads).apply({'params': params}, tokens)
    # and back (heads: the `Bert` attributes the params were trained with)
    heads = bert_heads(params)
    hf_config, state = bert_config_to_hf(cfg, **heads), export_bert_state_dict(cfg, params)

Reads `BertModel` checkpoints (encoder + pooler) and the heads of `BertForPreTraining`,
`BertForMaskedLM` and `BertForSequenceClassification` when present ('bert.'-prefixed names).
HF's `nn.Linear` weights are [out, in]: transposed to our [in, out] kernels, and the attention
projections' head axis unflattened (HF orders columns head-major, as our (heads, head_dim)).
Weights come from `safetensors`, or `pytorch_model.bin` via `torch.load(weights_only=True)`.

Export writes the HF class that holds exactly the heads the params have (`bert_architecture`):
MLM + NSP/SOP -> `BertForPreTraining`, MLM alone -> `BertForMaskedLM`, a classifier ->
`BertForSequenceClassification`; import(export(params)) == params bit for bit.
"""

import json
import os
import re
from typing import Any, Mapping

import numpy as np
from absl import logging

from transformer_jax.convert.hf_files import (HFModel, read_hf_config, read_state_dict,
                                              refuse_switches)
from transformer_jax.convert.name_table import (ParamReader, Table, canonical_names,
                                                params_from_table, same, state_from_table,
                                                strip_prefix, transpose)
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.bert import bert_config

# HF 'gelu' is the exact erf form; the *_new/_fast/_pytorch_tanh names are the tanh approximation.
ACTIVATIONS = {
    'gelu': 'gelu_exact', 'gelu_new': 'gelu', 'gelu_fast': 'gelu', 'gelu_pytorch_tanh': 'gelu',
    'relu': 'relu', 'silu': 'silu', 'swish': 'silu'
}
_PREFIX = 'bert.'
_BUFFERS = ('embeddings.position_ids', 'embeddings.token_type_ids')


def bert_config_from_hf(hf_config: Mapping[str, Any], **overrides) -> tuple[TransformerConfig, int]:
  """(our config, type_vocab_size) for an HF `BertConfig` dict; `overrides` win."""
  c = dict(hf_config)
  model_type = c.get('model_type', 'bert')
  if model_type != 'bert':
    # BERT's successors' folders look like BERT's but are read by their own converters.
    from transformer_jax.convert import families
    other = families.of_model_type(model_type)
    raise ConfigError(f'config.json has model_type={model_type!r}: a {other.name} checkpoint, not '
                      'BERT; import it with convert.families.of_directory(DIR).load(DIR)')
  activation = c.get('hidden_act', 'gelu')
  if activation not in ACTIVATIONS:
    raise ConfigError(f'config.json hidden_act={activation!r} is not supported; supported: '
                      f'{sorted(ACTIVATIONS)}')
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
                                           1e-12)), activation=ACTIVATIONS[activation],
                  dropout_rate=float(c.get('hidden_dropout_prob', 0.1)),
                  attention_dropout_rate=float(c.get('attention_probs_dropout_prob', 0.1)),
                  embed_init_std=float(c.get('initializer_range', 0.02)))
  except KeyError as e:
    raise ConfigError(f'config.json lacks {e.args[0]!r}, needed for a BERT model') from None
  values.update(overrides)
  return bert_config(**values), int(c.get('type_vocab_size', 2))


def encoder_table(cfg: TransformerConfig, type_vocab_size: int, num_layers: int, heads: dict,
                  pooler: bool = True) -> Table:
  """HF name (no prefix) -> (our param path, HF shape, HF array -> ours, our array -> HF's)."""
  e, m, h, d = cfg.emb_dim, cfg.mlp_dim, cfg.num_heads, cfg.head_dim
  table = {}

  def linear(hf, path, out, inp, kernel=(transpose, transpose), bias=(same, same)):
    table[f'{hf}.weight'] = (path + ('kernel',), (out, inp), *kernel)
    table[f'{hf}.bias'] = (path + ('bias',), (out,), *bias)

  def norm(hf, path):
    table[f'{hf}.weight'] = (path + ('scale',), (e,), same, same)
    table[f'{hf}.bias'] = (path + ('bias',), (e,), same, same)

  table['embeddings.word_embeddings.weight'] = (('token_embed', 'embedding'), (cfg.vocab_size, e),
                                                same, same)
  table['embeddings.position_embeddings.weight'] = (('input_embedding', 'position_embedding',
                                                     'embedding'), (cfg.max_len, e), same, same)
  table['embeddings.token_type_embeddings.weight'] = (('segment_embedding',), (type_vocab_size, e),
                                                      same, same)
  norm('embeddings.LayerNorm', ('input_embedding', 'embedding_norm'))
  for i in range(num_layers):
    hf, ours = f'encoder.layer.{i}', ('encoder', f'layer_{i}')
    for name in ('query', 'key', 'value'):
      linear(
          f'{hf}.attention.self.{name}', ours + ('self_attention', name), h * d, e,
          kernel=(lambda w: transpose(w).reshape(e, h, d),
                  lambda k: transpose(k.reshape(e, h * d))),
          bias=(lambda b: b.reshape(h, d), lambda b: b.reshape(h * d)))
    linear(
        f'{hf}.attention.output.dense', ours + ('self_attention', 'out'), e, h * d,
        kernel=(lambda w: transpose(w).reshape(h, d, e), lambda k: transpose(k.reshape(h * d, e))))
    norm(f'{hf}.attention.output.LayerNorm', ours + ('self_attention_norm',))
    linear(f'{hf}.intermediate.dense', ours + ('mlp', 'wi'), m, e)
    linear(f'{hf}.output.dense', ours + ('mlp', 'wo'), e, m)
    norm(f'{hf}.output.LayerNorm', ours + ('mlp_norm',))
  if pooler:
    linear('pooler.dense', ('pooler',), e, e)
  if heads.get('mlm'):
    linear('cls.predictions.transform.dense', ('mlm_transform',), e, e)
    norm('cls.predictions.transform.LayerNorm', ('mlm_norm',))
    table['cls.predictions.bias'] = (('mlm_bias',), (cfg.vocab_size,), same, same)
  if heads.get('sentence_classes'):
    linear('cls.seq_relationship', ('sentence_head',), heads['sentence_classes'], e)
  if heads.get('num_labels'):
    linear('classifier', ('classifier',), heads['num_labels'], e)
  return table


def bare_names(state: Mapping[str, Any], prefix: str = _PREFIX,
               head: str = 'cls.predictions.') -> tuple[dict, dict]:
  """(bare name -> array, bare name -> name in the file): no `prefix`, TF-era LayerNorm.gamma/beta
  renamed, buffers and the tied (or duplicated) decoder of the MLM `head` dropped.

  ALBERT and RoBERTa checkpoints differ only in the prefix and the head's name ('predictions.',
  'lm_head.'), so their converters call this too.
  """
  strip = strip_prefix(prefix)
  canonical = lambda name: re.sub(r'LayerNorm\.beta$', 'LayerNorm.bias',
                                  re.sub(r'LayerNorm\.gamma$', 'LayerNorm.weight', strip(name)))
  arrays, original = canonical_names(state, canonical, prefix, drop=_BUFFERS.__contains__)
  # The MLM decoder is tied to the word embeddings (weight) and shares the head's bias.
  decoder_w = arrays.pop(f'{head}decoder.weight', None)
  if decoder_w is not None and not np.array_equal(decoder_w,
                                                  arrays.get('embeddings.word_embeddings.weight')):
    raise ConfigError(f'{head}decoder.weight differs from the word embeddings: untied MLM output '
                      'layers are not supported')
  decoder_b = arrays.pop(f'{head}decoder.bias', None)
  if decoder_b is not None and f'{head}bias' not in arrays:
    arrays[f'{head}bias'], original[f'{head}bias'] = decoder_b, f'{head}decoder.bias'
  return arrays, original


def detect_heads(state: Mapping[str, Any]) -> dict:
  """The `Bert` head attributes a checkpoint's names and shapes imply."""
  arrays, _ = bare_names(state)
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
  arrays, original = bare_names(state)
  # BertForMaskedLM checkpoints have no pooler: it is then left out (a fine-tuning run
  # initialises it afresh).
  table = encoder_table(cfg, type_vocab_size, cfg.num_encoder_layers, heads,
                        pooler='pooler.dense.weight' in arrays)
  return params_from_table(table, arrays, original, dtype=cfg.param_dtype,
                           what=f'a BERT with {cfg.num_encoder_layers} layers and heads {heads}')


def load_hf_bert(directory: str, **overrides):
  """(config, params, tokenizer, heads) for the HF BERT checkpoint in `directory`.

  `heads` is {'type_vocab_size', 'mlm', 'sentence_classes', 'num_labels'}: the `Bert`
  attributes matching the weights. `overrides` go to the config (e.g. dropout_rate=0.0).
  """
  model = load(directory, **overrides)
  return model.config, model.params, model.tokenizer, model.heads


def load(directory: str, **overrides) -> HFModel:
  """The HF BERT folder `directory` with its WordPiece tokenizer (families.py's converter
  interface)."""
  from transformer_jax.data.wordpiece import WordPieceTokenizer
  hf_config = read_hf_config(directory, 'config.json, model.safetensors and vocab.txt')
  cfg, type_vocab_size = bert_config_from_hf(hf_config, **overrides)
  state = read_state_dict(directory)
  heads = detect_heads(state)
  params = convert_bert_state_dict(state, cfg, type_vocab_size, heads)
  lowercase = tokenizer_lowercase(directory)
  tokenizer = WordPieceTokenizer.from_vocab(os.path.join(directory, 'vocab.txt'),
                                            lowercase=lowercase)
  if tokenizer.vocab_size != cfg.vocab_size:
    raise ConfigError(f'{directory}/vocab.txt has {tokenizer.vocab_size} tokens but config.json '
                      f'says vocab_size={cfg.vocab_size}')
  logging.info('imported BERT from %s: %d layers, %d heads, width %d, vocab %d, heads %s',
               directory, cfg.num_encoder_layers, cfg.num_heads, cfg.emb_dim, cfg.vocab_size, heads)
  return HFModel(cfg, params, tokenizer, dict(heads, type_vocab_size=type_vocab_size))


def tokenizer_lowercase(directory: str) -> bool:
  """tokenizer_config.json's do_lower_case (BERT's uncased checkpoints); default True."""
  path = os.path.join(directory, 'tokenizer_config.json')
  if os.path.exists(path):
    with open(path) as f:
      return bool(json.load(f).get('do_lower_case', True))
  return True


# -- export -------------------------------------------------------------------------------------

# Our activation names -> HF's (the inverse of ACTIVATIONS; HF's 'gelu' is the exact erf form).
HF_ACTIVATIONS = {'gelu_exact': 'gelu', 'gelu': 'gelu_new', 'relu': 'relu', 'silu': 'silu'}


def bert_heads(params) -> dict:
  """The `Bert` attributes {'type_vocab_size', 'mlm', 'sentence_classes', 'num_labels'} that
  `params` were built with (what `load_hf_bert` returns as `heads`)."""
  shape = lambda name, axis: int(np.shape(params[name]['kernel'])[axis]) if name in params else 0
  if 'segment_embedding' not in params:
    raise ConfigError('params lack segment_embedding: not the parameters of a Bert model')
  return {
      'type_vocab_size': int(np.shape(params['segment_embedding'])[0]),
      'mlm': 'mlm_transform' in params, 'sentence_classes': shape('sentence_head', 1),
      'num_labels': shape('classifier', 1)
  }


def bert_architecture(mlm: bool = True, sentence_classes: int = 2, num_labels: int = 0) -> str:
  """The HF class that holds exactly these heads (and so loads every exported weight):

    MLM + 2-way sentence head (NSP, or SOP: the same shape) -> BertForPreTraining
    MLM alone (RoBERTa-style pretraining)                    -> BertForMaskedLM
    2-way sentence head alone                                -> BertForNextSentencePrediction
    a classifier alone (fine-tuned)                          -> BertForSequenceClassification
    no head                                                  -> BertModel
  Other combinations have no HF class: a ConfigError naming them.
  """
  heads = (bool(mlm), int(sentence_classes), int(num_labels))
  table = {(True, 2, 0): 'BertForPreTraining', (True, 0, 0): 'BertForMaskedLM',
           (False, 2, 0): 'BertForNextSentencePrediction', (False, 0, 0): 'BertModel'}
  if heads in table:
    return table[heads]
  if not mlm and not sentence_classes:
    return 'BertForSequenceClassification'
  raise ConfigError(f'no Hugging Face BERT class holds the heads mlm={mlm}, sentence_classes='
                    f'{sentence_classes}, num_labels={num_labels} together')


def check_bert_expressible(cfg: TransformerConfig, family: str = 'BERT') -> None:
  """One ConfigError naming the first switch of `cfg` that HF's BERT layers (which RoBERTa's
  reuse, hence `family` for the message) have no equivalent for."""
  refuse_switches(
      family, cfg,
      dict(position='learned', norm_type='layernorm', norm_position='post', embedding_norm=True,
           activation=tuple(HF_ACTIVATIONS), use_bias=True, tie_output=True,
           num_kv_heads=cfg.num_heads, head_dim=cfg.emb_dim // cfg.num_heads,
           scale_embeddings=False, scale_attention_scores=True, rescale_tied_output=False,
           share_layers=False, embedding_size=None))
  if cfg.head_dim * cfg.num_heads != cfg.emb_dim:
    raise ConfigError(f'{family} cannot express head_dim={cfg.head_dim} with num_heads='
                      f'{cfg.num_heads} and emb_dim={cfg.emb_dim} (it needs heads x head_dim = '
                      'emb_dim)')


_check_bert_expressible = check_bert_expressible  # the name other converters may import


def bert_config_to_hf(cfg: TransformerConfig, type_vocab_size: int = 2, mlm: bool = True,
                      sentence_classes: int = 2, num_labels: int = 0) -> dict:
  """The config.json dict of the HF BERT class (`bert_architecture`) computing what
  `Bert(cfg, type_vocab_size, mlm, sentence_classes, num_labels)` computes.

  Raises one ConfigError naming the first switch BERT has no equivalent for. HF masks padding
  through `attention_mask` (its tokenizer returns it), where `Bert` masks ids equal to [PAD] (0).
  """
  check_bert_expressible(cfg)
  architecture = bert_architecture(mlm, sentence_classes, num_labels)
  config = {
      'model_type': 'bert', 'architectures': [architecture], 'vocab_size': cfg.vocab_size,
      'hidden_size': cfg.emb_dim, 'num_hidden_layers': cfg.num_encoder_layers,
      'num_attention_heads': cfg.num_heads, 'intermediate_size': cfg.mlp_dim,
      'hidden_act': HF_ACTIVATIONS[cfg.activation], 'hidden_dropout_prob': cfg.dropout_rate,
      'attention_probs_dropout_prob': cfg.attention_dropout_rate,
      'max_position_embeddings': cfg.max_len, 'type_vocab_size': int(type_vocab_size),
      'initializer_range': cfg.embed_init_std or 0.02, 'layer_norm_eps': cfg.norm_epsilon,
      'position_embedding_type': 'absolute', 'pad_token_id': 0, 'tie_word_embeddings': True,
      'is_decoder': False, 'add_cross_attention': False, 'dtype': 'float32'
  }
  if architecture == 'BertForSequenceClassification':
    config['id2label'] = {str(i): f'LABEL_{i}' for i in range(num_labels)}
    config['label2id'] = {f'LABEL_{i}': i for i in range(num_labels)}
  return config


def export_bert_state_dict(cfg: TransformerConfig, params) -> dict[str, np.ndarray]:
  """HF state dict (name -> contiguous float32 array) of our `Bert` params, named as the class
  `bert_architecture(**heads)` saves them: encoder and pooler 'bert.'-prefixed (bare for
  `BertModel`), heads ('cls.*', 'classifier.*') not; the MLM decoder is tied, so not written.

  The inverse of `convert_bert_state_dict`: importing the result gives `params` back bit for bit
  (as float32). Raises ConfigError for a config BERT cannot express or params that do not fit.
  """
  check_bert_expressible(cfg)
  heads = bert_heads(params)
  prefix = '' if bert_architecture(heads['mlm'], heads['sentence_classes'],
                                   heads['num_labels']) == 'BertModel' else _PREFIX
  has_pooler = 'pooler' in params  # BertForMaskedLM checkpoints imported here have none
  table = encoder_table(cfg, heads['type_vocab_size'], cfg.num_encoder_layers, heads,
                        pooler=has_pooler)
  state = state_from_table(table, ParamReader(params, 'BERT'))
  return {('' if name.startswith(('cls.', 'classifier.')) else prefix) + name: value
          for name, value in state.items()}


def exporters(heads: dict | None = None, special_ids: dict | None = None):
  """(config_to_hf, export_state_dict) for params holding `heads` (families.py's converter
  interface; BERT's ids need no placing)."""
  del special_ids
  heads = dict(heads or {})
  return lambda cfg: bert_config_to_hf(cfg, **heads), export_bert_state_dict


def factorised(cfg: TransformerConfig) -> bool:
  """Whether `cfg` factorises its embedding or shares its layers: ALBERT's switches."""
  return cfg.embedding_size is not None or cfg.share_layers


def claims(cfg: TransformerConfig, byte_level: bool = False) -> bool:
  """Whether an export of the encoder `cfg` is BERT's: WordPiece ids, no ALBERT switches."""
  return not byte_level and not factorised(cfg)


# families.py's converter interface: our config of a config.json dict.
config_from_hf = bert_config_from_hf
