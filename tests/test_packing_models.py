"""Packed rows compute what their examples compute alone, in every model family and every
attention implementation that runs on CPU.

A packed batch puts several examples in one row with segment ids (which example a token
belongs to) and positions that restart at 0 per example. For each family (GPT-2, LLaMA, the
original encoder-decoder, T5, BERT, RoBERTa, ALBERT) and each implementation (reference,
chunked, xla; the Pallas TPU kernel, run by its interpreter, for LLaMA, T5 and ALBERT), the
per-example losses and the gradients of their sum equal those of the same examples each alone
in a padded row, to rtol 1e-5 in float32. The rows include an example that ends exactly at the
row's end, a row holding one example that fills it, and rows with padding.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from transformer_jax.layers.position import packed_positions
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models import bert as bert_models
from transformer_jax.models.encoder_decoder import EncoderDecoder, shift_right, t5_config
from transformer_jax.models.gpt import GPT, gpt2_config, llama_config


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
  with jax.default_matmul_precision('highest'):
    yield


ROW = 16  # tokens per packed row
VOCAB = 40
# Example lengths per packed row: 5 + 4 + 7 ends exactly at the row's end; 16 fills a row alone;
# the last two rows are padded (one of them holds a single example).
ROWS = [[5, 4, 7], [16], [3, 6], [9]]
# Targets of the encoder-decoder's pairs (pair k of a row: source ROWS[r][k], target TARGETS[r][k]).
TARGETS = [[6, 3, 7], [12], [4, 9], [16]]
IMPLEMENTATIONS = ['reference', 'chunked', 'xla', 'pallas']
# The Pallas kernel runs interpreted on CPU, 15-50 s a model: it runs on the family of each kind
# with the most to get right (LLaMA: grouped-query heads, rotary; T5: relative bias, unscaled
# logits, cross-attention; ALBERT: factorised embedding, one shared layer), out of the fast loop.
PALLAS_FAMILIES = ('llama', 't5', 'albert')


def cases(families):
  """(family, implementation) pairs: every CPU implementation, Pallas on PALLAS_FAMILIES."""
  return [
      pytest.param(family, implementation, marks=pytest.mark.slow)
      if implementation == 'pallas' else (family, implementation)
      for family in sorted(families)
      for implementation in IMPLEMENTATIONS
      if implementation != 'pallas' or family in PALLAS_FAMILIES
  ]


SMALL = dict(vocab_size=VOCAB, emb_dim=32, num_heads=4, mlp_dim=64, max_len=ROW, dropout_rate=0.0,
             attention_dropout_rate=0.0)
DECODERS = {
    'gpt2': lambda **kw: gpt2_config(num_decoder_layers=2, **SMALL, **kw),
    'llama': lambda **kw: llama_config(num_decoder_layers=2, num_kv_heads=2, **SMALL, **kw),
}
ENCODER_DECODERS = {
    # The original Transformer: sinusoidal positions, Post-LN, shared scaled embeddings.
    'transformer':
        lambda **kw: TransformerConfig(num_encoder_layers=2, num_decoder_layers=2, share_embeddings=
                                       True, **SMALL, **kw),
    # T5 v1.1: relative position bias, unscaled attention logits, gated GELU.
    't5':
        lambda **kw: t5_config('1.1', num_encoder_layers=2, num_decoder_layers=2, head_dim=8,
                               relative_buckets=8, relative_max_distance=12, **SMALL, **kw),
}
ENCODERS = {
    'bert':
        lambda **kw: bert_models.bert_config(num_encoder_layers=2, **SMALL, **kw),
    'roberta':
        lambda **kw: bert_models.roberta_config(num_encoder_layers=2, **SMALL, **kw),
    'albert':
        lambda **kw: bert_models.albert_config(num_encoder_layers=2, embedding_size=16, **SMALL, **
                                               kw),
}


def pallas_depth(implementation, encoder=False, encoder_decoder=False) -> dict:
  """One layer per stack for the interpreted Pallas kernel (its cost is per call), else the
  family's two."""
  if implementation != 'pallas':
    return {}
  if encoder_decoder:
    return dict(num_encoder_layers=1, num_decoder_layers=1)
  return dict(num_encoder_layers=1) if encoder else dict(num_decoder_layers=1)


def pack(sequences_per_row):
  """(tokens, segment ids, positions) int32 [rows, ROW] of the rows' sequences packed."""
  tokens = np.zeros((len(sequences_per_row), ROW), np.int32)
  segments, positions = np.zeros_like(tokens), np.zeros_like(tokens)
  for r, sequences in enumerate(sequences_per_row):
    start = 0
    for k, seq in enumerate(sequences):
      tokens[r, start:start + len(seq)] = seq
      segments[r, start:start + len(seq)] = k + 1
      positions[r, start:start + len(seq)] = np.arange(len(seq))
      start += len(seq)
  return tokens, segments, positions


def unpack(sequences_per_row):
  """Tokens [examples, ROW]: every sequence alone in a padded row (the same order)."""
  flat = [seq for sequences in sequences_per_row for seq in sequences]
  tokens = np.zeros((len(flat), ROW), np.int32)
  for i, seq in enumerate(flat):
    tokens[i, :len(seq)] = seq
  return tokens


def draw(lengths_per_row, seed):
  """Random ids (never 0 = padding) with the given lengths, nested as `lengths_per_row`."""
  rng = np.random.default_rng(seed)
  return [[rng.integers(1, VOCAB, n) for n in row] for row in lengths_per_row]


def per_token_nll(logits, labels):
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]


def example_sums(values, segment_ids, counts):
  """Per-example sums [examples] of per-token `values` [rows, T] of packed rows, in order."""
  out = []
  for r, count in enumerate(counts):
    for k in range(count):
      out.append(jnp.sum(jnp.where(segment_ids[r] == k + 1, values[r], 0.0)))
  return jnp.stack(out)


def run_with(implementation, fn):
  if implementation == 'pallas':  # the TPU kernel, run by Pallas's interpreter on CPU
    with pltpu.force_tpu_interpret_mode():
      return fn()
  return fn()


def init_params(model, implementation, *args, **kwargs):
  """The model's params: the same for every attention implementation, so made by the reference
  one (Pallas's TPU interpreter can hang when called eagerly a second time in a process)."""
  del implementation
  reference = model.clone(cfg=model.cfg.replace(attention_implementation='reference'))
  return reference.init(jax.random.key(0), *args, **kwargs)['params']


def check_equal(packed, unpacked):
  """Per-example losses and every gradient entry to rtol 1e-5. Entries that are zero but for
  rounding (e.g. the key bias's: softmax ignores a shift shared by all keys) are held to an
  absolute 1e-6 of the largest gradient entry instead."""
  (loss_p, grads_p), (loss_u, grads_u) = packed, unpacked
  np.testing.assert_allclose(loss_p, loss_u, rtol=1e-5)
  flat_p, flat_u = jax.tree.leaves_with_path(grads_p), jax.tree.leaves(grads_u)
  assert len(flat_p) == len(flat_u)
  scale = max(float(np.abs(g).max()) for g in flat_u)
  for (path, g_p), g_u in zip(flat_p, flat_u):
    np.testing.assert_allclose(g_p, g_u, rtol=1e-5, atol=1e-6 * scale,
                               err_msg=jax.tree_util.keystr(path))


def losses_and_grads(loss_fn, params):
  """(per-example losses, gradient of their sum), as one jitted program."""

  def both(params):
    losses, vjp = jax.vjp(loss_fn, params)
    return losses, vjp(jnp.ones_like(losses))[0]

  return jax.jit(both)(params)


# -- decoder-only (GPT-2, LLaMA) ------------------------------------------------------------


@pytest.mark.parametrize('family,implementation', cases(DECODERS))
def test_decoder_only_packed_equals_unpacked(family, implementation):
  cfg = DECODERS[family](attention_implementation=implementation)
  cfg = cfg.replace(**pallas_depth(implementation))
  check_decoder(cfg, implementation)


@pytest.mark.parametrize('layout', ['scan', 'remat'])
def test_decoder_only_packed_equals_unpacked_scanned_and_rematerialised(layout):
  """Segment ids and positions travel through nn.scan / nn.remat's positional arguments."""
  cfg = DECODERS['llama'](attention_implementation='chunked', scan_layers=layout == 'scan',
                          remat_policy='nothing_saveable' if layout == 'remat' else 'none')
  check_decoder(cfg, 'chunked')


def check_decoder(cfg, implementation):
  model = GPT(cfg)
  sequences = draw(ROWS, seed=1)
  labels = draw(ROWS, seed=2)  # any labels: the loss only has to be a function of each token
  counts = [len(row) for row in ROWS]
  tokens, segments, positions = pack(sequences)
  packed_labels = pack(labels)[0]
  params = init_params(model, implementation, tokens[:1])
  lone, lone_labels = unpack(sequences), unpack(labels)
  lone_segments = pack([[s] for row in sequences for s in row])[1]

  def packed_loss(p):
    logits = model.apply({'params': p}, tokens, segment_ids=segments, positions=positions)
    return example_sums(per_token_nll(logits, packed_labels), segments, counts)

  def unpacked_loss(p):
    logits = model.apply({'params': p}, lone)
    return example_sums(per_token_nll(logits, lone_labels), lone_segments, [1] * len(lone))

  check_equal(run_with(implementation, lambda: losses_and_grads(packed_loss, params)),
              run_with(implementation, lambda: losses_and_grads(unpacked_loss, params)))


# -- encoder-decoder (Transformer, T5) --------------------------------------------------------


@pytest.mark.parametrize('family,implementation', cases(ENCODER_DECODERS))
def test_encoder_decoder_packed_equals_unpacked(family, implementation):
  cfg = ENCODER_DECODERS[family](attention_implementation=implementation)
  cfg = cfg.replace(**pallas_depth(implementation, encoder_decoder=True))
  model = EncoderDecoder(cfg)
  sources, targets = draw(ROWS, seed=3), draw(TARGETS, seed=4)
  counts = [len(row) for row in ROWS]
  inputs, in_segments, in_positions = pack(sources)
  outputs, out_segments, out_positions = pack(targets)
  params = init_params(model, implementation, inputs[:1], outputs[:1])
  lone_inputs, lone_targets = unpack(sources), unpack(targets)
  lone_segments = pack([[t] for row in targets for t in row])[1]

  def packed_loss(p):
    logits = model.apply({'params': p}, inputs, outputs, inputs_segment_ids=in_segments,
                         inputs_positions=in_positions, targets_segment_ids=out_segments,
                         targets_positions=out_positions)
    return example_sums(per_token_nll(logits, outputs), out_segments, counts)

  def unpacked_loss(p):
    logits = model.apply({'params': p}, lone_inputs, lone_targets)
    return example_sums(per_token_nll(logits, lone_targets), lone_segments, [1] * len(lone_inputs))

  check_equal(run_with(implementation, lambda: losses_and_grads(packed_loss, params)),
              run_with(implementation, lambda: losses_and_grads(unpacked_loss, params)))


def test_shift_right_starts_every_packed_example_afresh():
  targets = jnp.asarray([[5, 6, 7, 8, 9, 0]])
  segments = jnp.asarray([[1, 1, 2, 2, 2, 0]])
  np.testing.assert_array_equal(shift_right(targets, segment_ids=segments), [[0, 5, 0, 7, 8, 0]])
  np.testing.assert_array_equal(shift_right(targets, start_id=3, segment_ids=segments),
                                [[3, 5, 3, 7, 8, 3]])


# -- encoder-only (BERT, RoBERTa, ALBERT) ---------------------------------------------------


@pytest.mark.parametrize('family,implementation', cases(ENCODERS))
def test_encoder_only_packed_equals_unpacked(family, implementation):
  cfg = ENCODERS[family](attention_implementation=implementation)
  cfg = cfg.replace(**pallas_depth(implementation, encoder=True))
  model = bert_models.Bert(cfg, mlm=True, sentence_classes=0)
  sequences, labels = draw(ROWS, seed=5), draw(ROWS, seed=6)
  counts = [len(row) for row in ROWS]
  tokens, segments, positions = pack(sequences)
  packed_labels = pack(labels)[0]
  # BERT's token types: sentence B of each example gets type 1 (its last two tokens here).
  types = np.zeros_like(tokens)
  for r, row in enumerate(sequences):
    ends = np.cumsum([len(s) for s in row])
    types[r, ends - 1] = types[r, ends - 2] = 1
  lone, lone_labels = unpack(sequences), unpack(labels)
  lone_types = np.zeros_like(lone)
  for i, seq in enumerate(s for row in sequences for s in row):
    lone_types[i, len(seq) - 2:len(seq)] = 1
  lone_segments = pack([[s] for row in sequences for s in row])[1]
  every = lambda x: jnp.broadcast_to(jnp.arange(ROW), x.shape)  # MLM logits at every position
  params = init_params(model, implementation, tokens[:1], types[:1],
                       mlm_positions=every(tokens[:1]))

  def packed_loss(p):
    out = model.apply({'params': p}, tokens, types, mlm_positions=every(tokens),
                      segment_ids=segments, positions=positions)
    return example_sums(per_token_nll(out['mlm_logits'], packed_labels), segments, counts)

  def unpacked_loss(p):
    out = model.apply({'params': p}, lone, lone_types, mlm_positions=every(lone))
    return example_sums(per_token_nll(out['mlm_logits'], lone_labels), lone_segments,
                        [1] * len(lone))

  check_equal(run_with(implementation, lambda: losses_and_grads(packed_loss, params)),
              run_with(implementation, lambda: losses_and_grads(unpacked_loss, params)))


# -- positions --------------------------------------------------------------------------------


def test_packed_positions_restart_at_every_example():
  segments = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(packed_positions(segments),
                                [[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7]])


@pytest.mark.parametrize('position', ['learned', 'sinusoidal'])
def test_position_embeddings_restart_per_example(position):
  """The embedded input of example k in a packed row is the embedded input of example k alone:
  its position vectors count from its own start, not the row's."""
  cfg = DECODERS['gpt2'](position=position)
  model = GPT(cfg)
  sequences = draw(ROWS, seed=7)
  tokens, segments, positions = pack(sequences)
  lone = unpack(sequences)
  variables = model.init(jax.random.key(0), tokens[:1])
  embed = functools.partial(model.apply, variables, method=lambda m, t, p: m.input_embedding(t, p))
  packed = np.asarray(embed(tokens, jnp.asarray(positions)))
  alone = np.asarray(embed(lone, jnp.arange(ROW)))
  i = 0
  for r, row in enumerate(sequences):
    start = 0
    for seq in row:
      np.testing.assert_allclose(packed[r, start:start + len(seq)], alone[i, :len(seq)], rtol=1e-6,
                                 atol=1e-7)
      start, i = start + len(seq), i + 1
  # Row positions instead of restarted ones would give other vectors: the check can fail.
  shifted = np.asarray(embed(tokens, jnp.arange(ROW)))
  assert np.abs(shifted[0, 5:9] - alone[1, :4]).max() > 1e-3


# -- the translation task: a packed training step, then decoding ------------------------------


def test_packed_translation_step_trains_the_model_that_unpacked_trains_and_it_decodes_the_same():
  """`TranslationTask.loss_fn` on a packed batch (the keys of data/packing.py) gives the loss
  and gradient of the same pairs unpacked; after an optimizer step from one init, greedy
  decoding of every source gives the same tokens from both models."""
  import optax
  from transformer_jax.tasks.translation import TranslationTask
  cfg = ENCODER_DECODERS['transformer'](attention_implementation='chunked')
  task = TranslationTask(cfg, label_smoothing=0.1)
  sources, targets = draw(ROWS, seed=8), draw(TARGETS, seed=9)
  inputs, in_segments, in_positions = pack(sources)
  outputs, out_segments, out_positions = pack(targets)
  packed = {
      'inputs': inputs, 'targets': outputs, 'inputs_segment_ids': in_segments,
      'inputs_positions': in_positions, 'targets_segment_ids': out_segments,
      'targets_positions': out_positions
  }
  unpacked = {'inputs': unpack(sources), 'targets': unpack(targets)}
  params = nn.meta.unbox(task.init_variables(jax.random.key(0))['params'])
  tx = optax.adam(3e-2)

  def step(batch):
    grad_fn = jax.value_and_grad(lambda p: task.loss_fn(p, batch, jax.random.key(1), False)[0])
    loss, grads = jax.jit(grad_fn)(params)
    updates, _ = tx.update(grads, tx.init(params), params)
    return loss, optax.apply_updates(params, updates)

  (loss_p, params_p), (loss_u, params_u) = step(packed), step(unpacked)
  np.testing.assert_allclose(loss_p, loss_u, rtol=1e-5)
  # The loss is not the unpacked one by accident: without segment ids the packed rows differ.
  loss_mixed = step({'inputs': inputs, 'targets': outputs})[0]
  assert abs(float(loss_mixed) - float(loss_u)) > 1e-3
  lone_inputs = unpack(sources)
  decode = lambda p: np.asarray(
      task.predict_tokens(p, jnp.asarray(lone_inputs), max_len=ROW, beam_size=1, alpha=0.6))
  decoded_p, decoded_u = decode(params_p), decode(params_u)
  np.testing.assert_array_equal(decoded_p, decoded_u)
  assert len({tuple(row) for row in decoded_p}) > 1  # not one constant output
