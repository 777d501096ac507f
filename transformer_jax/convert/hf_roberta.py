"""Hugging Face RoBERTa checkpoints <-> `Bert` config, params and byte-level BPE tokenizer.

    # config.json, model.safetensors, and tokenizer.json or vocab.json + merges.txt
    cfg, params, tokenizer, heads = load_hf_roberta('/path/to/roberta')
    ids, _ = tokenizer.encode_pair('Hello world')          # our ids: <pad> is 0, see below
    out = Bert(cfg, **heads).apply({'params': params}, np.asarray([ids]))
    # and back
    hf_config, state = roberta_config_to_hf(cfg, **bert_heads(params)), \\
        export_roberta_state_dict(cfg, params)

RoBERTa (Liu et al. 2019) is BERT's encoder with four differences at the checkpoint level, each
handled here:

- Learned positions offset by padding_idx + 1. HF computes position ids from the input ids:
  real tokens count up from padding_idx + 1 (cumsum of the non-pad mask), pads get padding_idx.
  For rows that are not left-padded, token i uses table row padding_idx + 1 + i, so our table
  (row i for token i) is HF's rows [padding_idx + 1:], and cfg.max_len is
  max_position_embeddings - padding_idx - 1 (512 for roberta-base's 514). Export writes zeros
  in the padding_idx + 1 offset rows: row padding_idx is what HF adds at pad positions (zero, as
  HF's `nn.Embedding(padding_idx=...)` initialises it), the rows below are never used. Import
  drops them, so import(export(params)) is bitwise.
- No token types: type_vocab_size 1, a single row added to every token (our `segment_embedding`
  with one row; segments must be all 0, which `RobertaTokenizer.build_pair` gives).
- Its own heads. The LM head (dense, exact GELU, LayerNorm, decoder tied to the word embeddings
  plus a bias) is BERT's MLM head under other names. The classification head (dense + tanh +
  out_proj on <s>) is our pooler (tanh(dense(hidden[:, 0]))) followed by our classifier, so
  `classifier.dense` <-> `pooler` and `classifier.out_proj` <-> `classifier`; HF applies dropout
  also before the dense layer, which only matters while training. There is no NSP/SOP head.
- The byte-level BPE tokenizer, with <s>=0 <pad>=1 </s>=2 <unk>=3 and <mask>.

The pad id. Everything else in this package takes PAD_ID = 0 as padding (`Bert.encode` masks
`tokens != 0`, batches are zero-filled, token counts are non-zero counts), while RoBERTa's
<pad> is 1 and its <s> is 0. Rather than thread a pad id through the model, tasks and data,
imported RoBERTa lives in a renumbered id space: HF ids 0 and pad_id swap places (for
roberta-base, ours <pad>=0, <s>=1, everything else unchanged). The swap is applied to the word
embedding rows and the MLM bias on import and undone on export, and `RobertaTokenizer` returns
and accepts ids in our space (`to_hf` / `from_hf` convert). The model then computes exactly what
HF's does for every real token, with `<s>` no longer mistaken for padding. The swap is its own
inverse, so round trips stay bitwise. HF's pad id is kept by the tokenizer (`hf_pad_id`) and
written to config.json on export.
"""

import json
import os
import tempfile
from typing import Any, Mapping

import numpy as np
from absl import logging

from transformer_jax.convert.hf_bert import _bare_names as _bert_bare_names
from transformer_jax.convert.hf_bert import (_ACTIVATIONS, _HF_ACTIVATIONS, _table, bert_heads,
                                             check_bert_expressible)
from transformer_jax.convert.hf_gpt2 import read_state_dict
from transformer_jax.convert.name_table import (ParamReader, Table, params_from_table, same,
                                                state_from_table, transpose)
from transformer_jax.data.hf_tokenizer import HFTokenizer
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.files import write_atomically
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.bert import roberta_config

_PREFIX = 'roberta.'
_POSITIONS = 'embeddings.position_embeddings.weight'
_WORDS = 'embeddings.word_embeddings.weight'
# RoBERTa's special tokens, in the order of its vocabulary (<mask> is the last id of
# roberta-base's, the fifth of a vocabulary trained here).
SPECIAL_TOKENS = ('<s>', '<pad>', '</s>', '<unk>', '<mask>')
_TOKEN_DEFAULTS = {
    'bos': '<s>', 'cls': '<s>', 'pad': '<pad>', 'eos': '</s>', 'sep': '</s>', 'unk': '<unk>',
    'mask': '<mask>'
}
_TOKENIZER_CONFIG, _SPECIAL_TOKENS_MAP = 'tokenizer_config.json', 'special_tokens_map.json'


def swap_ids(ids, pad_id: int):
  """`ids` (an int array or list) with 0 and `pad_id` exchanged: HF ids <-> ours, both ways."""
  if isinstance(ids, list):
    return [pad_id if i == 0 else 0 if i == pad_id else i for i in ids]
  ids = np.asarray(ids)
  return np.where(ids == 0, pad_id, np.where(ids == pad_id, 0, ids)).astype(ids.dtype)


def _swap_rows(table: np.ndarray, pad_id: int) -> np.ndarray:
  """Rows (or entries) 0 and `pad_id` of `table` exchanged: an embedding in HF's id order <->
  ours (its own inverse)."""
  order = swap_ids(np.arange(table.shape[0]), pad_id)
  return np.ascontiguousarray(table[order])


# -- config -------------------------------------------------------------------------------------


def roberta_pad_id(hf_config: Mapping[str, Any]) -> int:
  """config.json's pad_token_id (RoBERTa's padding_idx; 1 by default)."""
  pad = hf_config.get('pad_token_id', 1)
  if not isinstance(pad, int) or pad < 0:
    raise ConfigError(f'config.json pad_token_id={pad!r} is not a token id; RoBERTa needs one '
                      '(its position ids start after it)')
  return pad


def roberta_config_from_hf(hf_config: Mapping[str, Any],
                           **overrides) -> tuple[TransformerConfig, int]:
  """(our config, type_vocab_size) for an HF `RobertaConfig` dict; `overrides` win.

  max_len is the usable positions: max_position_embeddings - pad_token_id - 1.
  """
  c = dict(hf_config)
  model_type = c.get('model_type', 'roberta')
  if model_type != 'roberta':
    hint = {
        'bert': ': a BERT checkpoint, import it with convert/hf_bert.load_hf_bert',
        'albert': ': an ALBERT checkpoint, import it with convert/hf_albert.load_hf_albert'
    }.get(model_type, "; only 'roberta' is read here")
    raise ConfigError(f'config.json has model_type={model_type!r}{hint}')
  activation = c.get('hidden_act', 'gelu')
  if activation not in _ACTIVATIONS:
    raise ConfigError(f'config.json hidden_act={activation!r} is not supported; supported: '
                      f'{sorted(_ACTIVATIONS)}')
  if c.get('position_embedding_type', 'absolute') != 'absolute':
    raise ConfigError(f"config.json position_embedding_type={c['position_embedding_type']!r} "
                      "is not supported (need 'absolute')")
  if c.get('is_decoder') or c.get('add_cross_attention'):
    raise ConfigError('config.json describes a RoBERTa decoder (is_decoder/add_cross_attention); '
                      'only the bidirectional encoder is supported')
  pad = roberta_pad_id(c)
  try:
    table_rows = int(c['max_position_embeddings'])
    values = dict(vocab_size=int(c['vocab_size']), emb_dim=int(c['hidden_size']),
                  num_heads=int(c['num_attention_heads']), mlp_dim=int(c['intermediate_size']),
                  num_encoder_layers=int(c['num_hidden_layers']), max_len=table_rows - pad - 1,
                  norm_epsilon=float(c.get('layer_norm_eps',
                                           1e-12)), activation=_ACTIVATIONS[activation],
                  dropout_rate=float(c.get('hidden_dropout_prob', 0.1)),
                  attention_dropout_rate=float(c.get('attention_probs_dropout_prob', 0.1)),
                  embed_init_std=float(c.get('initializer_range', 0.02)))
  except KeyError as e:
    raise ConfigError(f'config.json lacks {e.args[0]!r}, needed for a RoBERTa model') from None
  if values['max_len'] < 1:
    raise ConfigError(f'config.json max_position_embeddings={table_rows} leaves no position after '
                      f'the pad_token_id + 1 = {pad + 1} offset rows')
  if pad >= values['vocab_size']:
    raise ConfigError(f'config.json pad_token_id={pad} is outside the vocabulary '
                      f'(vocab_size={values["vocab_size"]})')
  values.update(overrides)
  return roberta_config(**values), int(c.get('type_vocab_size', 1))


# -- the name table -----------------------------------------------------------------------------


def _roberta_table(cfg: TransformerConfig, type_vocab_size: int, heads: dict, pad_id: int,
                   pooler: bool) -> Table:
  """HF name (no 'roberta.' prefix on the encoder) -> (our path, HF shape, HF -> ours, ours ->
  HF): BERT's encoder table with RoBERTa's positions, renumbered ids and heads."""
  e, offset = cfg.emb_dim, pad_id + 1
  # BERT's encoder and pooler (RoBERTa's layers have BERT's names), no BERT heads.
  table = _table(cfg, type_vocab_size, cfg.num_encoder_layers, {}, pooler=pooler)
  table[_WORDS] = (('token_embed', 'embedding'), (cfg.vocab_size, e),
                   lambda w: _swap_rows(w, pad_id), lambda w: _swap_rows(w, pad_id))
  table[_POSITIONS] = (('input_embedding', 'position_embedding', 'embedding'),
                       (cfg.max_len + offset, e), lambda w: np.ascontiguousarray(w[offset:]),
                       lambda w: np.concatenate([np.zeros((offset, e), w.dtype), w]))

  def dense(hf, path, out, inp):
    table[f'{hf}.weight'] = (path + ('kernel',), (out, inp), transpose, transpose)
    table[f'{hf}.bias'] = (path + ('bias',), (out,), same, same)

  if heads.get('mlm'):
    dense('lm_head.dense', ('mlm_transform',), e, e)
    table['lm_head.layer_norm.weight'] = (('mlm_norm', 'scale'), (e,), same, same)
    table['lm_head.layer_norm.bias'] = (('mlm_norm', 'bias'), (e,), same, same)
    table['lm_head.bias'] = (('mlm_bias',), (cfg.vocab_size,), lambda b: _swap_rows(b, pad_id),
                             lambda b: _swap_rows(b, pad_id))
  if heads.get('num_labels'):
    dense('classifier.dense', ('pooler',), e, e)
    dense('classifier.out_proj', ('classifier',), heads['num_labels'], e)
  return table


def _bare_names(state: Mapping[str, Any]) -> tuple[dict, dict]:
  """(bare name -> array, bare name -> name in the file), as `hf_bert._bare_names`: no
  'roberta.' prefix, buffers and the tied LM decoder dropped (refused if it is not tied)."""
  return _bert_bare_names(state, _PREFIX, head='lm_head.')


def detect_roberta_heads(state: Mapping[str, Any]) -> dict:
  """The `Bert` head attributes a RoBERTa checkpoint's names and shapes imply."""
  arrays, _ = _bare_names(state)
  heads = {'mlm': 'lm_head.dense.weight' in arrays, 'sentence_classes': 0, 'num_labels': 0}
  if 'classifier.out_proj.weight' in arrays:
    heads['num_labels'] = int(arrays['classifier.out_proj.weight'].shape[0])
  return heads


def convert_roberta_state_dict(state: Mapping[str, Any], cfg: TransformerConfig,
                               type_vocab_size: int = 1, heads: dict | None = None,
                               pad_id: int = 1) -> dict:
  """Our `Bert` params from an HF RoBERTa state dict (names optionally 'roberta.'-prefixed).

  `heads` (default: detected) says which head weights to expect; `pad_id` is config.json's
  pad_token_id (the position offset and the id swapped with 0). Raises one ConfigError naming
  unknown, missing or wrongly shaped parameters.
  """
  heads = detect_roberta_heads(state) if heads is None else heads
  if heads.get('sentence_classes'):
    raise ConfigError('RoBERTa has no next-sentence / sentence-order head (heads '
                      f'{heads}); set sentence_classes=0')
  arrays, original = _bare_names(state)
  if heads.get('mlm') and cfg.activation != 'gelu_exact':
    # HF's RobertaLMHead applies exact GELU whatever hidden_act says; ours follows the config.
    raise ConfigError(f'RoBERTa\'s LM head uses exact GELU; a model with activation='
                      f'{cfg.activation!r} would compute another head')
  table = _roberta_table(cfg, type_vocab_size, heads, pad_id, pooler='pooler.dense.weight'
                         in arrays)
  return params_from_table(table, arrays, original, dtype=cfg.param_dtype,
                           what=f'a RoBERTa with {cfg.num_encoder_layers} layers and heads {heads}')


def load_hf_roberta(directory: str, **overrides):
  """(config, params, tokenizer, heads) for the HF RoBERTa checkpoint in `directory`, as
  `load_hf_bert`: `heads` is {'type_vocab_size', 'mlm', 'sentence_classes', 'num_labels'}, the
  `Bert` attributes matching the weights; `tokenizer` is a `RobertaTokenizer` in our id space.
  """
  config_path = os.path.join(directory, 'config.json')
  if not os.path.exists(config_path):
    raise DataError(f'{config_path} does not exist: expected a Hugging Face RoBERTa directory '
                    '(config.json, model.safetensors, tokenizer.json or vocab.json + merges.txt)')
  with open(config_path, encoding='utf-8') as f:
    hf_config = json.load(f)
  cfg, type_vocab_size = roberta_config_from_hf(hf_config, **overrides)
  pad = roberta_pad_id(hf_config)
  state = read_state_dict(directory)
  heads = detect_roberta_heads(state)
  params = convert_roberta_state_dict(state, cfg, type_vocab_size, heads, pad)
  tokenizer = RobertaTokenizer.from_dir(directory)
  if tokenizer.hf_pad_id != pad:
    raise ConfigError(f'{directory}: the tokenizer\'s pad token is id {tokenizer.hf_pad_id} but '
                      f'config.json says pad_token_id={pad}')
  if tokenizer.vocab_size > cfg.vocab_size:
    raise ConfigError(f'{directory}: the tokenizer has {tokenizer.vocab_size} tokens but '
                      f'config.json says vocab_size={cfg.vocab_size}')
  logging.info('imported RoBERTa from %s: %d layers, %d heads, width %d, vocab %d, heads %s',
               directory, cfg.num_encoder_layers, cfg.num_heads, cfg.emb_dim, cfg.vocab_size, heads)
  return cfg, params, tokenizer, dict(heads, type_vocab_size=type_vocab_size)


# -- export -------------------------------------------------------------------------------------


def roberta_architecture(mlm: bool = True, sentence_classes: int = 0, num_labels: int = 0) -> str:
  """The HF class holding exactly these heads: MLM -> RobertaForMaskedLM, a classifier ->
  RobertaForSequenceClassification, none -> RobertaModel; anything else (a sentence head, MLM
  with a classifier) is one ConfigError."""
  if sentence_classes:
    raise ConfigError(f'RoBERTa has no next-sentence / sentence-order head, but the model has a '
                      f'{sentence_classes}-way one: export it as BERT, or pretrain with '
                      "data.sentence_task='full_sentences' (or 'none')")
  if mlm and num_labels:
    raise ConfigError('no Hugging Face RoBERTa class holds an LM head and a classifier together')
  if mlm:
    return 'RobertaForMaskedLM'
  return 'RobertaForSequenceClassification' if num_labels else 'RobertaModel'


def _check_roberta_expressible(cfg: TransformerConfig, mlm: bool) -> None:
  check_bert_expressible(cfg, 'RoBERTa')
  if mlm and cfg.activation != 'gelu_exact':
    raise ConfigError(f'RoBERTa cannot express activation={cfg.activation!r} with an LM head (its '
                      "head always uses exact GELU, 'gelu_exact')")


def roberta_config_to_hf(cfg: TransformerConfig, type_vocab_size: int = 1, mlm: bool = True,
                         sentence_classes: int = 0, num_labels: int = 0, *, pad_token_id: int = 1,
                         bos_token_id: int = 0, eos_token_id: int = 2) -> dict:
  """The config.json dict of the HF RoBERTa class (`roberta_architecture`) computing what
  `Bert(cfg, type_vocab_size, mlm, sentence_classes, num_labels)` computes, with the token ids
  in HF's numbering (RoBERTa's by default; a `RobertaTokenizer` has them as `hf_special_ids`).

  Raises one ConfigError naming the first switch or head RoBERTa has no equivalent for.
  """
  architecture = roberta_architecture(mlm, sentence_classes, num_labels)
  _check_roberta_expressible(cfg, mlm)
  config = {
      'model_type': 'roberta', 'architectures': [architecture], 'vocab_size': cfg.vocab_size,
      'hidden_size': cfg.emb_dim, 'num_hidden_layers': cfg.num_encoder_layers,
      'num_attention_heads': cfg.num_heads, 'intermediate_size': cfg.mlp_dim,
      'hidden_act': _HF_ACTIVATIONS[cfg.activation], 'hidden_dropout_prob': cfg.dropout_rate,
      'attention_probs_dropout_prob': cfg.attention_dropout_rate,
      'max_position_embeddings': cfg.max_len + pad_token_id + 1,
      'type_vocab_size': int(type_vocab_size), 'initializer_range': cfg.embed_init_std or 0.02,
      'layer_norm_eps': cfg.norm_epsilon, 'position_embedding_type': 'absolute',
      'pad_token_id': int(pad_token_id), 'bos_token_id': int(bos_token_id),
      'eos_token_id': int(eos_token_id), 'tie_word_embeddings': True, 'is_decoder': False,
      'add_cross_attention': False, 'classifier_dropout': None, 'dtype': 'float32'
  }
  if num_labels:
    config['id2label'] = {str(i): f'LABEL_{i}' for i in range(num_labels)}
    config['label2id'] = {f'LABEL_{i}': i for i in range(num_labels)}
  return config


def export_roberta_state_dict(cfg: TransformerConfig, params,
                              pad_token_id: int = 1) -> dict[str, np.ndarray]:
  """HF state dict (name -> contiguous float32 array) of our `Bert` params, named as the class
  `roberta_architecture(**heads)` saves them: encoder 'roberta.'-prefixed (bare for
  `RobertaModel`), heads ('lm_head.*', 'classifier.*') not; the tied decoder is not written.

  Positions get pad_token_id + 1 zero rows in front (module docstring), the word embeddings and
  LM bias their ids 0 and pad_token_id swapped back. A pooler next to an LM head (ours always
  has one) is written as 'roberta.pooler.*', which `RobertaForMaskedLM` ignores with a warning,
  so that import(export(params)) == params bit for bit (as float32).
  """
  heads = bert_heads(params)
  architecture = roberta_architecture(heads['mlm'], heads['sentence_classes'], heads['num_labels'])
  _check_roberta_expressible(cfg, heads['mlm'])
  prefix = '' if architecture == 'RobertaModel' else _PREFIX
  pooler = 'pooler' in params and not heads['num_labels']  # else it is classifier.dense
  table = _roberta_table(cfg, heads['type_vocab_size'], heads, pad_token_id, pooler)
  state = state_from_table(table, ParamReader(params, 'RoBERTa'))
  return {('' if name.startswith(('lm_head.', 'classifier.')) else prefix) + name: value
          for name, value in state.items()}


# -- tokenizer ----------------------------------------------------------------------------------


def _read_json_object(path: str) -> dict:
  try:
    with open(path, encoding='utf-8') as f:
      data = json.load(f)
  except (OSError, ValueError) as e:
    raise DataError(f'cannot read {path}: {e}') from None
  if not isinstance(data, dict):
    raise DataError(f'{path} is not a JSON object')
  return data


def _special_names(directory: str) -> dict[str, str]:
  """kind ('bos', 'cls', 'mask', ...) -> token text from tokenizer_config.json, else
  special_tokens_map.json, else RoBERTa's."""
  names = {}
  for file in (_TOKENIZER_CONFIG, _SPECIAL_TOKENS_MAP):
    path = os.path.join(directory, file)
    if os.path.exists(path):
      data = _read_json_object(path)
      for kind in _TOKEN_DEFAULTS:
        value = data.get(f'{kind}_token')
        value = value.get('content') if isinstance(value, dict) else value
        if kind not in names and isinstance(value, str):
          names[kind] = value
  return {kind: names.get(kind, default) for kind, default in _TOKEN_DEFAULTS.items()}


class RobertaTokenizer:
  """RoBERTa's byte-level BPE with the interface of `data/wordpiece.WordPieceTokenizer` (what
  data/bert_pretrain.py, data/classification.py and the BERT workflow use), in our id space:
  ids 0 and `hf_pad_id` swapped, so `pad_id` is 0 (module docstring). `cls_id` is <s>,
  `sep_id` </s>; `build_pair` writes RoBERTa's `<s> A </s>` and `<s> A </s></s> B </s>` with
  all-zero segments (RoBERTa has no token types). `encode` adds no special token.
  """

  lowercase = False  # byte-level BPE sees the text as it is

  def __init__(self, hf: HFTokenizer, names: dict[str, str], source: str = ''):
    self.hf, self.names = hf, dict(names)
    hf_ids = {}
    for kind, token in self.names.items():
      i = hf.token_to_id(token)
      if i is None:
        raise DataError(f'{source or "the tokenizer"}: RoBERTa\'s {kind} token {token!r} is not in '
                        'the vocabulary')
      hf_ids[kind] = i
    self.hf_pad_id = hf_ids['pad']
    ours = {kind: swap_ids([i], self.hf_pad_id)[0] for kind, i in hf_ids.items()}
    self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
        ours[k] for k in ('pad', 'unk', 'cls', 'sep', 'mask'))
    self.bos_id, self.eos_id = ours['bos'], ours['eos']
    self.special_ids = np.asarray(sorted(set(ours.values())))
    self._hf_ids = hf_ids

  def __repr__(self) -> str:
    return (f'RobertaTokenizer(vocab_size={self.vocab_size}, hf_pad_id={self.hf_pad_id}, '
            f'mask_id={self.mask_id})')

  # -- building

  @classmethod
  def from_dir(cls, directory: str) -> 'RobertaTokenizer':
    """The tokenizer of an HF RoBERTa folder: tokenizer.json, else vocab.json + merges.txt;
    special tokens named by tokenizer_config.json / special_tokens_map.json, else RoBERTa's."""
    path = lambda name: os.path.join(directory, name)
    named = any(os.path.exists(path(n)) for n in (_TOKENIZER_CONFIG, _SPECIAL_TOKENS_MAP))
    bare_bpe = all(os.path.exists(path(n)) for n in ('vocab.json', 'merges.txt'))
    if named or os.path.exists(path('tokenizer.json')) or not bare_bpe:
      return cls(HFTokenizer.from_dir(directory), _special_names(directory), directory)
    # Bare vocab.json + merges.txt (fairseq-era folders): HFTokenizer would take GPT-2's special
    # token for the unnamed ones, so name RoBERTa's beside copies of the two files.
    with tempfile.TemporaryDirectory() as tmp:
      for name in ('vocab.json', 'merges.txt'):
        with open(path(name), 'rb') as f:
          write_atomically(os.path.join(tmp, name), f.read())
      names = {f'{kind}_token': token for kind, token in _TOKEN_DEFAULTS.items()}
      write_atomically(os.path.join(tmp, _SPECIAL_TOKENS_MAP), json.dumps(names))
      return cls(HFTokenizer.from_dir(tmp), _special_names(tmp), directory)

  @classmethod
  def train(cls, texts, vocab_size: int, *, min_frequency: int = 2) -> 'RobertaTokenizer':
    """A byte-level BPE learned from `texts` with RoBERTa's pipeline (GPT-2's regex split, no
    prefix space) and special tokens <s>=0 <pad>=1 </s>=2 <unk>=3 <mask>=4 (HF ids), so that an
    exported model has roberta-base's layout of the first four."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
      raise ConfigError(f'a byte-level BPE needs tokenizer.vocab_size >= '
                        f'{len(alphabet) + len(SPECIAL_TOKENS)} (every byte and RoBERTa\'s '
                        f'{len(SPECIAL_TOKENS)} special tokens), got {vocab_size}')
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), initial_alphabet=alphabet,
                                  show_progress=False)
    seen = [0]

    def counted():
      for text in texts:
        if text:
          seen[0] += 1
          yield text

    backend.train_from_iterator(counted(), trainer)
    if not seen[0]:
      raise DataError('cannot train a byte-level BPE: the training text is empty')
    with tempfile.TemporaryDirectory() as tmp:  # HFTokenizer reads files: go through them
      _write_files(tmp, backend.to_str(), dict(_TOKEN_DEFAULTS))
      tokenizer = cls.from_dir(tmp)
    logging.info('trained a RoBERTa byte-level BPE with %d tokens on %d texts',
                 tokenizer.vocab_size, seen[0])
    return tokenizer

  @classmethod
  def load_or_train(cls, directory: str, texts_fn, vocab_size: int) -> 'RobertaTokenizer':
    """The tokenizer saved in `directory`, or one trained on `texts_fn()` and saved there."""
    if os.path.exists(os.path.join(directory, 'tokenizer.json')):
      return cls.from_dir(directory)
    tokenizer = cls.train(texts_fn(), vocab_size)
    tokenizer.save(directory)
    return tokenizer

  # -- using

  @property
  def vocab_size(self) -> int:
    return self.hf.vocab_size

  @property
  def hf_special_ids(self) -> dict[str, int]:
    """config.json's token ids, in HF's numbering: {'pad_token_id', 'bos_token_id',
    'eos_token_id'}."""
    return {f'{k}_token_id': self._hf_ids[k] for k in ('pad', 'bos', 'eos')}

  def to_hf(self, ids):
    """Our ids -> HF's (a list or an array)."""
    return swap_ids(ids, self.hf_pad_id)

  def from_hf(self, ids):
    """HF's ids -> ours (a list or an array)."""
    return swap_ids(ids, self.hf_pad_id)

  def encode(self, text: str) -> list[int]:
    return self.from_hf(self.hf.encode(text))

  def encode_batch(self, texts) -> list[list[int]]:
    return [self.from_hf(ids) for ids in self.hf.encode_batch(list(texts))]

  def encode_pair(self, first: str, second: str | None = None,
                  max_len: int | None = None) -> tuple[list[int], list[int]]:
    """(<s> a </s> (</s> b </s>), segment ids (all 0)), the longer side trimmed to fit."""
    a = self.encode(first)
    b = self.encode(second) if second is not None else None
    return self.build_pair(a, b, max_len)

  def build_pair(self, a, b, max_len: int | None = None) -> tuple[list[int], list[int]]:
    a, b = list(a), (list(b) if b is not None else None)
    if max_len is not None:
      budget = max_len - (4 if b is not None else 2)
      while len(a) + (len(b) if b is not None else 0) > budget:
        if b is not None and len(b) > len(a):
          b.pop()
        else:
          a.pop()
    ids = [self.cls_id] + a + [self.sep_id]
    if b is not None:
      ids += [self.sep_id] + b + [self.sep_id]
    return ids, [0] * len(ids)

  def decode(self, ids) -> str:
    """Text of our ids; drops padding."""
    if hasattr(ids, '__array__'):
      ids = np.asarray(ids).reshape(-1).tolist()
    return self.hf.decode(self.to_hf([int(i) for i in ids if int(i) != self.pad_id]))

  # -- saving

  def save(self, directory: str, max_len: int | None = None):
    """Writes HF RoBERTa tokenizer files to `directory` (each file atomically; tokenizer.json,
    whose presence `load_or_train` checks, last): vocab.json, merges.txt, tokenizer_config.json
    (RobertaTokenizer), special_tokens_map.json, tokenizer.json (with RoBERTa's post-processor,
    so HF's `tokenizer(text)` adds <s> and </s>). `transformers.AutoTokenizer` loads them with
    the same HF ids; `from_dir` reads them back."""
    with tempfile.TemporaryDirectory() as tmp:
      self.hf.save(tmp)
      with open(os.path.join(tmp, 'tokenizer.json'), encoding='utf-8') as f:
        tokenizer_json = f.read()
    _write_files(directory, tokenizer_json, self.names, max_len)


def _write_files(directory: str, tokenizer_json: str, names: dict[str, str],
                 max_len: int | None = None) -> None:
  """The tokenizer files of `save` from a tokenizer.json text (see `RobertaTokenizer.save`)."""
  from tokenizers import Tokenizer, processors
  backend = Tokenizer.from_str(tokenizer_json)
  token_id = backend.token_to_id
  backend.post_processor = processors.RobertaProcessing((names['sep'], token_id(names['sep'])),
                                                        (names['cls'], token_id(names['cls'])),
                                                        trim_offsets=True, add_prefix_space=False)
  backend.no_padding()
  backend.no_truncation()
  os.makedirs(directory, exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp:
    for path in backend.model.save(tmp):  # vocab.json + merges.txt (a BPE model)
      with open(path, encoding='utf-8') as f:
        write_atomically(os.path.join(directory, os.path.basename(path)), f.read())
  special = {f'{kind}_token': token for kind, token in names.items()}
  config = dict(special, tokenizer_class='RobertaTokenizer', add_prefix_space=False,
                trim_offsets=True, errors='replace', clean_up_tokenization_spaces=False)
  if max_len:
    config['model_max_length'] = int(max_len)
  for name, value in ((_TOKENIZER_CONFIG, config), (_SPECIAL_TOKENS_MAP, special)):
    write_atomically(os.path.join(directory, name),
                     json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + '\n')
  write_atomically(os.path.join(directory, 'tokenizer.json'), backend.to_str(pretty=True))


def roberta_tokenizer_files(tokenizer: RobertaTokenizer, max_len: int):
  """`convert/export.TokenizerFiles` of a `RobertaTokenizer` (config.json's ids in HF's
  numbering), for `python -m experiments.export`."""
  from transformer_jax.convert.export import TokenizerFiles
  return TokenizerFiles(tokenizer.vocab_size, tokenizer.hf_special_ids,
                        lambda directory: tokenizer.save(directory, max_len))
