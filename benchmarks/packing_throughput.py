r"""Packed rows against length buckets: non-padding tokens trained per second on Multi30k.

  python benchmarks/packing_throughput.py --data_dir=../shared/data/multi30k --rounds=2 \
      --budget_minutes=3

Each measurement is a fresh process that trains experiments/configs/multi30k.py (En->De, 3+3
layers, 256 wide) from scratch for `budget_minutes` of wall time through the real trainer, with
data.pack=False (buckets) or True (packed), and reports the non-padding source + target tokens it
trained on per second, compilation included (buckets compile one program per bucket length as
they come; packed rows compile one; no persistent compilation cache). Rounds run buckets then
packed (A B A B ...); the ratio packed / buckets is taken per round and the median reported, as
the machine's speed drifts.
The SentencePiece model is trained once into --cache_dir and shared by every run.

Last line of output: one JSON object.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformer_jax.cli import process

if __name__ == '__main__':
  process.setup_allocator()

import json
import resource
import shutil
import statistics
import subprocess
import tempfile

from absl import app, flags

from tools import machine

_DATA_DIR = flags.DEFINE_string('data_dir', '../shared/data/multi30k', 'Multi30k directory.')
_ROUNDS = flags.DEFINE_integer('rounds', 2, 'Rounds of (buckets, packed).')
_BUDGET = flags.DEFINE_float('budget_minutes', 3.0, 'Wall-clock training budget per run.')
_CACHE = flags.DEFINE_string('cache_dir', '', 'Where the shared tokenizer lives (default: temp).')
_CHILD = flags.DEFINE_string('child', '', 'Internal: run one measurement (pack=True|False).')


def measure(pack: bool, data_dir: str, budget_minutes: float, cache_dir: str) -> dict:
  """One training run of `budget_minutes`; its token rate, steps and padding."""
  from experiments.configs import multi30k
  from transformer_jax.cli.workdir import prepare_workdir
  from transformer_jax.workflows import translation
  config = multi30k.get_config()
  config.data.dir = data_dir
  config.data.pack = pack
  config.train.max_minutes = budget_minutes
  config.train.num_steps = 1_000_000
  config.train.eval_every = 0
  config.train.checkpoint_every = 1_000_000
  config.train.log_every = 50
  config.eval.test_prefix = ''
  config.eval.average_last = 0
  workdir = prepare_workdir(tempfile.mkdtemp(prefix='packing_'))
  try:
    tokenizer = os.path.join(cache_dir, 'spm.model')
    if os.path.exists(tokenizer):
      shutil.copy(tokenizer, os.path.join(workdir, 'spm.model'))
    translation.validate(config)
    train_pairs = translation.load_split(config, config.data.train_prefix)
    task, trainer, (src_tok, tgt_tok) = translation.build(config, workdir, train_pairs)
    if not os.path.exists(tokenizer):
      shutil.copy(os.path.join(workdir, 'spm.model'), tokenizer)
    data = translation.make_batcher(config, trainer, src_tok, tgt_tok, train_pairs, train=True)
    padding = translation.padding_fraction(config, data)
    results = trainer.fit(data, None)
    trainer.close()
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  return {
      'pack': pack, 'tokens_per_s': results['tokens_per_s'], 'steps': results['step'],
      'minutes': results['minutes'], 'first_step_seconds': results['first_step_seconds'],
      'padding_fraction': padding,
      'peak_rss_gb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
  }


def spawn(pack: bool, cache_dir: str) -> dict:
  command = [
      sys.executable,
      os.path.abspath(__file__), f'--child={pack}', f'--data_dir={_DATA_DIR.value}',
      f'--budget_minutes={_BUDGET.value}', f'--cache_dir={cache_dir}'
  ]
  # Every run compiles its programs, as a first run does: no persistent compilation cache.
  env = dict(os.environ, TRANSFORMER_JAX_COMPILATION_CACHE='off')
  proc = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
  if proc.returncode != 0:
    raise SystemExit(f'error: the run with pack={pack} failed:\n{proc.stderr[-3000:]}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv):
  del argv
  if _CHILD.value:
    print(json.dumps(measure(_CHILD.value == 'True', _DATA_DIR.value, _BUDGET.value, _CACHE.value)))
    return
  cache_dir = _CACHE.value or tempfile.mkdtemp(prefix='packing_cache_')
  rounds = []
  for r in range(_ROUNDS.value):
    buckets, packed = spawn(False, cache_dir), spawn(True, cache_dir)
    ratio = packed['tokens_per_s'] / buckets['tokens_per_s']
    print(
        f'round {r + 1}: buckets {buckets["tokens_per_s"]:,.0f} tok/s '
        f'({buckets["steps"]} steps), packed {packed["tokens_per_s"]:,.0f} tok/s '
        f'({packed["steps"]} steps): {ratio:.3f}x', flush=True)
    rounds.append({'buckets': buckets, 'packed': packed, 'ratio': ratio})
  print(
      json.dumps({
          'benchmark':
              'packing_throughput',
          'cpu':
              machine.cpu_model(),
          'cores':
              os.cpu_count(),
          'budget_minutes':
              _BUDGET.value,
          'median_ratio_packed_over_buckets':
              round(statistics.median(r['ratio'] for r in rounds), 3),
          'rounds':
              rounds,
      }))


if __name__ == '__main__':
  from transformer_jax.cli import entrypoint
  app.run(lambda argv: entrypoint.run(main, argv))
