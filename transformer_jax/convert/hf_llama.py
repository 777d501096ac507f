"""Hugging Face LLaMA checkpoints <-> `GPT` (LLaMA architecture) config and params.

    model = hf_llama.load('/path/to/llama')   # config.json + model.safetensors: an HFModel
    logits = GPT(model.config).apply({'params': model.params}, tokens)

    hf_config = llama_config_to_hf(cfg, bos_token_id=1, eos_token_id=2)   # config.json
    state = export_llama_state_dict(cfg, params)                           # model.safetensors

Reads and writes `LlamaForCausalLM` checkpoints as transformers lays them out (`model.`-prefixed
decoder, `lm_head.weight`; a bare `LlamaModel`'s unprefixed names are accepted too). HF's
`nn.Linear` weights are [out, in]: transposed to our [in, out] kernels, and the attention
projections' head axis unflattened. HF orders those columns head-major (column h * head_dim +
d), as our (heads, head_dim) kernel axes are, so reshapes suffice.

Rotary positions need no permutation either. HF's LLaMA rotates "half" pairs (dimension i with
i + head_dim / 2, `rotate_half`), which is exactly our `apply_rotary`, at the same frequencies
theta^(-2i/head_dim). Meta's original checkpoints (consolidated.*.pth) rotate *interleaved*
pairs (2i, 2i + 1); transformers' convert_llama_weights_to_hf.py permutes the rows of q_proj and
k_proj into the half layout, and those converted checkpoints are what this module imports.
Meta's own files are not: convert them with transformers' script first.

Refused, with one ConfigError line each: another model_type, a hidden_act other than SiLU, rope
scaling other than none/default (linear, dynamic, yarn, llama3, ...), attention or MLP biases.
Weights are read without running code: safetensors (float32, float16 or bfloat16, single or
sharded) or, failing those, `pytorch_model.bin` (`hf_files.read_state_dict`, as every family).
"""

import re
from typing import Any, Mapping

import numpy as np
from absl import logging

from transformer_jax.convert import families
from transformer_jax.convert.hf_files import HFModel, read_hf_config, read_state_dict
from transformer_jax.convert.name_table import (ParamReader, Table, TableBuilder, causal_lm_names,
                                                params_from_table, state_from_table)
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.gpt import LLAMA_ARCHITECTURE, llama_config

_PREFIX = 'model.'
_HEAD = 'lm_head.weight'
# Rotary inverse frequencies that transformers < 4.31 saved with the weights: derived from
# rope_theta, not parameters.
_BUFFER = re.compile(r'(^|\.)rotary_emb\.inv_freq$')
# HF's names for SiLU (ACT2FN maps both to nn.SiLU).
_SILU = ('silu', 'swish')
_DEFAULT_ROPE = (None, 'default')
# Our switches that HF's LlamaConfig has no field for: an exported model must have LLaMA's value.
_FIXED = {
    key: value
    for key, value in LLAMA_ARCHITECTURE.items()
    if key not in ('norm_epsilon', 'rotary_base', 'tie_output', 'embed_init_std')
}
_FIXED.update(embedding_norm=False, scale_attention_scores=True, rescale_tied_output=False,
              share_layers=False, embedding_size=None)

# -- config -----------------------------------------------------------------------------------


def _rope_theta(c: Mapping[str, Any]) -> float:
  """rope_theta from `rope_parameters` (transformers >= 5) or the top level (older), refusing
  any rope scaling: our rotary applies the plain frequencies only."""
  theta = c.get('rope_theta')
  for key in ('rope_parameters', 'rope_scaling'):
    rope = c.get(key)
    if rope is None:
      continue
    if not isinstance(rope, Mapping):
      raise ConfigError(f'config.json {key}={rope!r} is not a dict; expected e.g. '
                        "{'rope_type': 'default', 'rope_theta': 10000.0}")
    kind = rope.get('rope_type', rope.get('type'))
    if kind not in _DEFAULT_ROPE:
      raise ConfigError(f'config.json {key} has rope_type={kind!r}: rope scaling is not '
                        "supported, only plain rotary positions (none or 'default')")
    theta = rope.get('rope_theta', theta)
  return 10000.0 if theta is None else float(theta)


def llama_config_from_hf(hf_config: Mapping[str, Any], **overrides) -> TransformerConfig:
  """Our config for an HF `LlamaConfig` dict (config.json); `overrides` win (e.g. dtype)."""
  c = dict(hf_config)
  families.refuse_other_model_type(c, 'llama', 'LLaMA')
  activation = c.get('hidden_act', 'silu')
  if activation not in _SILU:
    raise ConfigError(f'config.json hidden_act={activation!r} is not supported: LLaMA gates '
                      "with SiLU (need 'silu')")
  for key in ('attention_bias', 'mlp_bias'):
    if c.get(key):
      raise ConfigError(f'config.json {key}={c[key]} is not supported: our LLaMA architecture '
                        'has no biases (need false)')
  try:
    heads, emb_dim = int(c['num_attention_heads']), int(c['hidden_size'])
    values = dict(vocab_size=int(c['vocab_size']), emb_dim=emb_dim, num_heads=heads,
                  num_kv_heads=int(c.get('num_key_value_heads') or
                                   heads), mlp_dim=int(c['intermediate_size']),
                  num_decoder_layers=int(c['num_hidden_layers']),
                  max_len=int(c.get('max_position_embeddings',
                                    2048)), norm_epsilon=float(c.get('rms_norm_eps', 1e-6)),
                  rotary_base=_rope_theta(c), tie_output=bool(c.get('tie_word_embeddings', False)),
                  attention_dropout_rate=float(c.get('attention_dropout') or 0.0),
                  embed_init_std=float(c.get('initializer_range', 0.02)))
  except KeyError as e:
    raise ConfigError(f'config.json lacks {e.args[0]!r}, needed for a LLaMA model') from None
  head_dim = c.get('head_dim')
  if head_dim is not None and int(head_dim) != emb_dim // max(heads, 1):
    values['head_dim'] = int(head_dim)  # else derived (and re-derived by cfg.replace)
  values.update(overrides)
  return llama_config(**values)


def llama_config_to_hf(cfg: TransformerConfig, *, bos_token_id: int | None = None,
                       eos_token_id: int | list[int] | None = None,
                       pad_token_id: int | None = None) -> dict:
  """The config.json dict of a `LlamaForCausalLM` computing what `GPT(cfg)` computes.

  Token ids are the tokenizer's (our config does not know them); None is written as null, not
  left out, since transformers would otherwise assume LLaMA's bos 1 / eos 2. Raises ConfigError
  naming the first switch HF's LLaMA cannot express (learned positions, biases, GELU, ...).
  """
  for key, value in _FIXED.items():
    ours = getattr(cfg, key, value)  # (fields a version of TransformerConfig lacks: default)
    if ours != value:
      raise ConfigError(f'model.{key}={ours!r} cannot be exported as a Hugging Face LLaMA '
                        f'(which needs {value!r})')
  dtype = np.dtype(cfg.param_dtype).name
  return {
      'architectures': ['LlamaForCausalLM'],
      'model_type': 'llama',
      'vocab_size': cfg.vocab_size,
      'hidden_size': cfg.emb_dim,
      'intermediate_size': cfg.mlp_dim,
      'num_hidden_layers': cfg.num_decoder_layers,
      'num_attention_heads': cfg.num_heads,
      'num_key_value_heads': cfg.num_kv_heads,
      'head_dim': cfg.head_dim,
      'hidden_act': 'silu',
      'max_position_embeddings': cfg.max_len,
      'initializer_range': 0.02 if cfg.embed_init_std is None else cfg.embed_init_std,
      'rms_norm_eps': cfg.norm_epsilon,
      # Both spellings: transformers >= 5 reads rope_parameters, older versions rope_theta.
      'rope_theta': cfg.rotary_base,
      'rope_parameters': {'rope_type': 'default', 'rope_theta': cfg.rotary_base},
      'attention_bias': False,
      'mlp_bias': False,
      'attention_dropout': cfg.attention_dropout_rate,
      'tie_word_embeddings': cfg.tie_output,
      'pretraining_tp': 1,
      'use_cache': True,
      'bos_token_id': bos_token_id,
      'eos_token_id': eos_token_id,
      'pad_token_id': pad_token_id,
      'dtype': dtype,
      'torch_dtype': dtype,  # the name transformers < 4.56 reads
  }


# -- weights ----------------------------------------------------------------------------------


def _table(cfg: TransformerConfig) -> Table:
  """HF name -> (our param path, HF shape, HF array -> ours, our array -> HF's).

  One table serves import and export, so the two cannot disagree on a name or a layout.
  """
  e, m, h, k, d = cfg.emb_dim, cfg.mlp_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  t = TableBuilder()  # LLaMA's layers have no biases, its RMSNorms no bias either
  t.same(f'{_PREFIX}embed_tokens.weight', ('token_embed', 'embedding'), (cfg.vocab_size, e))
  for i in range(cfg.num_decoder_layers):
    hf, ours = f'{_PREFIX}layers.{i}', ('stack', f'layer_{i}')
    for name, heads in (('query', h), ('key', k), ('value', k)):
      t.to_heads(f'{hf}.self_attn.{name[0]}_proj', ours + ('self_attention', name), e, heads, d,
                 bias=False)
    t.from_heads(f'{hf}.self_attn.o_proj', ours + ('self_attention', 'out'), e, h, d, bias=False)
    t.linear(f'{hf}.mlp.gate_proj', ours + ('mlp', 'wi_gate'), m, e, bias=False)
    t.linear(f'{hf}.mlp.up_proj', ours + ('mlp', 'wi_up'), m, e, bias=False)
    t.linear(f'{hf}.mlp.down_proj', ours + ('mlp', 'wo'), e, m, bias=False)
    t.norm(f'{hf}.input_layernorm', ours + ('self_attention_norm',), e, bias=False)
    t.norm(f'{hf}.post_attention_layernorm', ours + ('mlp_norm',), e, bias=False)
  t.norm(f'{_PREFIX}norm', ('stack', 'final_norm'), e, bias=False)
  if not cfg.tie_output:
    t.linear('lm_head', ('lm_head',), cfg.vocab_size, e, bias=False)
  return t.table


def convert_llama_state_dict(state: Mapping[str, Any], cfg: TransformerConfig) -> dict:
  """Our `GPT` params (nested dict of numpy arrays, as `GPT.init` lays them out) from HF's.

  Raises one ConfigError naming unknown, missing or wrongly shaped parameters.
  """
  arrays, original = causal_lm_names(state, _PREFIX, _HEAD, f'{_PREFIX}embed_tokens.weight',
                                     cfg.tie_output, drop=lambda name: bool(_BUFFER.search(name)))
  return params_from_table(
      _table(cfg), arrays, original, dtype=cfg.param_dtype,
      what=f'a LLaMA with {cfg.num_decoder_layers} layers and tie_word_embeddings={cfg.tie_output}')


def export_llama_state_dict(cfg: TransformerConfig, params) -> dict[str, np.ndarray]:
  """HF `LlamaForCausalLM` name -> array for our `GPT(cfg)` params (either layer layout).

  Arrays keep the params' dtype; a tied model has no lm_head.weight (transformers ties it on
  load). Raises one ConfigError naming params the config does not imply, or lacks.
  """
  table = _table(cfg)
  get = ParamReader(params, 'LLaMA', dtype=None)  # (keeps the params' dtype)
  unknown = sorted(set(get.params) - {'/'.join(path) for path, *_ in table.values()})
  if unknown:
    raise ConfigError(f'params have entries {", ".join(unknown)} that a LLaMA with '
                      f'{cfg.num_decoder_layers} layers and tie_output={cfg.tie_output} lacks')
  return state_from_table(table, get)


def load(directory: str, **overrides) -> HFModel:
  """The HF LLaMA folder `directory` (families.py's converter interface)."""
  cfg = llama_config_from_hf(read_hf_config(directory, 'config.json and model.safetensors'),
                             **overrides)
  params = convert_llama_state_dict(read_state_dict(directory), cfg)
  logging.info('imported LLaMA from %s: %d layers, %d heads (%d key/value), width %d, vocab %d',
               directory, cfg.num_decoder_layers, cfg.num_heads, cfg.num_kv_heads, cfg.emb_dim,
               cfg.vocab_size)
  return HFModel(cfg, params)


def exporters(heads: dict | None = None, special_ids: dict | None = None):
  """(config_to_hf, export_state_dict) (families.py's converter interface)."""
  del heads, special_ids
  return llama_config_to_hf, export_llama_state_dict


def claims(cfg: TransformerConfig, byte_level: bool = False) -> bool:
  """Whether an export of the causal LM `cfg` is LLaMA's: rotary positions, RMSNorm or a gated
  MLP (the exporter refuses the switches LLaMA lacks)."""
  del byte_level
  return cfg.position == 'rotary' or cfg.norm_type == 'rmsnorm' or cfg.activation == 'swiglu'


# families.py's converter interface: our config of a config.json dict.
config_from_hf = llama_config_from_hf
