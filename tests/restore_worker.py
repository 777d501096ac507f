"""Restores a tiny GPT's params for inference on a simulated mesh; run as a subprocess.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/restore_worker.py SPEC_JSON

The device count is fixed when jax starts, so the test (tests/test_trained_model.py) runs this in a
fresh process. SPEC: {"workdir": DIR, "mesh": {"fsdp": 2, "tensor": 2}}. The checkpoint it writes
holds the params and a step but no optimizer state, and no optimizer may be built while restoring.
Prints one JSON line: the devices, whether the params came back bitwise, and per parameter its
sharding against the one the trainer gives it and its global and shard shapes.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from transformer_jax.models.gpt import gpt2_config
from transformer_jax.tasks.lm import LanguageModelTask
from transformer_jax.training import checkpointing, optimizer, trained_model, trainer, train_step


def refuse(*args, **kwargs):
  raise AssertionError('inference built part of training')


def main():
  spec = json.loads(sys.argv[1])
  workdir = spec['workdir']
  task = LanguageModelTask(
      gpt2_config(vocab_size=64, emb_dim=32, num_heads=4, mlp_dim=64, num_decoder_layers=2,
                  max_len=16, scan_layers=True))
  params = jax.device_get(nn.meta.unbox(task.init_variables(jax.random.key(3))['params']))
  writer = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'), save_every=1)
  state = {'step': jnp.int32(7), 'params': jax.tree.map(jnp.asarray, params)}  # no opt_state
  writer.maybe_save(7, state, {})
  writer.close()
  before = sorted((path, os.path.getmtime(os.path.join(path, name)))
                  for path, _, names in os.walk(workdir)
                  for name in names)

  optimizer.make_optimizer = trainer.make_optimizer = refuse
  trainer.Trainer.__init__ = refuse
  config = ml_collections.ConfigDict({'mesh': spec['mesh']})
  model = trained_model.restore(config, task, workdir)
  after = sorted((path, os.path.getmtime(os.path.join(path, name)))
                 for path, _, names in os.walk(workdir)
                 for name in names)

  # The shardings the trainer gives the params (built here, after the restore, with any optax).
  expected = train_step.build_train_step(task, optax.sgd(0.1), model.mesh,
                                         seed=0).abstract_state.params
  leaves = []
  for (path, leaf), want in zip(
      jax.tree_util.tree_flatten_with_path(model.params)[0], jax.tree.leaves(expected)):
    leaves.append({
        'name': jax.tree_util.keystr(path), 'as_trainer': leaf.sharding == want.sharding,
        'global': list(leaf.shape), 'shard': list(leaf.addressable_shards[0].data.shape)
    })
  same = jax.tree.all(
      jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), b)), model.params, params))
  print(
      json.dumps({
          'devices': jax.device_count(), 'mesh': dict(model.mesh.shape), 'bitwise': same,
          'wrote': before != after, 'leaves': leaves
      }))


if __name__ == '__main__':
  main()
