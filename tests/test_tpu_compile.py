"""Compiling for a TPU from a CPU host: the Pallas flash-attention kernel lowers and compiles
(Mosaic) on a v5e:2x2 topology mesh, forward and backward, inside `jax.shard_map`; 'auto'
follows the mesh's platform, not the host's; validation takes the target's device count and
platform.

The compile test needs XLA's TPU compiler (libtpu, no TPU: the `tpu_runtime` fixture) and runs
tests/tpu_compile_worker.py in a subprocess, as libtpu's settings must be made before jax starts.
"""

import itertools
import json
import os
import subprocess
import sys

import jax
import pytest

from transformer_jax import kernels
from transformer_jax.errors import ConfigError
from transformer_jax.planning import runtime

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tpu_environment(libtpu_dir: str, log_dir) -> dict[str, str]:
  """The environment of a subprocess compiling for TPU topologies on this CPU host: libtpu (in
  `libtpu_dir`, '' when installed) importable, jax's devices the CPU's, libtpu quiet and its
  logs in `log_dir`."""
  env = dict(os.environ, **runtime.QUIET_ENVIRONMENT)
  env['TPU_LOG_DIR'] = str(log_dir)
  env['TF_CPP_MIN_LOG_LEVEL'] = '2'
  env['PYTHONPATH'] = os.pathsep.join(
      filter(None, [REPO_ROOT, libtpu_dir, os.environ.get('PYTHONPATH')]))
  return env


def run_worker(env: dict[str, str], mode: str, spec: dict) -> dict[str, dict]:
  """tests/tpu_compile_worker.py's results by case name."""
  proc = subprocess.run(
      [sys.executable,
       os.path.join('tests', 'tpu_compile_worker.py'), mode,
       json.dumps(spec)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{')]
  return {r['name']: r for r in results}


MESHES = {'data4': {'data': 4}, 'data2_tensor2': {'data': 2, 'tensor': 2}}
KINDS = ('causal', 'key_padding', 'cross', 'packed')
KINDS_CAUSAL = {'causal': True, 'key_padding': False, 'cross': False, 'packed': True, 'layer': True}


@pytest.mark.slow
def test_pallas_attention_compiles_for_a_tpu_topology_inside_shard_map(tpu_runtime, tmp_path):
  """GPT (causal), BERT (key padding: segment ids), cross-attention and packed rows (the
  examples' segment ids), named 'pallas' or picked
  by 'auto', compile for a v5e:2x2 mesh split over data or data x tensor: one Mosaic call
  forward, three (forward, dq, dkv) for the gradient; each inside a shard_map, without which
  lowering fails. So does a grouped-query attention layer under 'auto', which passes the split of
  its logical-axis rules down to the kernel."""
  grid = itertools.product(MESHES, KINDS, ('pallas', 'auto'), (False, True))
  cases = [{
      'name': f'{mesh}/{kind}/{implementation}/{"grad" if grad else "forward"}',
      'mesh': MESHES[mesh], 'kind': kind, 'implementation': implementation, 'grad': grad
  } for mesh, kind, implementation, grad in grid]
  cases += [{
      'name': f'layer/{"grad" if grad else "forward"}', 'mesh': MESHES['data2_tensor2'],
      'kind': 'layer', 'implementation': 'auto', 'grad': grad
  } for grad in (False, True)]
  env = tpu_environment(tpu_runtime, tmp_path)
  results = run_worker(env, 'tpu', {'topology': 'v5e:2x2', 'cases': cases})
  host = results.pop('host')
  assert host['backend'] == 'cpu' and host['auto'] == host['auto_host_mesh'] == 'chunked'
  assert sorted(results) == sorted(case['name'] for case in cases)
  for case in cases:
    result = results[case['name']]
    assert result['platform'] == 'tpu' and result['auto'] == 'pallas', result
    # 'auto' keeps bidirectional attention on the chunked path (auto_implementation)
    if case['implementation'] == 'auto' and not KINDS_CAUSAL[case['kind']]:
      assert result['mosaic_calls'] == 0, result
      continue
    assert result['shard_map'], result
    assert result['mosaic_calls'] == (3 if case['grad'] else 1), result


def test_auto_follows_the_platform_of_the_active_mesh():
  """'auto' picks by the platform being compiled for: the mesh's devices' when a mesh is set
  (here an abstract TPU mesh, as a topology gives), else jax's backend (this CPU)."""
  assert kernels.auto_implementation() == 'chunked'
  tpu = jax.sharding.AbstractDevice(device_kind='TPU v5 lite', num_cores=None, platform='tpu')
  mesh = jax.sharding.AbstractMesh((2, 2), ('data', 'tensor'), abstract_device=tpu)
  with jax.sharding.use_abstract_mesh(mesh):
    assert kernels.auto_implementation() == 'pallas'
    assert kernels.auto_implementation(causal=False) == 'chunked'
    assert kernels.auto_implementation(dropout=True) == 'chunked'
  host = jax.sharding.Mesh(jax.devices()[:1], ('data',))
  with jax.set_mesh(host):
    assert kernels.auto_implementation() == 'chunked'


def test_validation_checks_a_config_against_a_target_not_the_host(tiny_config):
  """A planner on a CPU host validates a Pallas run for 4 TPU devices; by default the host's one
  CPU device still decides."""
  from transformer_jax.cli import validation
  config = tiny_config()  # mesh data=-1: all the devices
  config.model.attention_implementation = 'pallas'
  assert validation.attention_kernel_unavailable(config, platform='tpu') is None
  validation.check_training(config, 8, num_devices=4, platform='tpu')
  with pytest.raises(ConfigError, match=r'data-parallel size 4 .* over 4 devices'):
    validation.check_training(config, 6, num_devices=4, platform='tpu')
  with pytest.raises(ConfigError, match='runs on TPU only, and this run is on GPU'):
    validation.check_training(config, 8, num_devices=4, platform='gpu')
  assert 'this run is on CPU' in validation.attention_kernel_unavailable(config)
  with pytest.raises(ConfigError, match='runs on TPU only, and this run is on CPU'):
    validation.check_training(config, 6)  # the host: 1 device divides any batch
