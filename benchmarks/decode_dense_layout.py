r"""Which kernel layout a decoding step's dense layers run fastest in, on this CPU.

  python benchmarks/decode_dense_layout.py                       # batch 1, 8, 32; ~3 minutes
  python benchmarks/decode_dense_layout.py --batch_sizes=32 --rounds=5

GPT-2 small's dense layers (12 x qkv 768->2304, out 768->768, MLP 768->3072->768: 340 MB of
fp32 weights, more than the CPU's caches hold) applied to `batch` rows, `--steps` times in one
jitted `fori_loop` compiled with `search.decode_compiler_options()`, as in a decoding loop. Two
layouts of the same weights:
  in_out: kernels [in, out], y = x @ W (the model's layout, `layers/dense.py`);
  out_in: kernels [out, in] (PyTorch's `Linear`), y = x @ W.T with W.T never materialised.
Each (layout, batch) is a fresh process; rounds are interleaved in_out, out_in, then out_in,
in_out; the figure is ms per step (median of the timed calls) and the median over rounds of the
ratio in_out / out_in (> 1: out_in is faster). Both layouts compute the same numbers up to
float rounding (checked in each process against a float64 reference).

Last line: one JSON object.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformer_jax.cli import process

if __name__ == '__main__':
  process.setup_allocator()

import json
import statistics
import subprocess
import time

from absl import app, flags

_BATCHES = flags.DEFINE_list('batch_sizes', ['1', '8', '32'], 'Rows per step.')
_ROUNDS = flags.DEFINE_integer('rounds', 2, 'Interleaved rounds per batch size.')
_STEPS = flags.DEFINE_integer('steps', 10, 'Steps per timed call.')
_CALLS = flags.DEFINE_integer('calls', 5, 'Timed calls per process (after one that compiles).')
_RUN = flags.DEFINE_string('run', None, 'Internal: LAYOUT:BATCH, one timed run in this process.')

LAYOUTS = ('in_out', 'out_in')
LAYER_SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768))  # (in, out) of one layer
NUM_LAYERS = 12


def one_run(layout: str, batch: int) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax

  from transformer_jax.inference import search

  rng = np.random.default_rng(0)
  kernels = [[rng.standard_normal(shape, np.float32) * 0.02
              for shape in LAYER_SHAPES]
             for _ in range(NUM_LAYERS)]
  x = rng.standard_normal((batch, 768), np.float32)
  if layout == 'out_in':
    weights = [[jnp.asarray(np.ascontiguousarray(k.T)) for k in layer] for layer in kernels]
  else:
    weights = [[jnp.asarray(k) for k in layer] for layer in kernels]

  def dense(h, kernel):
    if layout == 'out_in':
      return lax.dot_general(h, kernel, (((1,), (1,)), ((), ())))
    return h @ kernel

  def step(h, layers):
    for qkv, out, up, down in layers:
      h = h + 0.1 * dense(dense(h, qkv)[:, :768], out)
      h = h + 0.1 * dense(jax.nn.gelu(dense(h, up)), down)
    return h

  def reference(h):  # the same step in float64 on the host
    for qkv, out, up, down in kernels:
      h = h + 0.1 * ((h @ qkv)[:, :768] @ out)
      u = h @ up
      h = h + 0.1 * (0.5 * u * (1 + np.tanh(0.7978845608 * (u + 0.044715 * u**3))) @ down)
    return h

  loop = jax.jit(lambda h, layers: lax.fori_loop(0, _STEPS.value, lambda _, h: step(h, layers), h),
                 compiler_options=search.decode_compiler_options())
  one = jax.jit(step, compiler_options=search.decode_compiler_options())
  error = float(
      np.abs(np.asarray(one(jnp.asarray(x), weights)) - reference(x.astype(np.float64))).max())
  loop(jnp.asarray(x), weights).block_until_ready()
  times = []
  for _ in range(_CALLS.value):
    start = time.perf_counter()
    loop(jnp.asarray(x), weights).block_until_ready()
    times.append((time.perf_counter() - start) / _STEPS.value * 1e3)
  return {
      'layout': layout, 'batch': batch, 'ms_per_step': statistics.median(times),
      'max_abs_error_vs_float64': error
  }


def main(argv):
  del argv
  if _RUN.value:
    layout, batch = _RUN.value.split(':')
    print(json.dumps(one_run(layout, int(batch))), flush=True)
    return
  from tools import machine
  results = {}
  for batch in [int(b) for b in _BATCHES.value]:
    runs = {layout: [] for layout in LAYOUTS}
    for round_ in range(_ROUNDS.value):
      for layout in (LAYOUTS if round_ % 2 == 0 else LAYOUTS[::-1]):
        done = subprocess.run([
            sys.executable,
            os.path.abspath(__file__), f'--run={layout}:{batch}', f'--steps={_STEPS.value}',
            f'--calls={_CALLS.value}'
        ], capture_output=True, text=True, check=False)
        if done.returncode:
          raise RuntimeError(f'{layout} batch {batch} failed: {done.stderr[-2000:]}')
        runs[layout].append(json.loads(done.stdout.strip().splitlines()[-1]))
    ratios = [a['ms_per_step'] / b['ms_per_step'] for a, b in zip(runs['in_out'], runs['out_in'])]
    errors = [r['max_abs_error_vs_float64'] for layout in LAYOUTS for r in runs[layout]]
    row = {f'{layout}_ms': [round(r['ms_per_step'], 2) for r in runs[layout]] for layout in LAYOUTS}
    row.update(in_out_over_out_in=round(statistics.median(ratios), 3),
               max_abs_error_vs_float64=max(errors))
    results[str(batch)] = row
    print(
        f'batch {batch:3d}: in_out {results[str(batch)]["in_out_ms"]} ms, out_in '
        f'{results[str(batch)]["out_in_ms"]} ms per step: in_out / out_in '
        f'{results[str(batch)]["in_out_over_out_in"]}', flush=True)
  print(
      json.dumps({
          'benchmark': 'decode_dense_layout', 'cpu': machine.cpu_model(),
          'commit': machine.git_commit(), 'batches': results
      }))


if __name__ == '__main__':
  app.run(main)
