"""Causal language modelling with `GPT`: next-token loss, and text generation with a KV cache.

Generation feeds the prompt once (prefill), then one token per step through the KV cache, so
each new token costs one position's work instead of a pass over the whole prefix. A model
with a position table (learned or sinusoidal) has seen only positions < max_len, so the
cache never holds more than max_len tokens: a longer generation continues in segments that
re-read the last max_len // 2 tokens into a fresh cache (nanoGPT instead recomputes the
last max_len tokens for every new one). See `LanguageModelTask.generate`;
`generate_stream` yields the same tokens one at a time (for printing them as they come): both
run the one schedule of `inference.generation.Sampler`. `score_windows` sums the next-token
loss of a file's sliding windows (perplexity).
"""

import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import struct

from transformer_jax.data import lm as lm_data
from transformer_jax.errors import ConfigError
from transformer_jax.inference import generation, lm_beam_search, search
from transformer_jax.layers import kernel_layout, scan_layout
from transformer_jax.layers.blocks import empty_cache, set_cache_positions
from transformer_jax.layers.losses import projected_cross_entropy_sums
from transformer_jax.model_config import KERNEL_LAYOUTS, TransformerConfig
from transformer_jax.models.gpt import GPT
from transformer_jax import flops
from transformer_jax.visualize import attention_maps, heatmaps

# The line whose attention maps go to TensorBoard at every evaluation ('' = none).
ATTENTION_TEXT = 'To be, or not to be, that is the question.'


@struct.dataclass
class DecodeParams:
  """Params as a decode model takes them: unrolled layers, dense kernels in `kernel_layout`
  (which of `LanguageModelTask.decode_models` runs them)."""
  params: Any
  kernel_layout: str = struct.field(pytree_node=False)


class LanguageModelTask:
  """Trains a `GPT` on windows {'inputs', 'targets'} and samples text from it."""

  def __init__(self, cfg: TransformerConfig, *, tokenizer=None, eos_id: int | None = None,
               sample_prompt: list[int] | None = None, sample_tokens: int = 200,
               temperature: float = 0.8, top_k: int = 200, top_p: float = 1.0, sample_seed: int = 0,
               attention_text: str = ATTENTION_TEXT):
    self.cfg = cfg
    self.model = GPT(cfg)
    # Dropout is off when generating; decode mode keeps the KV cache. Layers run unrolled
    # (scanned params are converted): a scanned stack would copy its KV caches every step. One
    # decode model per dense-kernel layout: generation picks one per batch size
    # (`search.decode_kernel_layout`) and converts the params to it (`_decode_params`).
    decode_cfg = cfg.replace(decode=True, scan_layers=False, dropout_rate=0.0,
                             attention_dropout_rate=0.0)
    self.decode_models = {
        layout: GPT(decode_cfg.replace(kernel_layout=layout)) for layout in KERNEL_LAYOUTS
    }
    self.decode_model = self.decode_models[cfg.kernel_layout]  # the params' own layout
    self._decode_axes = {}  # kernel layout -> its decode model's `kernel_layout.logical_axes`
    self.tokenizer, self.eos_id = tokenizer, eos_id
    self.sample_prompt, self.sample_tokens = sample_prompt, sample_tokens
    self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
    self.sample_seed = sample_seed
    self.attention_text = attention_text  # read at every evaluation for the attention pictures
    # Holds the jitted segment sampler and the streamed prefill and step (compiled once each).
    self._sampler = generation.Sampler(self._run_decode, self._empty_cache, set_cache_positions,
                                       max_len=cfg.max_len, prepare_params=self._decode_params)
    self._score_fn = jax.jit(self._score_windows)
    self._beam_fn = jax.jit(
        self._beam_search, compiler_options=search.decode_compiler_options(),
        static_argnames=('num_beams', 'max_new_tokens', 'early_stopping', 'eos_id'))

  # -- training -------------------------------------------------------------------------------

  def init_variables(self, rng):
    dummy = jnp.ones((1, min(8, self.cfg.max_len)), jnp.int32)  # shapes do not depend on T
    return self.model.init({'params': rng, 'dropout': rng}, dummy)

  def loss_fn(self, params, batch, rng, deterministic: bool):
    """Mean next-token cross-entropy over every position (windows have no padding).

    Packed windows (data.pack; 'inputs_segment_ids', 'inputs_positions') keep each document to
    itself: a token sees only its own document's earlier tokens (an EOS starts the next one).
    """
    rngs = None if deterministic else {'dropout': rng}
    packing = {}
    if 'inputs_segment_ids' in batch:
      packing = dict(segment_ids=batch['inputs_segment_ids'], positions=batch['inputs_positions'])
    features, embedding = self.model.apply({'params': params}, batch['inputs'],
                                           deterministic=deterministic, rngs=rngs,
                                           method=GPT.features_and_embedding, **packing)
    weights = jnp.ones(batch['targets'].shape, jnp.float32)
    _, nll_sum, correct, weight = projected_cross_entropy_sums(features, embedding,
                                                               batch['targets'], weights)
    return nll_sum / weight, {'loss': nll_sum, 'correct': correct, 'weight': weight}

  def count_tokens(self, batch) -> int:
    return int(batch['inputs'].size)  # every position is trained on; id 0 is a real token

  def count_slots(self, batch) -> int:
    return int(batch['inputs'].size)

  def model_flops(self, params, batch) -> float:
    """Model FLOPs of a step on `batch` (transformer_jax/flops.py); causal attention per row."""
    cfg, shape = self.cfg, batch['inputs'].shape
    length, tokens = shape[-1], int(np.prod(shape))
    per_token = (flops.stack_parameters(params['stack'], cfg.num_decoder_layers, cfg.share_layers) +
                 flops.kernel_parameters({k: v for k, v in params.items() if k != 'stack'}) +
                 flops.tied_output_parameters(cfg, params['token_embed']))
    return flops.dense(per_token, tokens) + flops.attention(cfg.num_decoder_layers,
                                                            tokens // length, length, length,
                                                            flops.attention_width(cfg), causal=True)

  # -- generation -----------------------------------------------------------------------------
  # One schedule for both (inference/generation.py); the model enters through these three (and
  # `blocks.set_cache_positions`).

  def _empty_cache(self, batch: int, slots: int):
    return empty_cache(self.decode_model, jnp.zeros((batch, slots), jnp.int32))

  def _decode_params(self, params, layout: str | None = None) -> DecodeParams:
    """`params` (either scan layout) as the decode model of kernel `layout` (default: the
    params' own) takes them."""
    layout = layout or self.cfg.kernel_layout
    params = scan_layout.for_layout(params, self.decode_models[layout].cfg.scan_layers)
    if layout != self.cfg.kernel_layout:
      params = kernel_layout.convert(params, self._axes(self.cfg.kernel_layout), self._axes(layout))
    return DecodeParams(params, layout)

  def _axes(self, layout: str):
    if layout not in self._decode_axes:
      self._decode_axes[layout] = kernel_layout.logical_axes(self.decode_models[layout],
                                                             jnp.zeros((1, 1), jnp.int32))
    return self._decode_axes[layout]

  def _run_decode(self, params: DecodeParams, cache, tokens):
    model = self.decode_models[params.kernel_layout]
    logits, updated = model.apply({'params': params.params, 'cache': cache}, tokens,
                                  mutable=['cache'])
    return logits, updated['cache']

  def generate(self, params, prompt_tokens, max_new_tokens: int, rng: jax.Array, *,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
               eos_id: int | None = None) -> np.ndarray:
    """Continues every prompt; returns int32[B, max(max_new_tokens)].

    `prompt_tokens`: an int array [B, P], or B sequences of ids of any lengths (one batch: each
    row gets what its prompt gets alone, `inference/generation.py`). `max_new_tokens` and the
    sampling settings: one value or one per row; `rng`: one key, or one per row (row i then
    draws exactly what its prompt alone draws with that key). Sampling as in `search.sample`
    (temperature 0 = greedy). The same rng gives the same tokens. With an EOS (default: the
    task's), a row is PAD after its EOS, and after its own budget.

    Context policy: the model never sees more than cfg.max_len tokens. A prompt longer than
    that is cropped to its last max_len tokens (as nanoGPT does). While prompt + new tokens
    fit in max_len, this is one prefill and one cached step per token. Beyond that the cache
    is full; generation continues in segments, each re-reading the last max_len // 2 tokens
    into a fresh cache and then sampling until the cache is full again.
    """
    # Sampling batches are tiny: replicate them instead of splitting rows over the mesh.
    with nn.logical_axis_rules(()):
      return self._sampler.generate(params, prompt_tokens, max_new_tokens, rng,
                                    temperature=temperature, top_k=top_k, top_p=top_p,
                                    eos_id=self.eos_id if eos_id is None else eos_id)

  def generate_stream(self, params, prompt_tokens, max_new_tokens: int, rng: jax.Array, *,
                      temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                      eos_id: int | None = None):
    """Yields int32[B] per new token: the tokens `generate` returns, column by column.

    The same segments, cache sizes, sampling rule and keys as `generate` (the same rng gives
    the same tokens), but each token comes back to the host as soon as it is drawn, so a
    caller can print it. A row is PAD after its EOS; the generator stops once every row has
    ended or after `max_new_tokens`.
    """
    with nn.logical_axis_rules(()):
      yield from self._sampler.stream(params, prompt_tokens, max_new_tokens, rng,
                                      temperature=temperature, top_k=top_k, top_p=top_p,
                                      eos_id=self.eos_id if eos_id is None else eos_id)

  def _beam_search(self, params, prompt, lengths, length_penalty, *, num_beams: int,
                   max_new_tokens: int, early_stopping, eos_id: int | None):
    """`beam_search` on the device: prefill all but each row's last prompt token (`prompt`
    [B, P] right-padded, row i `lengths[i]` long), then search."""
    params = self._decode_params(params)  # inside this program a transposed copy would be moot
    cache, last = self._sampler.filled_cache(
        params, prompt, lengths, generation.cache_slots(prompt.shape[1], max_new_tokens))

    def tokens_to_logits(tokens, cache):
      logits, cache = self._run_decode(params, cache, tokens)
      return logits[:, -1, :], cache

    return lm_beam_search.transformers_beam_search(tokens_to_logits, cache, first_tokens=last,
                                                   num_beams=num_beams,
                                                   max_new_tokens=max_new_tokens,
                                                   length_penalty=length_penalty,
                                                   early_stopping=early_stopping, eos_id=eos_id)

  def beam_search(self, params, prompt_tokens, num_beams: int, max_new_tokens: int, *,
                  length_penalty: float = 1.0, early_stopping: bool | str = False,
                  eos_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Beam search after each prompt, as transformers' `generate(num_beams=...,
    do_sample=False)` does (`inference/lm_beam_search.py`). `prompt_tokens`: an int array
    [B, P] or B sequences of ids of any lengths (each row searched as its prompt alone).

    Returns (int32[B, num_beams, max_new_tokens], float32[B, num_beams]): the hypotheses best
    first, PAD after EOS, and their scores (sum of log-probs / length**length_penalty). EOS
    defaults to the task's; -1 lets every hypothesis run max_new_tokens. Prompt and new tokens
    must fit in cfg.max_len (one cache, no segments). Compiled once per shape and setting.
    """
    rows = generation.prompt_rows(prompt_tokens)
    if num_beams < 1 or max_new_tokens < 1:
      raise ConfigError(f'num_beams and max_new_tokens must be positive, got {num_beams} and '
                        f'{max_new_tokens}')
    longest = max(len(row) for row in rows)
    if longest + max_new_tokens > self.cfg.max_len:
      raise ConfigError(f'prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceed '
                        f'the context of {self.cfg.max_len} tokens; beam search runs one cache')
    prompt, lengths = generation.pad_prompts(rows, self.cfg.max_len)
    with nn.logical_axis_rules(()):
      sequences, scores = self._beam_fn(params, jnp.asarray(prompt), jnp.asarray(lengths),
                                        jnp.float32(length_penalty), num_beams=num_beams,
                                        max_new_tokens=max_new_tokens,
                                        early_stopping=early_stopping,
                                        eos_id=self.eos_id if eos_id is None else eos_id)
    return np.asarray(sequences), np.asarray(scores)

  # -- perplexity -----------------------------------------------------------------------------

  def _score_windows(self, params, batch):
    """(sum of the weighted next-token NLL, sum of the weights) of windows [B, T]."""
    features, embedding = self.model.apply({'params': params}, batch['inputs'], deterministic=True,
                                           method=GPT.features_and_embedding)
    _, nll_sum, _, weight = projected_cross_entropy_sums(features, embedding, batch['targets'],
                                                         batch['weights'])
    return nll_sum, weight

  def score_windows(self, params, windows: dict[str, np.ndarray], batch_size: int = 8):
    """(summed NLL in nats, number of scored tokens) of `data.lm.sliding_windows` output.

    Windows go `batch_size` at a time through one jitted program (the last batch is filled
    with weight-0 windows, so every call has the same shape); sums add up in float64.
    """
    inputs = windows['inputs']
    total, count = 0.0, 0.0
    with nn.logical_axis_rules(()):
      for start in range(0, len(inputs), batch_size):
        batch = {k: v[start:start + batch_size] for k, v in windows.items()}
        short = batch_size - len(batch['inputs'])
        if short:
          batch = {
              k: np.concatenate([v, np.zeros((short,) + v.shape[1:], v.dtype)])
              for k, v in batch.items()
          }
        nll, weight = jax.device_get(self._score_fn(params, batch))
        total += float(nll)
        count += float(weight)
    return total, int(round(count))

  # -- evaluation -----------------------------------------------------------------------------

  def sample_text(self, params, max_new_tokens: int | None = None) -> str:
    """The fixed evaluation sample: fixed prompt, fixed seed (comparable across steps)."""
    new = self.generate(params, np.asarray([self.sample_prompt],
                                           np.int32), max_new_tokens or self.sample_tokens,
                        jax.random.key(self.sample_seed), temperature=self.temperature,
                        top_k=self.top_k, top_p=self.top_p)
    prompt = [int(i) for i in self.sample_prompt]
    # The token a document starts with (EOS or BOS, see data/lm.prompt_ids) is not text; a
    # continuation ends at EOS (generation pads the rest of the row).
    starts = {self.eos_id, getattr(self.tokenizer, 'bos_id', None)} - {None}
    if prompt and prompt[0] in starts:
      prompt = prompt[1:]
    row = [int(i) for i in new[0]]
    if self.eos_id is not None and self.eos_id in row:
      row = row[:row.index(self.eos_id)]
    return self.tokenizer.decode(prompt) + self.tokenizer.decode(row)

  def evaluate(self, context, params, step: int) -> dict[str, float]:
    """Writes a generated sample to the log and TensorBoard; adds no metric."""
    if self.tokenizer is None or not self.sample_prompt or self.sample_tokens <= 0:
      return {}
    start = time.time()
    text = self.sample_text(params)
    logging.info('step %d sample (%d tokens, %.1f s):\n%s', step, self.sample_tokens,
                 time.time() - start, text)
    context.write_text(step, 'samples', text.replace('\n', '  \n'))
    return {}

  def summary_images(self, params) -> dict[str, np.ndarray]:
    """Self-attention maps (layers x heads) of the model reading a fixed line, for TensorBoard."""
    if self.tokenizer is None or not self.attention_text:
      return {}
    if isinstance(self.tokenizer, lm_data.CharTokenizer):
      ids = self.tokenizer.encode(self.attention_text, skip_unknown=True)
    else:
      ids = lm_data.prompt_ids(self.tokenizer, self.attention_text)
    ids = ids[:self.cfg.max_len]
    if not ids:
      return {}
    return heatmaps.overview_images(
        attention_maps.lm_attention(self.model, params, self.tokenizer, '', ids=ids))
