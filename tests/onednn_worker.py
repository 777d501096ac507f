"""Creates, runs and drops programs compiled with the CPU precision policy's oneDNN options; run as
a subprocess, several at once (tests/test_onednn_lifetime.py).

    python tests/onednn_worker.py [--programs=6] [--unprotected]

Each program is a product a.T @ b (float32 and bf16 in turn: the pool race does not depend on the
dtype), jitted with `precision.compiler_options('bfloat16')` through `onednn_lifetime.jit`, run
three times and dropped at once; then the MFU probe's matmul (`precision.matmul_seconds`).
`--unprotected` jits with plain `jax.jit` instead: the code as it was before the workaround, to
see the abort (exit status 134, `object_pool.h ... Check failed`). Prints `ok` and the number of
programs kept alive on success.
"""

import argparse
import faulthandler
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from transformer_jax import onednn_lifetime, precision  # noqa: E402


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--programs', type=int, default=6)
  parser.add_argument('--size', type=int, default=512)
  parser.add_argument('--unprotected', action='store_true')
  args = parser.parse_args()
  faulthandler.enable()
  options = precision.compiler_options('bfloat16')
  if not onednn_lifetime.uses_onednn(options):
    sys.exit(f'jaxlib {jax.lib.__version__} compiles no oneDNN program for the policy')
  jit = jax.jit if args.unprotected else onednn_lifetime.jit
  for i in range(args.programs):
    dtype = (jnp.float32, jnp.bfloat16)[i % 2]
    a = jnp.ones((args.size, args.size), dtype)
    product = jit(lambda a, b: a.T @ b, compiler_options=options)
    for _ in range(3):
      product(a, a).block_until_ready()
    del product
    gc.collect()
  precision.matmul_seconds(jnp.bfloat16, args.size, repeats=2)
  print('ok', onednn_lifetime.kept(), flush=True)


if __name__ == '__main__':
  main()
