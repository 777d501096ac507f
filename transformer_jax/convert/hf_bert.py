"""Hugging Face BERT checkpoints <-> `Bert` config, params and WordPiece tokenizer.

    # a directory with config.json, model.safetensors (or pytorch_model.bin) and vocab.txt
    model = hf_bert.load('/path/to/bert')    # an HFModel: config, params, tokenizer, heads
    out = Bert(model.config, **model.heads).apply({'params': model.params}, tokens)
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

import dataclasses
import os
import re
from typing import Any, Mapping

import numpy as np
from absl import logging

from transformer_jax.convert import families
from transformer_jax.convert.hf_files import (HFModel, config_values, hf_activation, read_hf_config,
                                              read_state_dict, refuse_switches)
from transformer_jax.convert.name_table import (ParamReader, Table, TableBuilder, canonical_names,
                                                params_from_table, state_from_table, strip_prefix)
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig
from transformer_jax.data.hf_tokenizer import tokenizer_lowercase
from transformer_jax.data.wordpiece import WordPieceTokenizer
from transformer_jax.models.bert import bert_config, bert_heads  # bert_heads: re-exported

# HF 'gelu' is the exact erf form; the *_new/_fast/_pytorch_tanh names are the tanh approximation.
ACTIVATIONS = {
    'gelu': 'gelu_exact', 'gelu_new': 'gelu', 'gelu_fast': 'gelu', 'gelu_pytorch_tanh': 'gelu',
    'relu': 'relu', 'silu': 'silu', 'swish': 'silu'
}
_BUFFERS = ('embeddings.position_ids', 'embeddings.token_type_ids')

# config.json's keys, as BERT, RoBERTa and ALBERT name them: our field -> (key, type[, default]).
CONFIG_KEYS = {
    'vocab_size': ('vocab_size', int), 'emb_dim': ('hidden_size', int),
    'num_heads': ('num_attention_heads', int), 'mlp_dim': ('intermediate_size', int),
    'num_encoder_layers': ('num_hidden_layers', int), 'max_len': ('max_position_embeddings', int),
    'norm_epsilon': ('layer_norm_eps', float, 1e-12), 'dropout_rate':
        ('hidden_dropout_prob', float, 0.1), 'attention_dropout_rate':
            ('attention_probs_dropout_prob', float, 0.1), 'embed_init_std':
                ('initializer_range', float, 0.02)
}


@dataclasses.dataclass(frozen=True)
class EncoderNames:
  """Where a BERT-style family's checkpoint names differ from BERT's: the table of one family.

  The embeddings ('embeddings.*') are named alike in every family; a layer's sublayers by
  `sublayers` (our path under the layer -> HF name under `layer`).
  """
  prefix: str  # the encoder's names' prefix in a checkpoint with heads
  layer: str  # layer i's names start with layer.format(i) (ALBERT: its one shared layer's)
  sublayers: dict
  pooler: str
  mlm_transform: str  # the MLM head's dense layer; its names start with `mlm`
  mlm_norm: str
  mlm: str
  sentence: str | None  # the 2-way sentence head (NSP, SOP); None: the family has none
  classifier: str  # the classifier's output layer

  @property
  def heads(self) -> tuple[str, ...]:
    """The starts of the heads' names, which a checkpoint writes without `prefix`."""
    return tuple(
        name.split('.')[0] + '.' for name in (self.mlm, self.sentence, self.classifier) if name)


BERT_NAMES = EncoderNames(
    prefix='bert.', layer='encoder.layer.{}', sublayers={
        'query': 'attention.self.query', 'key': 'attention.self.key',
        'value': 'attention.self.value', 'out': 'attention.output.dense',
        'self_attention_norm': 'attention.output.LayerNorm', 'wi': 'intermediate.dense',
        'wo': 'output.dense', 'mlp_norm': 'output.LayerNorm'
    }, pooler='pooler.dense', mlm_transform='cls.predictions.transform.dense',
    mlm_norm='cls.predictions.transform.LayerNorm', mlm='cls.predictions.',
    sentence='cls.seq_relationship', classifier='classifier')


def encoder_config_values(c: Mapping[str, Any], family: str, keys=CONFIG_KEYS,
                          activation: str = 'gelu') -> dict:
  """Our config fields from the config.json dict `c` of a BERT-style `family` (`keys`: its key
  table; `activation`: HF's default hidden_act), refusing what our `Bert` does not compute."""
  ours = hf_activation(c, 'hidden_act', activation, ACTIVATIONS)
  if c.get('position_embedding_type', 'absolute') != 'absolute':
    raise ConfigError(f"config.json position_embedding_type={c['position_embedding_type']!r} "
                      "is not supported (need 'absolute')")
  if c.get('is_decoder') or c.get('add_cross_attention'):
    raise ConfigError(f'config.json describes a {family} decoder (is_decoder/add_cross_attention); '
                      'only the bidirectional encoder is supported')
  return dict(config_values(c, keys, family), activation=ours)


def bert_config_from_hf(hf_config: Mapping[str, Any], **overrides) -> tuple[TransformerConfig, int]:
  """(our config, type_vocab_size) for an HF `BertConfig` dict; `overrides` win."""
  c = dict(hf_config)
  families.refuse_other_model_type(c, 'bert', 'BERT')
  values = encoder_config_values(c, 'BERT')
  values.update(overrides)
  return bert_config(**values), int(c.get('type_vocab_size', 2))


def encoder_table(cfg: TransformerConfig, type_vocab_size: int, heads: dict, pooler: bool = True,
                  names: EncoderNames = BERT_NAMES) -> TableBuilder:
  """The name table of a BERT-style encoder (HF name, no prefix -> our param path, HF shape, HF
  -> ours, ours -> HF), as a `TableBuilder` a family may add its own entries to.

  Our `Bert`'s switches shape it: one entry per layer, or the one shared layer
  (cfg.share_layers); embeddings of cfg.embedding_size's width where set (ALBERT's
  factorisation; its projection is ALBERT's own entry).
  """
  e, m, h, d = cfg.emb_dim, cfg.mlp_dim, cfg.num_heads, cfg.head_dim
  width = cfg.embedding_size or e
  layers = ([(names.layer.format(0), ('encoder', 'shared_layer'))] if cfg.share_layers else [
      (names.layer.format(i), ('encoder', f'layer_{i}')) for i in range(cfg.num_encoder_layers)
  ])
  t = TableBuilder()
  t.same('embeddings.word_embeddings.weight', ('token_embed', 'embedding'), (cfg.vocab_size, width))
  t.same('embeddings.position_embeddings.weight',
         ('input_embedding', 'position_embedding', 'embedding'), (cfg.max_len, width))
  t.same('embeddings.token_type_embeddings.weight', ('segment_embedding',),
         (type_vocab_size, width))
  t.norm('embeddings.LayerNorm', ('input_embedding', 'embedding_norm'), width)
  for hf_layer, ours in layers:
    hf = {k: f'{hf_layer}.{v}' for k, v in names.sublayers.items()}
    for name in ('query', 'key', 'value'):
      t.to_heads(hf[name], ours + ('self_attention', name), e, h, d)
    t.from_heads(hf['out'], ours + ('self_attention', 'out'), e, h, d)
    t.norm(hf['self_attention_norm'], ours + ('self_attention_norm',), e)
    t.linear(hf['wi'], ours + ('mlp', 'wi'), m, e)
    t.linear(hf['wo'], ours + ('mlp', 'wo'), e, m)
    t.norm(hf['mlp_norm'], ours + ('mlp_norm',), e)
  if pooler:
    t.linear(names.pooler, ('pooler',), e, e)
  if heads.get('mlm'):
    t.linear(names.mlm_transform, ('mlm_transform',), width, e)
    t.norm(names.mlm_norm, ('mlm_norm',), width)
    t.same(f'{names.mlm}bias', ('mlm_bias',), (cfg.vocab_size,))
  if heads.get('sentence_classes'):
    t.linear(names.sentence, ('sentence_head',), heads['sentence_classes'], e)
  if heads.get('num_labels'):
    t.linear(names.classifier, ('classifier',), heads['num_labels'], e)
  return t


def bare_names(state: Mapping[str, Any], names: EncoderNames = BERT_NAMES) -> tuple[dict, dict]:
  """(bare name -> array, bare name -> name in the file): no prefix, TF-era LayerNorm.gamma/beta
  renamed, buffers and the tied (or duplicated) decoder of the MLM head dropped."""
  prefix, head = names.prefix, names.mlm
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


def detect_heads(state: Mapping[str, Any], names: EncoderNames = BERT_NAMES) -> dict:
  """The `Bert` head attributes a checkpoint's names and shapes imply."""
  arrays, _ = bare_names(state, names)
  classes = lambda name: int(arrays[f'{name}.weight'].shape[0]) if f'{name}.weight' in arrays else 0
  return {
      'mlm': f'{names.mlm_transform}.weight' in arrays,
      'sentence_classes': classes(names.sentence) if names.sentence else 0,
      'num_labels': classes(names.classifier)
  }


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
  table = encoder_table(cfg, type_vocab_size, heads, pooler='pooler.dense.weight' in arrays)
  return params_from_table(table.table, arrays, original, dtype=cfg.param_dtype,
                           what=f'a BERT with {cfg.num_encoder_layers} layers and heads {heads}')


def load(directory: str, **overrides) -> HFModel:
  """The HF BERT folder `directory` with its WordPiece tokenizer (families.py's converter
  interface)."""
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


# -- export -------------------------------------------------------------------------------------

# Our activation names -> HF's (the inverse of ACTIVATIONS; HF's 'gelu' is the exact erf form).
HF_ACTIVATIONS = {'gelu_exact': 'gelu', 'gelu': 'gelu_new', 'relu': 'relu', 'silu': 'silu'}


def bert_architecture(mlm: bool = True, sentence_classes: int = 2, num_labels: int = 0) -> str:
  """The HF class that holds exactly these heads (and so loads every exported weight):

    MLM + 2-way sentence head (NSP, or SOP: the same shape) -> BertForPreTraining
    MLM alone (RoBERTa-style pretraining)                    -> BertForMaskedLM
    2-way sentence head alone                                -> BertForNextSentencePrediction
    a classifier alone (fine-tuned)                          -> BertForSequenceClassification
    no head                                                  -> BertModel
  Other combinations have no HF class: a ConfigError naming them.
  """
  classes = {(True, 2, 0): 'BertForPreTraining', (True, 0, 0): 'BertForMaskedLM',
             (False, 2, 0): 'BertForNextSentencePrediction', (False, 0, 0): 'BertModel'}
  return encoder_architecture('BERT', classes, 'BertForSequenceClassification', mlm,
                              sentence_classes, num_labels)


def encoder_architecture(family: str, classes: Mapping[tuple[bool, int, int], str], classifier: str,
                         mlm: bool, sentence_classes: int, num_labels: int) -> str:
  """The HF class of `family` holding these heads: `classes` by (mlm, sentence_classes,
  num_labels), `classifier` for a classifier alone; one ConfigError naming the heads otherwise."""
  heads = (bool(mlm), int(sentence_classes), int(num_labels))
  if heads in classes:
    return classes[heads]
  if not mlm and not sentence_classes:
    return classifier
  raise ConfigError(f'no Hugging Face {family} class holds the heads mlm={mlm}, sentence_classes='
                    f'{sentence_classes}, num_labels={num_labels} together')


def encoder_config_to_hf(cfg: TransformerConfig, type_vocab_size: int, architecture: str,
                         num_labels: int, keys=CONFIG_KEYS) -> dict:
  """The config.json entries a BERT-style family's class `architecture` shares with BERT's (by
  the key table `keys`, as `encoder_config_values` reads them back), with HF's default label
  names for a classifier; the family adds its own."""
  config = {key: getattr(cfg, field) for field, (key, *_) in keys.items()}
  config.update(architectures=[architecture], hidden_act=HF_ACTIVATIONS[cfg.activation],
                type_vocab_size=int(type_vocab_size), initializer_range=cfg.embed_init_std or 0.02,
                tie_word_embeddings=True, dtype='float32')
  if num_labels:
    config['id2label'] = {str(i): f'LABEL_{i}' for i in range(num_labels)}
    config['label2id'] = {f'LABEL_{i}': i for i in range(num_labels)}
  return config


def export_encoder_state(table: Table, params, family: str, names: EncoderNames,
                         bare: bool) -> dict[str, np.ndarray]:
  """HF state dict (name -> contiguous float32 array) of our `Bert` params by a BERT-style
  family's name table: the encoder `names.prefix`ed unless the class is the `bare` model, the
  heads never."""
  state = state_from_table(table, ParamReader(params, family))
  prefix = '' if bare else names.prefix
  return {('' if name.startswith(names.heads) else prefix) + name: value
          for name, value in state.items()}


def check_bert_expressible(cfg: TransformerConfig, family: str = 'BERT') -> None:
  """One ConfigError naming the first switch of `cfg` that HF's BERT layers (which RoBERTa's
  reuse, hence `family` for the message) have no equivalent for."""
  check_encoder_expressible(cfg, family, head_dim=cfg.emb_dim // cfg.num_heads, share_layers=False,
                            embedding_size=None)


def check_encoder_expressible(cfg: TransformerConfig, family: str, **switches) -> None:
  """One ConfigError naming the first switch of `cfg` that the BERT-style layers of `family`
  have no equivalent for: theirs, then the family's own `switches`."""
  refuse_switches(
      family, cfg,
      dict(position='learned', norm_type='layernorm', norm_position='post', embedding_norm=True,
           activation=tuple(HF_ACTIVATIONS), use_bias=True, tie_output=True,
           num_kv_heads=cfg.num_heads, scale_embeddings=False, scale_attention_scores=True,
           rescale_tied_output=False, **switches))
  if cfg.head_dim * cfg.num_heads != cfg.emb_dim:
    raise ConfigError(f'{family} cannot express head_dim={cfg.head_dim} with num_heads='
                      f'{cfg.num_heads} and emb_dim={cfg.emb_dim} (it needs heads x head_dim = '
                      'emb_dim)')


def bert_config_to_hf(cfg: TransformerConfig, type_vocab_size: int = 2, mlm: bool = True,
                      sentence_classes: int = 2, num_labels: int = 0) -> dict:
  """The config.json dict of the HF BERT class (`bert_architecture`) computing what
  `Bert(cfg, type_vocab_size, mlm, sentence_classes, num_labels)` computes.

  Raises one ConfigError naming the first switch BERT has no equivalent for. HF masks padding
  through `attention_mask` (its tokenizer returns it), where `Bert` masks ids equal to [PAD] (0).
  """
  check_bert_expressible(cfg)
  architecture = bert_architecture(mlm, sentence_classes, num_labels)
  return dict(model_type='bert',
              **encoder_config_to_hf(cfg, type_vocab_size, architecture,
                                     num_labels), position_embedding_type='absolute',
              pad_token_id=0, is_decoder=False, add_cross_attention=False)


def export_bert_state_dict(cfg: TransformerConfig, params) -> dict[str, np.ndarray]:
  """HF state dict (name -> contiguous float32 array) of our `Bert` params, named as the class
  `bert_architecture(**heads)` saves them: encoder and pooler 'bert.'-prefixed (bare for
  `BertModel`), heads ('cls.*', 'classifier.*') not; the MLM decoder is tied, so not written.

  The inverse of `convert_bert_state_dict`: importing the result gives `params` back bit for bit
  (as float32). Raises ConfigError for a config BERT cannot express or params that do not fit.
  """
  check_bert_expressible(cfg)
  heads = bert_heads(params)
  architecture = bert_architecture(heads['mlm'], heads['sentence_classes'], heads['num_labels'])
  # BertForMaskedLM checkpoints imported here have no pooler.
  table = encoder_table(cfg, heads['type_vocab_size'], heads, pooler='pooler' in params)
  return export_encoder_state(table.table, params, 'BERT', BERT_NAMES, architecture == 'BertModel')


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
