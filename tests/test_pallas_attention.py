"""The TPU path ('pallas': JAX's Pallas flash-attention kernel) equals the reference attention,
forward and backward, run on CPU by Pallas's TPU interpreter: sequence lengths the kernel's
128-wide tiles don't divide, padding masks, a bias (with its gradient), grouped-query heads and
cross-attention, on one device and per shard over a mesh of several. These are the numbers a
TPU run gets, up to the chip's float rounding."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from transformer_jax import kernels
from transformer_jax import xla_options

B, H, D = 2, 2, 8
RTOL, ATOL = 1e-5, 1e-5


def inputs(t, s, kv_heads, padding, use_bias):
  """q, k, v, bias and mask; `padding`: None, 'keys' (a [B, 1, 1, S] mask, as BERT and
  cross-attention pass; row 1's last 4 keys hidden) or 'both' (also row 1's last 3 queries)."""
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (B, t, H, D))
  k = jax.random.normal(keys[1], (B, s, kv_heads, D))
  v = jax.random.normal(keys[2], (B, s, kv_heads, D))
  bias = jax.random.normal(keys[3], (1, H, t, s)) if use_bias else None
  k_valid = jnp.arange(s)[None, :] < jnp.array([[s], [s - 4]])
  mask = None
  if padding == 'keys':
    mask = k_valid[:, None, None, :]
  elif padding == 'both':
    q_valid = jnp.arange(t)[None, :] < jnp.array([[t], [t - 3]])
    mask = kernels.make_padding_mask(q_valid, k_valid)
  return q, k, v, bias, mask


def output_and_gradients(implementation, q, k, v, bias, mask, causal):
  """Attention output and the gradients of a weighted sum of it w.r.t. q, k, v (and bias)."""

  def loss(q, k, v, bias):
    out = kernels.dot_product_attention(q, k, v, mask=mask, bias=bias, causal=causal,
                                        implementation=implementation)
    weights = jnp.sin(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    return jnp.sum(out * weights), out

  argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
  grads, out = jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, bias)
  return out, grads


@pytest.mark.parametrize(
    't,s,kv_heads,causal,padding,use_bias',
    [
        (10, 10, 1, True, 'both', False),  # GPT-like: causal, padded, shorter than one tile
        # Cross-attention with padding and a bias (T5).
        pytest.param(7, 11, 2, False, 'both', True, marks=pytest.mark.slow),
        (9, 9, 2, False, 'keys', False),  # BERT-like: only keys hidden
    ])
def test_pallas_kernel_matches_reference_forward_and_backward(t, s, kv_heads, causal, padding,
                                                              use_bias):
  q, k, v, bias, mask = inputs(t, s, kv_heads, padding, use_bias)
  with pltpu.force_tpu_interpret_mode():
    out, grads = output_and_gradients('pallas', q, k, v, bias, mask, causal)
  ref_out, ref_grads = output_and_gradients('reference', q, k, v, bias, mask, causal)
  np.testing.assert_allclose(out, ref_out, rtol=RTOL, atol=ATOL)
  if padding == 'both':  # padded query rows: zero output, as the reference
    np.testing.assert_array_equal(np.asarray(out)[1, t - 3:], 0.0)
  for name, g, ref in zip('q k v bias'.split(), grads, ref_grads):
    assert np.abs(np.asarray(ref)).max() > 1e-3, name  # a real gradient, not all zeros
    np.testing.assert_allclose(g, ref, rtol=RTOL, atol=ATOL, err_msg=name)


def test_key_padding_reaches_the_kernel_as_segment_ids_not_a_score_sized_bias(monkeypatch):
  """BERT's and cross-attention's [B, 1, 1, S] masks cost the kernel no [B, H, T, S] array, and
  a batch row whose keys are all hidden comes out zero (the kernel alone would average it)."""
  from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash
  calls = []
  kernel = pallas_flash.flash_attention

  def recording_kernel(*args, **kwargs):
    calls.append(kwargs)
    return kernel(*args, **kwargs)

  monkeypatch.setattr(pallas_flash, 'flash_attention', recording_kernel)
  q, k, v, _, _ = inputs(5, 128, 2, None, False)  # exactly one key tile: no keys added
  mask = jnp.stack([jnp.arange(128) < 100, jnp.zeros(128, bool)])[:, None, None, :]
  with pltpu.force_tpu_interpret_mode():
    out = kernels.dot_product_attention(q, k, v, mask=mask, implementation='pallas')
  assert calls[0]['ab'] is None
  # Hidden keys get id -1, which no query has (queries are all 1 without packing).
  np.testing.assert_array_equal(calls[0]['segment_ids'].kv, np.where(mask[:, 0, 0, :], 1, -1))
  np.testing.assert_array_equal(calls[0]['segment_ids'].q[:, :5], 1)  # rows added to fill the
  # query tile (id 0) are dropped from the output
  np.testing.assert_allclose(
      out, kernels.dot_product_attention(q, k, v, mask=mask, implementation='reference'), rtol=RTOL,
      atol=ATOL)
  np.testing.assert_array_equal(np.asarray(out)[1], 0.0)


@pytest.mark.parametrize('backend,expected', [('gpu', 'cudnn'), ('tpu', 'pallas'),
                                              ('cpu', 'chunked')])
def test_auto_picks_the_backend_kernel_and_falls_back_when_it_cannot_run(
    monkeypatch, backend, expected):
  """'auto' asks for cuDNN on GPU and Pallas on TPU; where the kernel can't run (here: on a CPU
  posing as that backend, at trace time) it falls back to a path that can, with the same
  numbers. Attention dropout always takes the chunked path (the fused kernels have none)."""
  monkeypatch.setattr(jax, 'default_backend', lambda: backend)
  assert kernels.auto_implementation() == expected
  assert kernels.auto_implementation(dropout=True) == 'chunked'
  q, k, v, _, mask = inputs(9, 9, 1, padding='both', use_bias=False)
  if backend != 'cpu':
    # The kernel itself really can't run on this CPU; its error type varies by jax version.
    with pytest.raises(Exception):  # noqa: B017
      kernels.dot_product_attention(q, k, v, mask=mask, causal=True, implementation=expected)
  out = kernels.dot_product_attention(q, k, v, mask=mask, causal=True)
  ref = kernels.dot_product_attention(q, k, v, mask=mask, causal=True, implementation='reference')
  np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)


def shard_map_specs(mesh_axes, partition, batch=4, kv_heads=2, mask_shape=None, bias_shape=None,
                    axis_types=None):
  """The (in_specs, out_specs) of the shard_map around the kernel when 'pallas' is traced under
  a TPU mesh {name: size} (abstract: no devices needed), or None when there is no shard_map."""
  tpu = jax.sharding.AbstractDevice(device_kind='TPU v5 lite', num_cores=None, platform='tpu')
  mesh = jax.sharding.AbstractMesh(tuple(mesh_axes.values()), tuple(mesh_axes),
                                   axis_types=axis_types, abstract_device=tpu)
  t, h = 10, 4
  q = jax.ShapeDtypeStruct((batch, t, h, D), jnp.float32)
  kv = jax.ShapeDtypeStruct((batch, t, kv_heads, D), jnp.float32)
  mask = None if mask_shape is None else jax.ShapeDtypeStruct(mask_shape, jnp.bool_)
  bias = None if bias_shape is None else jax.ShapeDtypeStruct(bias_shape, jnp.float32)

  def attend(q, k, v, mask, bias):
    return kernels.dot_product_attention(q, k, v, mask=mask, bias=bias, causal=True,
                                         implementation='pallas', partition=partition)

  with jax.sharding.use_abstract_mesh(mesh):
    jaxpr = jax.make_jaxpr(attend)(q, kv, kv, mask, bias)
  found = [e.params for e in jaxpr.eqns if e.primitive.name == 'shard_map']
  return (tuple(found[0]['in_specs']), found[0]['out_specs'][0]) if found else None


def test_pallas_kernel_is_shard_mapped_over_the_batch_and_heads_the_mesh_splits():
  """On a mesh of several devices the kernel runs inside `jax.shard_map` (XLA cannot partition
  a Mosaic kernel: lowering would fail), split as `partition` says where the split divides the
  batch and the key/value heads; masks and biases split along the axes they have."""
  P = jax.sharding.PartitionSpec
  mesh = {'data': 2, 'fsdp': 2, 'tensor': 2}
  split = (('data', 'fsdp'), 'tensor')
  qkv = P(('data', 'fsdp'), None, 'tensor', None)
  # Auto axes (the trainer's mesh) and Explicit ones (jax.make_mesh's default since jax 0.11,
  # whose shard_map takes only inputs already split as in_specs say: they are resharded first).
  for kind in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit):
    in_specs, out_spec = shard_map_specs(mesh, split, mask_shape=(4, 1, 1, 10),
                                         bias_shape=(1, 4, 10, 10), axis_types=(kind,) * 3)
    assert in_specs == (qkv, qkv, qkv, P(('data', 'fsdp'), None), P(None, 'tensor'))
    assert out_spec == qkv
  # A batch of 2 keeps the data split only; one key/value head can't be split over 2 devices.
  assert shard_map_specs(mesh, split, batch=2, kv_heads=1)[0][0] == P('data', None, None, None)
  assert shard_map_specs(mesh, split, batch=3)[0][0] == P(None, None, 'tensor', None)
  # Unknown split (no rules): every device computes the whole attention, still inside shard_map.
  assert shard_map_specs(mesh, None)[0] == (P(None, None, None, None),) * 3
  # Axes the mesh doesn't have are ignored; one device, or every axis manual already (inside
  # a shard_map), needs none.
  assert shard_map_specs({'data': 4}, split)[0][0] == P('data', None, None, None)
  assert shard_map_specs({'data': 1}, split) is None
  manual = (jax.sharding.AxisType.Manual,) * 3
  assert shard_map_specs(mesh, split, axis_types=manual) is None


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_pallas_kernel_runs_per_shard_on_a_multi_device_mesh(translate_cli):
  """Over several devices the kernel runs inside `jax.shard_map` (XLA cannot partition a Mosaic
  kernel), each device on its block of the batch and heads as the logical-axis rules split them,
  and forward and gradients still equal the reference: 4 CPU devices in a subprocess
  (tests/tpu_compile_worker.py), the kernel interpreted. Batch over data or fsdp, heads over
  tensor with grouped key/value heads, a padding mask folded into the bias, key padding as
  segment ids, a bias shared by the batch (its gradient summed over the batch shards),
  cross-attention, a batch the mesh doesn't divide (left whole on every device), and packed
  rows (segment ids split with the batch)."""
  cases = [
      {
          'name': 'data2_tensor2/causal', 'mesh': {'data': 2, 'tensor': 2}, 'kind': 'causal',
          'batch': 4, 'heads': 4, 'kv_heads': 2
      },
      {
          'name': 'fsdp2_tensor2/key_padding+bias', 'mesh': {'fsdp': 2, 'tensor': 2},
          'kind': 'key_padding', 'batch': 2, 'heads': 2, 'kv_heads': 2, 'bias': True
      },
      {
          'name': 'data4/cross+bias', 'mesh': {'data': 4}, 'kind': 'cross', 'batch': 4, 'heads': 2,
          'kv_heads': 1, 'bias': True
      },
      {
          'name': 'data4/undivided_batch', 'mesh': {'data': 4}, 'kind': 'key_padding', 'batch': 2,
          'heads': 2, 'kv_heads': 1
      },
      {
          'name': 'data2_tensor2/packed', 'mesh': {'data': 2, 'tensor': 2}, 'kind': 'packed',
          'batch': 4, 'heads': 4, 'kv_heads': 2
      },
  ]
  for case in cases:
    case['implementation'] = 'pallas'
  env = xla_options.host_devices_env(4, translate_cli.env())
  proc = subprocess.run([
      sys.executable,
      os.path.join('tests', 'tpu_compile_worker.py'), 'interpret',
      json.dumps({'cases': cases})
  ], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = {r['name']: r for r in map(json.loads, proc.stdout.splitlines())}
  assert results.pop('host')['auto'] == 'chunked'  # a CPU mesh: the CPU's kernel
  assert sorted(results) == sorted(case['name'] for case in cases)
  for name, result in results.items():
    assert result['shard_map'], name
    for quantity, error in result['error'].items():
      assert result['scale'][quantity] > 1e-3, (name, quantity)  # a real gradient
      assert error <= ATOL + RTOL * result['scale'][quantity], (name, quantity, result)
