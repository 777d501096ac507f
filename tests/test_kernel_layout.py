"""Dense kernels [in, out] and [out, in]: one model, two layouts, params converted by their names.

A model built with `kernel_layout='out_in'` draws from a key the transposed weights of the same
model built 'in_out' (`layers/dense.py`), so `kernel_layout.convert` of one's params must equal
the other's exactly, and both must compute the same outputs. Generation converts the params of
a batch of `search.OUT_IN_ROWS` rows or more on CPU (tests/test_ragged_generation.py compares
such a batch's ids with each prompt's alone, 'in_out').
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.errors import ConfigError
from transformer_jax.inference import search
from transformer_jax.layers import kernel_layout
from transformer_jax.model_config import TransformerConfig, model_config_from_dict
from transformer_jax.models.bert import Bert, albert_config
from transformer_jax.models.encoder_decoder import EncoderDecoder, t5_config
from transformer_jax.models.gpt import GPT, gpt2_config, llama_config
from transformer_jax.tasks.lm import LanguageModelTask

SMALL = dict(vocab_size=37, emb_dim=24, num_heads=4, head_dim=8, mlp_dim=40, max_len=16,
             dropout_rate=0.0, attention_dropout_rate=0.0)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, 37, size=(2, 7)), jnp.int32)

# (model class, config, inputs): every kind of dense layer the family has, untied output layers
# (LLaMA, T5 1.1), grouped-query heads, cross-attention, ALBERT's embedding projection.
MODELS = {
    'llama': (GPT, llama_config(**SMALL, num_kv_heads=2, num_decoder_layers=2), (TOKENS,)),
    't5': (EncoderDecoder, t5_config(**SMALL, num_encoder_layers=1,
                                     num_decoder_layers=1), (TOKENS, TOKENS)),
    'albert': (Bert, albert_config(**SMALL, num_encoder_layers=2, embedding_size=12), (TOKENS,)),
}


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
  with jax.default_matmul_precision('highest'):
    yield


@pytest.mark.parametrize('name', sorted(MODELS))
def test_converted_params_are_the_other_layouts_own_and_compute_the_same(name):
  model_class, cfg, inputs = MODELS[name]
  in_out, out_in = model_class(cfg), model_class(cfg.replace(kernel_layout='out_in'))
  axes_in_out = kernel_layout.logical_axes(in_out, *inputs)
  axes_out_in = kernel_layout.logical_axes(out_in, *inputs)
  params = nn.meta.unbox(in_out.init(jax.random.key(3), *inputs)['params'])
  own = nn.meta.unbox(out_in.init(jax.random.key(3), *inputs)['params'])
  converted = kernel_layout.convert(params, axes_in_out, axes_out_in)
  jax.tree.map(np.testing.assert_array_equal, converted, own)
  changed = [a.shape != b.shape for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(own))]
  assert sum(changed) >= 4  # the kernels changed shape; embeddings, norms and biases did not
  jax.tree.map(np.testing.assert_array_equal,
               kernel_layout.convert(converted, axes_out_in, axes_in_out), params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
               out_in.apply({'params': converted}, *inputs),
               in_out.apply({'params': params}, *inputs))


def test_convert_refuses_names_that_do_not_say_how():
  box = lambda names: nn.Partitioned(jax.ShapeDtypeStruct((3, 3), jnp.float32), names)
  params = {'kernel': jnp.zeros((3, 3))}
  with pytest.raises(ValueError, match='the names must be the same, unique'):
    kernel_layout.convert(params, {'kernel': box(('embed', 'embed'))},
                          {'kernel': box(('embed', 'mlp'))})
  with pytest.raises(ValueError, match='different parameter trees'):
    kernel_layout.convert(params, {'kernel': box(('embed', 'mlp'))}, {'w': box(('mlp', 'embed'))})


def test_a_bad_layout_is_one_config_line_and_a_config_section_trains_in_out():
  with pytest.raises(ConfigError, match="kernel_layout must be one of .* got 'outin'"):
    TransformerConfig(kernel_layout='outin')
  # Checkpoints and converters hold [in, out]: an experiment may not train another layout.
  with pytest.raises(ConfigError, match="model.kernel_layout='out_in': experiments train"):
    model_config_from_dict({'kernel_layout': 'out_in'})
  assert model_config_from_dict({'kernel_layout': 'in_out'}).kernel_layout == 'in_out'


def test_generation_decodes_a_wide_batch_out_in_on_cpu_and_a_narrow_one_in_out():
  cfg = gpt2_config(**SMALL, num_decoder_layers=1)
  task = LanguageModelTask(cfg.replace(scan_layers=True))
  params = nn.meta.unbox(task.init_variables(jax.random.key(0))['params'])
  cpu = jax.default_backend() == 'cpu'
  assert search.decode_kernel_layout(1) == 'in_out'
  assert search.decode_kernel_layout(search.OUT_IN_ROWS) == ('out_in' if cpu else 'in_out')
  narrow = task._sampler.prepared_params(params, 1)
  wide = task._sampler.prepared_params(params, search.OUT_IN_ROWS)
  assert narrow.kernel_layout == 'in_out'
  assert wide.kernel_layout == search.decode_kernel_layout(search.OUT_IN_ROWS)
  wo = lambda prepared: prepared.params['stack']['layer_0']['mlp']['wo']['kernel']
  assert wo(narrow).shape == (40, 24)
  if cpu:
    np.testing.assert_array_equal(wo(wide), wo(narrow).T)
