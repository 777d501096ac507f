r"""Where a train step's time goes, from a profiler trace: every compiled instruction's time.

  python benchmarks/step_profile.py --config=bert           # MiniLM-size BERT (~1 min, 2 cores)
  python benchmarks/step_profile.py --config=mid --top=40
  python benchmarks/step_profile.py --config=mid --part=attention   # list only its instructions

Compiles the real train step of a `benchmarks/train_step.py` config (the trainer's jit, same
flags), runs 3 steps under `jax.profiler.trace`, and maps the trace's events to the optimised
HLO (`tools.hlo_text`): per instruction its time per step, kind and the JAX op it came
from. Printed: a summary by part of the model (matmuls forward / backward, attention, the
optimizer update, embeddings, the rest) and the N most expensive instructions. Complements
`dot_budget.py`, which times each matmul alone: this sees everything else too (normalisation,
activations, softmax, optimizer) as it runs inside the step.

Read it knowing how XLA:CPU runs a step: matmuls it hands to Eigen run on the intra-op thread
pool, so their own events are short, and independent instructions run concurrently, so one
instruction's time can include work done beside it (a backward matmul's input gradient and its
weight gradient overlap: the one YNNPACK runs carries the time of both). Totals per part are
sound; single lines are upper bounds.

Last line of output: one JSON object.
"""

import collections
import glob
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformer_jax.cli import process

if __name__ == '__main__':
  process.setup_allocator()  # before jax allocates anything

from absl import app, flags

from benchmarks import train_step as bench

_CONFIG = flags.DEFINE_enum('config', 'bert', list(bench.CONFIGS), 'Config of train_step.py.')
_TOP = flags.DEFINE_integer('top', 25, 'Print the N most expensive instructions.')
_PART = flags.DEFINE_string(
    'part', '', 'List only instructions of parts whose name contains '
    'this (e.g. "attention"); the summary still covers all.')
_STEPS = 3  # profiled, after as many untimed ones


def part_of_model(instruction: dict, calls_dot: bool) -> str:
  """Which part of the step an instruction belongs to, from its JAX op_name."""
  op_name = instruction['op_name']
  if '_attention/' in op_name and ('->' in op_name or not calls_dot):
    return 'attention (scores, softmax, mixing)'  # not the q/k/v/out projections
  if calls_dot:
    return 'matmuls backward' if 'transpose(' in op_name else 'matmuls forward'
  if 'jvp(' not in op_name:
    return 'optimizer update, gradient clipping'  # outside the model's forward/backward
  # GPT's method `features_and_embedding` names every op of the model: look at the modules only.
  if 'embed' in op_name.replace('features_and_embedding', ''):
    return 'embeddings'
  return 'other (norms, activations, residuals, loss)'


def main(argv):
  del argv
  import jax
  from tools import hlo_text
  from transformer_jax.parallel import sharding

  spec = bench._spec(_CONFIG.value)
  training = bench.build_jax_training(spec, seed=0)
  batches = training.batches
  trace_dir = tempfile.mkdtemp(prefix='step_profile_')
  with sharding.use_mesh(training.mesh, training.rules):
    compiled = training.train_step.lower(training.state, batches[0]).compile()

    def run_steps(state):
      for i in range(_STEPS):
        state, metrics = compiled(state, batches[i % len(batches)])
        jax.block_until_ready(metrics)
      return state

    state = run_steps(training.state)  # warm-up, untraced
    with jax.profiler.trace(trace_dir):
      run_steps(state)
  profile = jax.profiler.ProfileData.from_file(
      glob.glob(os.path.join(trace_dir, '**', '*.xplane.pb'), recursive=True)[0])
  event_ms = collections.Counter()
  for plane in profile.planes:
    for line in plane.lines:
      for event in line.events:
        event_ms[event.name] += event.duration_ns / 1e6 / _STEPS

  instructions = hlo_text.parse(compiled.as_text())
  # Fused computations that contain a dot (YNNPACK fuses matmuls with their neighbours).
  dot_computations = {i['computation'] for i in instructions if i['opcode'] == 'dot'}
  rows = []
  for i in instructions:
    if i['computation'] != 'ENTRY' or i['name'] not in event_ms:
      continue
    called = hlo_text.called_computation(i)
    calls_dot = i['opcode'] == 'dot' or called in dot_computations
    rows.append(
        dict(name=i['name'], opcode=i['opcode'], shape=i['shape'].split('{')[0],
             ms=event_ms[i['name']], part=part_of_model(i, calls_dot), op_name=i['op_name']))
  rows.sort(key=lambda r: -r['ms'])
  total_ms = sum(r['ms'] for r in rows)
  parts = collections.Counter()
  for r in rows:
    parts[r['part']] += r['ms']

  print(f'{_CONFIG.value}: {total_ms:.0f} ms of instructions per step, {len(rows)} instructions '
        f'(profile in {trace_dir})')
  for part, ms in parts.most_common():
    print(f'  {ms:8.1f} ms  {100 * ms / total_ms:4.1f}%  {part}')
  listed = [r for r in rows if _PART.value in r['part']][:_TOP.value]
  print(f'the {len(listed)} most expensive instructions' +
        (f' of "{_PART.value}":' if _PART.value else ':'))
  for r in listed:
    print(f'  {r["ms"]:8.1f} ms  {r["name"]:26s} {r["shape"]:22s} {r["op_name"][-90:]}')
  print(
      json.dumps({
          'benchmark': 'step_profile', 'config': _CONFIG.value, 'spec': spec,
          'instructions_ms': total_ms, 'parts_ms': dict(parts), 'top': listed,
          'jax_version': jax.__version__, 'allocator': process.allocator_description()
      }))


if __name__ == '__main__':
  app.run(main)
