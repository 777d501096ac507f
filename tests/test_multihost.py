"""Two processes on localhost (jax.distributed over CPU collectives) train like one process.

`launch/local_multiprocess.sh 2 python -m experiments.lm ...` runs the real experiment as two
processes, each with one CPU device and its own half of every batch; together they write one
orbax checkpoint, and restore it to continue. The logged losses must match a single process.
A run checkpointed by two processes resumes in one and back in two (elastic resume) on the same
global batches as an uninterrupted run.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import resume
from transformer_jax import xla_options
from transformer_jax.parallel import distributed
from transformer_jax.errors import ConfigError
from transformer_jax.training import batch_record

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
# The quickstart shrunk as in benchmarks/resume.py, packed. Packed rows are rounded to the first
# layout's data-parallel ways, which elastic resume must keep: 480 tokens make 15 rows of 32, 14
# on 2 devices, so a resume on 1 device that rounded again would differ.
TINY_TRANSLATE = dict(resume.TRANSLATE_FLAGS, **resume.elastic_flags('translate'))
# Elastic chains: a digest of every global batch, a checkpoint where the layout changes, a loss
# per step.
ELASTIC = {'train.record_batches': True, 'train.checkpoint_every': 2, 'train.log_every': 1}


def cli_command(module: str, config: str, workdir, flags: dict) -> list[str]:
  return [sys.executable, '-m', module, f'--config={config}', f'--workdir={workdir}'
         ] + [f'--config.{k}={v}' for k, v in flags.items()]


def lm_command(workdir, num_steps: int, data: str, extra: dict | None = None) -> list[str]:
  flags = dict(TINY_LM, **{'data.path': data, 'train.num_steps': num_steps}, **(extra or {}))
  return cli_command('experiments.lm', 'experiments/configs/shakespeare_char.py', workdir, flags)


def translate_command(workdir, num_steps: int, extra: dict | None = None) -> list[str]:
  flags = dict(TINY_TRANSLATE, **{'train.num_steps': num_steps}, **(extra or {}))
  return cli_command('experiments.translate', 'experiments/configs/translate_quickstart.py',
                     workdir, flags)


def run(command: list[str], translate_cli,
        devices: int | None = None) -> subprocess.CompletedProcess:
  """Runs `command` to success; `devices`: CPU devices per process (default: the env's)."""
  env = translate_cli.env()
  for name in list(env):  # the test run's compilation cache is not shared across a job
    if name.startswith('JAX_COMPILATION_CACHE') or name.startswith('JAX_PERSISTENT_CACHE'):
      del env[name]
  if devices is not None:
    env = xla_options.host_devices_env(devices, env)
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


def provenance_layouts(workdir) -> list[tuple]:
  """(start step, layout, resumed_from) of each start; a layout as (devices, processes, batch
  multiple), or None."""

  def brief(layout):
    return None if layout is None else (layout['devices'], layout['processes'],
                                        layout['batch_multiple'])

  with open(os.path.join(workdir, 'provenance.jsonl')) as f:
    records = [json.loads(line) for line in f]
  return [(r['start_step'], brief(r['layout']), brief(r['resumed_from'])) for r in records]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize('family', ['lm', 'translate'])
def test_two_processes_resume_in_one_and_back_on_the_same_batches(family, translate_cli, request,
                                                                  tmp_path):
  # Only the GPT needs a corpus (the translation quickstart generates its data).
  data = request.getfixturevalue('tiny_shakespeare') if family == 'lm' else None

  def command(workdir, num_steps: int) -> list[str]:
    if family == 'lm':
      return lm_command(workdir, num_steps, data, ELASTIC)
    return translate_command(workdir, num_steps, ELASTIC)

  launcher = os.path.join(REPO_ROOT, 'launch', 'local_multiprocess.sh')
  chain, reference = tmp_path / 'chain', tmp_path / 'reference'
  # One workdir: steps 1-2 in 2 processes, 3-4 in 1 process, 5-6 in 2 processes again; each
  # process has one CPU device.
  run(['bash', launcher, '2'] + command(chain, 2), translate_cli, devices=1)
  run(command(chain, 4), translate_cli, devices=1)
  run(['bash', launcher, '2'] + command(chain, 6), translate_cli, devices=1)
  # Uninterrupted, on as many data-parallel devices as the chain's first run (which fixes how
  # translation batches are rounded).
  run(command(reference, 6), translate_cli, devices=2)

  # Each start resumed the previous one's last checkpoint and kept its batch multiple.
  assert provenance_layouts(chain) == [(0, (2, 2, 2), None), (2, (1, 1, 2), (2, 2, 2)),
                                       (4, (2, 2, 2), (1, 1, 2))]
  assert provenance_layouts(reference) == [(0, (2, 1, 2), None)]
  chain_batches, reference_batches = batch_record.read(chain), batch_record.read(reference)
  assert sorted(chain_batches) == list(range(1, 7))
  assert len(set(chain_batches.values())) == 6  # six different batches, not one repeated
  assert chain_batches == reference_batches
  resumed, single = train_losses(chain), train_losses(reference)
  assert sorted(resumed) == sorted(single) == list(range(1, 7))
  got, want = [resumed[s] for s in range(1, 7)], [single[s] for s in range(1, 7)]
  print(f'{family}: largest relative loss difference '
        f'{np.max(np.abs(np.subtract(got, want)) / np.abs(want)):.3g}')
  np.testing.assert_allclose(got, want, rtol=1e-5)


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
