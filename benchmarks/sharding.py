r"""Per-device memory of params + optimizer state, and step time, for each mesh layout.

    python benchmarks/sharding.py [--steps=5] [--layers=4] [--width=256]

Runs on 8 simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8 is set
here, before jax starts) with a GPT of the given size, and for each layout prints the bytes of
params and of AdamW state held by the fullest device, and the median step time. On one CPU
the 8 "devices" share the same cores, so the times show the cost of the extra collectives,
not a speed-up; the bytes are what carries over to real accelerators. Last line: JSON.
"""

import os
import sys

if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from transformer_jax import xla_options  # imports no jax
  xla_options.add_flags(xla_force_host_platform_device_count=8)
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import json
import statistics
import tempfile
import time

import jax
import ml_collections
import numpy as np
from absl import app, flags

from experiments.configs.common import base_config
from transformer_jax.parallel import sharding
from transformer_jax.models.gpt import gpt2_config
from transformer_jax.tasks.lm import LanguageModelTask
from transformer_jax.training.trainer import Trainer

_STEPS = flags.DEFINE_integer('steps', 5, 'Timed steps per layout (after one compile step).')
_LAYERS = flags.DEFINE_integer('layers', 4, 'GPT layers.')
_WIDTH = flags.DEFINE_integer('width', 256, 'Model width (8 heads, MLP 4x).')
_BATCH = flags.DEFINE_integer('batch', 16, 'Global batch (rows of 128 tokens).')

LAYOUTS = {
    'data=8': {'data': 8, 'fsdp': 1, 'tensor': 1},
    'fsdp=8': {'data': 1, 'fsdp': 8, 'tensor': 1},
    'tensor=8': {'data': 1, 'fsdp': 1, 'tensor': 8},
    'data=2 x fsdp=2 x tensor=2': {'data': 2, 'fsdp': 2, 'tensor': 2},
    'fsdp=4 x tensor=2': {'data': 1, 'fsdp': 4, 'tensor': 2},
}
BLOCK, VOCAB = 128, 4096


def measure(name: str, mesh_config: dict, task, batch, workdir: str) -> dict:
  config = base_config()
  config.mesh = ml_collections.ConfigDict(mesh_config)
  config.train.num_steps, config.train.log_every = 1, 1
  config.train.checkpoint_every = 0
  trainer = Trainer(config, task, workdir)
  state = trainer.init_state()
  params = max(sharding.bytes_per_device(state.params).values())
  optimizer = max(sharding.bytes_per_device(state.opt_state).values())
  times = []
  with sharding.use_mesh(trainer.mesh, trainer.rules):
    for _ in range(_STEPS.value + 1):
      start = time.perf_counter()
      # The trainer's own jitted step (what fit runs), without fit's logging around it.
      step_fn = trainer._train_step
      state, metrics = step_fn(state, trainer.to_global(batch))
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - start)
  trainer.close()
  result = {
      'layout': name, 'mesh': mesh_config, 'param_bytes_per_device': params,
      'optimizer_bytes_per_device': optimizer, 'total_bytes_per_device': params + optimizer,
      'first_step_s': round(times[0], 3), 'step_ms': round(statistics.median(times[1:]) * 1e3,
                                                           1), 'loss': float(metrics['loss_mean'])
  }
  print(
      f'{name:28s} params {params / 2**20:7.2f} MiB + optimizer {optimizer / 2**20:7.2f} MiB '
      f'per device | first step {times[0]:6.1f} s | step {result["step_ms"]:8.1f} ms | '
      f'loss {result["loss"]:.4f}', flush=True)
  return result


def main(argv):
  del argv
  assert jax.device_count() == 8, jax.devices()
  cfg = gpt2_config(vocab_size=VOCAB, emb_dim=_WIDTH.value, num_heads=8, mlp_dim=4 * _WIDTH.value,
                    num_decoder_layers=_LAYERS.value, max_len=BLOCK, dropout_rate=0.0,
                    attention_dropout_rate=0.0)
  task = LanguageModelTask(cfg)
  tokens = np.random.RandomState(0).randint(0, VOCAB, (_BATCH.value, BLOCK + 1)).astype(np.int32)
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}
  print(
      f'GPT {_LAYERS.value} layers x {_WIDTH.value} wide, vocab {VOCAB}, batch '
      f'{_BATCH.value} x {BLOCK}; {jax.device_count()} simulated CPU devices', flush=True)
  results = []
  with tempfile.TemporaryDirectory() as workdir:
    for i, (name, mesh_config) in enumerate(LAYOUTS.items()):
      results.append(measure(name, mesh_config, task, batch, os.path.join(workdir, str(i))))
  total = sum(
      int(np.prod(x.shape)) * x.dtype.itemsize
      for x in jax.tree.leaves(jax.eval_shape(lambda: task.init_variables(jax.random.key(0)))))
  by_name = {r['layout']: r for r in results}
  summary = {
      'model': {
          'layers': _LAYERS.value, 'width': _WIDTH.value, 'vocab': VOCAB, 'param_bytes': int(total)
      },
      'layouts':
          results,
      'fsdp8_over_data8_bytes':
          round(
              by_name['fsdp=8']['total_bytes_per_device'] /
              by_name['data=8']['total_bytes_per_device'], 4),
  }
  print(json.dumps(summary))


if __name__ == '__main__':
  app.run(main)
