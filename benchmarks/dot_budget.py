r"""Where a train step's time goes: every matmul of the compiled step, timed on its own.

  python benchmarks/dot_budget.py --config=mid          # GPT mid (~1.5 min on 2 cores)
  python benchmarks/dot_budget.py --config=bert --top=8

Compiles the real train step of a `benchmarks/train_step.py` config (the trainer's jit, same
flags: --dtype, --batch_size, --scan_layers), times the step, then reads every `dot` out of the
optimised HLO (`tools.hlo_text.dots`) and times each distinct one alone as a jitted
`lax.dot_general` of the same shapes and dimension numbers. Printed per distinct dot: the time
it accounts for (count x time alone), its GFLOP/s, shapes and the JAX op it came from; then the
share of the step the dots would take at those speeds. What that share leaves is everything else
(normalisation, activations, softmax, optimizer, copies), as long as XLA does not overlap them:
XLA:CPU runs independent ops concurrently, so read the split as a budget, not a profile.

Last line of output: one JSON object.
"""

import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformer_jax.cli import process

if __name__ == '__main__':
  process.setup_allocator()  # before jax allocates anything

import numpy as np
from absl import app, flags

from benchmarks import train_step as bench

_CONFIG = flags.DEFINE_enum('config', 'mid', list(bench.CONFIGS), 'Config of train_step.py.')
_MEASURED = flags.DEFINE_integer('measured_steps', 4, 'Timed steps (median reported), after 2 '
                                 'untimed ones.')
_TOP = flags.DEFINE_integer('top', 0, 'Print only the N most expensive dots (0: all).')


def _dot_key(dot: dict) -> tuple:
  return (dot['lhs'], dot['rhs'], dot['lhs_contracting_dims'], dot['rhs_contracting_dims'],
          dot['lhs_batch_dims'], dot['rhs_batch_dims'])


def _time_dot(key: tuple, dtype) -> tuple[float, float]:
  """(best seconds, FLOPs) of one dot_general of these shapes and dimension numbers, less the
  cost of calling a jitted function on the same operands (dispatch: ~0.1 ms, which would
  otherwise dominate the small dots)."""
  import jax
  import jax.numpy as jnp
  lhs, rhs, lhs_c, rhs_c, lhs_b, rhs_b = key
  dot = jax.jit(lambda a, b: jax.lax.dot_general(a, b, ((lhs_c, rhs_c), (lhs_b, rhs_b))))
  call = jax.jit(lambda a, b: a.ravel()[:1] + b.ravel()[:1])
  a, b = jnp.ones(lhs, dtype), jnp.ones(rhs, dtype)
  out, _ = dot(a, b).block_until_ready(), call(a, b).block_until_ready()
  flops = 2.0 * out.size * np.prod([lhs[d] for d in lhs_c])
  seconds = (bench._best_seconds(lambda: dot(a, b).block_until_ready(), 7) -
             bench._best_seconds(lambda: call(a, b).block_until_ready(), 7))
  return max(seconds, 1e-6), float(flops)


def main(argv):
  del argv
  import jax
  from tools import hlo_text
  from transformer_jax.parallel import sharding
  from transformer_jax.model_config import DTYPES

  spec = bench._spec(_CONFIG.value)
  training = bench.build_jax_training(spec, seed=0)
  with sharding.use_mesh(training.mesh, training.rules):
    compiled = training.train_step.lower(training.state, training.batches[0]).compile()

    # train_step.py's loop: first step and one more excluded, each timed step synced alone.
    def step(state, batch):
      state, metrics = compiled(state, batch)
      return state, metrics['loss_mean']

    _, timings = bench._timed_loop(step, training.state, training.batches, 1, _MEASURED.value,
                                   jax.block_until_ready)
  step_s = timings['seconds_per_step']

  counts, origin = collections.Counter(), {}
  for dot in hlo_text.dots(compiled.as_text()):
    key = _dot_key(dot)
    counts[key] += 1
    origin.setdefault(key,
                      dot['op_name'].split('/')[-2] if '/' in dot['op_name'] else dot['op_name'])
  rows = []
  for key, count in counts.items():
    alone_s, flops = _time_dot(key, DTYPES[bench._DTYPE.value])
    rows.append(
        dict(lhs=key[0], rhs=key[1], contracting=[key[2], key[3]], batch=[key[4],
                                                                          key[5]], count=count,
             ms_total=1000.0 * count * alone_s, gflops_per_s=flops / alone_s / 1e9, op=origin[key]))
  rows.sort(key=lambda r: -r['ms_total'])
  dots_ms = sum(r['ms_total'] for r in rows)
  batched_ms = sum(r['ms_total'] for r in rows if r['batch'][0])
  print(f'{_CONFIG.value}: step {1000 * step_s:.0f} ms (median of {_MEASURED.value}); '
        f'{sum(counts.values())} dots, {len(rows)} distinct')
  for r in rows[:_TOP.value or None]:
    print(f'{r["ms_total"]:8.1f} ms  x{r["count"]:<3d} {r["gflops_per_s"]:6.1f} GFLOP/s  '
          f'{r["lhs"]} . {r["rhs"]} contract {r["contracting"]} batch {r["batch"]}  ({r["op"]})')
  print(f'dots alone: {dots_ms:.0f} ms = {100 * dots_ms / (1000 * step_s):.0f}% of the step '
        f'(batched, i.e. attention: {batched_ms:.0f} ms); everything else at most '
        f'{1000 * step_s - dots_ms:.0f} ms')
  print(
      json.dumps({
          'benchmark': 'dot_budget', 'config': _CONFIG.value, 'spec': spec,
          'dtype': bench._DTYPE.value, 'step_ms': 1000 * step_s, 'dots_alone_ms': dots_ms,
          'batched_dots_alone_ms': batched_ms, 'dots': rows, 'jax_version': jax.__version__,
          'allocator': process.allocator_description()
      }))


if __name__ == '__main__':
  app.run(main)
