r"""Per-token generation time of the baby GPT: KV cache vs recomputing the whole prefix.

  python benchmarks/decode.py                 # contexts 64, 256, 1024; about a minute or two

For each context length C the model continues a C-token prompt:
  cached:    the prompt is prefilled once, then each new token is one cached step (attention
             over the cache, every other layer on one position); timed over `--new_tokens`
             greedy steps inside one jitted loop, prefill excluded;
  recompute: each new token is a full forward pass over the last C tokens (what generation
             without a cache costs); timed per call.
Parameters are random (speed does not depend on them). Last line: one JSON object.
Targets: cached time at 1024 <= 1.3x that at 64, and cached >= 10x faster than recompute at 1024.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformer_jax import runtime  # pylint: disable=g-import-not-at-top

if __name__ == '__main__':
  runtime.setup_allocator()

# pylint: disable=g-import-not-at-top,wrong-import-position
import json
import time

from absl import app, flags, logging

_CONTEXTS = flags.DEFINE_list('contexts', ['64', '256', '1024'], 'Prompt lengths to time.')
_NEW = flags.DEFINE_integer('new_tokens', 64, 'Cached steps timed per context.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed repetitions; the fastest counts.')


def fastest(fn, repeats: int) -> tuple[float, float]:
  """(wall, CPU) seconds of the fastest of `repeats` calls, after a warm-up call that compiles.

  CPU time (all threads of this process) is reported too: on a shared machine it still
  measures the work done when wall time mostly measures waiting for a core.
  """
  import jax
  jax.block_until_ready(fn())
  walls, cpus = [], []
  for _ in range(repeats):
    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    walls.append(time.perf_counter() - wall)
    cpus.append(time.process_time() - cpu)
  return min(walls), min(cpus)


def main(argv):
  del argv
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np

  from transformer_jax import decoding
  from transformer_jax.models.gpt import GPT, gpt2_config

  contexts = [int(c) for c in _CONTEXTS.value]
  new = _NEW.value
  # The baby shakespeare_char model, with a position table long enough for every test.
  cfg = gpt2_config(vocab_size=65, emb_dim=128, num_heads=4, mlp_dim=512, num_decoder_layers=4,
                    max_len=max(contexts) + new, dropout_rate=0.0, attention_dropout_rate=0.0)
  model, decoder = GPT(cfg), GPT(cfg.replace(decode=True))
  params = jax.jit(lambda key: nn.meta.unbox(model.init(key, jnp.zeros((1, 8), jnp.int32))))(
      jax.random.key(0))['params']
  rng = np.random.default_rng(0)

  @jax.jit
  def prefill(params, prompt):
    cache_len = prompt.shape[1] + new - 1
    shapes = jax.eval_shape(decoder.init, jax.random.key(0), jnp.zeros((1, cache_len), jnp.int32))
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes['cache'])
    _, updated = decoder.apply({'params': params, 'cache': cache}, prompt[:, :-1],
                               mutable=['cache'])
    return updated['cache']

  @jax.jit
  def cached_steps(params, cache, first):
    def tokens_to_logits(tokens, cache):
      logits, updated = decoder.apply({'params': params, 'cache': cache}, tokens,
                                      mutable=['cache'])
      return logits[:, -1], updated['cache']
    return decoding.sample(tokens_to_logits, cache, jax.random.key(0), first_tokens=first,
                           max_len=new, temperature=0.0)

  @jax.jit
  def recompute_step(params, window):
    return jnp.argmax(model.apply({'params': params}, window)[:, -1], axis=-1)

  results = {}
  for context in contexts:
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(1, context)), jnp.int32)
    cache = prefill(params, prompt)
    cached = [t / new for t in fastest(lambda: cached_steps(params, cache, prompt[:, -1]),
                                       _REPEATS.value)]
    recompute = fastest(lambda: recompute_step(params, prompt), _REPEATS.value)
    results[context] = (cached, recompute)
    logging.info('context %5d: cached %.3f ms/token (CPU %.3f), recompute %.3f ms/token '
                 '(CPU %.3f): %.1fx', context, cached[0] * 1e3, cached[1] * 1e3,
                 recompute[0] * 1e3, recompute[1] * 1e3, recompute[0] / cached[0])

  first, last = contexts[0], contexts[-1]
  out = {
      'benchmark': 'decode', 'device': jax.devices()[0].platform, 'new_tokens': new,
      'cached_ms_per_token': {str(c): round(r[0][0] * 1e3, 4) for c, r in results.items()},
      'recompute_ms_per_token': {str(c): round(r[1][0] * 1e3, 4) for c, r in results.items()},
      'cached_cpu_ms_per_token': {str(c): round(r[0][1] * 1e3, 4) for c, r in results.items()},
      'recompute_cpu_ms_per_token': {str(c): round(r[1][1] * 1e3, 4)
                                     for c, r in results.items()},
      f'cached_ratio_{last}_vs_{first}': round(results[last][0][0] / results[first][0][0], 3),
      f'cached_cpu_ratio_{last}_vs_{first}': round(
          results[last][0][1] / results[first][0][1], 3),
      f'speedup_at_{last}': round(results[last][1][0] / results[last][0][0], 1),
  }
  print(json.dumps(out))


if __name__ == '__main__':
  app.run(main)
