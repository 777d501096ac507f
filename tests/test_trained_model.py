"""training/trained_model.restore: inference reads a checkpoint's params alone, without building
an optimizer or writing to the workdir, and places them on the mesh as the trainer does.

The multi-device case runs in a subprocess (tests/restore_worker.py) started with
XLA_FLAGS=--xla_force_host_platform_device_count=4: the device count is fixed at jax start-up.
"""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from transformer_jax import xla_options
from transformer_jax.errors import ConfigError
from transformer_jax.models.gpt import gpt2_config
from transformer_jax.tasks.lm import LanguageModelTask
from transformer_jax.training import checkpointing, trained_model

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _task(emb_dim: int = 16) -> LanguageModelTask:
  return LanguageModelTask(
      gpt2_config(vocab_size=32, emb_dim=emb_dim, num_heads=2, mlp_dim=32, num_decoder_layers=1,
                  max_len=8))


def _files(directory) -> dict:
  return {
      os.path.join(path, name): os.path.getmtime(os.path.join(path, name))
      for path, _, names in os.walk(directory) for name in names
  }


def test_restore_reads_params_without_optimizer_state_and_writes_nothing(tmp_path):
  """A checkpoint whose state has no optimizer item restores (the params alone are read);
  another model's shapes and a workdir without checkpoints are one ConfigError each."""
  task = _task()
  params = jax.device_get(nn.meta.unbox(task.init_variables(jax.random.key(1))['params']))
  writer = checkpointing.Checkpointer(str(tmp_path / 'checkpoints'), save_every=1)
  writer.maybe_save(5, {'step': jnp.int32(5), 'params': jax.tree.map(jnp.asarray, params)}, {})
  writer.close()
  before = _files(tmp_path)
  config = ml_collections.ConfigDict({'mesh': {'data': 1}})

  model = trained_model.restore(config, task, str(tmp_path), tokenizer='the tokenizer')
  assert model.task is task and model.tokenizer == 'the tokenizer'
  assert dict(model.mesh.shape) == {'data': 1, 'fsdp': 1, 'tensor': 1}
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(model.params), params)
  assert _files(tmp_path) == before

  with pytest.raises(
      ConfigError, match=r'does not fit the model of this config: params\.\S+ has '
      r'shape \(\d+, 16\) in the checkpoint but \(\d+, 24\) in the config'):
    trained_model.restore(config, _task(emb_dim=24), str(tmp_path))
  with pytest.raises(ConfigError, match='no checkpoint in .*/empty/checkpoints: train first'):
    trained_model.restore(config, task, str(tmp_path / 'empty'))
  assert not (tmp_path / 'empty').exists() and _files(tmp_path) == before


@pytest.mark.slow
def test_restore_places_params_as_the_trainer_on_four_devices(tmp_path):
  """On a 2 x 2 (fsdp x tensor) mesh of four CPU devices: the params come back bitwise, each
  with the sharding the trainer's state gives it, some really split, with no optimizer or
  Trainer built (the worker makes both raise) and nothing written."""
  env = xla_options.host_devices_env(4)
  spec = {'workdir': str(tmp_path), 'mesh': {'data': 1, 'fsdp': 2, 'tensor': 2}}
  proc = subprocess.run(
      [sys.executable, os.path.join('tests', 'restore_worker.py'),
       json.dumps(spec)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads([line for line in proc.stdout.splitlines() if line.startswith('{')][-1])
  assert result['devices'] == 4 and result['mesh'] == spec['mesh']
  assert result['bitwise'] and not result['wrote']
  assert all(leaf['as_trainer'] for leaf in result['leaves']), result['leaves']
  split = [leaf['name'] for leaf in result['leaves'] if leaf['shard'] != leaf['global']]
  assert any('token_embed' in name for name in split), split
  assert any('mlp' in name for name in split), split
