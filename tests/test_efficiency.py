"""Efficiency switches change memory and compile time, never the numbers: nn.scan over layers vs
unrolled, remat vs none, k accumulated micro-batches vs one k-times batch, and bf16 compute."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.layers import scan_layout
from transformer_jax.training.accumulation import accumulated_value_and_grad, split_micro_batches
from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig
from transformer_jax.models.gpt import gpt2_config, llama_config
from transformer_jax.tasks.lm import LanguageModelTask
from transformer_jax.tasks.translation import TranslationTask

VOCAB = 48


def gpt_task(**overrides):
  return LanguageModelTask(
      gpt2_config(vocab_size=VOCAB, emb_dim=32, num_heads=4, mlp_dim=64, num_decoder_layers=2,
                  max_len=16, **overrides))


def t5_task(**overrides):
  """Pre-RMSNorm, relative position bias, gated GELU: the bias goes through scan/remat too."""
  cfg = TransformerConfig(vocab_size=VOCAB, emb_dim=32, num_heads=4, mlp_dim=64,
                          num_encoder_layers=1, num_decoder_layers=2, max_len=16,
                          norm_type='rmsnorm', norm_position='pre', position='relative',
                          activation='geglu', use_bias=False, **overrides)
  return TranslationTask(cfg, label_smoothing=0.1)


def lm_batch(rows=8, seed=0):
  r = np.random.RandomState(seed)
  tokens = r.randint(0, VOCAB, (rows, 13)).astype(np.int32)
  return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}


def translation_batch(rows=8, seed=0):
  """Right-padded rows of different lengths: micro-batches score different token counts."""
  r = np.random.RandomState(seed)
  inputs = r.randint(3, VOCAB, (rows, 11)).astype(np.int32)
  targets = r.randint(3, VOCAB, (rows, 9)).astype(np.int32)
  for row in range(rows):
    inputs[row, r.randint(2, 12):] = 0
    targets[row, r.randint(1, 10):] = 0
  return {'inputs': inputs, 'targets': targets}


def params_of(task, seed=0):
  return nn.meta.unbox(task.init_variables(jax.random.key(seed))['params'])


def loss_and_grads(task, params, batch, *, train: bool):
  """Loss and gradients; with train=True dropout is on (fixed key), label smoothing too."""
  rng = jax.random.key(7)
  fn = lambda p: task.loss_fn(p, batch, rng, not train)[0]
  return jax.jit(jax.value_and_grad(fn))(params)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-7):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for path, x in jax.tree_util.tree_flatten_with_path(a)[0]:
    y = b
    for key in path:
      y = y[key.key]
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                               err_msg=jax.tree_util.keystr(path))


# -- nn.scan over layers -------------------------------------------------------------------------


@pytest.mark.parametrize('make_task, make_batch', [(gpt_task, lm_batch),
                                                   (t5_task, translation_batch)])
@pytest.mark.slow
def test_scanned_layers_equal_unrolled_loss_and_gradients(make_task, make_batch):
  """The unrolled model's params, stacked, give the scanned model the same loss and gradients
  (no dropout: scan draws its per-layer dropout keys differently)."""
  unrolled = make_task(dropout_rate=0.0, attention_dropout_rate=0.0)
  scanned = make_task(dropout_rate=0.0, attention_dropout_rate=0.0, scan_layers=True)
  params = params_of(unrolled)
  stacked = scan_layout.stack_layers(params)
  # The layouts are each other's inverse, and the scanned model declares exactly this layout.
  assert_trees_close(scan_layout.unstack_layers(stacked), params, rtol=0, atol=0)
  expected = jax.tree.map(lambda x: (x.shape, x.dtype), params_of(scanned))
  assert jax.tree.map(lambda x: (x.shape, x.dtype), stacked) == expected
  batch = make_batch()
  loss, grads = loss_and_grads(unrolled, params, batch, train=True)
  scan_loss, scan_grads = loss_and_grads(scanned, stacked, batch, train=True)
  np.testing.assert_allclose(scan_loss, loss, rtol=1e-5)
  assert_trees_close(scan_layout.unstack_layers(scan_grads), grads)


def test_scanned_params_carry_a_layers_axis_name():
  boxed = gpt_task(scan_layers=True).init_variables(jax.random.key(0))
  specs = nn.get_partition_spec(boxed)['params']['stack']['layers']
  assert specs['mlp']['wi']['kernel'] == jax.sharding.PartitionSpec('layers', 'embed', 'mlp')
  assert specs['self_attention']['query']['kernel'][0] == 'layers'


def with_scanned_decoder(task):
  """`task` decoding through a scanned decode-mode model (the tasks decode unrolled)."""
  scanned = lambda model: type(model)(model.cfg.replace(scan_layers=True))
  task.decode_model = scanned(task.decode_model)
  if hasattr(task, 'decode_models'):  # the language model's, one per kernel layout
    task.decode_models = {layout: scanned(model) for layout, model in task.decode_models.items()}
  return task


@pytest.mark.slow
@pytest.mark.parametrize('scanned_decoder', [False, True])
def test_scanned_gpt_decodes_the_same_tokens_as_unrolled(scanned_decoder):
  """Greedy generation from stacked params is identical: converted back to unrolled layers
  (what the task does), or through a scanned decoder whose KV caches are scanned too."""
  unrolled = gpt_task(dropout_rate=0.0, attention_dropout_rate=0.0)
  scanned = gpt_task(dropout_rate=0.0, attention_dropout_rate=0.0, scan_layers=True)
  if scanned_decoder:
    scanned = with_scanned_decoder(scanned)
  params = params_of(unrolled)
  prompt = np.asarray([[1, 2, 3], [4, 5, 6]], np.int32)
  kwargs = dict(max_new_tokens=6, rng=jax.random.key(0), temperature=0.0)
  np.testing.assert_array_equal(
      scanned.generate(scan_layout.stack_layers(params), prompt, **kwargs),
      unrolled.generate(params, prompt, **kwargs))


@pytest.mark.slow
@pytest.mark.parametrize('scanned_decoder', [False, True])
def test_scanned_t5_beam_searches_the_same_translations_as_unrolled(scanned_decoder):
  """The same with beam search over a T5-style decoder. A scanned decoder's relative bias must
  span the whole KV cache (its table enters the scan as an array) and its stacked caches must
  keep rows first (the beam helpers reorder rows)."""
  unrolled = t5_task(dropout_rate=0.0, attention_dropout_rate=0.0)
  scanned = t5_task(dropout_rate=0.0, attention_dropout_rate=0.0, scan_layers=True)
  if scanned_decoder:
    scanned = with_scanned_decoder(scanned)
  params = params_of(unrolled, seed=3)
  inputs = translation_batch(rows=3, seed=5)['inputs']
  kwargs = dict(max_len=10, beam_size=3, alpha=0.6)
  expected = np.asarray(unrolled.predict_tokens(params, inputs, **kwargs))
  got = scanned.predict_tokens(scan_layout.stack_layers(params), inputs, **kwargs)
  np.testing.assert_array_equal(np.asarray(got), expected)
  # Random weights rarely emit EOS early: the outputs really span several decoding steps.
  assert np.count_nonzero(expected) > 3 * 3


# -- rematerialisation ---------------------------------------------------------------------------


@pytest.mark.parametrize('make_task, make_batch, policy, scan', [
    (t5_task, translation_batch, 'nothing_saveable', False),
    (gpt_task, lm_batch, 'dots_saveable', True),
])
@pytest.mark.slow
def test_remat_equals_no_remat_with_dropout_on(make_task, make_batch, policy, scan):
  """Recomputing a layer on the backward pass redraws the same dropout masks: same numbers."""
  plain = make_task(scan_layers=scan)
  remat = make_task(scan_layers=scan, remat_policy=policy)
  params = params_of(plain)
  assert jax.tree.structure(params) == jax.tree.structure(params_of(remat))
  batch = make_batch()
  loss, grads = loss_and_grads(plain, params, batch, train=True)
  remat_loss, remat_grads = loss_and_grads(remat, params, batch, train=True)
  np.testing.assert_allclose(remat_loss, loss, rtol=1e-5)
  assert_trees_close(remat_grads, grads)


@pytest.mark.slow
def test_remat_recomputes_on_the_backward_pass():
  """nothing_saveable really rematerialises: the gradient program has more matmuls."""
  batch = lm_batch()

  def dots(task):
    params = params_of(task)
    fn = jax.grad(lambda p: task.loss_fn(p, batch, jax.random.key(0), True)[0])
    return jax.jit(fn).lower(params).as_text().count('dot_general')

  assert dots(gpt_task(remat_policy='nothing_saveable')) > dots(gpt_task())


def test_unknown_remat_policy_is_a_config_error():
  with pytest.raises(ConfigError, match='remat_policy must be one of'):
    gpt2_config(remat_policy='save_everything_please')


# -- gradient accumulation -----------------------------------------------------------------------


def test_micro_batches_take_strided_rows():
  batch = {'x': np.arange(12).reshape(6, 2)}
  micro = split_micro_batches(batch, 3)['x']
  assert micro.shape == (3, 2, 2)
  np.testing.assert_array_equal(micro[1], [[2, 3], [8, 9]])  # rows 1 and 4


@pytest.mark.parametrize('make_task, make_batch', [(gpt_task, lm_batch),
                                                   (t5_task, translation_batch)])
@pytest.mark.slow
def test_accumulated_micro_batches_equal_one_big_batch(make_task, make_batch):
  """4 micro-batches of 4 rows = one batch of 16 rows: loss, metric sums and gradients, with
  padding (different token counts per micro-batch) and label smoothing."""
  task = make_task(dropout_rate=0.0, attention_dropout_rate=0.0)
  params = params_of(task)
  batch = make_batch(rows=16, seed=3)
  rng = jax.random.key(1)
  grad_fn = jax.value_and_grad(lambda p: task.loss_fn(p, batch, rng, False), has_aux=True)
  (loss, metrics), grads = jax.jit(grad_fn)(params)
  (acc_loss, acc_metrics), acc_grads = jax.jit(
      lambda p: accumulated_value_and_grad(task.loss_fn, p, batch, rng, 4))(params)
  np.testing.assert_allclose(acc_loss, loss, rtol=1e-5)
  for key in metrics:
    np.testing.assert_allclose(acc_metrics[key], metrics[key], rtol=1e-5, err_msg=key)
  assert_trees_close(acc_grads, grads)


@pytest.mark.slow
def test_trainer_step_with_accumulation_equals_plain_step():
  """The trainer's jitted step with train.accumulation_steps=4 makes the same update."""
  from experiments.configs.common import base_config
  from transformer_jax.training.trainer import (TrainState, make_train_step)
  from transformer_jax.training.optimizer import make_optimizer
  task = gpt_task(dropout_rate=0.0, attention_dropout_rate=0.0)
  config = base_config()
  tx, _ = make_optimizer(config.optimizer)
  params = params_of(task)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
  batch = lm_batch(rows=16, seed=5)
  plain_state, plain = jax.jit(make_train_step(task.loss_fn, tx, 0))(state, batch)
  acc_state, acc = jax.jit(make_train_step(task.loss_fn, tx, 0, accumulation_steps=4))(state, batch)
  for key in ('loss_mean', 'grad_norm', 'loss', 'weight'):
    np.testing.assert_allclose(acc[key], plain[key], rtol=1e-5, err_msg=key)
  assert_trees_close(acc_state.params, plain_state.params, rtol=1e-5, atol=1e-6)


def test_batch_not_divisible_into_micro_batches_is_a_config_error(tiny_config):
  """Validation names the accumulation steps when the batch can't be cut into micro-batches."""
  from transformer_jax.cli import validation
  config = tiny_config()
  config.train.accumulation_steps = 3
  with pytest.raises(ConfigError, match='accumulation_steps=3'):
    validation.check_training(config, global_batch=8)
  config.train.accumulation_steps = 4
  validation.check_training(config, global_batch=8)


# -- mixed precision -----------------------------------------------------------------------------


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_params_gradients_logits_and_loss():
  """dtype=bfloat16, param_dtype=float32: bf16 matmuls, fp32 master weights, softmax and loss."""
  fp32 = LanguageModelTask(
      llama_config(vocab_size=VOCAB, emb_dim=32, num_heads=4, num_kv_heads=2, mlp_dim=64,
                   num_decoder_layers=2, max_len=16))
  bf16 = LanguageModelTask(fp32.cfg.replace(dtype=jnp.bfloat16))
  params = params_of(bf16)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  batch = lm_batch()
  logits = bf16.model.apply({'params': params}, batch['inputs'])
  assert logits.dtype == jnp.float32
  hlo = jax.jit(lambda p: bf16.model.apply({'params': p}, batch['inputs'])).lower(params).as_text()
  assert 'bf16' in hlo  # the matmuls really run in bfloat16
  loss, grads = loss_and_grads(bf16, params, batch, train=False)
  ref_loss, ref_grads = loss_and_grads(fp32, params, batch, train=False)
  assert loss.dtype == jnp.float32
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
  np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
  cosine = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))
  norms = optax_norm(grads) * optax_norm(ref_grads)
  assert cosine / norms > 0.99


def optax_norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))
