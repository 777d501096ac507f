r"""Exact resume after SIGKILL: kill a run at random steps, rerun the same command, compare.

  python benchmarks/resume.py --kills=10

For each kill point: a run is started with the exact command of a reference run, killed with
SIGKILL (no chance to checkpoint) at a random step after its first checkpoint, and the same
command is run again until it finishes. The final train state (parameters, optimizer state,
step) must be bitwise identical to that of the uninterrupted reference run. Kill points
alternate between the tiny translation quickstart (length-bucketed, shuffled batches) and a
tiny character GPT on Tiny Shakespeare (random windows), both with dropout on. Prints one
line per kill point; the last line is one JSON object: how many of the kill points matched.

The helpers here (`run_to_end`, `run_and_kill`, `saved_state`, `compare_states`) are also
used by tests/test_resume.py.
"""

import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRESS = re.compile(r'step (\d+)/(\d+) \|')
RESTORED = re.compile(r'restored checkpoint at step (\d+) ')

# The quickstart shrunk as in tests/conftest.py (TINY_OVERRIDES), dropout on, short epochs so
# that kill points fall in different epochs of the shuffled batcher.
TRANSLATE_FLAGS = {
    'model.emb_dim': 32,
    'model.num_heads': 2,
    'model.mlp_dim': 64,
    'model.num_encoder_layers': 1,
    'model.num_decoder_layers': 1,
    'model.dropout_rate': 0.1,
    'model.attention_dropout_rate': 0.1,
    'data.max_len': 32,
    'data.batch_tokens': 512,
    'data.max_train_examples': 300,
    'optimizer.learning_rate': 5e-3,
    'optimizer.warmup_steps': 10,
    'train.log_every': 1,
    'train.eval_every': 0,
    'train.eval_max_batches': 1,
    'eval.bleu_sentences': 2,
    'eval.decode_rows': 64,
    'eval.test_prefix': '',
}
# A tiny character GPT (dropout on); eval.sample_tokens=0: no sampling at the end.
LM_FLAGS = {
    'model.emb_dim': 32,
    'model.num_heads': 2,
    'model.mlp_dim': 64,
    'model.num_decoder_layers': 2,
    'model.dropout_rate': 0.1,
    'model.attention_dropout_rate': 0.1,
    'data.block_size': 16,
    'data.batch_size': 8,
    'data.eval_batches': 1,
    'optimizer.warmup_steps': 5,
    'optimizer.decay_steps': 100,
    'train.log_every': 1,
    'train.eval_every': 0,
    'train.eval_max_batches': 0,
    'eval.sample_tokens': 0,
}


def command(task: str, workdir: str, num_steps: int, checkpoint_every: int,
            extra: dict | None = None) -> list[str]:
  """The command line of one tiny training run ('translate' or 'lm')."""
  if task == 'translate':
    module, config = 'experiments.translate', 'experiments/configs/translate_quickstart.py'
    values = dict(TRANSLATE_FLAGS)
  elif task == 'lm':
    module, config = 'experiments.lm', 'experiments/configs/shakespeare_char.py'
    values = dict(LM_FLAGS)
    values['data.path'] = os.path.join(REPO_ROOT, '..', 'shared', 'data', 'tinyshakespeare',
                                       'input.txt')
  else:
    raise ValueError(f'unknown task {task!r}')
  values.update({'train.num_steps': num_steps, 'train.checkpoint_every': checkpoint_every})
  values.update(extra or {})
  return [sys.executable, '-m', module, f'--config={config}', f'--workdir={workdir}'
         ] + [f'--config.{k}={v}' for k, v in values.items()]


def environment(extra: dict | None = None) -> dict[str, str]:
  """CPU only, the default allocator (no re-exec), the repo importable."""
  env = dict(os.environ, TRANSFORMER_JAX_ALLOCATOR='system', JAX_PLATFORMS='cpu',
             TF_CPP_MIN_LOG_LEVEL='2')
  env['PYTHONPATH'] = os.pathsep.join(filter(None, [REPO_ROOT, env.get('PYTHONPATH')]))
  env.update(extra or {})
  return env


def run_to_end(cmd: list[str], env: dict, timeout: float = 900) -> str:
  """Runs `cmd` to completion; its log (stderr) or RuntimeError with the tail of it."""
  result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
  if result.returncode != 0:
    raise RuntimeError(f'{cmd[2]} exited with {result.returncode}:\n{result.stderr[-3000:]}')
  return result.stderr


def run_and_kill(cmd: list[str], env: dict, kill_step: int, timeout: float = 900) -> int:
  """Starts `cmd` and SIGKILLs it once it has logged step `kill_step`; the last step logged."""
  process = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             bufsize=1)
  deadline, last, tail = time.time() + timeout, 0, []
  try:
    for line in process.stderr:
      tail = (tail + [line])[-40:]
      match = PROGRESS.search(line)
      if match:
        last = int(match.group(1))
        if last >= kill_step:
          process.send_signal(signal.SIGKILL)
          break
      if time.time() > deadline:
        raise TimeoutError(f'step {kill_step} not reached in {timeout} s')
    else:
      raise RuntimeError(f'exited before step {kill_step}:\n{"".join(tail)}')
  finally:
    if process.poll() is None:
      process.kill()
    process.wait()
    process.stderr.close()
  return last


def saved_state(workdir: str, step: int | None = None) -> dict[str, np.ndarray]:
  """{key path: array} of the train state in the workdir's latest (or `step`) checkpoint."""
  import jax
  import orbax.checkpoint as ocp
  directory = os.path.join(workdir, 'checkpoints')
  if step is None:
    step = max(int(name) for name in os.listdir(directory) if name.isdigit())
  with ocp.StandardCheckpointer() as checkpointer:  # no target: every array whole, on CPU
    restored = checkpointer.restore(os.path.join(directory, str(step), 'state'))
  leaves = jax.tree_util.tree_flatten_with_path(restored)[0]
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def compare_states(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> str | None:
  """None if bitwise identical, else the first difference (a key path and how)."""
  if a.keys() != b.keys():
    return f'different entries: {sorted(a.keys() ^ b.keys())[:3]}'
  for key in a:
    x, y = a[key], b[key]
    if x.dtype != y.dtype or x.shape != y.shape:
      return f'{key}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}'
    if x.tobytes() != y.tobytes():
      diff = np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))
      return f'{key}: max abs difference {diff:.3g}'
  return None


def kill_and_resume(task: str, root: str, index: int, kill_step: int, num_steps: int,
                    checkpoint_every: int, reference: dict, env: dict) -> dict:
  """One kill point: run, SIGKILL at `kill_step`, rerun the same command, compare."""
  workdir = os.path.join(root, f'{task}_kill{index}')
  cmd = command(task, workdir, num_steps, checkpoint_every)
  start = time.time()
  killed_at = run_and_kill(cmd, env, kill_step)
  log = run_to_end(cmd, env)
  restored = RESTORED.search(log)
  state = saved_state(workdir)
  difference = compare_states(reference, state)
  return {
      'task': task, 'kill_step': kill_step, 'killed_after_step': killed_at,
      'restored_step': int(restored.group(1)) if restored else None,
      'fell_back': 'could not be restored' in log, 'match': difference is None,
      'difference': difference, 'seconds': round(time.time() - start, 1)
  }


def main():
  from absl import flags
  kills = flags.DEFINE_integer('kills', 10, 'Kill points (alternating translate / lm).')
  num_steps = flags.DEFINE_integer('num_steps', 30, 'Steps of every run.')
  checkpoint_every = flags.DEFINE_integer('checkpoint_every', 4, 'Checkpoint cadence.')
  seed = flags.DEFINE_integer('seed', 0, 'Seed of the random kill points.')
  workdir_flag = flags.DEFINE_string('workdir', None, 'Root directory (default: a temp dir).')
  cache = flags.DEFINE_bool('compilation_cache', True,
                            'Share a persistent XLA compilation cache between the runs.')
  flags.FLAGS(sys.argv)
  import json
  root = workdir_flag.value or tempfile.mkdtemp(prefix='resume_')
  extra_env = {'TRANSFORMER_JAX_COMPILATION_CACHE': 'off'}  # not the user's cache
  if cache.value:
    extra_env = {
        'JAX_COMPILATION_CACHE_DIR': os.path.join(root, 'xla_cache'),
        'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
        'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0'
    }
  env = environment(extra_env)
  rng = random.Random(seed.value)
  tasks = ['translate', 'lm'][:max(1, min(2, kills.value))]
  start = time.time()
  references = {}
  for task in tasks:
    t0 = time.time()
    workdir = os.path.join(root, f'{task}_reference')
    run_to_end(command(task, workdir, num_steps.value, checkpoint_every.value), env)
    references[task] = saved_state(workdir)
    print(
        f'{task}: uninterrupted reference run of {num_steps.value} steps in '
        f'{time.time() - t0:.0f} s', flush=True)
  results = []
  for i in range(kills.value):
    task = tasks[i % len(tasks)]
    # After the first checkpoint, and early enough that the kill lands before the end.
    kill_step = rng.randint(checkpoint_every.value + 1, num_steps.value - 2)
    result = kill_and_resume(task, root, i, kill_step, num_steps.value, checkpoint_every.value,
                             references[task], env)
    results.append(result)
    print(
        f'kill {i + 1}/{kills.value} {task}: SIGKILL after step {result["killed_after_step"]}'
        f', resumed from step {result["restored_step"]}'
        f'{" (fell back past an unfinished checkpoint)" if result["fell_back"] else ""}: '
        f'{"bitwise identical" if result["match"] else "DIFFERENT: " + result["difference"]}'
        f' ({result["seconds"]:.0f} s)', flush=True)
  matched = sum(r['match'] for r in results)
  print(
      f'{matched}/{len(results)} resumed runs ended bitwise identical to the uninterrupted '
      f'run ({time.time() - start:.0f} s)', flush=True)
  print(
      json.dumps({
          'kill_points': len(results), 'matched': matched,
          'tasks': {t: sum(r['match'] for r in results if r['task'] == t) for t in tasks},
          'num_steps': num_steps.value, 'checkpoint_every': checkpoint_every.value,
          'kill_steps': [r['killed_after_step'] for r in results],
          'restored_steps': [r['restored_step'] for r in results], 'minutes': round(
              (time.time() - start) / 60, 2)
      }))


if __name__ == '__main__':
  main()
