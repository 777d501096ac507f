"""Two processes on localhost (jax.distributed over CPU collectives) train like one process.

`launch/local_multiprocess.sh 2 python -m experiments.lm ...` runs the real experiment as two
processes, each with one CPU device and its own half of every batch; together they write one
orbax checkpoint, and restore it to continue. The logged losses must match a single process.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from transformer_jax.parallel import distributed
from transformer_jax.errors import ConfigError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_LM = {
    'model.emb_dim': 32,
    'model.num_heads': 2,
    'model.mlp_dim': 64,
    'model.num_decoder_layers': 1,
    'model.dropout_rate': 0.1,
    'data.block_size': 16,
    'data.batch_size': 8,
    'data.eval_batches': 1,
    'eval.sample_tokens': 0,
    'optimizer.warmup_steps': 1,
    'optimizer.decay_steps': 100,
    'train.log_every': 1,
    'train.eval_every': 0,
    'train.checkpoint_every': 0,
}


def lm_command(workdir, num_steps: int, data: str) -> list[str]:
  flags = dict(TINY_LM, **{'train.num_steps': num_steps})
  return [
      sys.executable, '-m', 'experiments.lm', '--config=experiments/configs/shakespeare_char.py',
      f'--config.data.path={data}', f'--workdir={workdir}'
  ] + [f'--config.{k}={v}' for k, v in flags.items()]


def run(command: list[str], translate_cli) -> subprocess.CompletedProcess:
  env = translate_cli.env()
  for name in list(env):  # the test run's compilation cache is not shared across a job
    if name.startswith('JAX_COMPILATION_CACHE') or name.startswith('JAX_PERSISTENT_CACHE'):
      del env[name]
  proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=600, check=False)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
  return proc


def train_losses(workdir) -> dict[int, float]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  return {r['step']: r['train/loss'] for r in records if 'train/loss' in r}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_train_checkpoint_and_resume_like_one(translate_cli, corpus, tmp_path):
  launcher = os.path.join(REPO_ROOT, 'launch', 'local_multiprocess.sh')
  two, one = tmp_path / 'two', tmp_path / 'one'
  data = str(corpus('tinyshakespeare') / 'input.txt')
  proc = run(['bash', launcher, '2'] + lm_command(two, 3, data), translate_cli)
  assert '[0] ' in proc.stdout and '[1] ' in proc.stdout
  assert 'process 1 of 2' in proc.stdout  # both really joined one job
  # Both processes wrote their shards of the step-3 checkpoint.
  state_dir = two / 'checkpoints' / '3' / 'state'
  assert sorted(p for p in os.listdir(state_dir) if p.startswith('ocdbt.process_')) == [
      'ocdbt.process_0', 'ocdbt.process_1'
  ]
  # Both restore it and train one more step.
  run(['bash', launcher, '2'] + lm_command(two, 4, data), translate_cli)
  run(lm_command(one, 4, data), translate_cli)
  multi, single = train_losses(two), train_losses(one)
  assert sorted(multi) == sorted(single) == [1, 2, 3, 4]
  np.testing.assert_allclose([multi[s] for s in range(1, 5)], [single[s] for s in range(1, 5)],
                             rtol=1e-5)
  assert single[4] < single[1]  # it does train


def test_single_process_needs_no_distributed_setup(monkeypatch):
  for name in ('JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID',
               'SLURM_STEP_NODELIST', 'TPU_WORKER_HOSTNAMES'):
    monkeypatch.delenv(name, raising=False)
  assert distributed.initialize(None) is False
  assert distributed.detected_cluster() is None


def test_distributed_config_errors_say_what_to_set(monkeypatch):
  import ml_collections
  monkeypatch.delenv('JAX_NUM_PROCESSES', raising=False)
  monkeypatch.delenv('JAX_PROCESS_ID', raising=False)
  monkeypatch.delenv('SLURM_STEP_NODELIST', raising=False)
  monkeypatch.delenv('TPU_WORKER_HOSTNAMES', raising=False)
  config = ml_collections.ConfigDict({'distributed': {'mode': 'sometimes'}})
  with pytest.raises(ConfigError, match='distributed.mode must be one of'):
    distributed.initialize(config)
  config = ml_collections.ConfigDict({'distributed': {'coordinator_address': '10.0.0.1:1234'}})
  with pytest.raises(ConfigError, match='num_processes'):
    distributed.initialize(config)
  monkeypatch.setenv('JAX_PROCESS_ID', 'first')
  config = ml_collections.ConfigDict(
      {'distributed': {'coordinator_address': '10.0.0.1:1234', 'num_processes': 2}})
  with pytest.raises(ConfigError, match='JAX_PROCESS_ID'):
    distributed.initialize(config)


def test_slurm_and_tpu_vm_jobs_are_detected(monkeypatch):
  monkeypatch.setenv('SLURM_STEP_NODELIST', 'node[1-2]')
  monkeypatch.setenv('SLURM_NTASKS', '2')
  assert distributed.detected_cluster() == 'slurm'
  monkeypatch.setenv('SLURM_NTASKS', '1')  # a one-task step is one process
  assert distributed.detected_cluster() is None
  monkeypatch.setenv('TPU_WORKER_ID', '0')
  monkeypatch.setenv('TPU_WORKER_HOSTNAMES', 'w0,w1,w2,w3')
  assert distributed.detected_cluster() == 'tpu_vm'


@pytest.mark.parametrize('script', ['local_multiprocess.sh', 'tpu_vm.sh', 'slurm_gpu.sbatch'])
def test_launch_scripts_parse(script):
  path = os.path.join(REPO_ROOT, 'launch', script)
  proc = subprocess.run(['bash', '-n', path], capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr
  with open(path) as f:
    text = f.read()
  assert text.startswith('#!') and 'set -euo pipefail' in text
