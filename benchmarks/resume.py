r"""Exact resume after SIGKILL: kill a run at random steps, rerun the same command, compare.

  python benchmarks/resume.py --kills=10

For each kill point: a run is started with the exact command of a reference run, killed with
SIGKILL (no chance to checkpoint) at a random step after its first checkpoint, and the same
command is run again until it finishes. The final train state (parameters, optimizer state,
step) must be bitwise identical to that of the uninterrupted reference run. Kill points
alternate between the tiny translation quickstart (length-bucketed, shuffled batches) and a
tiny character GPT on Tiny Shakespeare (random windows), both with dropout on. Prints one
line per kill point; the last line is one JSON object: how many of the kill points matched.

Elastic resume: the same, but each rerun comes back on another device count and mesh.

  python benchmarks/resume.py --elastic --kills=10

For each kill point: a chain starts the command of the uninterrupted reference run on 8
simulated CPU devices (mesh data=8), is SIGKILLed at a random step after its first checkpoint
(and not before that checkpoint is committed: it is saved asynchronously) and resumed on a random
other device count of 1, 2, 4 or 8 with a random mesh for it (1: data=1; 2: data=2 or fsdp=2;
4: data=4 or data=2 x fsdp=2; 8: data=8, data=4 x fsdp=2 or fsdp=8). About half of the chains
are killed once more, after the resumed run's first checkpoint step, and resumed on yet another
count; then every chain runs to the end. All runs record the SHA-256 of every global batch
(train.record_batches). A kill point passes when the chain trained on exactly the reference's
batches at every step (the data order, token for token) and its train loss, at the last step
and at every step after the first resume, is within --rtol (relative, default 1e-4) of the
reference's: the parameters cannot be bitwise identical across meshes, whose reductions add in
another order. The translation kill points pack their batches (data.pack=True), whose rows are
rounded to data x fsdp of the first layout (8, which every resume can split). Prints one line
per kill point; the last line is one JSON object: how many matched and the largest relative
loss difference seen.

The helpers here (`command`, `environment`, `run_to_end`, `run_and_kill`, `saved_state`,
`compare_states`) are also used by tests/test_resume.py.
"""

import json
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

# The package beside this file (run as a script, sys.path[0] is benchmarks/), not another copy.
if REPO_ROOT not in sys.path:
  sys.path.insert(0, REPO_ROOT)
from transformer_jax import xla_options  # imports no jax

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


def run_and_kill(cmd: list[str], env: dict, kill_step: int, timeout: float = 900,
                 ready=None) -> int:
  """Starts `cmd` and SIGKILLs it once it has logged step `kill_step` (and, if given, `ready()`
  holds at a step it logs); the last step logged."""
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
        if last >= kill_step and (ready is None or ready()):
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


# Elastic mode. Every chain starts on 8 devices: the packed translation batches keep the rows
# multiple of the first layout (data x fsdp = 8) on every resume, which each count here splits.
FIRST_DEVICES = 8
# The meshes a resume may pick for each device count (tensor=1): data parallel, FSDP and a mix,
# so that a resume changes how the state is sharded as well as the device count.
ELASTIC_MESHES = {
    1: [{'data': 1, 'fsdp': 1}],
    2: [{'data': 2, 'fsdp': 1}, {'data': 1, 'fsdp': 2}],
    4: [{'data': 4, 'fsdp': 1}, {'data': 2, 'fsdp': 2}],
    8: [{'data': 8, 'fsdp': 1}, {'data': 4, 'fsdp': 2}, {'data': 1, 'fsdp': 8}],
}


def elastic_flags(task: str) -> dict:
  """Flags of every run of an elastic chain and of its reference."""
  values = {'train.record_batches': True}  # batches.jsonl: the digest of each global batch
  if task == 'translate':
    # Packed rows, rounded to the batch multiple the first layout fixes: 480 // 32 = 15 rows
    # make 8 on 8 devices but 12, 14 or 15 on 4, 2 or 1, so a resume that rounded them again
    # would train on other batches (512 would give 16 rows on every count and prove nothing).
    values.update({'data.pack': True, 'data.batch_tokens': 480})
  return values


def plan_chain(rng: random.Random, num_steps: int, checkpoint_every: int) -> list[dict]:
  """The segments of one chain, each {'devices', 'mesh' (None: the reference's, data=all),
  'kill_step' (None: run to the end)}: 8 devices, then 1 or 2 resumes on other counts."""
  # Two kills need a checkpoint of the first resume before the second kill, and that kill
  # before the end: the first kill at most num_steps - 3 - checkpoint_every.
  two = rng.random() < 0.5 and num_steps - 3 - checkpoint_every >= checkpoint_every + 1
  first = rng.randint(checkpoint_every + 1,
                      num_steps - 3 - checkpoint_every if two else num_steps - 2)
  kills = [first]
  if two:
    # After the checkpoint the first resume writes (the first multiple past `first`), so that
    # the second resume restores state that the other mesh saved.
    kills.append(rng.randint((first // checkpoint_every + 1) * checkpoint_every + 1, num_steps - 2))
  segments = [{'devices': FIRST_DEVICES, 'mesh': None, 'kill_step': kills[0]}]
  for kill_step in kills[1:] + [None]:
    devices = rng.choice([n for n in ELASTIC_MESHES if n != segments[-1]['devices']])
    segments.append(
        {'devices': devices, 'mesh': rng.choice(ELASTIC_MESHES[devices]), 'kill_step': kill_step})
  return segments


def has_checkpoint(workdir: str) -> bool:
  """Whether a checkpoint of the workdir is committed (orbax renames a finished one from
  'N.orbax-checkpoint-tmp' to 'N')."""
  directory = os.path.join(workdir, 'checkpoints')
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def train_losses(workdir: str) -> dict[int, float]:
  """{step: train/loss} of the workdir's metrics.jsonl; a step run again after a resume is
  logged again, and its last record counts."""
  losses = {}
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    for line in f:
      record = json.loads(line)
      if 'train/loss' in record:
        losses[int(record['step'])] = float(record['train/loss'])
  return losses


def starts(workdir: str) -> list[dict]:
  """The provenance record of each start of the run in the workdir (its layout, start step)."""
  with open(os.path.join(workdir, 'provenance.jsonl')) as f:
    return [json.loads(line) for line in f]


def mesh_text(mesh: dict) -> str:
  """'data=2 x fsdp=2'; 'data=1' for one device."""
  return ' x '.join(f'{axis}={size}' for axis, size in mesh.items() if size > 1) or 'data=1'


def relative_difference(a: float, b: float) -> float:
  return abs(a - b) / max(abs(b), 1e-30)


def elastic_chain(task: str, root: str, index: int, segments: list[dict], num_steps: int,
                  checkpoint_every: int, reference: dict, env: dict, rtol: float) -> dict:
  """One elastic kill point: run the chain's segments in one workdir, compare with `reference`
  ({'digests', 'losses'} of the uninterrupted run)."""
  from transformer_jax.training import batch_record
  workdir = os.path.join(root, f'{task}_elastic{index}')
  start = time.time()
  killed = []
  for segment in segments:
    values = elastic_flags(task)
    if segment['mesh'] is not None:
      values.update({f'mesh.{axis}': size for axis, size in segment['mesh'].items()})
    cmd = command(task, workdir, num_steps, checkpoint_every, values)
    segment_env = xla_options.host_devices_env(segment['devices'], env)
    if segment['kill_step'] is None:
      run_to_end(cmd, segment_env)
    else:
      # Checkpoints are saved asynchronously: on a slow host the first one can still be in
      # flight several steps later. A kill before it is committed would restart the next run
      # from scratch, on its own layout (a new first layout, so other translation batches):
      # a fresh run on another mesh, not a resume. So the kill also waits for a checkpoint.
      killed.append(
          run_and_kill(cmd, segment_env, segment['kill_step'],
                       ready=lambda: has_checkpoint(workdir)))
  # What each start really ran on, from its provenance line: a killed run whose log had not got
  # that far would leave no line, and a layout other than the one asked for is a failure.
  records = starts(workdir)
  layouts = [r['layout'] for r in records]
  start_steps = [int(r['start_step']) for r in records]
  problems = []
  if len(records) != len(segments):
    problems.append(f'{len(records)} starts recorded for {len(segments)} segments')
  for segment, layout in zip(segments, layouts):
    mesh = segment['mesh'] or {'data': segment['devices']}
    if layout['devices'] != segment['devices'] or any(
        layout['mesh'].get(axis, 1) != size for axis, size in mesh.items()):
      problems.append(f'asked for {segment["devices"]} devices, {mesh_text(mesh)}; ran on '
                      f'{layout["devices"]}, {mesh_text(layout["mesh"])}')
  digests = batch_record.read(workdir)
  different = [s for s in range(1, num_steps + 1) if digests.get(s) != reference['digests'][s]]
  if different:
    problems.append(f'{len(different)} steps trained on other batches, first step '
                    f'{different[0]}')
  losses = train_losses(workdir)
  # The steps trained after the first resume (the 8-device start ran the reference's command).
  resumed = range(start_steps[1] + 1 if len(start_steps) > 1 else 1, num_steps + 1)
  missing = [s for s in resumed if s not in losses]
  if missing:
    problems.append(f'no train/loss logged at steps {missing[:3]}')
  differences = {
      s: relative_difference(losses[s], reference['losses'][s]) for s in resumed if s in losses
  }
  final = differences.get(num_steps, float('inf'))
  worst = max(differences.values(), default=float('inf'))
  if final > rtol:
    problems.append(f'final loss {losses.get(num_steps)} vs {reference["losses"][num_steps]}')
  elif worst > rtol:
    step = max(differences, key=differences.get)
    problems.append(f'loss at step {step}: {losses[step]} vs {reference["losses"][step]}')
  return {
      'task': task, 'kill_steps': killed, 'start_steps': start_steps,
      'layouts': [f'{layout["devices"]}:{mesh_text(layout["mesh"])}' for layout in layouts],
      'batches_match': not different, 'final_rel_loss_diff': final, 'max_rel_loss_diff': worst,
      'match': not problems, 'problems': problems, 'seconds': round(time.time() - start, 1)
  }


def segment_text(result: dict, j: int) -> str:
  """'4:data=2 x fsdp=2 from step 8, killed after step 13' for segment j of a chain."""
  text = f'{result["layouts"][j]} from step {result["start_steps"][j]}'
  if j < len(result['kill_steps']):
    text += f', killed after step {result["kill_steps"][j]}'
  return text


def elastic_main(tasks: list[str], kills: int, num_steps: int, checkpoint_every: int,
                 rng: random.Random, root: str, env: dict, rtol: float):
  """--elastic: one reference per task on 8 devices, then `kills` chains (elastic_chain)."""
  from transformer_jax.training import batch_record
  start = time.time()
  references = {}
  for task in tasks:
    t0 = time.time()
    workdir = os.path.join(root, f'{task}_reference')
    run_to_end(command(task, workdir, num_steps, checkpoint_every, elastic_flags(task)),
               xla_options.host_devices_env(FIRST_DEVICES, env))
    references[task] = {'digests': batch_record.read(workdir), 'losses': train_losses(workdir)}
    print(
        f'{task}: uninterrupted reference run of {num_steps} steps on {FIRST_DEVICES} devices in '
        f'{time.time() - t0:.0f} s', flush=True)
  results = []
  for i in range(kills):
    task = tasks[i % len(tasks)]
    segments = plan_chain(rng, num_steps, checkpoint_every)
    result = elastic_chain(task, root, i, segments, num_steps, checkpoint_every, references[task],
                           env, rtol)
    results.append(result)
    path = ' -> '.join(segment_text(result, j) for j in range(len(result['layouts'])))
    print(
        f'kill {i + 1}/{kills} {task}: {path}: batches '
        f'{"identical" if result["batches_match"] else "DIFFERENT"}, max rel loss diff '
        f'{result["max_rel_loss_diff"]:.2g} (final {result["final_rel_loss_diff"]:.2g}): '
        f'{"ok" if result["match"] else "FAILED: " + "; ".join(result["problems"])}'
        f' ({result["seconds"]:.0f} s)', flush=True)
  matched = sum(r['match'] for r in results)
  print(
      f'{matched}/{len(results)} chains resumed on other device counts trained on the '
      f'reference batches with losses within rtol {rtol:g} ({time.time() - start:.0f} s)',
      flush=True)
  summary = {'mode': 'elastic', 'kills': len(results), 'matched': matched, 'rtol': rtol}
  summary['batches_matched'] = sum(r['batches_match'] for r in results)
  summary['max_rel_loss_diff'] = max(r['max_rel_loss_diff'] for r in results)
  summary['max_rel_final_loss_diff'] = max(r['final_rel_loss_diff'] for r in results)
  summary['tasks'] = {t: sum(r['match'] for r in results if r['task'] == t) for t in tasks}
  summary.update(num_steps=num_steps, checkpoint_every=checkpoint_every)
  for key in ('kill_steps', 'start_steps', 'layouts'):
    summary[key] = [r[key] for r in results]
  summary['minutes'] = round((time.time() - start) / 60, 2)
  print(json.dumps(summary))


def main():
  from absl import flags
  kills = flags.DEFINE_integer('kills', 10, 'Kill points (alternating translate / lm).')
  num_steps = flags.DEFINE_integer('num_steps', 30, 'Steps of every run.')
  checkpoint_every = flags.DEFINE_integer('checkpoint_every', 4, 'Checkpoint cadence.')
  seed = flags.DEFINE_integer('seed', 0, 'Seed of the random kill points.')
  workdir_flag = flags.DEFINE_string('workdir', None, 'Root directory (default: a temp dir).')
  cache = flags.DEFINE_bool('compilation_cache', True,
                            'Share a persistent XLA compilation cache between the runs.')
  elastic = flags.DEFINE_bool(
      'elastic', False, 'Resume each kill point on other simulated CPU device counts and meshes; '
      'compare the batches and losses (not the bitwise state) with the reference.')
  rtol = flags.DEFINE_float('rtol', 1e-4, '--elastic: relative tolerance of the train losses.')
  flags.FLAGS(sys.argv)
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
  if elastic.value:
    elastic_main(tasks, kills.value, num_steps.value, checkpoint_every.value, rng, root, env,
                 rtol.value)
    return
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
