r"""XLA:CPU's bf16 dot paths: how fast each runs the matmuls of a training step, and whether the
oneDNN one computes a model's gradient correctly. Decides the CPU precision policy
(transformer_jax/precision.py); rerun it on a new jaxlib.

  python benchmarks/cpu_bf16_paths.py          # ~1 min on 2 cores

Per orientation of a GPT step's matmuls (tokens 4096, width 384, hidden 1536): forward x @ w,
input gradient g @ w^T, weight gradient x^T @ g, in GFLOP/s (best of 5 after a warm-up), for
float32, bf16 on XLA's default path (YNNPACK) and bf16 through the oneDNN dot fusion
(`xla_cpu_use_onednn` + `xla_cpu_experimental_onednn_fusion_type`). Then the relative error
(median and worst over the parameters) of a tiny 2-layer GPT's float32 gradient compiled with
the oneDNN options against XLA's defaults: 0 means the path is safe to use.

Last line of output: one JSON object.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import machine  # noqa: E402
from transformer_jax import xla_options  # noqa: E402

ONEDNN = xla_options.compiler_options(
    xla_cpu_use_onednn=True, xla_cpu_experimental_onednn_fusion_type='LIBRARY_FUSION_TYPE_DOT')
TOKENS, WIDTH, HIDDEN = 4096, 384, 1536


def _rate(fn, *args) -> float:
  fn(*args).block_until_ready()
  best = float('inf')
  for _ in range(5):
    start = time.perf_counter()
    fn(*args).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2.0 * TOKENS * WIDTH * HIDDEN / best / 1e9


def dot_rates() -> dict:
  import jax
  import jax.numpy as jnp
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (TOKENS, WIDTH))
  w = jax.random.normal(keys[1], (WIDTH, HIDDEN))
  g = jax.random.normal(keys[2], (TOKENS, HIDDEN))
  products = {
      'forward x@w': (lambda x, w, g: x @ w),
      'input grad g@w^T': (lambda x, w, g: g @ w.T),
      'weight grad x^T@g': (lambda x, w, g: x.T @ g),
  }
  rates = {}
  for name, product in products.items():
    for label, dtype, options in (('float32', jnp.float32, None), ('bf16 default', jnp.bfloat16,
                                                                   None), ('bf16 onednn',
                                                                           jnp.bfloat16, ONEDNN)):
      args = [a.astype(dtype) for a in (x, w, g)]
      rates[f'{name} {label}'] = round(_rate(jax.jit(product, compiler_options=options), *args))
  return rates


def onednn_gradient_error() -> dict:
  import jax
  import numpy as np
  from transformer_jax.models.gpt import gpt2_config
  from transformer_jax.tasks.lm import LanguageModelTask
  task = LanguageModelTask(
      gpt2_config(vocab_size=64, emb_dim=32, num_heads=4, mlp_dim=64, num_decoder_layers=2,
                  max_len=16, dropout_rate=0.0, attention_dropout_rate=0.0))
  params = jax.tree.map(lambda box: getattr(box, 'value', box),
                        task.init_variables(jax.random.key(0))['params'],
                        is_leaf=lambda x: hasattr(x, 'value'))
  tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 64)
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}
  grad = jax.grad(lambda p, b: task.loss_fn(p, b, None, True)[0])
  onednn, default = (jax.jit(grad, compiler_options=o)(params, batch) for o in (ONEDNN, None))
  errors = [
      float(np.linalg.norm(a - b) / np.linalg.norm(b))
      for (path, b), a in zip(jax.tree_util.tree_leaves_with_path(default), jax.tree.leaves(onednn))
      if not ('key' in jax.tree_util.keystr(path) and 'bias' in jax.tree_util.keystr(path))
  ]  # a key bias's gradient is rounding only (softmax ignores a shift of all scores)
  return {'median': float(np.median(errors)), 'worst': float(max(errors))}


def main():
  import jax
  rates = dot_rates()
  for name, rate in rates.items():
    print(f'{name:36s} {rate:6,d} GFLOP/s')
  error = onednn_gradient_error()
  print(f'tiny GPT float32 gradient, oneDNN dot fusion vs XLA defaults: relative error median '
        f'{error["median"]:.4f}, worst {error["worst"]:.4f}')
  print(
      json.dumps({
          'benchmark': 'cpu_bf16_paths', **machine.description(), 'jax': jax.__version__,
          'gflops': rates, 'onednn_gradient_relative_error': error
      }))


if __name__ == '__main__':
  main()
