r"""XLA:CPU's bf16 dot paths: how fast each runs the matmuls of a training step, and whether the
oneDNN one computes a model's gradient correctly. Decides the CPU precision policy
(transformer_jax/precision.py); rerun it on a new jaxlib.

  python benchmarks/cpu_bf16_paths.py          # ~1 min on 2 cores

Per orientation of a GPT step's matmuls (tokens 4096, width 384, hidden 1536): forward x @ w,
input gradient g @ w^T, weight gradient x^T @ g, in GFLOP/s (best of 5 after a warm-up), for
float32, bf16 on XLA's default path (YNNPACK) and bf16 through the oneDNN dot fusion
(`xla_cpu_use_onednn` + `xla_cpu_experimental_onednn_fusion_type`). Then the relative error
(median and worst over the parameters) of a tiny 2-layer GPT's gradient against XLA's float32
defaults: in float32 compiled with the oneDNN options as they are (wrong on jax 0.12.0.1: the
fusion of a dot with its bias add), and under the CPU precision policy as the trainer compiles
it (bf16 rounding only, ~1%).
Needs jaxlib >= 0.11.2 (0.10.2 dies of an illegal instruction under the oneDNN options).

Last line of output: one JSON object.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import machine  # noqa: E402
from transformer_jax import onednn_lifetime, precision, xla_options  # noqa: E402

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
      rates[f'{name} {label}'] = round(
          _rate(onednn_lifetime.jit(product, compiler_options=options), *args))
  return rates


def gradient_error(matmul_dtype, options) -> dict:
  """Relative gradient error of a tiny GPT with `matmul_dtype` compiled with `options`, against
  the float32 model with XLA's defaults."""
  import jax
  import numpy as np
  from transformer_jax.models.gpt import gpt2_config
  from transformer_jax.tasks.lm import LanguageModelTask
  tasks = [
      LanguageModelTask(
          gpt2_config(vocab_size=64, emb_dim=32, num_heads=4, mlp_dim=64, num_decoder_layers=2,
                      max_len=16, dropout_rate=0.0, attention_dropout_rate=0.0, matmul_dtype=dtype))
      for dtype in (matmul_dtype, None)
  ]
  task = tasks[1]
  params = jax.tree.map(lambda box: getattr(box, 'value', box),
                        task.init_variables(jax.random.key(0))['params'],
                        is_leaf=lambda x: hasattr(x, 'value'))
  tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 64)
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}
  grads = [jax.grad(lambda p, b, t=t: t.loss_fn(p, b, None, True)[0]) for t in tasks]
  onednn = onednn_lifetime.jit(grads[0], compiler_options=options)(params, batch)
  default = jax.jit(grads[1])(params, batch)
  errors = [
      float(np.linalg.norm(a - b) / np.linalg.norm(b))
      for (path, b), a in zip(jax.tree_util.tree_leaves_with_path(default), jax.tree.leaves(onednn))
      if not ('key' in jax.tree_util.keystr(path) and 'bias' in jax.tree_util.keystr(path))
  ]  # a key bias's gradient is rounding only (softmax ignores a shift of all scores)
  return {'median': float(np.median(errors)), 'worst': float(max(errors))}


def main():
  import jax
  if not precision.has_fast_bf16_dots():
    sys.exit(f'jaxlib {xla_options.jaxlib_version()} has no fast bf16 dot on CPU and dies under '
             f'the oneDNN options; run this with jaxlib >= {precision.FAST_BF16_JAXLIB}')
  rates = dot_rates()
  for name, rate in rates.items():
    print(f'{name:36s} {rate:6,d} GFLOP/s')
  errors = {
      'float32 with the oneDNN options':
          gradient_error(None, ONEDNN),
      'CPU precision policy as trained':
          gradient_error('bfloat16', precision.compiler_options('bfloat16')),
  }
  for name, error in errors.items():
    print(f'tiny GPT gradient, {name}, against float32 with XLA defaults: relative error median '
          f'{error["median"]:.4f}, worst {error["worst"]:.4f}')
  print(
      json.dumps({
          'benchmark': 'cpu_bf16_paths', **machine.description(), 'jax': jax.__version__,
          'gflops': rates, 'gradient_relative_error': errors
      }))


if __name__ == '__main__':
  main()
