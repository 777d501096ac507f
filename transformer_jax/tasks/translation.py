"""Translation with the encoder-decoder: loss, beam-search prediction, BLEU evaluation.

The trainer sees only `init_variables`, `loss_fn` and `evaluate`; everything specific to
translation (teacher forcing, label smoothing, decoding, detokenised BLEU) lives here.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu
from absl import logging

from transformer_jax.inference import search
from transformer_jax.layers import scan_layout
from transformer_jax.parallel import sharding
from transformer_jax.layers.blocks import empty_cache
from transformer_jax.special_tokens import EOS_ID, PAD_ID
from transformer_jax.layers.losses import projected_cross_entropy_sums
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models import EncoderDecoder
from transformer_jax import flops
from transformer_jax.visualize import attention_maps, heatmaps

# The keys of a packed batch (data/packing.py) beyond 'inputs' and 'targets'.
PACKING_KEYS = ('inputs_segment_ids', 'inputs_positions', 'targets_segment_ids',
                'targets_positions')


class TranslationTask:
  """Sequence-to-sequence training and decoding for an `EncoderDecoder`."""

  def __init__(self, cfg: TransformerConfig, *, label_smoothing: float = 0.1, beam_size: int = 4,
               alpha: float = 0.6, decode_rows: int = 64, src_tokenizer=None, tgt_tokenizer=None,
               eval_sources=(), eval_references=(), num_samples: int = 3):
    self.cfg = cfg
    self.model = EncoderDecoder(cfg)
    # Decoding runs the layers unrolled (scan_layout.unstack_layers converts scanned params):
    # a scanned stack would copy every layer's KV cache on every step.
    self.decode_model = EncoderDecoder(
        cfg.replace(decode=True, scan_layers=False, dropout_rate=0.0, attention_dropout_rate=0.0))
    self.label_smoothing = label_smoothing
    self.beam_size, self.alpha, self.decode_rows = beam_size, alpha, decode_rows
    self.src_tokenizer, self.tgt_tokenizer = src_tokenizer, tgt_tokenizer
    self.eval_sources, self.eval_references = list(eval_sources), list(eval_references)
    self.num_samples = num_samples
    self._predict_fns = {}

  # -- training -------------------------------------------------------------------------------

  def init_variables(self, rng):
    dummy = jnp.ones((1, 8), jnp.int32)
    return self.model.init({'params': rng, 'dropout': rng}, dummy, dummy)

  def loss_fn(self, params, batch, rng, deterministic: bool):
    """Label-smoothed cross-entropy per target token (padding excluded). Packed rows carry
    each side's segment ids and positions (`PACKING_KEYS`); the loss is the same sum over
    the same tokens, so a packed batch trains as its examples would unpacked."""
    rngs = None if deterministic else {'dropout': rng}
    packing = {key: batch[key] for key in PACKING_KEYS if key in batch}
    features, embedding = self.model.apply({'params': params}, batch['inputs'], batch['targets'],
                                           deterministic=deterministic, rngs=rngs,
                                           method=EncoderDecoder.features_and_embedding, **packing)
    weights = batch['targets'] != PAD_ID
    smooth_sum, nll_sum, correct, weight = projected_cross_entropy_sums(
        features, embedding, batch['targets'], weights,
        0.0 if deterministic else self.label_smoothing)
    loss = smooth_sum / jnp.maximum(weight, 1.0)
    return loss, {'loss': nll_sum, 'correct': correct, 'weight': weight}

  def model_flops(self, params, batch) -> float:
    """Model FLOPs of a step on `batch` (transformer_jax/flops.py): the encoder and the
    cross-attention's key and value projections on the source positions; the rest of the
    decoder, its causal self-attention, the cross-attention and the output on the target ones."""
    cfg, source, target = self.cfg, batch['inputs'].shape, batch['targets'].shape
    s, t, rows = source[-1], target[-1], int(np.prod(target)) // target[-1]
    layers, width = cfg.num_decoder_layers, flops.attention_width(cfg)
    memory = flops.memory_projection_parameters(
        params['decoder']) * (layers if cfg.share_layers else 1)
    encoder = flops.stack_parameters(params['encoder'], cfg.num_encoder_layers, cfg.share_layers)
    decoder = (flops.stack_parameters(params['decoder'], layers, cfg.share_layers) - memory +
               flops.kernel_parameters(
                   {k: v for k, v in params.items() if k not in ('encoder', 'decoder')}) +
               flops.tied_output_parameters(cfg, params['target_embed']))
    return (flops.dense(encoder + memory, rows * s) + flops.dense(decoder, rows * t) +
            flops.attention(cfg.num_encoder_layers, rows, s, s, width, causal=False) +
            flops.attention(layers, rows, t, t, width, causal=True) +
            flops.attention(layers, rows, t, s, width, causal=False))

  # -- decoding -------------------------------------------------------------------------------

  def predict_tokens(self, params, inputs, *, max_len: int, beam_size: int, alpha: float):
    """Best target token ids [B, max_len] for source ids [B, S] (beam 1 = greedy)."""
    batch_size = inputs.shape[0]
    encoded = self.model.apply({'params': params}, inputs, method=EncoderDecoder.encode)
    cache = empty_cache(self.decode_model, inputs, jnp.zeros((batch_size, max_len), jnp.int32))
    decode_params = scan_layout.for_layout(params, self.decode_model.cfg.scan_layers)
    encoded_b = search.expand_to_beams(encoded, beam_size)
    inputs_b = search.expand_to_beams(inputs, beam_size)

    def tokens_to_logits(tokens, cache):
      logits, updated = self.decode_model.apply({'params': decode_params, 'cache': cache},
                                                encoded_b, inputs_b, tokens,
                                                method=EncoderDecoder.decode, mutable=['cache'])
      return logits[:, -1, :], updated['cache']

    if beam_size == 1:
      return search.greedy_search(tokens_to_logits, cache, batch_size=batch_size, max_len=max_len,
                                  eos_id=EOS_ID)
    sequences, _ = search.beam_search(tokens_to_logits, cache, batch_size=batch_size,
                                      beam_size=beam_size, max_len=max_len, alpha=alpha,
                                      eos_id=EOS_ID)
    return sequences[:, 0, :]

  def _predict_fn(self, mesh, max_len: int, beam_size: int, alpha: float):
    key = (id(mesh), max_len, beam_size, alpha)
    if key not in self._predict_fns:
      self._predict_fns[key] = jax.jit(
          functools.partial(self.predict_tokens, max_len=max_len, beam_size=beam_size,
                            alpha=alpha), out_shardings=sharding.replicated(mesh),
          compiler_options=search.decode_compiler_options())
    return self._predict_fns[key]

  def translate(self, params, sources: list[str], mesh, *, beam_size: int | None = None,
                alpha: float | None = None, rows: int | None = None) -> list[str]:
    """Detokenised translations of `sources`, in order; batches are grouped by length."""
    beam_size = beam_size or self.beam_size
    alpha = self.alpha if alpha is None else alpha
    rows = rows or self.decode_rows
    ways = sharding.data_parallel_size(mesh)
    rows = max(ways, rows // ways * ways)
    encoded = [self.src_tokenizer.encode(s)[:self.cfg.max_len - 1] + [EOS_ID] for s in sources]
    order = np.argsort([len(e) for e in encoded], kind='stable')
    outputs = [''] * len(sources)
    with sharding.use_mesh(mesh):
      for start in range(0, len(order), rows):
        chunk = order[start:start + rows]
        longest = max(len(encoded[i]) for i in chunk)
        src_len = min(self.cfg.max_len, -(-longest // 8) * 8)  # round up: few compiled shapes
        # Targets are rarely much longer than sources; cap to keep decoding cheap.
        max_len = min(self.cfg.max_len, -(-int(src_len * 1.5 + 8) // 8) * 8)
        inputs = np.zeros((rows, src_len), np.int32)
        for r, i in enumerate(chunk):
          inputs[r, :len(encoded[i])] = encoded[i]
        inputs = jax.device_put(inputs, sharding.batch_sharding(mesh))
        tokens = np.asarray(
            jax.device_get(self._predict_fn(mesh, max_len, beam_size, alpha)(params, inputs)))
        for r, i in enumerate(chunk):
          outputs[i] = self.tgt_tokenizer.decode(tokens[r].tolist())
    return outputs

  # -- evaluation -----------------------------------------------------------------------------

  def evaluate(self, context, params, step: int) -> dict[str, float]:
    """Detokenised, cased sacreBLEU on the validation set, plus sample translations in the log."""
    if not self.eval_sources:
      return {}
    start = time.time()
    hypotheses = self.translate(params, self.eval_sources, context.mesh)
    bleu = sacrebleu.corpus_bleu(hypotheses, [self.eval_references])
    samples = []
    for i in range(min(self.num_samples, len(hypotheses))):
      samples.append(f'SRC: {self.eval_sources[i]}\nREF: {self.eval_references[i]}\n'
                     f'OUT: {hypotheses[i]}')
    logging.info('step %d: BLEU %.2f on %d sentences (beam %d, %.1f s)\n%s', step, bleu.score,
                 len(hypotheses), self.beam_size,
                 time.time() - start, '\n\n'.join(samples))
    context.write_text(step, 'samples', '\n\n'.join(s.replace('\n', '  \n') for s in samples))
    exact = float(
        np.mean([h.strip() == r.strip() for h, r in zip(hypotheses, self.eval_references)]))
    return {'bleu': bleu.score, 'exact_match': exact}

  def summary_images(self, params) -> dict[str, np.ndarray]:
    """Attention maps (layers x heads per stack and type) of the first validation pair, its
    reference teacher-forced: the same sentence at every evaluation, for TensorBoard."""
    if not self.eval_sources or self.src_tokenizer is None:
      return {}
    maps = attention_maps.translation_attention(self.model, params, self.src_tokenizer,
                                                self.tgt_tokenizer, self.eval_sources[0],
                                                self.eval_references[0])
    return heatmaps.overview_images(maps)
