"""The Pallas flash-attention kernel on TPU (`jax.experimental.pallas.ops.tpu`): its bias and
segment ids in the kernel's padded form, and its run per device inside `shard_map` over the
batch and head axes the mesh splits. `scaled_dot_product.dot_product_attention` picks it for
implementation 'pallas'; shapes and masks as there."""

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from transformer_jax.kernels.masks import (as_4d, combine_masks, make_causal_mask,
                                           make_segment_mask, zero_fully_masked_rows)

_PALLAS_TILE = 128  # the Pallas kernel's default tile along both sequences (and its lane width)


def _pallas_bias_and_segments(mask, bias, shape, t_pad, s_pad, segments=None):
  """What the Pallas kernel takes for `mask`, `bias` and `segments` (packed rows' (query ids
  [B, T], key ids [B, S]), or None) at its tile-padded lengths: an additive bias [B, H, T', S']
  (or None) and (query, key) segment ids [B, T'], [B, S'] (or None); the kernel lets a query see
  the keys whose id equals its own.

  Packed rows' ids pass as they are. Key padding (a mask [B or 1, 1, 1, S], as BERT and
  cross-attention pass) and the keys added to fill the last tile become key id -1, which no
  query has (query ids are 1 without packing, and the added query rows are dropped): nothing
  [T, S]-sized is built for them. Any other mask is folded into the bias (correct, but it
  materialises [B, H, T, S]).
  """
  b, h, t, s = shape
  key_valid = None  # [B, S]: the mask, when it only hides keys
  if mask is not None and mask.shape[1:3] == (1, 1):
    key_valid, mask = jnp.broadcast_to(mask[:, 0, 0, :], (b, s)), None
  ab = None
  if bias is not None or mask is not None:
    ab = jnp.zeros(shape, jnp.float32)
    if bias is not None:
      ab = ab + bias.astype(jnp.float32)
    if mask is not None:
      ab = jnp.where(mask, ab, -0.7 * float(jnp.finfo(jnp.float32).max))
    ab = jnp.pad(ab, ((0, 0), (0, 0), (0, t_pad), (0, s_pad)))
  if segments is None and key_valid is None and not s_pad:
    return ab, None
  q_ids, k_ids = segments if segments is not None else (jnp.ones(
      (b, t), jnp.int32), jnp.ones((b, s), jnp.int32))
  if key_valid is not None:
    k_ids = jnp.where(key_valid, k_ids, -1)
  q_ids = jnp.pad(q_ids.astype(jnp.int32), ((0, 0), (0, t_pad)))
  k_ids = jnp.pad(k_ids.astype(jnp.int32), ((0, 0), (0, s_pad)), constant_values=-1)
  return ab, (q_ids, k_ids)


def _pallas_flash_attention(q, k, v, mask, bias, causal, dtype, segments=None):
  """TPU: the Pallas flash-attention kernel, on the arrays of one device.

  The kernel tiles both sequences by 128, so other lengths are padded up to a multiple (the
  padded keys hidden by segment ids, the padded query rows dropped); masks, bias and packed
  rows' segment ids as `_pallas_bias_and_segments` says; causality stays inside the kernel.
  The kernel scales the scores after adding its bias, so q is scaled here instead.
  """
  # lazy: TPU only, and importing Pallas's kernels adds 0.3-0.4 s to every run's start-up (measured)
  from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash
  b, t, h, d = q.shape
  s = k.shape[1]
  groups = h // k.shape[2]
  if groups > 1:  # the kernel wants as many key/value heads as query heads
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  mask = as_4d(mask)
  t_pad, s_pad = -t % _PALLAS_TILE, -s % _PALLAS_TILE
  ab, ids = _pallas_bias_and_segments(mask, bias, (b, h, t, s), t_pad, s_pad, segments)
  segment_ids = None if ids is None else pallas_flash.SegmentIds(q=ids[0], kv=ids[1])
  to_bhtd = lambda x, pad: jnp.swapaxes(
      jnp.pad(x.astype(dtype), ((0, 0), (0, pad), (0, 0), (0, 0))), 1, 2)
  out = pallas_flash.flash_attention(to_bhtd(q * d**-0.5, t_pad), to_bhtd(k, s_pad),
                                     to_bhtd(v, s_pad), ab=ab, segment_ids=segment_ids,
                                     causal=causal)
  out = jnp.swapaxes(out, 1, 2)[:, :t]
  if causal:
    mask = combine_masks(mask, make_causal_mask(t, s))
  if mask is not None and segments is not None:  # (packed rows alone leave no row empty)
    mask = combine_masks(mask, make_segment_mask(*segments))
  return zero_fully_masked_rows(out, mask)


def _dividing_axes(axes, size, mesh, free_axes):
  """The leading mesh axes of `axes` (a name, a tuple of names or None) whose sizes multiply to
  a divisor of `size`, skipping names that are not free axes of `mesh` (absent, or already
  manual); None when none is left."""
  names = axes if isinstance(axes, tuple) else (axes,)
  kept, product = [], 1
  for name in names:
    if name is None or name not in free_axes:
      continue
    if size % (product * mesh.shape[name]):
      break
    kept.append(name)
    product *= mesh.shape[name]
  return None if not kept else kept[0] if len(kept) == 1 else tuple(kept)


def pallas_tpu_attention(q, k, v, mask, bias, causal, dtype, partition=None, segments=None):
  """TPU: the Pallas flash-attention kernel (`_pallas_flash_attention`), run per device inside
  `jax.shard_map` when the active mesh has several devices.

  XLA cannot partition a Mosaic kernel: on a multi-device mesh, lowering it fails with
  "Mosaic kernels cannot be automatically partitioned", after tracing, so no fallback can catch
  it. Inside the shard_map (over every free mesh axis: Mosaic wants them all manual) each
  device runs the kernel on its block of the batch and the heads, split over the mesh axes that
  `partition` = (batch axes, head axes) names (from the layer's logical-axis rules), less those
  that do not divide B, or K for the heads (grouped key/value heads are repeated per device, so
  query and key/value heads must be split alike). Masks and biases are split along the batch
  and head axes they have (a size-1 broadcast axis stays whole), segment ids along the batch.
  Without `partition` every device computes the whole attention on replicated inputs: correct,
  but redundant. The mesh is the one `jax.set_mesh` sets (as `parallel.sharding.use_mesh`
  does); the legacy `with mesh:` sets none.
  """
  mesh = jax.sharding.get_abstract_mesh()
  free_axes = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
  if mesh.empty or math.prod(mesh.shape[a] for a in free_axes) == 1:
    return _pallas_flash_attention(q, k, v, mask, bias, causal, dtype, segments)
  b, h, kv_heads = q.shape[0], q.shape[2], k.shape[2]
  batch_axes, head_axes = partition or (None, None)
  batch_axes = _dividing_axes(batch_axes, b, mesh, free_axes)
  head_axes = _dividing_axes(head_axes, kv_heads, mesh, free_axes)  # K divides H
  qkv_spec = P(batch_axes, None, head_axes, None)
  mask, bias = as_4d(mask), as_4d(bias)
  extras = [x for x in (mask, bias) if x is not None]
  extra_specs = [
      P(batch_axes if x.shape[0] == b else None, head_axes if x.shape[1] == h else None)
      for x in extras
  ]

  if segments is not None:
    extras += list(segments)
    extra_specs += [P(batch_axes, None)] * 2

  def per_device(q, k, v, *extras):
    extras = iter(extras)
    local_mask = None if mask is None else next(extras)
    local_bias = None if bias is None else next(extras)
    local_segments = None if segments is None else (next(extras), next(extras))
    return _pallas_flash_attention(q, k, v, local_mask, local_bias, causal, dtype, local_segments)

  in_specs = (qkv_spec,) * 3 + tuple(extra_specs)
  inputs = [_reshard_explicit(x, spec, mesh) for x, spec in zip((q, k, v, *extras), in_specs)]
  # check_vma=False: pallas_call has no rule for the varying manual axes of its outputs.
  return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=qkv_spec,
                       axis_names=frozenset(free_axes), check_vma=False)(*inputs)


def _reshard_explicit(x, spec, mesh):
  """`x` resharded to `spec` over the mesh's Explicit axes, so that shard_map accepts it.

  An array's type carries its split over Explicit axes, and jax >= 0.11's shard_map refuses
  in_specs that differ from it instead of resharding; over Auto axes (the trainer's mesh,
  `parallel.sharding.make_mesh`) shard_map reshards by itself, and `jax.reshard` refuses them.
  """
  explicit = {
      name for name, kind in zip(mesh.axis_names, mesh.axis_types)
      if kind == jax.sharding.AxisType.Explicit
  }
  if not explicit:
    return x

  def keep(entry):
    names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n in explicit)
    return None if not names else names[0] if len(names) == 1 else names

  return jax.reshard(x, P(*(keep(entry) for entry in spec)))
