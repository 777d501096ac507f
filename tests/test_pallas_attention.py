"""The TPU path ('pallas': JAX's Pallas flash-attention kernel) equals the reference attention,
forward and backward, run on CPU by Pallas's TPU interpreter: sequence lengths the kernel's
128-wide tiles don't divide, padding masks, a bias (with its gradient), grouped-query heads and
cross-attention. These are the numbers a TPU run gets, up to the chip's float rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from transformer_jax import kernels

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
  np.testing.assert_array_equal(calls[0]['segment_ids'].kv, mask[:, 0, 0, :])
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
