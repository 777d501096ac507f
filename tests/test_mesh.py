"""The same training on 1 device and on 8 simulated devices split three ways gives the same
numbers (encoder-decoder, GPT, BERT), fully-sharded meshes really split params and
optimizer state, and XLA never has to replicate a whole array to reshard it.

Each model family runs in one subprocess (tests/mesh_worker.py) started with
XLA_FLAGS=--xla_force_host_platform_device_count=8: the device count is fixed at jax start-up.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from transformer_jax import xla_options

pytestmark = pytest.mark.slow

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MESHES = {
    'data8': {'data': 8, 'fsdp': 1, 'tensor': 1},
    'fsdp8': {'data': 1, 'fsdp': 8, 'tensor': 1},
    'data2_fsdp2_tensor2': {'data': 2, 'fsdp': 2, 'tensor': 2},
}


def run_worker(translate_cli, workdir, family: str, runs: list[dict], steps: int = 3,
               devices: int = 8) -> dict[str, dict]:
  env = xla_options.host_devices_env(devices, translate_cli.env())  # keeps conftest's flags
  env['TF_CPP_MIN_LOG_LEVEL'] = '1'  # XLA's warnings too, for the check below
  spec = {'family': family, 'steps': steps, 'workdir': str(workdir), 'runs': runs}
  proc = subprocess.run(
      [sys.executable, os.path.join('tests', 'mesh_worker.py'),
       json.dumps(spec)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  # XLA's partitioner warns when it can only reshard an array by replicating it whole on every
  # device (e.g. a lookup from an fsdp-split table, whose split lands on the features).
  replicated = [
      line[:600]
      for line in proc.stderr.splitlines()
      if 'Involuntary full rematerialization' in line
  ]
  assert not replicated, '\n'.join(replicated)
  results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{')]
  assert [r['name'] for r in results] == [r['name'] for r in runs]
  return {r['name']: r for r in results}


def find_shape(result: dict, suffix: str) -> dict:
  matches = [v for k, v in result['shapes'].items() if k.endswith(suffix)]
  assert matches, (suffix, sorted(result['shapes']))
  return matches[0]


EFFICIENT = {
    'model': {'scan_layers': True, 'remat_policy': 'dots_saveable', 'num_decoder_layers': 2},
    'train': {'accumulation_steps': 2}
}
MESH_RUNS = [{'name': 'one'}] + [{'name': name, 'mesh': mesh} for name, mesh in MESHES.items()]


@pytest.fixture(scope='module')
def lm_results(translate_cli, tmp_path_factory):
  """One subprocess for every GPT run (start-up and compilation are most of the time)."""
  runs = MESH_RUNS + [
      dict(EFFICIENT, name='efficient_one'),
      dict(EFFICIENT, name='efficient_fsdp4_tensor2', mesh={'data': 1, 'fsdp': 4, 'tensor': 2})
  ]
  return run_worker(translate_cli, tmp_path_factory.mktemp('lm_mesh'), 'lm', runs)


@pytest.fixture(scope='module')
def translation_results(translate_cli, tmp_path_factory):
  return run_worker(translate_cli, tmp_path_factory.mktemp('translation_mesh'), 'translation',
                    MESH_RUNS)


@pytest.fixture(scope='module')
def bert_results(translate_cli, tmp_path_factory):
  return run_worker(translate_cli, tmp_path_factory.mktemp('bert_mesh'), 'bert', MESH_RUNS)


def check_meshes_match_one_device_and_split_state(results: dict, mlp_kernel: str):
  one = results['one']
  assert one['devices'] == 1 and len(one['loss']) == 3
  assert np.all(np.isfinite(one['loss'])) and one['loss'][-1] != one['loss'][0]
  for name in MESHES:
    r = results[name]
    assert r['devices'] == 8
    np.testing.assert_allclose(r['loss'], one['loss'], rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(r['grad_norm'], one['grad_norm'], rtol=1e-5, err_msg=name)

  # data=8 replicates: every device holds everything (params, and Adam's mu and nu).
  total = one['total_param_bytes']
  data8, fsdp8, mixed = results['data8'], results['fsdp8'], results['data2_fsdp2_tensor2']
  assert data8['param_bytes'] == total and one['param_bytes'] == total
  assert data8['opt_bytes'] >= 2 * total
  # fsdp=8 splits every 'embed' axis 8 ways; only small 1-D biases stay whole.
  for key in ('param_bytes', 'opt_bytes'):
    assert data8[key] / 8 <= fsdp8[key] < 1.25 * data8[key] / 8, (key, data8[key], fsdp8[key])
    assert data8[key] / 4 <= mixed[key] < 1.35 * data8[key] / 4, (key, data8[key], mixed[key])
  # The MLP input kernel (embed, mlp) = (32, 64): embed over fsdp, mlp over tensor.
  assert find_shape(data8, mlp_kernel) == {'global': [32, 64], 'shard': [32, 64]}
  assert find_shape(fsdp8, mlp_kernel) == {'global': [32, 64], 'shard': [4, 64]}
  assert find_shape(mixed, mlp_kernel) == {'global': [32, 64], 'shard': [16, 32]}
  # Attention heads split over tensor: query kernel (embed, heads, kv) = (32, 4, 8).
  query = mlp_kernel.replace('mlp/wi', 'self_attention/query')
  assert find_shape(mixed, query) == {'global': [32, 4, 8], 'shard': [16, 2, 8]}


def test_encoder_decoder_meshes_match_one_device_and_split_state(translation_results):
  """Loss and gradient norm of 3 steps (dropout on) equal one device's on data=8, fsdp=8 and
  data=2 x fsdp=2 x tensor=2; per-device bytes and shard shapes show the split."""
  check_meshes_match_one_device_and_split_state(translation_results,
                                                'decoder/layer_0/mlp/wi/kernel')


def test_gpt_meshes_match_one_device_and_split_state(lm_results):
  check_meshes_match_one_device_and_split_state(lm_results, 'stack/layer_0/mlp/wi/kernel')


def test_bert_meshes_match_one_device_and_split_state(bert_results):
  """Masked-LM + NSP pretraining: this caught wrong gradients on data x fsdp x tensor (fixed
  by a sharding constraint before BERT's tied output layer)."""
  check_meshes_match_one_device_and_split_state(bert_results, 'encoder/layer_0/mlp/wi/kernel')


def test_scanned_remat_accumulated_gpt_on_a_mesh_matches_one_device(lm_results):
  """scan_layers stacks layers on an unsplit leading axis and still splits 'embed' over fsdp;
  with remat and 2-micro-batch accumulation, fsdp=4 x tensor=2 matches one device."""
  one, sharded = lm_results['efficient_one'], lm_results['efficient_fsdp4_tensor2']
  np.testing.assert_allclose(sharded['loss'], one['loss'], rtol=1e-5)
  np.testing.assert_allclose(sharded['grad_norm'], one['grad_norm'], rtol=1e-5)
  kernel = find_shape(sharded, 'stack/layers/mlp/wi/kernel')
  assert kernel == {'global': [2, 32, 64], 'shard': [2, 8, 32]}
  assert not any('layer_0' in name for name in sharded['shapes'])
