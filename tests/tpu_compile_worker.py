"""Runs the Pallas attention path over a multi-device mesh; run as a subprocess.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/tpu_compile_worker.py \
        interpret SPEC_JSON
    JAX_PLATFORMS=cpu PYTHONPATH=LIBTPU_DIR:. python tests/tpu_compile_worker.py tpu SPEC_JSON

The device count and the TPU runtime are fixed when jax starts, hence a fresh process.

- `interpret`: runs attention (forward and the gradients of a weighted sum) on CPU devices
  sharded as the logical-axis rules say, the Pallas kernel interpreted, and compares it with
  the reference attention on one device.
- `tpu`: lowers and compiles it (Mosaic) for a TPU topology (`jax.experimental.topologies`),
  without a TPU: nothing runs.

SPEC: {"topology": "v5e:2x2" (tpu only), "cases": [{"name": ..., "mesh": {"data": 2, "tensor": 2},
"kind": "causal"|"key_padding"|"cross"|"packed"|"layer", "implementation": "pallas"|"auto",
"grad": bool, "batch": 8, "heads": 4, "kv_heads": 2, "bias": bool (interpret only)}]}. Prints one
JSON line per case (errors or Mosaic calls and compile times).
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from transformer_jax import kernels
from transformer_jax.kernels import scaled_dot_product
from transformer_jax.layers.attention import attention_partition
from transformer_jax.parallel import sharding

HEAD_DIM = 64
# (query length, key length, causal, mask): the attention of a GPT, a BERT (keys padded, as
# segment ids in the kernel), an encoder-decoder's cross-attention and a packed GPT (several
# examples a row: segment ids [B, T] in place of a mask), at lengths the kernel's 128-wide tiles
# do not divide.
KINDS = {
    'tpu': {
        'causal': (256, 256, True, None),
        'key_padding': (200, 200, False, 'keys'),
        'cross': (96, 160, False, 'keys'),
        'packed': (200, 200, True, 'packed'),
    },
    'interpret': {
        'causal': (10, 10, True, 'both'),
        'key_padding': (9, 9, False, 'keys'),
        'cross': (7, 11, False, 'keys'),
        'packed': (10, 10, True, 'packed'),
    },
}


def make_inputs(case, t, s, mask_kind, head_dim):
  """q [B, T, H, D], k and v [B, S, K, D], the mask and the bias (when asked)."""
  b, h, kv_heads = case.get('batch', 8), case.get('heads', 4), case.get('kv_heads', 2)
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, h, head_dim))
  k = jax.random.normal(keys[1], (b, s, kv_heads, head_dim))
  v = jax.random.normal(keys[2], (b, s, kv_heads, head_dim))
  bias = jax.random.normal(keys[3], (1, h, t, s)) if case.get('bias') else None
  # Every other row hides its last keys (and, with 'both', its last queries).
  k_valid = jnp.arange(s)[None, :] < jnp.where(jnp.arange(b) % 2, s - 4, s)[:, None]
  mask = None
  if mask_kind == 'keys':
    mask = k_valid[:, None, None, :]
  elif mask_kind == 'both':
    q_valid = jnp.arange(t)[None, :] < jnp.where(jnp.arange(b) % 2, t - 3, t)[:, None]
    mask = kernels.make_padding_mask(q_valid, k_valid)
  elif mask_kind == 'packed':  # segment ids [B, T]: three examples a row, padding (0) at the end
    index = jnp.arange(t)
    mask = jnp.broadcast_to(
        jnp.where(index < t // 3, 1, jnp.where(index < t - 3, 2, jnp.where(index < t - 1, 3, 0))),
        (b, t)).astype(jnp.int32)
  return q, k, v, mask, bias


def attention_loss(implementation, causal, mask):
  """(q, k, v, bias) -> (weighted sum of the attention output, output), as a layer calls it.
  A 2-D `mask` is a packed row's segment ids (for queries and keys)."""
  segments = {}
  if mask is not None and mask.ndim == 2:
    segments = dict(query_segment_ids=mask, key_segment_ids=mask)
    mask = None

  def loss(q, k, v, bias):
    out = kernels.dot_product_attention(q, k, v, mask=mask, bias=bias, causal=causal,
                                        implementation=implementation,
                                        partition=attention_partition(), **segments)
    weights = jnp.sin(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    return jnp.sum(out * weights), out

  return loss


def output_and_gradients(loss, q, k, v, bias):
  argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
  grads, out = jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, bias)
  return (out,) + tuple(grads)


def specs(mesh, q, k, mask, bias):
  """q/k/v, mask and bias PartitionSpecs from the active logical-axis rules, as the layer's
  constraints place them (an axis that doesn't divide its dimension left out)."""
  batch, _, heads, _ = nn.logical_to_mesh_axes(('batch', 'length', 'heads', 'kv'))
  size = lambda axes: np.prod(
      [mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)) if a is not None])
  batch = batch if q.shape[0] % size(batch) == 0 else None
  heads = heads if k.shape[2] % size(heads) == 0 else None  # K divides H

  def scores_spec(x):  # a mask or bias [B or 1, H or 1, T or 1, S], or segment ids [B, T]
    if x is None:
      return None
    if x.ndim == 2:
      return P(batch, None)
    return P(batch if x.shape[0] > 1 else None, heads if x.shape[1] > 1 else None)

  return P(batch, None, heads, None), scores_spec(mask), scores_spec(bias)


def run_interpret(case):
  """Max |error| against the reference of the output and each gradient on the mesh."""
  from jax.experimental.pallas import tpu as pltpu
  t, s, causal, mask_kind = KINDS['interpret'][case['kind']]
  q, k, v, mask, bias = make_inputs(case, t, s, mask_kind, head_dim=8)
  expected = output_and_gradients(attention_loss('reference', causal, mask), q, k, v, bias)
  mesh = sharding.make_mesh(case['mesh'])
  with sharding.use_mesh(mesh):
    qkv_spec, mask_spec, bias_spec = specs(mesh, q, k, mask, bias)
    put = lambda x, spec: None if x is None else jax.device_put(x, NamedSharding(mesh, spec))
    q, k, v = (put(x, qkv_spec) for x in (q, k, v))
    mask, bias = put(mask, mask_spec), put(bias, bias_spec)
    loss = attention_loss(case['implementation'], causal, mask)
    fn = jax.jit(lambda q, k, v, bias: output_and_gradients(loss, q, k, v, bias))
    jaxpr = str(jax.make_jaxpr(fn)(q, k, v, bias))
    # True: Pallas's generic interpreter (each device's kernel as plain XLA ops). The TPU
    # interpreter (`InterpretParams`, as the one-device tests use) synchronises the devices it
    # simulates through host callbacks, and those hang on a multi-device CPU mesh.
    with pltpu.force_tpu_interpret_mode(True):
      got = fn(q, k, v, bias)
  names = ['out', 'dq', 'dk', 'dv', 'dbias'][:len(expected)]
  return {
      'shard_map': 'shard_map' in jaxpr,
      'error': {n: float(jnp.max(jnp.abs(g - e))) for n, g, e in zip(names, got, expected)},
      'scale': {n: float(jnp.max(jnp.abs(e))) for n, e in zip(names, expected)},
  }


def layer_function(mesh, case):
  """(step function, abstract args) of a grouped-query causal self-attention layer with the
  given kernel: its output, or the gradient of its output's sum w.r.t. the parameters."""
  from transformer_jax.layers.attention import MultiHeadAttention
  from transformer_jax.model_config import TransformerConfig
  cfg = TransformerConfig(emb_dim=256, num_heads=4, num_kv_heads=2, dropout_rate=0.0,
                          attention_dropout_rate=0.0,
                          attention_implementation=case['implementation'])
  layer = MultiHeadAttention(cfg, causal=True)
  x = jax.ShapeDtypeStruct((8, 256, 256), jnp.float32)
  # Abstract all through: nothing may run on the topology's devices (they have no client).
  key = jax.eval_shape(jax.random.key, 0)
  boxed = jax.eval_shape(layer.init, key, x)
  shardings = sharding.tree_shardings(mesh, boxed)
  boxes = lambda x: isinstance(x, nn.Partitioned)
  params = jax.tree.map(
      lambda box, sh: jax.ShapeDtypeStruct(box.value.shape, box.value.dtype, sharding=sh), boxed,
      shardings, is_leaf=boxes)
  x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.batch_sharding(mesh))
  forward = lambda params, x: layer.apply(params, x)
  if case.get('grad'):
    return jax.grad(lambda params, x: jnp.sum(forward(params, x)**2)), (params, x)
  return forward, (params, x)


def attention_function(mesh, case):
  """(step function, abstract args) of `dot_product_attention` on q, k, v (and the mask)."""
  t, s, causal, mask_kind = KINDS['tpu'][case['kind']]
  q, k, v, mask, _ = jax.eval_shape(
      lambda: make_inputs(dict(case, bias=False), t, s, mask_kind, HEAD_DIM))
  qkv_spec, mask_spec, _ = specs(mesh, q, k, mask, None)

  def abstract(x, spec):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

  args = [abstract(x, qkv_spec) for x in (q, k, v)]
  if mask is not None:
    args.append(abstract(mask, mask_spec))

  def forward(q, k, v, mask=None):
    return attention_loss(case['implementation'], causal, mask)(q, k, v, None)[1]

  if case.get('grad'):
    return jax.grad(lambda *a: jnp.sum(forward(*a)**2), argnums=(0, 1, 2)), tuple(args)
  return forward, tuple(args)


def run_tpu(case, devices):
  """Lowers and compiles for the topology; the kernel 'auto' picks, the Mosaic calls."""
  mesh = sharding.make_mesh(case['mesh'], devices=devices)
  with sharding.use_mesh(mesh):
    auto = kernels.auto_implementation()
    platform = scaled_dot_product.target_platform()
    build = layer_function if case['kind'] == 'layer' else attention_function
    fn, args = build(mesh, case)
    start = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    lowered_s = time.perf_counter() - start
    jaxpr = str(jax.make_jaxpr(fn)(*args))
  start = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start
  return {
      'auto': auto, 'platform': platform, 'shard_map': 'shard_map' in jaxpr,
      'mosaic_calls': compiled.as_text().count('custom_call_target="tpu_custom_call"'),
      'lower_s': round(lowered_s, 2), 'compile_s': round(compile_s, 2)
  }


def main():
  mode, spec = sys.argv[1], json.loads(sys.argv[2])
  if mode == 'tpu':
    from jax.experimental import topologies
    devices = topologies.get_topology_desc(spec.get('topology', 'v5e:2x2'), platform='tpu').devices
    run = lambda case: run_tpu(case, devices)
  elif mode == 'interpret':
    run = run_interpret
  else:
    raise SystemExit(f'unknown mode {mode!r}: use interpret or tpu')
  host = {'name': 'host', 'backend': jax.default_backend(), 'auto': kernels.auto_implementation()}
  with sharding.use_mesh(sharding.make_mesh({'data': 1}, devices=jax.devices()[:1])):
    host['auto_host_mesh'] = kernels.auto_implementation()
  print(json.dumps(host), flush=True)
  for case in spec['cases']:
    print(json.dumps(dict(run(case), name=case['name'])), flush=True)


if __name__ == '__main__':
  main()
