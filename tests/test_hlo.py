"""The compiled train step keeps its matmuls 2-D: no transposing copies outside attention.

On XLA:CPU a Dense layer fed (B, T, D) activations makes the weight-gradient dot contract two
axes, and XLA inserts transposes fused into the GELU/LayerNorm backward (a third of a small GPT
step). `dense.DenseGeneral` flattens to (B*T, D); these tests read the optimised HLO of a real
train step (`jit(...).lower(...).compile().as_text()`) and fail if that regresses. Attention
itself is 4-D and moves heads around by design, so its own transposes are allowed.
"""

import collections
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tools import hlo_text
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.gpt import gpt2_config
from transformer_jax.training.optimizer import make_optimizer
from transformer_jax.tasks.lm import LanguageModelTask
from transformer_jax.tasks.translation import TranslationTask
from transformer_jax.training.trainer import TrainState, make_train_step

_DENSE_LAYERS = ('query', 'key', 'value', 'out', 'wi', 'wo', 'wi_gate', 'wi_up', 'lm_head')


def transposes_outside_attention(hlo: str) -> list[str]:
  """Transposes (and copies of transposes, i.e. materialised ones) not made by attention."""
  instructions = hlo_text.parse(hlo)
  transposed = {i['name'] for i in instructions if i['opcode'] == 'transpose'}
  bad = []
  for i in instructions:
    is_transpose = i['opcode'] == 'transpose' or (i['opcode'] == 'copy' and
                                                  i['operands'].lstrip('%') in transposed)
    if is_transpose and '_attention/' not in i['op_name']:
      bad.append(f"{i['name']} {i['shape']} ({i['op_name']})")
  return bad


def dense_dots(hlo: str) -> list[dict]:
  """Dots the Dense layers produced (forward and both backward matmuls); attention's own
  einsums carry their equation ('...->...') in op_name and are left out."""
  layer = re.compile(r'/(%s)/|\.attend/' % '|'.join(_DENSE_LAYERS))
  return [
      i for i in hlo_text.parse(hlo)
      if i['opcode'] == 'dot' and layer.search(i['op_name']) and '->' not in i['op_name']
  ]


def compiled_train_step(task, batch) -> str:
  tx, _ = make_optimizer(
      ml_collections.ConfigDict(
          dict(learning_rate=1e-3, warmup_steps=0, schedule='constant', b1=0.9, b2=0.95, eps=1e-8,
               weight_decay=0.1, grad_clip_norm=1.0)))
  params = nn.meta.unbox(task.init_variables(jax.random.key(0))['params'])
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
  step = jax.jit(make_train_step(task.loss_fn, tx, 0), donate_argnums=(0,))
  return step.lower(state, batch).compile().as_text()


def tiny_gpt():
  cfg = gpt2_config(vocab_size=65, emb_dim=64, num_heads=4, mlp_dim=256, num_decoder_layers=2,
                    max_len=128, dropout_rate=0.1, attention_dropout_rate=0.0)
  tokens = np.random.RandomState(0).randint(0, 65, (4, 128)).astype(np.int32)
  return LanguageModelTask(cfg), {'inputs': tokens, 'targets': tokens}


def tiny_translation():
  cfg = TransformerConfig(vocab_size=64, emb_dim=64, num_heads=4, mlp_dim=256, num_encoder_layers=1,
                          num_decoder_layers=1, max_len=64, dropout_rate=0.1,
                          attention_dropout_rate=0.0)
  r = np.random.RandomState(0)
  inputs, targets = r.randint(3, 64, (4, 40)), r.randint(3, 64, (4, 32))
  inputs[1, 30:], targets[1, 20:] = 0, 0
  return TranslationTask(cfg), {
      'inputs': inputs.astype(np.int32), 'targets': targets.astype(np.int32)
  }


@pytest.mark.slow
@pytest.mark.parametrize('make_task', [tiny_gpt, tiny_translation])
def test_train_step_has_no_transposing_copies_feeding_dots(make_task):
  hlo = compiled_train_step(*make_task())
  assert transposes_outside_attention(hlo) == []
  dots = dense_dots(hlo)
  assert len(dots) >= 3 * 6  # forward, input-gradient and weight-gradient dot per projection
  for dot in dots:  # each one plain (tokens, in) x (in, out): no batch dims, rank 2
    assert len(hlo_text.dims(dot['shape'])) == 2, dot
    assert 'lhs_batch_dims' not in dot['rest'], dot


def test_detector_flags_a_three_dimensional_dense():
  """The check can fail: a (B, T, D) einsum MLP + LayerNorm gets transposes in its backward."""

  def loss(params, x):
    w1, w2 = params
    h = jax.nn.gelu(jnp.einsum('btd,df->btf', x, w1))
    y = jnp.einsum('btf,fd->btd', h, w2)
    y = (y - y.mean(-1, keepdims=True)) * jax.lax.rsqrt(y.var(-1, keepdims=True) + 1e-5)
    return jnp.sum(y**2)

  params = (jnp.ones((64, 256)), jnp.ones((256, 64)))
  hlo = jax.jit(jax.grad(loss)).lower(params, jnp.ones((4, 128, 64))).compile().as_text()
  assert transposes_outside_attention(hlo)


# -- decoding: the KV cache is read in place ----------------------------------------------------


def copies_outside_entry(hlo: str, shapes: set[str]) -> list[str]:
  """`copy` instructions of the given shapes (e.g. 'f32[2,4,8,40]') anywhere but the ENTRY
  computation: inside a decode loop's body (or a fusion it calls) they run on every step,
  while ENTRY's run once (copying a non-donated argument)."""
  return [
      f"{i['computation']}: {i['name']} {i['shape']}" for i in hlo_text.parse(hlo) if
      i['opcode'] == 'copy' and i['computation'] != 'ENTRY' and i['shape'].split('{')[0] in shapes
  ]


@pytest.mark.slow
@pytest.mark.parametrize('num_kv_heads', [None, 2], ids=['mha', 'gqa'])
def test_cached_decode_loop_never_copies_the_cache(num_kv_heads):
  """A greedy decode loop of a small GPT, jitted as the library jits it: no step copies or
  transposes a layer's cache (that copy made a token at context 1024 cost 6x one at 64)."""
  from transformer_jax.inference import search
  from transformer_jax.layers.blocks import empty_cache
  from transformer_jax.models.gpt import GPT

  cfg = gpt2_config(vocab_size=65, emb_dim=64, num_heads=4, mlp_dim=256, num_decoder_layers=2,
                    max_len=72, dropout_rate=0.0, attention_dropout_rate=0.0,
                    num_kv_heads=num_kv_heads)
  decoder = GPT(cfg.replace(decode=True))
  params = nn.meta.unbox(GPT(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))['params']
  prompt = jnp.ones((2, 8), jnp.int32)

  def generate(params, prompt):
    cache = empty_cache(decoder, jnp.zeros((2, cfg.max_len), jnp.int32))
    _, state = decoder.apply({'params': params, 'cache': cache}, prompt, mutable=['cache'])

    def tokens_to_logits(tokens, cache):
      logits, updated = decoder.apply({'params': params, 'cache': cache}, tokens, mutable=['cache'])
      return logits[:, -1], updated['cache']

    return search.sample(tokens_to_logits, state['cache'], jax.random.key(0),
                         first_tokens=prompt[:, -1], max_len=32, temperature=0.0)

  hlo = jax.jit(generate, compiler_options=search.decode_compiler_options()).lower(
      params, prompt).compile().as_text()
  assert ' while(' in hlo
  d = cfg.emb_dim // cfg.num_heads
  k = cfg.num_kv_heads
  cache_shapes = {
      f'f32[2,{k},{d},{cfg.max_len}]',  # keys [B, K, D, S]
      f'f32[2,{k},{cfg.max_len},{d}]',  # values [B, K, S, D]
      f'f32[2,{k},{cfg.max_len},1]',  # (a transposed view)
      f'f32[2,{k},1,{d},{cfg.max_len}]',  # (keys with a group axis)
      f'f32[2,{k},1,{cfg.max_len},{d}]'
  }  # (values with a group axis)
  assert copies_outside_entry(hlo, cache_shapes) == []
  # ...its dots run in YNNPACK (on every core) and its reductions in XLA's own loops, not in
  # YNNPACK calls (~15 us of overhead each: small models decoded up to 1.3x slower).
  instructions = hlo_text.parse(hlo)
  opcodes = collections.defaultdict(set)
  for instruction in instructions:
    opcodes[instruction['computation']].add(instruction['opcode'])
  ynn = [
      hlo_text.called_computation(i)
      for i in instructions
      if i['opcode'] == 'fusion' and '__ynn_fusion' in i['rest']
  ]
  assert ynn
  assert all(opcodes[c] & {'dot'} and not opcodes[c] & {'reduce', 'reduce-window'} for c in ynn)


def test_copy_detector_flags_a_dot_over_an_updated_buffer():
  """The check can fail: a loop that updates a [1, 4, S, 32] buffer in place and reads it with
  an einsum (a dot) makes XLA:CPU transpose-copy the buffer inside the loop."""

  def run(buffer, x):

    def step(i, carry):
      buffer, x = carry
      buffer = jax.lax.dynamic_update_slice(buffer, x[None, :, None, :], (0, 0, i, 0))
      scores = jnp.einsum('bksd,kd->bks', buffer, x)
      return buffer, x + scores.sum(-1).reshape(4, 1) * 1e-6

    return jax.lax.fori_loop(0, 16, step, (buffer, x))

  s = 96
  hlo = jax.jit(run).lower(jnp.zeros((1, 4, s, 32)), jnp.ones((4, 32))).compile().as_text()
  assert copies_outside_entry(hlo, {f'f32[4,32,1,{s}]', f'f32[1,4,{s},32]', f'f32[4,32,{s}]'})


# -- decoding: a wide batch reads the kernels [out, in] ---------------------------------------


def _kernel_relayouts(hlo: str, shapes: set[str]) -> list[str]:
  """`transpose` and `copy` instructions of the given 2-D shapes, either way round: a kernel
  moved into another layout where the program runs."""
  flipped = {f"f32[{','.join(reversed(s[4:-1].split(',')))}]" for s in shapes}
  return [
      f"{i['computation']}: {i['name']} {i['shape']}" for i in hlo_text.parse(hlo)
      if i['opcode'] in ('transpose', 'copy') and i['shape'].split('{')[0] in shapes | flipped
  ]


def test_a_wide_decoding_loop_takes_its_kernels_out_in_as_they_are():
  """The Sampler's loop for `search.OUT_IN_ROWS` rows on CPU: its kernels arrive [out, in]
  (row-major, converted by a call of their own) and nothing in it moves them. Converted inside
  the loop's program, XLA would fold the transposition into the dots' operand layout, and the
  loop would read the weights [in, out] again (benchmarks/decode_dense_layout.py)."""
  from transformer_jax.inference import search
  cfg = gpt2_config(vocab_size=65, emb_dim=48, num_heads=4, head_dim=16, mlp_dim=256,
                    num_decoder_layers=2, max_len=64, dropout_rate=0.0, attention_dropout_rate=0.0)
  task = LanguageModelTask(cfg)
  params = nn.meta.unbox(task.init_variables(jax.random.key(0))['params'])
  rows = search.OUT_IN_ROWS
  prepared = task._sampler.prepared_params(params, rows)
  if jax.default_backend() != 'cpu':  # a CPU choice: elsewhere the compiler picks the layouts
    assert prepared.kernel_layout == 'in_out'
    return
  assert prepared.kernel_layout == 'out_in'
  sampler = task._sampler
  hlo = sampler._loop_fn.lower(prepared, task._empty_cache(rows, 64), jnp.ones((rows,), jnp.int32),
                               jnp.full((rows,), 8,
                                        jnp.int32), jax.random.key(0), jnp.zeros((rows,)),
                               jnp.zeros((rows,), jnp.int32), jnp.ones((rows,)), num_new=8,
                               eos_id=None, rule='greedy').compile().as_text()
  entry = {i['shape'] for i in hlo_text.parse(hlo) if i['opcode'] == 'parameter'}
  # query/key/value [heads, head_dim, embed], out [embed, heads, head_dim], wi and wo.
  assert {'f32[4,16,48]{2,1,0}', 'f32[48,4,16]{2,1,0}', 'f32[256,48]{1,0}',
          'f32[48,256]{1,0}'} <= entry
  assert _kernel_relayouts(hlo, {'f32[64,48]', 'f32[256,48]'}) == []
  # The check can fail: the same conversion inside the loop's program.
  converted_inside = jax.jit(
      lambda p: sampler._decode_loop(task._decode_params(p, 'out_in'), task._empty_cache(
          rows, 64), jnp.ones((rows,), jnp.int32), jnp.full(
              (rows,), 8, jnp.int32), jax.random.key(0), jnp.zeros(
                  (rows,)), jnp.zeros((rows,), jnp.int32), jnp.ones(
                      (rows,)), num_new=8, eos_id=None, rule='greedy'),
      compiler_options=search.decode_compiler_options())
  inside = converted_inside.lower(params).compile().as_text()
  assert _kernel_relayouts(inside, {'f32[64,48]', 'f32[256,48]'})
