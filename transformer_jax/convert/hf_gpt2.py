"""Hugging Face GPT-2 checkpoints <-> `GPT` config and params.

    model = hf_gpt2.load('/path/to/gpt2')     # config.json + model.safetensors: an HFModel
    logits = GPT(model.config).apply({'params': model.params}, tokens)
    # and back: the config.json dict and the state dict `GPT2LMHeadModel` loads
    hf_config, state = gpt2_config_to_hf(cfg), export_gpt2_state_dict(cfg, params)

HF's GPT-2 stores its linear layers as `Conv1D`, i.e. weight [in, out] (the transpose of
`nn.Linear`), which is already our kernel layout; only the fused q|k|v projection needs splitting
and the head axis unflattening. HF flattens heads head-major (column h * head_dim + d), the same
order as our (heads, head_dim) kernels, so reshapes suffice and nothing is permuted.

Export is the exact inverse (import(export(params)) == params bitwise): q|k|v fused back into
`c_attn`, names 'transformer.'-prefixed as `GPT2LMHeadModel.save_pretrained` writes them, and
`lm_head.weight` only for an untied output layer. A config GPT-2 cannot express (rotary
positions, RMSNorm, no biases, gated MLPs, ...) is refused with one line naming the switch.

The files are read by `hf_files.py`, as for every family.
"""

import re
from typing import Any, Mapping

import numpy as np
from absl import logging

# ParamReader and params_to_numpy lived here; other converters and callers may import them
# from this module still.
from transformer_jax.convert.name_table import ParamReader, params_to_numpy  # noqa: F401
from transformer_jax.convert import families
from transformer_jax.convert.hf_files import (HFModel, hf_activation, read_hf_config,
                                              read_state_dict, refuse_switches)
from transformer_jax.convert.name_table import canonical_names, check_state, strip_prefix
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.gpt import gpt2_config

# HF activation names -> ours. 'gelu_new', 'gelu_fast' and 'gelu_pytorch_tanh' are all the tanh
# approximation (GPT-2's original); HF's plain 'gelu' is the exact erf form.
_ACTIVATIONS = {
    'gelu_new': 'gelu', 'gelu_fast': 'gelu', 'gelu_pytorch_tanh': 'gelu', 'gelu': 'gelu_exact',
    'relu': 'relu', 'silu': 'silu', 'swish': 'silu'
}
_PREFIX = 'transformer.'
# Causal-mask buffers that older transformers versions saved with the weights; not parameters.
_BUFFER = re.compile(r'^h\.\d+\.attn\.(bias|masked_bias)$')


def gpt2_config_from_hf(hf_config: Mapping[str, Any], **overrides) -> TransformerConfig:
  """Our config for an HF `GPT2Config` dict (config.json); `overrides` win (e.g. dtype)."""
  c = dict(hf_config)
  families.refuse_other_model_type(c, 'gpt2', 'GPT-2')
  activation = hf_activation(c, 'activation_function', 'gelu_new', _ACTIVATIONS)
  # Variants of attention scaling and cross-attention that our blocks do not express: refuse
  # them rather than import a model that silently computes something else.
  for key, supported in (('scale_attn_weights', True), ('scale_attn_by_inverse_layer_idx', False),
                         ('add_cross_attention', False)):
    if bool(c.get(key, supported)) != supported:
      raise ConfigError(f'config.json {key}={c[key]} is not supported (need {supported})')
  try:
    emb_dim = int(c['n_embd'])
    values = dict(vocab_size=int(c['vocab_size']), emb_dim=emb_dim, num_heads=int(c['n_head']),
                  mlp_dim=int(c.get('n_inner') or 4 * emb_dim),
                  num_decoder_layers=int(c['n_layer']), max_len=int(c['n_positions']),
                  norm_epsilon=float(c.get('layer_norm_epsilon', 1e-5)), activation=activation,
                  dropout_rate=float(c.get('resid_pdrop', 0.1)), attention_dropout_rate=float(
                      c.get('attn_pdrop', 0.1)), tie_output=bool(c.get('tie_word_embeddings',
                                                                       True)))
  except KeyError as e:
    raise ConfigError(f'config.json lacks {e.args[0]!r}, needed for a GPT-2 model') from None
  values.update(overrides)
  return gpt2_config(**values)


def _expected_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
  """HF parameter names (without the 'transformer.' prefix) -> shapes this config implies."""
  e, m = cfg.emb_dim, cfg.mlp_dim
  shapes = {
      'wte.weight': (cfg.vocab_size, e), 'wpe.weight': (cfg.max_len, e), 'ln_f.weight': (e,),
      'ln_f.bias': (e,)
  }
  for i in range(cfg.num_decoder_layers):
    shapes.update({
        f'h.{i}.ln_1.weight': (e,), f'h.{i}.ln_1.bias': (e,), f'h.{i}.attn.c_attn.weight':
            (e, 3 * e), f'h.{i}.attn.c_attn.bias': (3 * e,), f'h.{i}.attn.c_proj.weight': (e, e),
        f'h.{i}.attn.c_proj.bias': (e,), f'h.{i}.ln_2.weight': (e,), f'h.{i}.ln_2.bias': (e,),
        f'h.{i}.mlp.c_fc.weight': (e, m), f'h.{i}.mlp.c_fc.bias': (m,), f'h.{i}.mlp.c_proj.weight':
            (m, e), f'h.{i}.mlp.c_proj.bias': (e,)
    })
  if not cfg.tie_output:
    shapes['lm_head.weight'] = (cfg.vocab_size, e)
  return shapes


def _strip_names(state: Mapping[str, Any], tie_output: bool) -> tuple[dict, dict]:
  """(bare name -> array, bare name -> name in the file), dropping buffers and a tied head
  (HF re-ties the head on load; the embedding is the one that counts)."""
  return canonical_names(
      state, strip_prefix(_PREFIX), _PREFIX, drop=lambda bare: bool(_BUFFER.match(bare)) or
      (bare == 'lm_head.weight' and tie_output))


def _check(arrays: dict, original: dict, cfg: TransformerConfig) -> None:
  """Raises one ConfigError naming unknown, missing or mis-shaped parameters."""
  check_state(_expected_shapes(cfg), arrays, original,
              what=f'a GPT-2 with {cfg.num_decoder_layers} layers')


def convert_gpt2_state_dict(state: Mapping[str, Any], cfg: TransformerConfig) -> dict:
  """Our `GPT` params (nested dict of numpy arrays, as `GPT.init` lays them out) from HF's.

  `state` maps HF names (optionally 'transformer.'-prefixed) to arrays. Raises ConfigError on
  unknown, missing or wrongly shaped parameters.
  """
  arrays, original = _strip_names(state, cfg.tie_output)
  _check(arrays, original, cfg)
  dtype = np.dtype(cfg.param_dtype)
  get = lambda name: np.ascontiguousarray(np.asarray(arrays[name]), dtype=dtype)
  heads, head_dim, e = cfg.num_heads, cfg.head_dim, cfg.emb_dim

  def norm(name):
    return {'scale': get(f'{name}.weight'), 'bias': get(f'{name}.bias')}

  def dense(name):
    return {'kernel': get(f'{name}.weight'), 'bias': get(f'{name}.bias')}

  stack = {'final_norm': norm('ln_f')}
  for i in range(cfg.num_decoder_layers):
    p = f'h.{i}'
    qkv_w, qkv_b = get(f'{p}.attn.c_attn.weight'), get(f'{p}.attn.c_attn.bias')
    attention = {}
    for j, name in enumerate(('query', 'key', 'value')):
      attention[name] = {
          'kernel': qkv_w[:, j * e:(j + 1) * e].reshape(e, heads, head_dim).copy(),
          'bias': qkv_b[j * e:(j + 1) * e].reshape(heads, head_dim).copy()
      }
    attention['out'] = {
        'kernel': get(f'{p}.attn.c_proj.weight').reshape(heads, head_dim, e),
        'bias': get(f'{p}.attn.c_proj.bias')
    }
    stack[f'layer_{i}'] = {
        'self_attention_norm': norm(f'{p}.ln_1'), 'self_attention': attention,
        'mlp_norm': norm(f'{p}.ln_2'),
        'mlp': {'wi': dense(f'{p}.mlp.c_fc'), 'wo': dense(f'{p}.mlp.c_proj')}
    }
  params = {
      'token_embed': {'embedding': get('wte.weight')},
      'input_embedding': {'position_embedding': {'embedding': get('wpe.weight')}}, 'stack': stack
  }
  if not cfg.tie_output:
    params['lm_head'] = {'kernel': get('lm_head.weight').T.copy()}  # nn.Linear is [out, in]
  return params


def load(directory: str, **overrides) -> HFModel:
  """The HF GPT-2 folder `directory` (families.py's converter interface)."""
  cfg = gpt2_config_from_hf(read_hf_config(directory, 'config.json and model.safetensors'),
                            **overrides)
  params = convert_gpt2_state_dict(read_state_dict(directory), cfg)
  logging.info('imported GPT-2 from %s: %d layers, %d heads, width %d, vocab %d', directory,
               cfg.num_decoder_layers, cfg.num_heads, cfg.emb_dim, cfg.vocab_size)
  return HFModel(cfg, params)


# -- export -------------------------------------------------------------------------------------

# Our activation names -> HF's (the inverse of _ACTIVATIONS; 'gelu' is the tanh approximation).
_HF_ACTIVATIONS = {'gelu': 'gelu_new', 'gelu_exact': 'gelu', 'relu': 'relu', 'silu': 'silu'}
# A block's HF names (under 'h.{i}.') -> ours (under 'stack/layer_{i}/') that map one to one; the
# fused c_attn and the head-split c_proj weight are built apart.
_LAYER_NAMES = (('ln_1.weight', 'self_attention_norm/scale'), ('ln_1.bias',
                                                               'self_attention_norm/bias'),
                ('attn.c_proj.bias', 'self_attention/out/bias'), ('ln_2.weight', 'mlp_norm/scale'),
                ('ln_2.bias', 'mlp_norm/bias'), ('mlp.c_fc.weight',
                                                 'mlp/wi/kernel'), ('mlp.c_fc.bias', 'mlp/wi/bias'),
                ('mlp.c_proj.weight', 'mlp/wo/kernel'), ('mlp.c_proj.bias', 'mlp/wo/bias'))


def gpt2_switches(cfg: TransformerConfig) -> dict:
  """The switches GPT-2's architecture fixes, for `refuse_switches` (OPT's are these too)."""
  return dict(num_encoder_layers=0, position='learned', norm_type='layernorm', norm_position='pre',
              activation=tuple(_HF_ACTIVATIONS), use_bias=True, num_kv_heads=cfg.num_heads,
              head_dim=cfg.emb_dim // cfg.num_heads, scale_embeddings=False, embedding_norm=False,
              scale_attention_scores=True, rescale_tied_output=False, share_layers=False,
              embedding_size=None)


def _check_gpt2_expressible(cfg: TransformerConfig) -> None:
  refuse_switches('GPT-2', cfg, gpt2_switches(cfg))
  if cfg.head_dim * cfg.num_heads != cfg.emb_dim:
    raise ConfigError(f'GPT-2 cannot express head_dim={cfg.head_dim} with num_heads='
                      f'{cfg.num_heads} and emb_dim={cfg.emb_dim} (it needs heads x head_dim = '
                      'emb_dim)')


def gpt2_config_to_hf(cfg: TransformerConfig) -> dict:
  """The config.json dict of a `GPT2LMHeadModel` computing what `GPT(cfg)` computes.

  Raises one ConfigError naming the first switch GPT-2 has no equivalent for. Token ids (bos,
  eos) are the tokenizer's: None here, set by the caller that knows the tokenizer.
  """
  _check_gpt2_expressible(cfg)
  activation = _HF_ACTIVATIONS[cfg.activation]
  return {
      'model_type': 'gpt2', 'architectures': ['GPT2LMHeadModel'], 'vocab_size': cfg.vocab_size,
      'n_embd': cfg.emb_dim, 'n_head': cfg.num_heads, 'n_layer': cfg.num_decoder_layers,
      'n_positions': cfg.max_len, 'n_ctx': cfg.max_len, 'n_inner': cfg.mlp_dim,
      'activation_function': activation, 'layer_norm_epsilon': cfg.norm_epsilon,
      'resid_pdrop': cfg.dropout_rate, 'embd_pdrop': cfg.dropout_rate,
      'attn_pdrop': cfg.attention_dropout_rate, 'initializer_range': cfg.embed_init_std or 0.02,
      'tie_word_embeddings': cfg.tie_output, 'scale_attn_weights': True,
      'scale_attn_by_inverse_layer_idx': False, 'reorder_and_upcast_attn': False,
      'add_cross_attention': False, 'bos_token_id': None, 'eos_token_id': None, 'dtype': 'float32'
  }


def export_gpt2_state_dict(cfg: TransformerConfig, params) -> dict[str, np.ndarray]:
  """HF `GPT2LMHeadModel` state dict (name -> contiguous float32 array) of our `GPT` params.

  The inverse of `convert_gpt2_state_dict`: importing the result gives `params` back bit for
  bit (as float32). Raises ConfigError for a config GPT-2 cannot express or params that do not
  fit it.
  """
  _check_gpt2_expressible(cfg)
  get = ParamReader(params, 'GPT-2')
  e = cfg.emb_dim
  state = {
      'wte.weight': get('token_embed/embedding'),
      'wpe.weight': get('input_embedding/position_embedding/embedding')
  }
  for i in range(cfg.num_decoder_layers):
    ours, hf = f'stack/layer_{i}', f'h.{i}'
    qkv = [f'{ours}/self_attention/{name}' for name in ('query', 'key', 'value')]
    state[f'{hf}.attn.c_attn.weight'] = np.concatenate(
        [get(f'{path}/kernel').reshape(e, -1) for path in qkv], axis=1)
    state[f'{hf}.attn.c_attn.bias'] = np.concatenate([get(f'{path}/bias').ravel() for path in qkv])
    state[f'{hf}.attn.c_proj.weight'] = get(f'{ours}/self_attention/out/kernel').reshape(-1, e)
    for hf_name, our_name in _LAYER_NAMES:
      state[f'{hf}.{hf_name}'] = get(f'{ours}/{our_name}')
  state['ln_f.weight'] = get('stack/final_norm/scale')
  state['ln_f.bias'] = get('stack/final_norm/bias')
  names = {k: _PREFIX + k for k in state}
  if not cfg.tie_output:
    state['lm_head.weight'] = get('lm_head/kernel').T  # nn.Linear is [out, in]
    names['lm_head.weight'] = 'lm_head.weight'
  # The shapes the importer expects: params of another size are named here, not by HF on load.
  _check(state, names, cfg)
  get.finish()
  return {names[k]: np.ascontiguousarray(v) for k, v in state.items()}


def exporters(heads: dict | None = None, special_ids: dict | None = None):
  """(config_to_hf, export_state_dict) (families.py's converter interface; GPT-2 needs neither
  heads nor special ids)."""
  del heads, special_ids
  return gpt2_config_to_hf, export_gpt2_state_dict


def claims(cfg: TransformerConfig, byte_level: bool = False) -> bool:
  """Whether an export of the causal LM `cfg` is GPT-2's: any without rotary positions, RMSNorm
  or a gated MLP (those are LLaMA's), but for OPT's architecture (GPT-2's switches with ReLU),
  which OPT claims: a model built as an OPT exports as one. The exporter refuses the switches
  GPT-2 lacks."""
  llama = cfg.position == 'rotary' or cfg.norm_type == 'rmsnorm' or cfg.activation == 'swiglu'
  return not llama and not families.named('opt').converter.claims(cfg, byte_level)


# families.py's converter interface: our config of a config.json dict.
config_from_hf = gpt2_config_from_hf
