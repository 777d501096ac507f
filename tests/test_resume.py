"""Exact resume after SIGKILL, and preemption agreed by several processes (CLI subprocesses).

The helpers are those of benchmarks/resume.py, which runs the first test at 10 kill points.
"""

import os
import re
import signal
import subprocess
import time

import pytest

from benchmarks import resume

pytestmark = pytest.mark.slow

# Only one checkpoint on disk at a time: a SIGKILL between deleting the old one and committing
# the new one would leave none (the rerun would start from scratch and the test fail).
KEEP_ONE = {'train.keep_checkpoints': 1}


def test_sigkill_then_rerun_ends_bitwise_identical_to_uninterrupted_run(
    tmp_path, translate_cli, tiny_shakespeare):
  """A tiny character GPT (dropout on) of 40 steps killed with SIGKILL once it logged step 9
  (checkpoints every 4 steps, saved asynchronously: one may be in flight), then the same
  command again: it resumes from a checkpoint, not from scratch, and ends with exactly the
  parameters, Adam state and step of an uninterrupted run. keep_checkpoints=1 also checks that
  the last good checkpoint is not deleted before the next one is committed."""
  env = resume.environment(translate_cli.env())  # with the test run's compilation cache
  reference_dir, killed_dir = str(tmp_path / 'reference'), str(tmp_path / 'killed')
  flags = {**KEEP_ONE, 'data.path': tiny_shakespeare}
  resume.run_to_end(resume.command('lm', reference_dir, 40, 4, flags), env)
  reference = resume.saved_state(reference_dir)
  assert reference["['step']"] == 40

  cmd = resume.command('lm', killed_dir, 40, 4, flags)
  killed_after = resume.run_and_kill(cmd, env, kill_step=9)
  assert killed_after == 9
  assert not os.path.isdir(os.path.join(killed_dir, 'checkpoints', '40'))
  log = resume.run_to_end(cmd, env)
  restored = resume.RESTORED.search(log)
  assert restored, log[-3000:]
  restored_step = int(restored.group(1))
  assert 4 <= restored_step < 40 and restored_step % 4 == 0
  assert 'step 1/40 |' not in log  # it did not start again from scratch
  difference = resume.compare_states(reference, resume.saved_state(killed_dir))
  assert difference is None, difference


@pytest.mark.multiprocess
def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step(tmp_path, tiny_shakespeare):
  """Two local processes (one CPU device each) train one model with jax.distributed; SIGTERM
  to process 1 only: both log that all 2 processes agreed to stop after the same step S, both
  exit 0, and checkpoint S is on disk."""
  workdir = str(tmp_path / 'work')
  cmd = resume.command('lm', workdir, 100_000, 0, {'data.path': tiny_shakespeare})
  port = 20000 + os.getpid() % 20000
  processes, logs = [], []
  for index in range(2):
    env = resume.environment({
        'JAX_COORDINATOR_ADDRESS': f'localhost:{port}', 'JAX_NUM_PROCESSES': '2',
        'JAX_PROCESS_ID': str(index), 'JAX_CPU_COLLECTIVES_IMPLEMENTATION': 'gloo'
    })
    logs.append(str(tmp_path / f'log{index}'))
    with open(logs[-1], 'w') as log:
      processes.append(
          subprocess.Popen(cmd, cwd=resume.REPO_ROOT, env=env, stderr=log,
                           stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL))
  try:
    deadline = time.time() + 600
    while True:
      with open(logs[1]) as f:
        steps = resume.PROGRESS.findall(f.read())
      if steps and int(steps[-1][0]) >= 3:
        break
      assert time.time() < deadline and all(p.poll() is None for p in processes), (open(
          logs[1]).read()[-3000:])
      time.sleep(0.2)
    processes[1].send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=600) for p in processes]
  finally:
    for p in processes:
      if p.poll() is None:
        p.kill()
        p.wait()
  texts = [open(path).read() for path in logs]
  assert codes == [0, 0], [t[-3000:] for t in texts]
  agreed = [re.findall(r'all 2 processes agreed to stop after step (\d+)', t) for t in texts]
  assert len(agreed[0]) == 1 and agreed[0] == agreed[1], agreed
  step = int(agreed[0][0])
  assert f'checkpoint written at step {step}, exiting cleanly' in texts[0]
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', str(step)))
  assert all('Traceback' not in t for t in texts)
