"""Hugging Face T5 checkpoints <-> `EncoderDecoder` config and params (T5 v1.0 and v1.1).

    model = hf_t5.load('/path/to/t5')          # config.json + model.safetensors: an HFModel
    logits = EncoderDecoder(model.config).apply({'params': model.params}, inputs, targets)

    hf_config = t5_config_to_hf(cfg)           # config.json for T5ForConditionalGeneration
    state = export_t5_state_dict(cfg, params)  # HF names -> arrays, as save_pretrained writes

HF's `nn.Linear` weights are [out, in]: transposed to our [in, out] kernels, with the head axis
unflattened (HF orders q/k/v columns head-major, as our (heads, head_dim)). HF keeps the
relative-bias table [buckets, heads] in layer 0 of each stack (`...block.0.layer.0.SelfAttention.
relative_attention_bias`); ours is the stack's `relative_bias`, shared by its layers as HF shares
layer 0's bias. The encoder's and decoder's `embed_tokens` are the `shared` table.

Which output projection: transformers 5 always ties `lm_head` to `shared` unless the checkpoint
holds a different `lm_head.weight`, and scales the decoder output by d_model**-0.5 when
`scale_decoder_outputs` (older config.json files: `tie_word_embeddings`, False for v1.1) says
so. `load` follows the same rules. Our PAD_ID 0 and EOS_ID 1 are T5's pad and eos, and
`shift_right` starts the decoder with 0, T5's decoder_start_token_id.
"""

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from transformer_jax.convert import families
from transformer_jax.convert.hf_files import HFModel, read_hf_config, read_state_dict
from transformer_jax.convert.name_table import params_from_table, params_to_numpy, same
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.encoder_decoder import T5_V1_0_ARCHITECTURE, EncoderDecoder
from transformer_jax.special_tokens import EOS_ID, PAD_ID

# HF activation names (`feed_forward_proj` 'ACT' or 'gated-ACT') -> ours (plain, gated). HF's
# 'gelu' is the exact erf form, the *_new/_fast/_pytorch_tanh names the tanh approximation;
# 'gated-gelu' itself means tanh GELU (T5 v1.1), as HF special-cases it.
_ACTIVATIONS = {
    'relu': ('relu', 'reglu'), 'gelu': ('gelu_exact', None), 'gelu_new': ('gelu', 'geglu'),
    'gelu_fast': ('gelu', 'geglu'), 'gelu_pytorch_tanh': ('gelu', 'geglu'),
    'silu': ('silu', 'swiglu'), 'swish': ('silu', 'swiglu')
}
_SUPPORTED_PROJ = sorted([name for name in _ACTIVATIONS] +
                         [f'gated-{n}' for n, (_, g) in _ACTIVATIONS.items() if g] + ['gated-gelu'])
# Ours -> HF's feed_forward_proj (the names HF's own T5 configs use).
_FEED_FORWARD_PROJ = {
    'relu': 'relu', 'gelu_exact': 'gelu', 'gelu': 'gelu_new', 'silu': 'silu', 'geglu': 'gated-gelu',
    'reglu': 'gated-relu', 'swiglu': 'gated-silu'
}
# A cross-attention bias table that old checkpoints hold and HF ignores (cross-attention has none).
_IGNORED = ('decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight',)
_EMBEDDINGS = ('shared.weight', 'encoder.embed_tokens.weight', 'decoder.embed_tokens.weight')
# Relative positions set no length limit; T5's config.json may name one as n_positions (t5-small's
# says 512, as does `t5_config_to_hf`), else max_len is this.
DEFAULT_MAX_LEN = 512
StateDict = dict[str, np.ndarray]


def _activation(c: Mapping[str, Any]) -> str:
  """Our activation for an HF T5 config; ConfigError for one we do not have.

  As T5Config: `feed_forward_proj` is 'ACT' or 'gated-ACT', and the `dense_act_fn` and
  `is_gated_act` that transformers writes next to it win when present.
  """
  proj = str(c.get('feed_forward_proj', 'relu'))
  parts = proj.split('-')
  name, gated = parts[-1], parts[0] == 'gated'
  if proj == 'gated-gelu':
    name = 'gelu_new'
  name, gated = c.get('dense_act_fn', name), bool(c.get('is_gated_act', gated))
  ours = _ACTIVATIONS.get(name, (None, None))[1 if gated else 0]
  if ours is None or len(parts) > 2 or (len(parts) == 2 and parts[0] != 'gated'):
    raise ConfigError(f'config.json feed_forward_proj={proj!r} (dense_act_fn={name!r}, '
                      f'is_gated_act={gated}) is not supported; supported feed_forward_proj: '
                      f'{", ".join(_SUPPORTED_PROJ)}')
  return ours


def _scales_output(c: Mapping[str, Any]) -> bool:
  """Whether HF multiplies the decoder output by d_model**-0.5 (T5Config's own rule)."""
  if 'scale_decoder_outputs' in c:
    return bool(c['scale_decoder_outputs'])
  return c.get('tie_word_embeddings', True) is not False


def t5_config_from_hf(hf_config: Mapping[str, Any], **overrides) -> TransformerConfig:
  """Our config for an HF `T5Config` dict (config.json); `overrides` win (e.g. max_len, dtype).

  The output is tied as `tie_word_embeddings` says (older files: False for v1.1); `load`
  corrects that from the weights, as transformers 5 does.
  """
  c = dict(hf_config)
  families.refuse_other_model_type(c, 't5', 'T5')
  if c.get('is_decoder'):
    raise ConfigError('config.json has is_decoder=true: only the encoder-decoder '
                      'T5ForConditionalGeneration is supported')
  activation = _activation(c)
  scale = _scales_output(c)
  tie = bool(c.get('tie_word_embeddings', True)) or scale
  try:
    values = dict(vocab_size=int(c['vocab_size']), emb_dim=int(c['d_model']),
                  num_heads=int(c['num_heads']), head_dim=int(c['d_kv']), mlp_dim=int(c['d_ff']),
                  num_encoder_layers=int(c['num_layers']),
                  num_decoder_layers=int(c.get('num_decoder_layers') or c['num_layers']))
  except KeyError as e:
    raise ConfigError(f'config.json lacks {e.args[0]!r}, needed for a T5 model') from None
  values.update(max_len=int(c.get('n_positions') or DEFAULT_MAX_LEN), activation=activation,
                tie_output=tie, rescale_tied_output=scale,
                relative_buckets=int(c.get('relative_attention_num_buckets', 32)),
                relative_max_distance=int(c.get('relative_attention_max_distance', 128)),
                norm_epsilon=float(c.get('layer_norm_epsilon',
                                         1e-6)), dropout_rate=float(c.get('dropout_rate', 0.1)),
                attention_dropout_rate=float(c.get('dropout_rate', 0.1)))
  return TransformerConfig(**{**T5_V1_0_ARCHITECTURE, **values, **overrides})


# Switches of ours that HF's T5 has no field for: a model must have T5's values to be exported.
_T5_FIXED = ('norm_type', 'norm_position', 'position', 'use_bias', 'scale_embeddings',
             'share_embeddings', 'scale_attention_scores')


def _check_t5(cfg: TransformerConfig) -> None:
  """Refuses configs whose model HF's T5 cannot express."""
  wrong = {k: getattr(cfg, k) for k in _T5_FIXED if getattr(cfg, k) != T5_V1_0_ARCHITECTURE[k]}
  if cfg.activation not in _FEED_FORWARD_PROJ:
    wrong['activation'] = cfg.activation
  if cfg.embedding_norm:
    wrong['embedding_norm'] = cfg.embedding_norm
  if cfg.num_kv_heads != cfg.num_heads:
    wrong['num_kv_heads'] = cfg.num_kv_heads
  if cfg.source_vocab_size != cfg.vocab_size:
    wrong['source_vocab_size'] = cfg.source_vocab_size
  if cfg.share_layers:
    wrong['share_layers'] = cfg.share_layers
  if cfg.embedding_size is not None:
    wrong['embedding_size'] = cfg.embedding_size
  if wrong:
    raise ConfigError(f'model config is not a T5: HF T5 cannot express {wrong} (build it with '
                      'models.encoder_decoder.t5_config)')


def _table(cfg: TransformerConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], bool]]:
  """HF name -> (our param path, HF shape, is a linear layer's [out, in] weight)."""
  e, m, h, d, v = cfg.emb_dim, cfg.mlp_dim, cfg.num_heads, cfg.head_dim, cfg.vocab_size
  table = {'shared.weight': (('target_embed', 'embedding'), (v, e), False)}
  gated = cfg.activation in ('geglu', 'reglu', 'swiglu')

  def attention(hf, ours):
    for name, our_name in (('q', 'query'), ('k', 'key'), ('v', 'value')):
      table[f'{hf}.{name}.weight'] = (ours + (our_name, 'kernel'), (h * d, e), True)
    table[f'{hf}.o.weight'] = (ours + ('out', 'kernel'), (e, h * d), True)

  def norm(hf, ours):
    table[f'{hf}.weight'] = (ours + ('scale',), (e,), False)

  def mlp(hf, ours):
    names = (('wi_0', 'wi_gate'), ('wi_1', 'wi_up')) if gated else (('wi', 'wi'),)
    for name, our_name in names:
      table[f'{hf}.{name}.weight'] = (ours + (our_name, 'kernel'), (m, e), True)
    table[f'{hf}.wo.weight'] = (ours + ('wo', 'kernel'), (e, m), True)

  for stack, num_layers in (('encoder', cfg.num_encoder_layers), ('decoder',
                                                                  cfg.num_decoder_layers)):
    table[f'{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight'] = ((
        stack, 'relative_bias', 'rel_embedding'), (cfg.relative_buckets, h), False)
    for i in range(num_layers):
      hf, ours = f'{stack}.block.{i}.layer', (stack, f'layer_{i}')
      attention(f'{hf}.0.SelfAttention', ours + ('self_attention',))
      norm(f'{hf}.0.layer_norm', ours + ('self_attention_norm',))
      ff = 1
      if stack == 'decoder':
        attention(f'{hf}.1.EncDecAttention', ours + ('cross_attention',))
        norm(f'{hf}.1.layer_norm', ours + ('cross_attention_norm',))
        ff = 2
      mlp(f'{hf}.{ff}.DenseReluDense', ours + ('mlp',))
      norm(f'{hf}.{ff}.layer_norm', ours + ('mlp_norm',))
    norm(f'{stack}.final_layer_norm', (stack, 'final_norm'))
  if not cfg.tie_output:
    table['lm_head.weight'] = (('logits_dense', 'kernel'), (v, e), True)
  return table


def _our_shapes(cfg: TransformerConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
  """Our param path -> shape, as `EncoderDecoder.init` lays the params out (unrolled layers);
  traced, nothing initialised."""
  dummy = jnp.ones((1, 2), jnp.int32)
  shapes = jax.eval_shape(
      EncoderDecoder(cfg.replace(scan_layers=False)).init, jax.random.key(0), dummy, dummy)
  flat = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(shapes['params']))[0]
  return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


def _shared_embedding(arrays: dict) -> None:
  """Folds the encoder's and decoder's `embed_tokens` (HF ties both to `shared`) into
  'shared.weight', refusing ones that differ from it."""
  present = [name for name in _EMBEDDINGS if name in arrays]
  if not present:
    return
  shared = arrays[present[0]]
  for name in present[1:]:
    if arrays[name].shape != shared.shape or not np.array_equal(arrays[name], shared):
      raise ConfigError(f'checkpoint {name} differs from {present[0]}: only T5 with one embedding '
                        'table shared by encoder and decoder is supported')
  for name in present:
    del arrays[name]
  arrays['shared.weight'] = shared


def convert_t5_state_dict(state: Mapping[str, Any], cfg: TransformerConfig) -> dict:
  """Our `EncoderDecoder` params (nested dict of numpy arrays, unrolled layers) from HF's
  T5ForConditionalGeneration state dict.

  Raises one ConfigError naming unknown, missing or wrongly shaped tensors, or a tied config
  given an `lm_head.weight` that is not the embedding.
  """
  _check_t5(cfg)
  arrays = {name: np.asarray(value) for name, value in state.items() if name not in _IGNORED}
  _shared_embedding(arrays)
  if cfg.tie_output and 'lm_head.weight' in arrays:
    head = arrays.pop('lm_head.weight')
    if 'shared.weight' in arrays and not np.array_equal(head, arrays['shared.weight']):
      raise ConfigError('checkpoint lm_head.weight differs from shared.weight but the config ties '
                        'the output to the embedding; load it with tie_output=False')
  ours = _our_shapes(cfg)
  # A linear layer's [out, in] weight, transposed, is our kernel with its head axes unflattened.
  to_ours = lambda path, linear: (lambda w: w.T.reshape(ours[path])) if linear else same
  table = {
      name: (path, shape, to_ours(path, linear), None)
      for name, (path, shape, linear) in _table(cfg).items()
  }
  return params_from_table(
      table, arrays, dtype=cfg.param_dtype,
      what=f'a T5 with {cfg.num_encoder_layers}+{cfg.num_decoder_layers} layers and activation '
      f'{cfg.activation!r}')


def _untied_head(state: Mapping[str, Any]) -> bool:
  """Whether the checkpoint has an `lm_head.weight` of its own (transformers 5 then leaves
  it untied, whatever config.json says)."""
  if 'lm_head.weight' not in state:
    return False
  embedding = next((state[n] for n in _EMBEDDINGS if n in state), None)
  return embedding is None or not np.array_equal(np.asarray(state['lm_head.weight']),
                                                 np.asarray(embedding))


def load(directory: str, **overrides) -> HFModel:
  """The HF T5 folder `directory` (families.py's converter interface; the SentencePiece
  tokenizer is the caller's to load: `data/t5_tokenizer.py`)."""
  hf_config = read_hf_config(directory, 'config.json and model.safetensors')
  cfg = t5_config_from_hf(hf_config, **overrides)  # (refuses another family before reading)
  state = read_state_dict(directory)
  if 'tie_output' not in overrides:
    untied = _untied_head(state)
    if untied and cfg.rescale_tied_output:
      raise ConfigError(f'{directory} has an lm_head.weight of its own but config.json scales the '
                        'decoder output (scale_decoder_outputs / tie_word_embeddings): an untied '
                        'output with that rescale is not supported')
    cfg = cfg.replace(tie_output=not untied)
  params = convert_t5_state_dict(state, cfg)
  logging.info('imported T5 from %s: %d+%d layers, %d heads of %d, width %d, vocab %d, %s, %s',
               directory, cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.num_heads,
               cfg.head_dim, cfg.emb_dim, cfg.vocab_size, cfg.activation,
               'tied output' if cfg.tie_output else 'untied output')
  return HFModel(cfg, params)


def t5_config_to_hf(cfg: TransformerConfig) -> dict:
  """The config.json dict of a T5ForConditionalGeneration equal to our model `cfg`."""
  _check_t5(cfg)
  return {
      'architectures': ['T5ForConditionalGeneration'],
      'model_type': 't5',
      'vocab_size': cfg.vocab_size,
      'd_model': cfg.emb_dim,
      'd_kv': cfg.head_dim,
      'd_ff': cfg.mlp_dim,
      'num_layers': cfg.num_encoder_layers,
      'num_decoder_layers': cfg.num_decoder_layers,
      'num_heads': cfg.num_heads,
      'relative_attention_num_buckets': cfg.relative_buckets,
      'relative_attention_max_distance': cfg.relative_max_distance,
      'layer_norm_epsilon': cfg.norm_epsilon,
      'feed_forward_proj': _FEED_FORWARD_PROJ[cfg.activation],
      'dropout_rate': cfg.dropout_rate,
      'initializer_factor': 1.0,
      'n_positions': cfg.max_len,
      'is_encoder_decoder': True,
      'use_cache': True,
      'pad_token_id': PAD_ID,
      'eos_token_id': EOS_ID,
      'decoder_start_token_id': PAD_ID,
      # transformers 5 reads scale_decoder_outputs; older versions tie and scale by
      # tie_word_embeddings (a tied output without the rescale is beyond them).
      'tie_word_embeddings': cfg.tie_output,
      'scale_decoder_outputs': cfg.rescale_tied_output,
      'dtype': 'float32'
  }


def export_t5_state_dict(cfg: TransformerConfig, params: Mapping[str, Any]) -> StateDict:
  """HF T5ForConditionalGeneration names -> float32 arrays for our params (either layer layout).

  The names `save_pretrained` writes: 'shared.weight' (the encoder's and decoder's
  embed_tokens are tied to it, so HF leaves them out), and 'lm_head.weight' only when the
  output is untied. `convert_t5_state_dict` gives `params` back bitwise.
  """
  _check_t5(cfg)
  params = params_to_numpy(dict(params))
  ours = _our_shapes(cfg)
  state = {}
  for name, (path, shape, linear) in _table(cfg).items():
    node = params
    for key in path:
      if not isinstance(node, Mapping) or key not in node:
        raise ConfigError(f'params lack {"/".join(path)} (for {name}) that the config implies')
      node = node[key]
    if tuple(node.shape) != ours[path]:
      raise ConfigError(f'params {"/".join(path)} has shape {tuple(node.shape)} but the config '
                        f'implies {ours[path]}')
    value = np.asarray(node, np.float32)
    state[name] = np.ascontiguousarray(value.reshape(shape[::-1]).T if linear else value)
  return state


def exporters(heads: dict | None = None, special_ids: dict | None = None):
  """(config_to_hf, export_state_dict) (families.py's converter interface). The decoder starts
  from PAD (`models/encoder_decoder.shift_right`), as T5's own config.json says."""
  del heads, special_ids

  def config_to_hf(cfg: TransformerConfig) -> dict:
    config = t5_config_to_hf(cfg)
    if config.get('decoder_start_token_id') is None:
      config['decoder_start_token_id'] = PAD_ID
    return config

  return config_to_hf, export_t5_state_dict


# The switches of T5 that the original Transformer (or another translation model) may lack; the
# exporter checks the rest itself.
_T5_SWITCHES = dict(position='relative', norm_type='rmsnorm', norm_position='pre', use_bias=False)


def claims(cfg: TransformerConfig, byte_level: bool = False) -> bool:
  """Whether an export of the encoder-decoder `cfg` is T5's; one ConfigError line naming the
  first switch T5 lacks otherwise (no other family here computes an encoder-decoder)."""
  del byte_level
  for name, want in _T5_SWITCHES.items():
    if getattr(cfg, name) != want:
      t5 = ', '.join(f'{k}={v!r}' for k, v in _T5_SWITCHES.items())
      raise ConfigError(f'no Hugging Face class computes this translation model: {name}='
                        f'{getattr(cfg, name)!r} has no equivalent (the original Transformer '
                        f'has none; T5 needs {t5})')
  return True


# families.py's converter interface: our config of a config.json dict.
config_from_hf = t5_config_from_hf
