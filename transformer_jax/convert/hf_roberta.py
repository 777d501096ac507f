"""Hugging Face RoBERTa checkpoints <-> `Bert` config, params and byte-level BPE tokenizer.

    # config.json, model.safetensors, and tokenizer.json or vocab.json + merges.txt
    model = hf_roberta.load('/path/to/roberta')     # an HFModel: config, params, tokenizer, heads
    ids, _ = model.tokenizer.encode_pair('Hello world')    # our ids: <pad> is 0, see below
    out = Bert(model.config, **model.heads).apply({'params': model.params}, np.asarray([ids]))
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

import dataclasses
from typing import Any, Mapping

import numpy as np
from absl import logging

from transformer_jax.convert import families
from transformer_jax.convert.hf_bert import (BERT_NAMES, bare_names, bert_heads,
                                             check_bert_expressible, detect_heads,
                                             encoder_config_to_hf, encoder_config_values,
                                             encoder_table, export_encoder_state)
from transformer_jax.convert.hf_files import HFModel, read_hf_config, read_state_dict
from transformer_jax.convert.name_table import Table, params_from_table
from transformer_jax.data.roberta_tokenizer import RobertaTokenizer, swap_ids
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.bert import roberta_config

# BERT's layers and pooler, RoBERTa's heads. `classifier.dense` is our pooler when the
# classification head is there (module docstring).
NAMES = dataclasses.replace(BERT_NAMES, prefix='roberta.', mlm_transform='lm_head.dense',
                            mlm_norm='lm_head.layer_norm', mlm='lm_head.', sentence=None,
                            classifier='classifier.out_proj')
_POSITIONS = 'embeddings.position_embeddings.weight'
_WORDS = 'embeddings.word_embeddings.weight'


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
  families.refuse_other_model_type(c, 'roberta', 'RoBERTa')
  values = encoder_config_values(c, 'RoBERTa')
  pad = roberta_pad_id(c)
  table_rows = values['max_len']
  values['max_len'] = table_rows - pad - 1
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
  HF): BERT's encoder table under RoBERTa's names, with its positions and renumbered ids."""
  e, offset = cfg.emb_dim, pad_id + 1
  t = encoder_table(cfg, type_vocab_size, heads, pooler, NAMES)
  if heads.get('num_labels'):
    t.linear('classifier.dense', ('pooler',), e, e)
  swap = lambda w: _swap_rows(w, pad_id)
  t.table[_WORDS] = (('token_embed', 'embedding'), (cfg.vocab_size, e), swap, swap)
  t.table[_POSITIONS] = (('input_embedding', 'position_embedding', 'embedding'),
                         (cfg.max_len + offset, e), lambda w: np.ascontiguousarray(w[offset:]),
                         lambda w: np.concatenate([np.zeros((offset, e), w.dtype), w]))
  if heads.get('mlm'):
    t.table[f'{NAMES.mlm}bias'] = (('mlm_bias',), (cfg.vocab_size,), swap, swap)
  return t.table


def convert_roberta_state_dict(state: Mapping[str, Any], cfg: TransformerConfig,
                               type_vocab_size: int = 1, heads: dict | None = None,
                               pad_id: int = 1) -> dict:
  """Our `Bert` params from an HF RoBERTa state dict (names optionally 'roberta.'-prefixed).

  `heads` (default: detected) says which head weights to expect; `pad_id` is config.json's
  pad_token_id (the position offset and the id swapped with 0). Raises one ConfigError naming
  unknown, missing or wrongly shaped parameters.
  """
  heads = detect_heads(state, NAMES) if heads is None else heads
  if heads.get('sentence_classes'):
    raise ConfigError('RoBERTa has no next-sentence / sentence-order head (heads '
                      f'{heads}); set sentence_classes=0')
  arrays, original = bare_names(state, NAMES)
  if heads.get('mlm') and cfg.activation != 'gelu_exact':
    # HF's RobertaLMHead applies exact GELU whatever hidden_act says; ours follows the config.
    raise ConfigError(f'RoBERTa\'s LM head uses exact GELU; a model with activation='
                      f'{cfg.activation!r} would compute another head')
  table = _roberta_table(cfg, type_vocab_size, heads, pad_id, pooler='pooler.dense.weight'
                         in arrays)
  return params_from_table(table, arrays, original, dtype=cfg.param_dtype,
                           what=f'a RoBERTa with {cfg.num_encoder_layers} layers and heads {heads}')


def load(directory: str, **overrides) -> HFModel:
  """The HF RoBERTa folder `directory` with its tokenizer in our id space (families.py's
  converter interface)."""
  hf_config = read_hf_config(
      directory, 'config.json, model.safetensors, tokenizer.json or vocab.json + merges.txt')
  cfg, type_vocab_size = roberta_config_from_hf(hf_config, **overrides)
  pad = roberta_pad_id(hf_config)
  state = read_state_dict(directory)
  heads = detect_heads(state, NAMES)
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
  return HFModel(cfg, params, tokenizer, dict(heads, type_vocab_size=type_vocab_size))


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
  config = dict(model_type='roberta',
                **encoder_config_to_hf(cfg, type_vocab_size, architecture, num_labels),
                position_embedding_type='absolute', pad_token_id=int(pad_token_id),
                bos_token_id=int(bos_token_id), eos_token_id=int(eos_token_id), is_decoder=False,
                add_cross_attention=False, classifier_dropout=None)
  config['max_position_embeddings'] = cfg.max_len + pad_token_id + 1  # the offset rows
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
  pooler = 'pooler' in params and not heads['num_labels']  # else it is classifier.dense
  table = _roberta_table(cfg, heads['type_vocab_size'], heads, pad_token_id, pooler)
  return export_encoder_state(table, params, 'RoBERTa', NAMES, architecture == 'RobertaModel')


def exporters(heads: dict | None = None, special_ids: dict | None = None):
  """(config_to_hf, export_state_dict) for params holding `heads` (families.py's converter
  interface). `special_ids`: config.json's pad/bos/eos ids in HF's numbering, as
  `TokenizerFiles.special_ids` of a `RobertaTokenizer` gives them (RoBERTa's own by default);
  the pad id also places the position rows and the swapped word embedding rows."""
  heads = dict(heads or {})
  ids = {
      k: int(v)
      for k, v in (special_ids or {}).items()
      if k in ('pad_token_id', 'bos_token_id', 'eos_token_id')
  }
  pad = ids.get('pad_token_id', 1)
  return (lambda cfg: roberta_config_to_hf(cfg, **heads, **ids),
          lambda cfg, params: export_roberta_state_dict(cfg, params, pad))


def claims(cfg: TransformerConfig, byte_level: bool = False) -> bool:
  """Whether an export of the encoder `cfg` is RoBERTa's: byte-level BPE ids."""
  del cfg
  return byte_level


# families.py's converter interface: our config of a config.json dict.
config_from_hf = roberta_config_from_hf
