r"""Generation speed: KV cache vs recomputing the whole prefix, for GPT and translation.

  python benchmarks/decode.py                 # both parts; a few minutes
  python benchmarks/decode.py --parts=throughput --batch_sizes=1,16

Part 'context' (batch 1; the baby GPT and GPT-2 small, `--context_models`): per-token time as
the context grows, next to the ratio a purely memory-bound step would show (weights + the
keys/values so far, read once per token): for the baby model, whose cache at 1024 outweighs its
weights, that bound alone is ~2.2x; for GPT-2 small it is ~1.14x.

For each context length C the model continues a C-token prompt:
  cached:    the prompt is prefilled once, then each new token is one cached step (attention
             over the cache, every other layer on one position); timed over `--new_tokens`
             greedy steps inside one jitted loop, prefill excluded;
  recompute: each new token is a full forward pass over the last C tokens (what generation
             without a cache costs); timed per call.
Part 'throughput': generated tokens/s at each batch size, with and without the cache, for
  gpt:         the baby GPT continuing a `--prompt`-token prompt by `--new_tokens` greedy tokens;
  translation: the Multi30k model (3+3 layers, 256 wide, vocab 8000), beam 4 (alpha 0.6) over
               `--source_len`-token sources for `--target_len` steps. Without the cache every
               step reruns the decoder over the whole target buffer (the encoder runs once).
  EOS is disabled so every run does the full number of steps (random parameters would stop
  at random points); tokens/s counts the batch's output tokens (best beam), not beams.
Part 'transformers' (not in the default parts; tens of minutes): batched generation against
  transformers' `generate`, on the same machine and the same prompts. `--num_prompts` (256)
  windows of Tiny Shakespeare (`--corpus`), of lengths 8-200 (seeded), tokenized by a byte-level
  BPE of 8,192 tokens trained on the corpus (GPT-2's own vocabulary files cannot be downloaded
  here), each continued by `--new_tokens` (64) greedy tokens by GPT-2 small (124M, random
  weights built by transformers and imported here: both run the same weights, fp32). Batches of
  `--vs_batch_sizes` (1, 8, 32) prompts in file order: ours right-pads and keeps a position per
  row (`inference/generation.py`), transformers left-pads with an attention mask. EOS is off.
  Each engine runs in a fresh process, interleaved A B, B A over `--rounds`; a process first
  generates one batch of every padded shape it will meet (so JAX compiles every program once,
  reported as warm-up), then times every batch: tokens/s = prompts x new tokens / seconds. The
  ratio is ours / transformers' per round; the median is reported. The greedy ids of the two
  engines are compared too (rows identical: float rounding may flip a near tie on random
  weights).
Parameters are random (speed does not depend on them). Last line: one JSON object.
Targets: cached time at 1024 <= 1.3x that at 64, and cached >= 10x faster than recompute at
1024; part 'transformers': ours ahead at every batch size.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformer_jax.cli import process

if __name__ == '__main__':
  process.setup_allocator()

import functools
import json
import time

from absl import app, flags, logging

_CONTEXTS = flags.DEFINE_list('contexts', ['64', '256', '1024'], 'Prompt lengths to time.')
_NEW = flags.DEFINE_integer('new_tokens', 64, 'Cached steps timed per context.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed repetitions; the fastest counts.')
_PARTS = flags.DEFINE_list('parts', ['context', 'throughput'], "Of 'context', 'throughput'.")
_BATCHES = flags.DEFINE_list('batch_sizes', ['1', '16'], 'Batch sizes for the throughput part.')
_PROMPT = flags.DEFINE_integer('prompt', 64, 'GPT prompt length (throughput part).')
_SOURCE_LEN = flags.DEFINE_integer('source_len', 24, 'Translation source length.')
_TARGET_LEN = flags.DEFINE_integer('target_len', 32, 'Translation steps (output length).')
_BEAM = flags.DEFINE_integer('beam_size', 4, 'Translation beam size.')
_CONTEXT_MODELS = flags.DEFINE_list('context_models', ['baby', 'gpt2'],
                                    "GPT sizes for the context part: 'baby', 'gpt2' (124M).")
_NUM_PROMPTS = flags.DEFINE_integer('num_prompts', 256, "Part 'transformers': prompts.")
_VS_BATCHES = flags.DEFINE_list('vs_batch_sizes', ['1', '8', '32'],
                                "Part 'transformers': batch sizes.")
_ROUNDS = flags.DEFINE_integer('rounds', 2, "Part 'transformers': interleaved rounds.")
_CORPUS = flags.DEFINE_string(
    'corpus',
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), '..', 'shared',
                 'data', 'tinyshakespeare', 'input.txt'), "Part 'transformers': the prompts' text.")
_ENGINE = flags.DEFINE_enum('engine', None, ['jax', 'torch'],
                            "Internal: one timed run of part 'transformers' in this process.")
_WORK = flags.DEFINE_string('work', None, "Internal: part 'transformers' model and prompts.")
_ENGINE_BATCH = flags.DEFINE_integer('engine_batch', 1, "Internal: the run's batch size.")
NO_EOS = -1  # an id no step can emit: every decode runs its full length


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


def gpt_throughput(batch_size: int, new: int, prompt_len: int, repeats: int) -> dict:
  """Generated tokens/s of the baby GPT at `batch_size`, cached vs recomputed."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  from jax import lax

  from transformer_jax.inference import search
  from transformer_jax.layers.blocks import empty_cache
  from transformer_jax.models.gpt import GPT, gpt2_config

  total = prompt_len + new
  cfg = gpt2_config(vocab_size=65, emb_dim=128, num_heads=4, mlp_dim=512, num_decoder_layers=4,
                    max_len=total, dropout_rate=0.0, attention_dropout_rate=0.0)
  model, decoder = GPT(cfg), GPT(cfg.replace(decode=True))
  params = jax.jit(lambda key: nn.meta.unbox(model.init(key, jnp.zeros((1, 8), jnp.int32))))(
      jax.random.key(0))['params']
  prompt = jax.random.randint(jax.random.key(1), (batch_size, prompt_len), 0, cfg.vocab_size)

  @functools.partial(jax.jit, compiler_options=search.decode_compiler_options())
  def cached(params, prompt):  # prefill + `new` cached greedy steps
    cache = empty_cache(decoder, jnp.zeros((batch_size, total - 1), jnp.int32))
    _, state = decoder.apply({'params': params, 'cache': cache}, prompt[:, :-1], mutable=['cache'])

    def tokens_to_logits(tokens, cache):
      logits, updated = decoder.apply({'params': params, 'cache': cache}, tokens, mutable=['cache'])
      return logits[:, -1], updated['cache']

    return search.sample(tokens_to_logits, state['cache'], jax.random.key(0),
                         first_tokens=prompt[:, -1], max_len=new, temperature=0.0)

  @jax.jit
  def recompute(params, prompt):  # every step a full causal pass over the whole buffer
    buffer = jnp.zeros((batch_size, total), jnp.int32).at[:, :prompt_len].set(prompt)

    def body(i, buffer):
      position = prompt_len + i
      logits = model.apply({'params': params}, buffer)
      last = lax.dynamic_index_in_dim(logits, position - 1, axis=1, keepdims=False)
      return lax.dynamic_update_index_in_dim(buffer,
                                             jnp.argmax(last, -1).astype(jnp.int32), position,
                                             axis=1)

    return lax.fori_loop(0, new, body, buffer)

  out = {}
  for name, fn in (('cached', cached), ('recompute', recompute)):
    wall, cpu = fastest(lambda: fn(params, prompt), repeats)
    out[name] = {'tokens_per_s': batch_size * new / wall, 'cpu_s': cpu, 'wall_s': wall}
  return out


def translation_throughput(batch_size: int, beam: int, source_len: int, target_len: int,
                           repeats: int) -> dict:
  """Output tokens/s of the Multi30k-size model with beam search, cached vs recomputed."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from transformer_jax.inference import search
  from transformer_jax.layers.blocks import empty_cache
  from transformer_jax.model_config import TransformerConfig
  from transformer_jax.models.encoder_decoder import EncoderDecoder

  cfg = TransformerConfig(vocab_size=8000, emb_dim=256, num_heads=4, mlp_dim=1024,
                          num_encoder_layers=3, num_decoder_layers=3, max_len=256, dropout_rate=0.0,
                          attention_dropout_rate=0.0)
  model, decoder = EncoderDecoder(cfg), EncoderDecoder(cfg.replace(decode=True))
  inputs = jax.random.randint(jax.random.key(1), (batch_size, source_len), 3, cfg.vocab_size)
  params = jax.jit(lambda key: nn.meta.unbox(model.init(key, inputs[:1], inputs[:1, :4])))(
      jax.random.key(0))['params']

  def best_sequences(params, inputs, tokens_to_logits_fn, cache):
    encoded = model.apply({'params': params}, inputs, method=EncoderDecoder.encode)
    encoded_b = search.expand_to_beams(encoded, beam)
    inputs_b = search.expand_to_beams(inputs, beam)
    sequences, _ = search.beam_search(
        lambda tokens, cache: tokens_to_logits_fn(params, encoded_b, inputs_b, tokens, cache),
        cache, batch_size=batch_size, beam_size=beam, max_len=target_len, alpha=0.6, eos_id=NO_EOS)
    return sequences[:, 0]

  def cached_logits(params, encoded, inputs, tokens, cache):
    logits, updated = decoder.apply({'params': params, 'cache': cache}, encoded, inputs, tokens,
                                    method=EncoderDecoder.decode, mutable=['cache'])
    return logits[:, -1], updated['cache']

  def recomputed_logits(params, encoded, inputs, tokens, cache):
    # The "cache" is the target history [N, target_len] (reordered with the beams) + the step.
    history = jax.lax.dynamic_update_index_in_dim(cache['history'], tokens[:, 0], cache['step'],
                                                  axis=1)
    logits = model.apply({'params': params}, encoded, inputs, history, method=EncoderDecoder.decode)
    last = jax.lax.dynamic_index_in_dim(logits, cache['step'], axis=1, keepdims=False)
    return last, {'history': history, 'step': cache['step'] + 1}

  @functools.partial(jax.jit, compiler_options=search.decode_compiler_options())
  def cached(params, inputs):
    cache = empty_cache(decoder, inputs, jnp.zeros((batch_size, target_len), jnp.int32))
    return best_sequences(params, inputs, cached_logits, cache)

  @jax.jit
  def recompute(params, inputs):
    cache = {
        'history': jnp.zeros((batch_size, target_len), jnp.int32), 'step': jnp.zeros((), jnp.int32)
    }
    return best_sequences(params, inputs, recomputed_logits, cache)

  out = {}
  for name, fn in (('cached', cached), ('recompute', recompute)):
    wall, cpu = fastest(lambda: fn(params, inputs), repeats)
    out[name] = {'tokens_per_s': batch_size * target_len / wall, 'cpu_s': cpu, 'wall_s': wall}
  return out


def throughput_part(repeats: int) -> dict:
  results = {'gpt': {}, 'translation': {}}
  for batch in [int(b) for b in _BATCHES.value]:
    g = gpt_throughput(batch, _NEW.value, _PROMPT.value, repeats)
    results['gpt'][str(batch)] = g
    print(
        f'gpt         batch {batch:3d}: cached {g["cached"]["tokens_per_s"]:9,.0f} tok/s, '
        f'recompute {g["recompute"]["tokens_per_s"]:9,.0f} tok/s', flush=True)
    t = translation_throughput(batch, _BEAM.value, _SOURCE_LEN.value, _TARGET_LEN.value, repeats)
    results['translation'][str(batch)] = t
    print(
        f'translation batch {batch:3d} beam {_BEAM.value}: cached '
        f'{t["cached"]["tokens_per_s"]:9,.0f} tok/s, recompute '
        f'{t["recompute"]["tokens_per_s"]:9,.0f} tok/s', flush=True)
  return results


def main(argv):
  del argv
  if _ENGINE.value:
    print(json.dumps(engine_run(_ENGINE.value, _WORK.value, _ENGINE_BATCH.value)), flush=True)
    return
  out = {'benchmark': 'decode'}
  if 'transformers' in _PARTS.value:
    out['transformers'] = transformers_part()
  if 'throughput' in _PARTS.value:
    out['throughput'] = throughput_part(_REPEATS.value)
  if 'context' in _PARTS.value:
    out.update(context_part())
  print(json.dumps(out))


CONTEXT_MODELS = {
    # The baby shakespeare_char model: 0.8M parameters, so at long contexts the cache it reads
    # per token (4.5 MB at 1024) outweighs its weights (3.2 MB).
    'baby': dict(vocab_size=65, emb_dim=128, num_heads=4, mlp_dim=512, num_decoder_layers=4),
    # GPT-2 small (124M): weights 500 MB per token against a 75 MB cache at 1024.
    'gpt2': dict(),
}


def context_part() -> dict:
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np

  from transformer_jax.inference import search
  from transformer_jax.models.gpt import GPT, gpt2_config

  contexts = [int(c) for c in _CONTEXTS.value]
  new = _NEW.value
  out = {}
  for name in _CONTEXT_MODELS.value:
    # A position table long enough for every context.
    cfg = gpt2_config(**CONTEXT_MODELS[name], max_len=max(contexts) + new, dropout_rate=0.0,
                      attention_dropout_rate=0.0)
    model, decoder = GPT(cfg), GPT(cfg.replace(decode=True))
    params = jax.jit(lambda key: nn.meta.unbox(model.init(key, jnp.zeros((1, 8), jnp.int32))))(
        jax.random.key(0))['params']
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    rng = np.random.default_rng(0)

    @jax.jit
    def prefill(params, prompt):
      cache_len = prompt.shape[1] + new - 1
      shapes = jax.eval_shape(decoder.init, jax.random.key(0), jnp.zeros((1, cache_len), jnp.int32))
      cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes['cache'])
      _, updated = decoder.apply({'params': params, 'cache': cache}, prompt[:, :-1],
                                 mutable=['cache'])
      return updated['cache']

    @functools.partial(jax.jit, compiler_options=search.decode_compiler_options())
    def cached_steps(params, cache, first):

      def tokens_to_logits(tokens, cache):
        logits, updated = decoder.apply({'params': params, 'cache': cache}, tokens,
                                        mutable=['cache'])
        return logits[:, -1], updated['cache']

      return search.sample(tokens_to_logits, cache, jax.random.key(0), first_tokens=first,
                           max_len=new, temperature=0.0)

    @jax.jit
    def recompute_step(params, window):
      return jnp.argmax(model.apply({'params': params}, window)[:, -1], axis=-1)

    repeats = _REPEATS.value if param_bytes < 50e6 else max(2, _REPEATS.value // 2)
    results = {}
    for context in contexts:
      prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(1, context)), jnp.int32)
      cache = prefill(params, prompt)
      cached = [
          t / new for t in fastest(lambda: cached_steps(params, cache, prompt[:, -1]), repeats)
      ]
      recompute = fastest(lambda: recompute_step(params, prompt), repeats)
      # What a step must read at the least: every weight once, and the keys and values of the
      # tokens so far (the mean context over the timed steps).
      cache_bytes = 2 * cfg.num_decoder_layers * (context + new / 2) * cfg.num_kv_heads * \
          cfg.head_dim * 4
      results[context] = (cached, recompute, param_bytes + cache_bytes)
      logging.info(
          '%s context %5d: cached %.3f ms/token (CPU %.3f), recompute %.3f ms/token '
          '(CPU %.3f): %.1fx; least bytes per token %.1f MB', name, context, cached[0] * 1e3,
          cached[1] * 1e3, recompute[0] * 1e3, recompute[1] * 1e3, recompute[0] / cached[0],
          (param_bytes + cache_bytes) / 1e6)

    first, last = contexts[0], contexts[-1]
    ratio = results[last][0][0] / results[first][0][0]
    bound = results[last][2] / results[first][2]
    print(
        f'{name}: cached ms/token ' +
        ', '.join(f'{c}: {r[0][0] * 1e3:.3f}' for c, r in results.items()) +
        f' | {last}/{first} {ratio:.2f}x (memory-traffic bound {bound:.2f}x) | '
        f'{results[last][1][0] / results[last][0][0]:.0f}x faster than recompute', flush=True)
    out[name] = {
        'params': int(sum(x.size for x in jax.tree.leaves(params))),
        'new_tokens': new,
        'cached_ms_per_token': {str(c): round(r[0][0] * 1e3, 4) for c, r in results.items()},
        'recompute_ms_per_token': {str(c): round(r[1][0] * 1e3, 4) for c, r in results.items()},
        'cached_cpu_ms_per_token': {str(c): round(r[0][1] * 1e3, 4) for c, r in results.items()},
        f'cached_ratio_{last}_vs_{first}': round(ratio, 3),
        f'cached_cpu_ratio_{last}_vs_{first}': round(results[last][0][1] / results[first][0][1], 3),
        f'bytes_bound_ratio_{last}_vs_{first}': round(bound, 3),
        f'speedup_at_{last}': round(results[last][1][0] / results[last][0][0], 1),
    }
  return {'device': jax.devices()[0].platform, 'context': out}


# -- part 'transformers' -------------------------------------------------------------------------


def corpus_prompts(path: str, count: int, seed: int = 0) -> list[list[int]]:
  """`count` windows of the corpus of 8-200 tokens (seeded), as ids of a byte-level BPE of 8,192
  tokens trained on it."""
  import numpy as np
  import tokenizers
  with open(path, encoding='utf-8') as f:
    text = f.read()
  tokenizer = tokenizers.ByteLevelBPETokenizer()
  tokenizer.train_from_iterator([text], vocab_size=8192, show_progress=False)
  ids = tokenizer.encode(text).ids
  rng = np.random.default_rng(seed)
  lengths = rng.integers(8, 201, count)
  starts = rng.integers(0, len(ids) - 201, count)
  return [ids[start:start + n] for start, n in zip(starts.tolist(), lengths.tolist())]


def engine_run(engine: str, work: str, batch_size: int) -> dict:
  """One process's run: warm-up (one batch of every padded shape), then every batch timed."""
  import numpy as np
  with open(os.path.join(work, 'prompts.json')) as f:
    prompts = json.load(f)
  new = _NEW.value
  batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
  generate, shape_of = (_jax_generator if engine == 'jax' else _torch_generator)(work, new)
  start = time.perf_counter()
  seen = set()
  for batch in batches:
    if shape_of(batch) not in seen:
      seen.add(shape_of(batch))
      generate(batch)
  warmup = time.perf_counter() - start
  start = time.perf_counter()
  outputs = [generate(batch) for batch in batches]
  seconds = time.perf_counter() - start
  ids = np.concatenate(outputs)
  np.save(os.path.join(work, f'{engine}_{batch_size}.npy'), ids)
  assert ids.shape == (len(prompts), new), ids.shape
  return {
      'engine': engine, 'batch_size': batch_size, 'seconds': seconds,
      'tokens_per_s': ids.size / seconds, 'warmup_s': warmup, 'shapes': len(seen)
  }


def _jax_generator(work: str, new: int):
  import jax
  from transformer_jax.convert import hf_gpt2
  from transformer_jax.inference import generation
  from transformer_jax.tasks.lm import LanguageModelTask
  loaded = hf_gpt2.load(os.path.join(work, 'gpt2'))
  task = LanguageModelTask(loaded.config)  # no EOS: every row runs its budget
  params = jax.device_put(loaded.params)  # once, as experiments.generate does
  key = jax.random.key(0)

  def generate(batch):
    return task.generate(params, batch, new, key, temperature=0.0)

  def shape_of(batch):
    return len(batch), generation.pad_prompts(generation.prompt_rows(batch),
                                              loaded.config.max_len)[0].shape[1]

  return generate, shape_of


def _torch_generator(work: str, new: int):
  import numpy as np
  import torch
  import transformers
  model = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(work, 'gpt2')).eval()
  model.generation_config.eos_token_id = None

  def generate(batch):
    longest = max(len(row) for row in batch)
    ids = torch.zeros((len(batch), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(batch):  # left padding, as transformers asks of a decoder-only model
      ids[i, longest - len(row):] = torch.tensor(row)
      mask[i, longest - len(row):] = 1
    with torch.inference_mode():
      out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                           min_new_tokens=new, pad_token_id=0, eos_token_id=None)
    return np.asarray(out[:, longest:], np.int32)

  def shape_of(batch):  # one warm-up call is enough for eager PyTorch
    return 'any'

  return generate, shape_of


def transformers_part() -> dict:
  """Fresh processes per engine and batch size, interleaved; the median per-round ratio."""
  import statistics
  import subprocess
  import tempfile

  import numpy as np
  import torch
  import transformers
  from tools import machine
  work = tempfile.mkdtemp(prefix='decode_vs_transformers_')
  torch.manual_seed(0)
  transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(os.path.join(
      work, 'gpt2'))
  prompts = corpus_prompts(_CORPUS.value, _NUM_PROMPTS.value)
  with open(os.path.join(work, 'prompts.json'), 'w') as f:
    json.dump(prompts, f)
  logging.info('%d prompts of %d-%d tokens (mean %.1f), %d new tokens each; work in %s',
               len(prompts), min(map(len, prompts)), max(map(len, prompts)),
               np.mean([len(p) for p in prompts]), _NEW.value, work)
  runs: dict[int, dict[str, list[dict]]] = {}
  for round_ in range(_ROUNDS.value):
    for batch_size in [int(b) for b in _VS_BATCHES.value]:
      order = ('jax', 'torch') if round_ % 2 == 0 else ('torch', 'jax')
      for engine in order:
        command = [
            sys.executable,
            os.path.abspath(__file__), f'--engine={engine}', f'--work={work}',
            f'--engine_batch={batch_size}', f'--new_tokens={_NEW.value}'
        ]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode:
          raise RuntimeError(f'{engine} run failed: {result.stderr[-2000:]}')
        run = json.loads(result.stdout.strip().splitlines()[-1])
        runs.setdefault(batch_size, {}).setdefault(engine, []).append(run)
        logging.info('round %d batch %d %s: %.1f tokens/s (warm-up %.1f s, %d shapes)', round_,
                     batch_size, engine, run['tokens_per_s'], run['warmup_s'], run['shapes'])
  table = {}
  for batch_size, by_engine in runs.items():
    ratios = [
        a['tokens_per_s'] / b['tokens_per_s'] for a, b in zip(by_engine['jax'], by_engine['torch'])
    ]
    ours = np.load(os.path.join(work, f'jax_{batch_size}.npy'))
    theirs = np.load(os.path.join(work, f'torch_{batch_size}.npy'))
    table[str(batch_size)] = {
        'jax_tokens_per_s': [round(r['tokens_per_s'], 1) for r in by_engine['jax']],
        'torch_tokens_per_s': [round(r['tokens_per_s'], 1) for r in by_engine['torch']],
        'ratios': [round(r, 3) for r in ratios],
        'median_ratio': round(statistics.median(ratios), 3),
        'jax_warmup_s': [round(r['warmup_s'], 1) for r in by_engine['jax']],
        'jax_shapes': by_engine['jax'][0]['shapes'],
        'rows_identical_to_transformers': round(float(np.mean((ours == theirs).all(1))), 4),
        'tokens_identical_to_transformers': round(float(np.mean(ours == theirs)), 4),
    }
    print(
        f'batch {batch_size}: ours {table[str(batch_size)]["jax_tokens_per_s"]} tokens/s, '
        f'transformers {table[str(batch_size)]["torch_tokens_per_s"]}: median ratio '
        f'{table[str(batch_size)]["median_ratio"]}; rows with identical ids '
        f'{table[str(batch_size)]["rows_identical_to_transformers"]:.1%}', flush=True)
  return {
      'cpu': machine.cpu_model(), 'commit': machine.git_commit(), 'torch': torch.__version__,
      'transformers': transformers.__version__, 'prompts': len(prompts), 'new_tokens': _NEW.value,
      'batches': table
  }


if __name__ == '__main__':
  app.run(main)
