"""Trains a tiny model for a few steps on several device meshes; run as a subprocess.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/mesh_worker.py SPEC_JSON

The device count is fixed when jax starts, so multi-device tests run this in a fresh process.
SPEC: {"family": "translation"|"lm"|"bert", "steps": 3, "workdir": DIR, "runs": [{"name": ...,
"mesh": {"data": 8} or null (= one device), "model": {overrides}, "train": {overrides}}]}.
Prints one JSON line per run: the logged train loss and gradient norm of every step, and the
bytes of params and optimizer state held by each device (with a few shard shapes).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import ml_collections
import numpy as np

from experiments.configs.common import base_config
from transformer_jax.parallel import sharding
from transformer_jax.training.trainer import Trainer

VOCAB, ROWS = 64, 16
TINY = dict(vocab_size=VOCAB, emb_dim=32, num_heads=4, mlp_dim=64, max_len=32, dropout_rate=0.1,
            attention_dropout_rate=0.1)


def make_task(family: str, model_overrides: dict):
  """(task, batch function step -> host batch) for a tiny model of `family`."""
  rng = np.random.RandomState(0)
  if family == 'translation':
    from transformer_jax.model_config import TransformerConfig
    from transformer_jax.tasks.translation import TranslationTask
    cfg = TransformerConfig(
        **dict(TINY, num_encoder_layers=1, num_decoder_layers=1, **model_overrides))
    task = TranslationTask(cfg, label_smoothing=0.1)

    def batch(step):  # right-padded rows of varying length, as the bucketed batcher makes
      r = np.random.RandomState(step)
      inputs = r.randint(3, VOCAB, (ROWS, 12)).astype(np.int32)
      targets = r.randint(3, VOCAB, (ROWS, 10)).astype(np.int32)
      for row in range(ROWS):
        inputs[row, r.randint(4, 13):] = 0
        targets[row, r.randint(3, 11):] = 0
      return {'inputs': inputs, 'targets': targets}

    return task, batch
  if family == 'lm':
    from transformer_jax.models.gpt import gpt2_config
    from transformer_jax.tasks.lm import LanguageModelTask
    cfg = gpt2_config(**dict(dict(TINY, num_decoder_layers=1), **model_overrides))
    task = LanguageModelTask(cfg)
    stream = rng.randint(0, VOCAB, 4096).astype(np.int32)

    def batch(step):
      starts = np.random.RandomState(step).randint(0, len(stream) - 17, ROWS)
      windows = np.stack([stream[s:s + 17] for s in starts])
      return {'inputs': windows[:, :-1], 'targets': windows[:, 1:]}

    return task, batch
  if family == 'bert':
    from transformer_jax.models.bert import bert_config
    from transformer_jax.tasks.bert import BertPretrainTask
    cfg = bert_config(**dict(TINY, num_encoder_layers=1, **model_overrides))
    task = BertPretrainTask(cfg, sentence_task='nsp')

    def batch(step):  # masked-LM + NSP rows, right-padded, 1-4 real predictions per row
      r = np.random.RandomState(step)
      inputs = r.randint(5, VOCAB, (ROWS, 16)).astype(np.int32)
      segments = np.zeros((ROWS, 16), np.int32)
      positions = np.zeros((ROWS, 4), np.int32)
      weights = np.zeros((ROWS, 4), np.float32)
      for row in range(ROWS):
        length = r.randint(8, 17)
        inputs[row, length:] = 0
        segments[row, length // 2:length] = 1
        count = r.randint(1, 5)
        positions[row, :count] = r.choice(np.arange(1, length), count, replace=False)
        weights[row, :count] = 1.0
      ids = np.take_along_axis(inputs, positions, axis=1) * (weights > 0)
      masked = inputs.copy()
      np.put_along_axis(masked, positions, np.where(weights > 0, 4, inputs[:, :1]), axis=1)
      return {
          'inputs': masked, 'segments': segments, 'mlm_positions': positions,
          'mlm_ids': ids.astype(np.int32), 'mlm_weights': weights,
          'sentence_labels': r.randint(0, 2, ROWS).astype(np.int32)
      }

    return task, batch
  raise ValueError(family)


class FixedBatches:
  """The training-data protocol of `Trainer.fit` over batch(step) for step = 0, 1, ..."""

  def __init__(self, batch_fn):
    self.batch_fn, self.step = batch_fn, 0

  def __iter__(self):
    while True:
      yield self.batch_fn(self.step)
      self.step += 1

  def state(self):
    return {'step': self.step}


def make_config(mesh: dict | None, steps: int, train_overrides: dict):
  config = base_config()
  config.mesh = ml_collections.ConfigDict(mesh or {'data': 1})
  config.train.num_steps = steps
  config.train.log_every = 1
  config.train.eval_every = 0
  config.train.checkpoint_every = 0
  config.optimizer.schedule = 'constant'
  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_steps = 0
  config.optimizer.weight_decay = 0.01
  for key, value in train_overrides.items():
    config.train[key] = value
  return config


def run(family: str, spec: dict, steps: int, workdir: str) -> dict:
  task, batch_fn = make_task(family, spec.get('model', {}))
  mesh_config = spec.get('mesh')
  devices = jax.devices() if mesh_config else jax.devices()[:1]
  config = make_config(mesh_config, steps, spec.get('train', {}))
  mesh = sharding.make_mesh(config.mesh, devices)
  trainer = Trainer(config, task, workdir, mesh=mesh)
  # Sharded checkpoints are tested elsewhere (test_trainer, test_multihost); here they would
  # only add seconds per mesh.
  trainer.checkpointer.maybe_save = lambda *args, **kwargs: False
  trainer.fit(FixedBatches(batch_fn))
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f if 'train/loss' in line]
  state = trainer.state
  params_bytes = sharding.bytes_per_device(state.params)
  opt_bytes = sharding.bytes_per_device(state.opt_state)
  shapes = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
    name = '/'.join(str(getattr(k, 'key', k)) for k in path)
    shapes[name] = {
        'global': list(leaf.shape), 'shard': list(leaf.addressable_shards[0].data.shape)
    }
  trainer.close()
  return {
      'name': spec['name'], 'mesh': dict(mesh.shape), 'devices': len(devices),
      'loss': [r['train/loss'] for r in records],
      'grad_norm': [r['train/grad_norm'] for r in records],
      'param_bytes': max(params_bytes.values()), 'opt_bytes': max(opt_bytes.values()),
      'total_param_bytes': sum(x.nbytes for x in jax.tree.leaves(state.params)), 'shapes': shapes
  }


def main():
  spec = json.loads(sys.argv[1])
  for i, run_spec in enumerate(spec['runs']):
    workdir = os.path.join(spec['workdir'], f'{i}_{run_spec["name"]}')
    result = run(spec['family'], run_spec, int(spec.get('steps', 3)), workdir)
    print(json.dumps(result), flush=True)


if __name__ == '__main__':
  main()
