"""Hugging Face OPT checkpoints <-> `GPT` config and params (Meta's OPT, `OPTForCausalLM`).

    model = families.named('opt').load('/path/to/opt')     # HFModel: config, params
    logits = GPT(model.config).apply({'params': model.params}, tokens)

OPT is GPT-2's architecture with two real differences, both handled here:
  - ReLU in the MLP (GPT-2: GELU), an `activation` switch of our config;
  - learned positions offset by 2: OPT's table has max_position_embeddings + 2 rows and position
    p reads row p + 2 (rows 0 and 1 serve left padding only). Import drops the first two rows;
    export writes them as zeros, which only a padded position would read.
Unlike GPT-2 its projections are `nn.Linear` ([out, in], separate q, k, v), so the table below
transposes and splits heads. Refused, with one ConfigError line each: OPT-350m's post-LN layout
(do_layer_norm_before=false) and projected embeddings (word_embed_proj_dim != hidden_size),
norms without affine parameters, no biases.
"""

from typing import Any, Mapping

import numpy as np
from absl import logging

from transformer_jax.convert.hf_gpt2 import gpt2_switches
from transformer_jax.convert import families
from transformer_jax.convert.hf_files import (HFModel, hf_activation, read_hf_config,
                                              read_state_dict, refuse_switches)
from transformer_jax.convert.name_table import (ParamReader, Table, TableBuilder, causal_lm_names,
                                                params_from_table, state_from_table)
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.gpt import OPT_ARCHITECTURE, opt_config

_PREFIX = 'model.decoder.'
_HEAD = 'lm_head.weight'
OFFSET = 2  # rows of the position table before position 0
# HF activation names -> ours ('gelu' is HF's exact erf form; ours 'gelu' is the tanh one).
_ACTIVATIONS = {'relu': 'relu', 'gelu': 'gelu_exact', 'gelu_new': 'gelu', 'silu': 'silu'}
_HF_ACTIVATIONS = {ours: hf for hf, ours in _ACTIVATIONS.items()}
# OPT's nn.LayerNorm keeps torch's default epsilon: config.json has no field for it.
_EPSILON = 1e-5


def opt_config_from_hf(hf_config: Mapping[str, Any], **overrides) -> TransformerConfig:
  """Our config for an HF `OPTConfig` dict (config.json); `overrides` win."""
  c = dict(hf_config)
  families.refuse_other_model_type(c, 'opt', 'OPT')
  refused = {
      'do_layer_norm_before': (True, 'the post-LN layout of OPT-350m'),
      '_remove_final_layer_norm': (False, 'a decoder without its final norm'),
      'layer_norm_elementwise_affine': (True, 'norms without scale and bias'),
      'enable_bias': (True, 'projections without biases'),
  }
  for key, (want, what) in refused.items():
    if c.get(key, want) != want:
      raise ConfigError(f'config.json {key}={c[key]} is not supported: {what} (need {want})')
  if c.get('word_embed_proj_dim', c.get('hidden_size')) != c.get('hidden_size'):
    raise ConfigError(f'config.json word_embed_proj_dim={c["word_embed_proj_dim"]} differs from '
                      f'hidden_size={c.get("hidden_size")}: projected embeddings (project_in/out) '
                      'are not supported')
  activation = hf_activation(c, 'activation_function', 'relu', _ACTIVATIONS)
  try:
    values = dict(vocab_size=int(c['vocab_size']), emb_dim=int(c['hidden_size']),
                  num_heads=int(c['num_attention_heads']), mlp_dim=int(c['ffn_dim']),
                  num_decoder_layers=int(c['num_hidden_layers']),
                  max_len=int(c.get('max_position_embeddings', 2048)), activation=activation,
                  norm_epsilon=_EPSILON, dropout_rate=float(c.get('dropout', 0.1)),
                  attention_dropout_rate=float(c.get('attention_dropout', 0.0)),
                  tie_output=bool(c.get('tie_word_embeddings',
                                        True)), embed_init_std=float(c.get('init_std', 0.02)))
  except KeyError as e:
    raise ConfigError(f'config.json lacks {e.args[0]!r}, needed for an OPT model') from None
  values.update(overrides)
  return opt_config(**values)


def _check_opt_expressible(cfg: TransformerConfig) -> None:
  """GPT-2's switches, OPT's activations and the one norm epsilon OPT has."""
  needed = dict(gpt2_switches(cfg), activation=tuple(_HF_ACTIVATIONS), norm_epsilon=_EPSILON)
  refuse_switches('OPT', cfg, needed)


def opt_config_to_hf(cfg: TransformerConfig, *, bos_token_id: int | None = None,
                     eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict:
  """The config.json dict of an `OPTForCausalLM` computing what `GPT(cfg)` computes."""
  _check_opt_expressible(cfg)
  return {
      'model_type': 'opt', 'architectures': ['OPTForCausalLM'], 'vocab_size': cfg.vocab_size,
      'hidden_size': cfg.emb_dim, 'word_embed_proj_dim': cfg.emb_dim,
      'num_hidden_layers': cfg.num_decoder_layers, 'num_attention_heads': cfg.num_heads,
      'ffn_dim': cfg.mlp_dim, 'max_position_embeddings': cfg.max_len,
      'activation_function': _HF_ACTIVATIONS[cfg.activation], 'do_layer_norm_before': True,
      'layer_norm_elementwise_affine': True, 'enable_bias': True, 'dropout': cfg.dropout_rate,
      'attention_dropout': cfg.attention_dropout_rate, 'init_std': cfg.embed_init_std or 0.02,
      'tie_word_embeddings': cfg.tie_output, 'bos_token_id': bos_token_id,
      'eos_token_id': eos_token_id, 'pad_token_id': pad_token_id, 'dtype': 'float32'
  }


def _table(cfg: TransformerConfig) -> Table:
  """HF name -> (our param path, HF shape, HF array -> ours, our array -> HF's)."""
  e, m, h, d = cfg.emb_dim, cfg.mlp_dim, cfg.num_heads, cfg.head_dim
  t = TableBuilder()
  t.same(f'{_PREFIX}embed_tokens.weight', ('token_embed', 'embedding'), (cfg.vocab_size, e))
  # OPT's one special layout: the position table's first OFFSET rows (module docstring).
  t.table[f'{_PREFIX}embed_positions.weight'] = (
      ('input_embedding', 'position_embedding', 'embedding'), (cfg.max_len + OFFSET, e),
      lambda w: w[OFFSET:], lambda w: np.concatenate([np.zeros((OFFSET, e), w.dtype), w]))
  for i in range(cfg.num_decoder_layers):
    hf, ours = f'{_PREFIX}layers.{i}', ('stack', f'layer_{i}')
    for name in ('query', 'key', 'value'):
      t.to_heads(f'{hf}.self_attn.{name[0]}_proj', ours + ('self_attention', name), e, h, d)
    t.from_heads(f'{hf}.self_attn.out_proj', ours + ('self_attention', 'out'), e, h, d)
    t.linear(f'{hf}.fc1', ours + ('mlp', 'wi'), m, e)
    t.linear(f'{hf}.fc2', ours + ('mlp', 'wo'), e, m)
    t.norm(f'{hf}.self_attn_layer_norm', ours + ('self_attention_norm',), e)
    t.norm(f'{hf}.final_layer_norm', ours + ('mlp_norm',), e)
  t.norm(f'{_PREFIX}final_layer_norm', ('stack', 'final_norm'), e)
  if not cfg.tie_output:
    t.linear('lm_head', ('lm_head',), cfg.vocab_size, e, bias=False)
  return t.table


def convert_opt_state_dict(state: Mapping[str, Any], cfg: TransformerConfig) -> dict:
  """Our `GPT` params (nested dict of numpy arrays) from an HF OPT state dict; one ConfigError
  naming unknown, missing or wrongly shaped parameters."""
  # A bare `OPTModel`'s names get the 'model.' prefix; a tied head (the embedding) goes.
  arrays, original = causal_lm_names(state, 'model.', _HEAD, f'{_PREFIX}embed_tokens.weight',
                                     cfg.tie_output)
  return params_from_table(_table(cfg), arrays, original, dtype=cfg.param_dtype,
                           what=f'an OPT with {cfg.num_decoder_layers} layers')


def export_opt_state_dict(cfg: TransformerConfig, params) -> dict[str, np.ndarray]:
  """HF `OPTForCausalLM` name -> float32 array for our `GPT(cfg)` params; the inverse of
  `convert_opt_state_dict` (bit for bit). A tied model has no lm_head.weight."""
  _check_opt_expressible(cfg)
  return state_from_table(_table(cfg), ParamReader(params, 'OPT'))


def load(directory: str, **overrides) -> HFModel:
  """The HF OPT folder `directory` (families.py's converter interface; the tokenizer is the
  caller's, e.g. `data/hf_tokenizer.HFTokenizer.from_dir`)."""
  cfg = opt_config_from_hf(read_hf_config(directory, 'config.json and model.safetensors'),
                           **overrides)
  params = convert_opt_state_dict(read_state_dict(directory), cfg)
  logging.info('imported OPT from %s: %d layers, %d heads, width %d, vocab %d', directory,
               cfg.num_decoder_layers, cfg.num_heads, cfg.emb_dim, cfg.vocab_size)
  return HFModel(cfg, params)


def exporters(heads: dict | None = None, special_ids: dict | None = None):
  """(config_to_hf, export_state_dict) (families.py's converter interface); `special_ids`: the
  tokenizer's bos/eos/pad ids for config.json."""
  del heads
  ids = {
      k: int(v)
      for k, v in (special_ids or {}).items()
      if k in ('pad_token_id', 'bos_token_id', 'eos_token_id')
  }
  return lambda cfg: opt_config_to_hf(cfg, **ids), export_opt_state_dict


def claims(cfg: TransformerConfig, byte_level: bool = False) -> bool:
  """Whether an export of the causal LM `cfg` is OPT's: OPT's architecture (models/gpt.py
  OPT_ARCHITECTURE, GPT-2's switches with ReLU: what `load` gives and
  experiments/configs/opt_shakespeare.py trains) at the norm epsilon OPT has. GPT-2 computes
  such a model too; hf_gpt2.claims leaves it to OPT, so a model built as an OPT exports as one."""
  del byte_level
  if cfg.activation != OPT_ARCHITECTURE['activation']:
    return False
  try:
    _check_opt_expressible(cfg)
  except ConfigError:
    return False
  return True


config_from_hf = opt_config_from_hf
