"""Integration tests of training: learning, exact resumption, non-finite steps, checkpoints,
preemption, learning-rate schedules and the device mesh."""

import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from experiments.configs.common import base_config
from transformer_jax import flops
from transformer_jax.training import checkpointing
from transformer_jax.training import optimizer as optim
from transformer_jax.parallel import sharding
from transformer_jax.errors import ConfigError, UserError
from transformer_jax.model_config import TransformerConfig
from transformer_jax.workflows import translation
from transformer_jax.training.trainer import NonFiniteError, Trainer, TrainState, make_train_step


def read_metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def train_steps_logged(workdir) -> list[int]:
  return [r['step'] for r in read_metrics(workdir) if 'train/loss' in r]


def assert_trees_equal(a, b):
  """Bitwise equality of two pytrees of arrays (same structure, shapes, dtypes, values)."""
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x, y)


def trees_equal(a, b) -> bool:
  return all(
      np.array_equal(np.asarray(x), np.asarray(y))
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# -- learning and resumption with the translation task -------------------------------------------


@pytest.mark.slow
def test_tiny_model_learns_numbers_translation_and_reports_bleu(tiny_config, tmp_path):
  """train_and_evaluate on the numbers corpus: the final eval loss is well below the first
  logged train loss (which starts near uniform), and BLEU is computed and logged."""
  config = tiny_config(train__num_steps=60)
  results = translation.train_and_evaluate(config, str(tmp_path))

  records = read_metrics(tmp_path)
  train = [r for r in records if 'train/loss' in r]
  first_loss = train[0]['train/loss']
  # A fresh model predicts roughly uniformly over the vocabulary.
  assert first_loss > 0.7 * np.log(config.tokenizer.vocab_size)
  assert results['step'] == 60
  assert np.isfinite(results['eval_loss'])
  assert results['eval_loss'] < 0.6 * first_loss, (first_loss, results['eval_loss'])
  assert results['eval_accuracy'] > train[0]['train/accuracy']
  assert 0.0 <= results['eval_bleu'] <= 100.0
  eval_records = [r for r in records if 'eval/bleu' in r]
  assert [r['step'] for r in eval_records] == [60]
  assert eval_records[0]['eval/loss'] == pytest.approx(results['eval_loss'])
  assert os.path.isdir(tmp_path / 'checkpoints' / '60')  # the last step is always saved


def resume_config(tiny_config, num_steps: int):
  # Dropout on, so that the per-step dropout keys matter for the comparison.
  return tiny_config(train__num_steps=num_steps, train__checkpoint_every=10,
                     model__dropout_rate=0.1, model__attention_dropout_rate=0.1)


@pytest.fixture(scope='module')
def numbers_train_pairs(tiny_config):
  """The tiny config's training pairs (generated once per module)."""
  config = resume_config(tiny_config, 1)
  pairs = translation.load_split(config, config.data.train_prefix)
  return tuple(side[:config.data.max_train_examples] for side in pairs)


def train_translation(config, workdir, train_pairs):
  """Trains with the real Trainer, TranslationTask and batcher (no evaluation)."""
  _, trainer, (src_tok, tgt_tok) = translation.build(config, str(workdir), train_pairs)
  data = translation.make_batcher(config, trainer, src_tok, tgt_tok, train_pairs, train=True)
  try:
    results = trainer.fit(data)
  finally:
    trainer.close()
  return results, trainer.state, data.state()


@pytest.mark.slow
def test_resumed_run_matches_uninterrupted_run_bitwise(tiny_config, tmp_path, numbers_train_pairs,
                                                       caplog):
  """20 steps, then a second run to 40 in the same workdir, ends with exactly the same
  parameters, optimizer state and data position as 40 uninterrupted steps: the checkpoint
  holds the batcher position and dropout keys depend only on (seed, step)."""
  caplog.set_level(logging.INFO, logger='absl')
  resumed_dir, reference_dir = tmp_path / 'resumed', tmp_path / 'reference'

  first, _, first_data = train_translation(resume_config(tiny_config, 20), resumed_dir,
                                           numbers_train_pairs)
  assert first['step'] == 20
  assert sorted(os.listdir(resumed_dir / 'checkpoints')) == ['10', '20']
  caplog.clear()
  second, resumed_state, resumed_data = train_translation(resume_config(tiny_config, 40),
                                                          resumed_dir, numbers_train_pairs)
  assert 'restored checkpoint at step 20' in caplog.text
  assert second['step'] == 40
  # The second run logged steps 25..40 only: it did not start again from step 0.
  assert train_steps_logged(resumed_dir) == [5, 10, 15, 20, 25, 30, 35, 40]

  _, reference_state, reference_data = train_translation(resume_config(tiny_config, 40),
                                                         reference_dir, numbers_train_pairs)
  assert int(resumed_state.step) == int(reference_state.step) == 40
  assert resumed_data == reference_data != first_data
  assert_trees_equal(resumed_state.params, reference_state.params)
  assert_trees_equal(resumed_state.opt_state, reference_state.opt_state)
  # The logged training losses after the resume point agree too.
  resumed = {r['step']: r['train/loss'] for r in read_metrics(resumed_dir) if 'train/loss' in r}
  reference = {r['step']: r['train/loss'] for r in read_metrics(reference_dir) if 'train/loss' in r}
  assert resumed == reference


# -- non-finite steps ----------------------------------------------------------------------------


def toy_loss_fn(params, batch, rng, deterministic):
  """Least squares on batch['x']; a negative entry in x poisons the step with NaN."""
  x = batch['x'].astype(jnp.float32)
  poison = jnp.where(jnp.any(x < 0), jnp.nan, 1.0)
  residual = x @ params['w'] + params['b'] - 2.0
  loss = jnp.mean(residual**2) * poison
  rows = jnp.float32(x.shape[0])
  return loss, {'loss': loss * rows, 'weight': rows}


def sqrt_loss_fn(params, batch, rng, deterministic):
  """Finite loss whose gradient is NaN where x is 0 (d sqrt(|w x|)/dw at w x = 0)."""
  x = batch['x'].astype(jnp.float32)
  loss = jnp.sum(jnp.sqrt(jnp.abs(x @ params['w'])))
  return loss, {'loss': loss, 'weight': jnp.float32(1.0)}


def toy_state(tx):
  params = {'w': jnp.arange(1.0, 5.0) / 10.0, 'b': jnp.zeros(())}
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


@pytest.mark.parametrize(
    'loss_fn, bad_x',
    [
        (toy_loss_fn, -np.ones((2, 4), np.int32)),  # NaN loss (and gradient)
        (sqrt_loss_fn, np.zeros((2, 4), np.int32)),  # finite loss, NaN gradient
    ],
    ids=['nan_loss', 'nan_gradient'])
def test_train_step_skips_non_finite_updates(loss_fn, bad_x):
  """A non-finite loss or gradient leaves params and optimizer state untouched and reports
  skipped=1; a finite step updates them and reports skipped=0."""
  tx = optax.adam(0.1)
  step_fn = jax.jit(make_train_step(loss_fn, tx, seed=0))
  state = toy_state(tx)
  good = {'x': np.ones((2, 4), np.int32)}

  after_good, metrics = step_fn(state, good)
  assert int(metrics['skipped']) == 0
  assert np.isfinite(float(metrics['loss_mean']))
  assert not trees_equal(after_good.params, state.params)
  assert int(after_good.step) == 1

  after_bad, metrics = step_fn(after_good, {'x': bad_x})
  assert int(metrics['skipped']) == 1
  assert not np.isfinite(float(metrics['grad_norm'])) or not np.isfinite(float(
      metrics['loss_mean']))
  assert_trees_equal(after_bad.params, after_good.params)
  assert_trees_equal(after_bad.opt_state, after_good.opt_state)
  assert int(after_bad.step) == 2  # the step counter (and dropout key) still moves on


class ToyTask:
  """The least-squares problem above as a trainer Task."""
  cfg = TransformerConfig()  # no model; its matmul_dtype (None) gives the steps XLA's defaults

  def init_variables(self, rng):
    return {'params': {'w': jax.random.normal(rng, (4,)) * 0.1, 'b': jnp.zeros(())}}

  def loss_fn(self, params, batch, rng, deterministic):
    return toy_loss_fn(params, {'x': batch['inputs']}, rng, deterministic)

  def evaluate(self, context, params, step):
    return {}


class ScriptedData:
  """Endless batches {'inputs': [8, 4]}; from batch `poison_from` on (0-based) they are
  poisoned with a negative entry. Its position is saved in checkpoints."""

  def __init__(self, poison_from: int):
    self.poison_from = poison_from
    self.position = 0

  def __iter__(self):
    while True:
      inputs = np.random.default_rng(self.position).integers(1, 5, size=(8, 4)).astype(np.int32)
      if self.position >= self.poison_from:
        inputs[0, 0] = -1
      self.position += 1
      yield {'inputs': inputs}

  def state(self):
    return {'position': self.position}

  def restore(self, state):
    self.position = int(state['position'])


def toy_trainer_config(**train):
  config = base_config()
  config.optimizer.update(dict(schedule='constant', learning_rate=0.05, warmup_steps=0))
  config.train.update(
      dict(num_steps=100, log_every=1, eval_every=0, checkpoint_every=2, max_nonfinite=3,
           keep_checkpoints=5))
  config.train.update(train)
  return config


class CountedToyTask(ToyTask):
  """ToyTask with a model FLOP formula: 1e8 FLOPs a batch (at hundreds of steps/s, well below a
  CPU's matmul rate)."""

  def model_flops(self, params, batch):
    return 1e8


def test_progress_line_shows_mfu_against_the_measured_matmul(tmp_path, caplog):
  """A task with `model_flops`: every progress line and train/mfu give the model FLOP/s over a
  2048^3 matmul in the model's matmul dtype (float32 here), the best seen on this machine;
  without it, no MFU."""
  caplog.set_level(logging.INFO, logger='absl')
  trainer = Trainer(toy_trainer_config(num_steps=4), CountedToyTask(), str(tmp_path / 'mfu'))
  try:
    trainer.fit(ScriptedData(poison_from=10**9))
  finally:
    trainer.close()
  peak = flops.CpuPeak.of(jnp.float32).flops  # cached: the figure the trainer divided by
  records = read_metrics(tmp_path / 'mfu')
  assert [r['step'] for r in records] == [1, 2, 3, 4]
  for record in records:
    assert record['train/model_flops_per_s'] == pytest.approx(1e8 * record['train/steps_per_s'])
    assert record['train/mfu'] == pytest.approx(record['train/model_flops_per_s'] / peak)
  lines = [line for line in caplog.text.splitlines() if 'step 4/4' in line]
  assert len(lines) == 1 and re.search(r'\| MFU \d+\.\d%', lines[0])
  assert (f'against a 2048^3 float32 matmul, the best seen on this machine: '
          f'{peak / 1e9:,.0f} GFLOP/s') in caplog.text

  caplog.clear()
  plain = Trainer(toy_trainer_config(num_steps=2), ToyTask(), str(tmp_path / 'plain'))
  try:
    plain.fit(ScriptedData(poison_from=10**9))
  finally:
    plain.close()
  assert 'step 2/2' in caplog.text and 'MFU' not in caplog.text
  assert all('train/mfu' not in r for r in read_metrics(tmp_path / 'plain'))


def _mfu_figures(text: str) -> list[float]:
  return [float(x) for x in re.findall(r'\| MFU (\d+(?:\.\d+)?)%', text)]


def test_mfu_divides_by_the_best_peak_seen_and_never_shows_above_100(tmp_path, caplog, monkeypatch):
  """The CPU peak measured beside a busy neighbour (faked: 10 MFLOP/s) must not give MFU figures
  above 100%. With no better figure known, the line says the peak is stale and the matmul is
  measured again; once a quiet run has cached the machine's best, a slow measurement is ignored
  and the MFU divides by that best."""
  caplog.set_level(logging.INFO, logger='absl')
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
  monkeypatch.setattr(flops, '_CPU_PEAKS', {})
  measured = {'flops': 1e7, 'count': 0}

  def fake_matmul(matmul_dtype, n=flops.CPU_MATMUL_N, repeats=3):
    measured['count'] += 1
    return measured['flops']

  monkeypatch.setattr(flops, 'measure_cpu_matmul', fake_matmul)

  def run(name: str, steps: int = 4) -> list[dict]:
    trainer = Trainer(toy_trainer_config(num_steps=steps), CountedToyTask(), str(tmp_path / name))
    try:
      trainer.fit(ScriptedData(poison_from=10**9))
    finally:
      trainer.close()
    return read_metrics(tmp_path / name)

  records = run('busy')  # nothing known but the slow figure
  assert all(figure <= 100.0 for figure in _mfu_figures(caplog.text)), caplog.text
  assert 'GFLOP/s is stale)' in caplog.text and 'measured the matmul again' in caplog.text
  assert measured['count'] == 2  # at start, and once more at the first stale window
  assert all('train/mfu' not in r for r in records)  # no figure where the peak is stale

  # A quiet run on this machine measures 5 TFLOP/s and caches it ...
  monkeypatch.setattr(flops, '_CPU_PEAKS', {})
  measured['flops'] = 5e12
  assert flops.CpuPeak.of(jnp.float32).flops == 5e12
  # ... so a later run started under load divides by that, not by what it measured.
  monkeypatch.setattr(flops, '_CPU_PEAKS', {})
  measured['flops'] = 1e7
  caplog.clear()
  records = run('later')
  assert ('the best seen on this machine: 5,000 GFLOP/s (measured now: 0;' in caplog.text)
  assert 'stale' not in caplog.text
  for record in records:
    assert record['train/mfu'] == pytest.approx(record['train/model_flops_per_s'] / 5e12)
  assert 0 < max(_mfu_figures(caplog.text)) <= 100.0
  saved = json.loads((tmp_path / 'cache' / 'transformer_jax' / 'cpu_matmul_peak.json').read_text())
  assert list(saved.values()) == [5e12] and 'float32 2048^3' in list(saved)[0]


def test_consecutive_non_finite_steps_stop_with_user_error_and_keep_checkpoint(tmp_path):
  """Batches 5.. are poisoned: steps 5, 6, 7 are skipped (counted in the metrics) and the
  third consecutive one raises NonFiniteError, a UserError naming the checkpoint directory.
  The checkpoints hold finite parameters equal to those before the first bad step."""
  trainer = Trainer(toy_trainer_config(), ToyTask(), str(tmp_path))
  try:
    with pytest.raises(NonFiniteError) as raised:
      trainer.fit(ScriptedData(poison_from=4))
  finally:
    trainer.close()
  assert isinstance(raised.value, UserError)
  message = str(raised.value)
  assert '3 consecutive steps' in message and 'up to step 7' in message
  assert trainer.checkpointer.directory in message

  skipped = {r['step']: r['train/skipped_nonfinite'] for r in read_metrics(tmp_path)}
  assert skipped == {1: 0, 2: 0, 3: 0, 4: 0, 5: 1, 6: 2, 7: 3}

  checkpointer = checkpointing.Checkpointer(str(tmp_path / 'checkpoints'))
  try:
    assert checkpointer.all_steps() == [2, 4, 6]
    state4, data4, _ = checkpointer.restore(trainer.abstract_state, step=4)
    latest, latest_data, latest_step = checkpointer.restore(trainer.abstract_state)
    state2, _, _ = checkpointer.restore(trainer.abstract_state, step=2)
  finally:
    checkpointer.close()
  assert latest_step == 6 and latest_data == {'position': 6} and data4 == {'position': 4}
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(latest.params))
  assert_trees_equal(latest.params, state4.params)
  assert_trees_equal(latest.opt_state, state4.opt_state)
  assert not trees_equal(state4.params, state2.params)  # steps 3-4 did train


# -- checkpoints ---------------------------------------------------------------------------------


def make_state(seed: int) -> TrainState:
  """A TrainState with random params and a non-trivial Adam state."""
  rng = np.random.default_rng(seed)
  params = {
      'dense': {
          'kernel': jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
          'bias': jnp.asarray(rng.normal(size=(4,)), jnp.float32)
      }, 'scale': jnp.asarray(rng.normal(size=()), jnp.float32),
      'table': jnp.asarray(rng.normal(size=(5, 2)), jnp.bfloat16)
  }
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  params_update, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, params_update)
  return TrainState(step=jnp.asarray(seed, jnp.int32), params=params, opt_state=opt_state)


def test_checkpoint_round_trip_restores_identical_arrays_and_data_state(tmp_path):
  """Every array (params, Adam moments and count, step; float32 and bfloat16) and the data
  position come back bitwise identical."""
  state = make_state(7)
  checkpointer = checkpointing.Checkpointer(str(tmp_path / 'ckpt'), save_every=5)
  try:
    assert not checkpointer.maybe_save(7, state, {'epoch': 0, 'position': 7})  # 7 % 5 != 0
    assert checkpointer.maybe_save(7, state, {'epoch': 2, 'position': 13}, force=True)
    assert not checkpointer.maybe_save(7, state, {'epoch': 9, 'position': 9}, force=True)
    checkpointer.wait()
    restored, data_state, step = checkpointer.restore(checkpointing.abstract_like(state))
  finally:
    checkpointer.close()
  assert step == 7
  assert data_state == {'epoch': 2, 'position': 13}
  assert_trees_equal(restored, state)


def corrupt_checkpoint(step_dir):
  """Overwrites every file of the saved train state with garbage of a different size."""
  corrupted = 0
  for root, _, files in os.walk(os.path.join(step_dir, 'state')):
    for name in files:
      with open(os.path.join(root, name), 'wb') as f:
        f.write(b'\x00garbage')
      corrupted += 1
  assert corrupted, f'no files under {step_dir}/state'


def test_corrupted_latest_checkpoint_falls_back_to_previous(tmp_path, caplog):
  """A latest checkpoint whose files are garbage is reported and skipped; the previous one is
  restored. With every checkpoint corrupted, restore returns None (start from scratch)."""
  caplog.set_level(logging.INFO, logger='absl')
  directory = tmp_path / 'ckpt'
  state1, state2 = make_state(1), make_state(2)
  checkpointer = checkpointing.Checkpointer(str(directory), save_every=1)
  try:
    checkpointer.maybe_save(1, state1, {'epoch': 0, 'position': 1})
    checkpointer.maybe_save(2, state2, {'epoch': 0, 'position': 2})
    checkpointer.wait()
  finally:
    checkpointer.close()
  corrupt_checkpoint(directory / '2')

  abstract = checkpointing.abstract_like(state1)
  checkpointer = checkpointing.Checkpointer(str(directory), save_every=1)
  try:
    assert checkpointer.latest_step() == 2
    restored, data_state, step = checkpointer.restore(abstract)
    assert 'checkpoint at step 2' in caplog.text and 'trying an older one' in caplog.text
    assert step == 1 and data_state == {'epoch': 0, 'position': 1}
    assert_trees_equal(restored, state1)
    corrupt_checkpoint(directory / '1')
    assert checkpointer.restore(abstract) is None
  finally:
    checkpointer.close()


def test_keep_deletes_the_oldest_checkpoints(tmp_path):
  """With keep=2, saving steps 1..4 leaves only steps 3 and 4 on disk."""
  directory = tmp_path / 'ckpt'
  checkpointer = checkpointing.Checkpointer(str(directory), keep=2, save_every=1)
  try:
    for step in range(1, 5):
      assert checkpointer.maybe_save(step, make_state(step), {'epoch': 0, 'position': step})
    checkpointer.wait()
    assert checkpointer.all_steps() == [3, 4]
  finally:
    checkpointer.close()
  assert sorted(p for p in os.listdir(directory) if p.isdigit()) == ['3', '4']


def test_retention_uses_orbax_preservation_policy_where_it_exists(monkeypatch):
  """orbax >= 0.12 deprecates max_to_keep for preservation_policy; older orbax has only the
  former."""
  import orbax.checkpoint as ocp
  policy = checkpointing._retention(3)['preservation_policy']
  assert isinstance(policy, ocp.checkpoint_managers.LatestN) and policy.n == 3
  monkeypatch.delattr(ocp.checkpoint_managers, 'LatestN')
  assert checkpointing._retention(3) == {'max_to_keep': 3}


def test_average_params_is_the_mean_of_the_checkpoints(tmp_path):
  """average_params over steps 1 and 3 equals the element-wise mean of their params, and
  ignores step 2."""
  states = {step: make_state(step) for step in (1, 2, 3)}
  checkpointer = checkpointing.Checkpointer(str(tmp_path / 'ckpt'), save_every=1)
  try:
    for step, state in states.items():
      checkpointer.maybe_save(step, state, {'epoch': 0, 'position': step})
    checkpointer.wait()
    averaged = checkpointing.average_params(checkpointer, checkpointing.abstract_like(states[1]),
                                            [1, 3])
    with pytest.raises(ValueError, match='could not be restored'):
      checkpointing.average_params(checkpointer, checkpointing.abstract_like(states[1]), [1, 9])
  finally:
    checkpointer.close()
  expected = jax.tree.map(lambda a, b: (np.asarray(a, np.float32) + np.asarray(b, np.float32)) / 2,
                          states[1].params, states[3].params)
  for got, want in zip(jax.tree.leaves(averaged), jax.tree.leaves(expected)):
    tolerance = 1e-2 if got.dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tolerance, atol=tolerance)


# -- preemption (SIGTERM) through the command line -----------------------------------------------


def read_lines_in_background(stream) -> queue.Queue:
  lines: queue.Queue = queue.Queue()

  def pump():
    for line in stream:
      lines.put(line)
    lines.put(None)

  threading.Thread(target=pump, daemon=True).start()
  return lines


@pytest.mark.slow
def test_sigterm_checkpoints_exits_cleanly_and_rerun_resumes(translate_cli, tmp_path):
  """SIGTERM after the first progress line: exit status 0, a log line saying the checkpoint
  was written at step K, checkpoints/K on disk; rerunning the command restores step K."""
  workdir = str(tmp_path)
  flags = translate_cli.tiny_flags({
      'train.num_steps': 100_000, 'train.log_every': 1, 'eval.bleu_sentences': 2,
      'train.eval_max_batches': 1
  })
  process = translate_cli.popen(f'--workdir={workdir}', *flags)
  output = []
  try:
    lines = read_lines_in_background(process.stdout)
    deadline = time.time() + 900  # generous: only a hang should reach it
    while True:
      line = lines.get(timeout=max(deadline - time.time(), 0.1))
      assert line is not None, 'exited before training started:\n' + ''.join(output)
      output.append(line)
      if re.search(r'step \d+/100000 \| loss', line):
        break
    process.send_signal(signal.SIGTERM)
    returncode = process.wait(timeout=900)
    while (line := lines.get(timeout=60)) is not None:
      output.append(line)
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()
  log = ''.join(output)
  assert returncode == 0, log[-3000:]
  match = re.search(r'received SIGTERM: checkpoint written at step (\d+)', log)
  assert match, log[-3000:]
  step = int(match.group(1))
  assert 1 <= step < 100_000
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', str(step)))
  assert 'Traceback' not in log

  rerun = translate_cli.run(
      f'--workdir={workdir}',
      *translate_cli.tiny_flags({
          'train.num_steps': step + 2, 'train.log_every': 1, 'eval.bleu_sentences': 2,
          'train.eval_max_batches': 1
      }))
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert f'restored checkpoint at step {step} ' in rerun.stderr
  assert f'step {step + 2}/{step + 2} |' in rerun.stderr
  assert 'step 1/' not in rerun.stderr
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', str(step + 2)))


# -- learning-rate schedules ---------------------------------------------------------------------


def optimizer_config(**values) -> ml_collections.ConfigDict:
  opt = ml_collections.ConfigDict(base_config().optimizer.to_dict())
  opt.update(values)
  return opt


def test_rsqrt_schedule_warms_up_linearly_peaks_at_warmup_then_decays_as_rsqrt():
  """rsqrt: linear rise to the peak `learning_rate` reached at the warmup_steps-th step
  (index warmup-1), then lr * sqrt(warmup / step)."""
  lr, warmup = 2e-3, 100
  schedule = optim.make_schedule(
      optimizer_config(schedule='rsqrt', learning_rate=lr, warmup_steps=warmup))
  values = np.array([float(schedule(s)) for s in range(0, 8 * warmup)])
  assert int(np.argmax(values)) == warmup - 1
  assert values.max() == pytest.approx(lr, rel=1e-6)
  assert np.all(np.diff(values[:warmup]) > 0) and np.all(np.diff(values[warmup - 1:]) < 0)
  assert values[0] == pytest.approx(lr / warmup, rel=1e-5)
  assert values[warmup // 2 - 1] == pytest.approx(lr / 2, rel=1e-5)
  assert values[4 * warmup - 1] == pytest.approx(lr / 2, rel=1e-5)  # sqrt(100 / 400)


@pytest.mark.parametrize('name', ['cosine', 'linear'])
def test_decaying_schedules_reach_end_learning_rate_at_decay_steps(name):
  """cosine/linear: peak lr at warmup_steps, monotone decay to end_learning_rate exactly at
  decay_steps, constant after."""
  lr, end, warmup, decay = 1e-3, 1e-5, 10, 200
  schedule = optim.make_schedule(
      optimizer_config(schedule=name, learning_rate=lr, warmup_steps=warmup, decay_steps=decay,
                       end_learning_rate=end))
  values = np.array([float(schedule(s)) for s in range(0, decay + 50)])
  assert values[0] == pytest.approx(0.0, abs=1e-12)
  assert values[warmup] == pytest.approx(lr, rel=1e-5)
  assert int(np.argmax(values)) == warmup
  assert np.all(np.diff(values[warmup:decay + 1]) < 0)
  assert values[decay] == pytest.approx(end, rel=1e-4)
  np.testing.assert_allclose(values[decay:], end, rtol=1e-4)
  midpoint = (warmup + decay) // 2
  expected_mid = end + (lr - end) * 0.5  # both pass halfway at the middle of the decay
  assert values[midpoint] == pytest.approx(expected_mid, rel=1e-3)


@pytest.mark.parametrize('name', ['rsqrt', 'constant'])
def test_cooldown_leaves_the_schedule_unchanged_then_falls_linearly_to_end_lr(name):
  """cooldown_steps: identical to the plain schedule before decay_steps - cooldown_steps (so a
  run trained without a cooldown can be resumed with one), then a straight line to
  end_learning_rate at decay_steps, constant after."""
  lr, warmup, decay, cooldown = 1e-3, 10, 200, 80
  plain = optim.make_schedule(optimizer_config(schedule=name, learning_rate=lr,
                                               warmup_steps=warmup))
  cooled = optim.make_schedule(
      optimizer_config(schedule=name, learning_rate=lr, warmup_steps=warmup, decay_steps=decay,
                       cooldown_steps=cooldown, end_learning_rate=0.0))
  start = decay - cooldown
  before = np.array([float(cooled(s)) for s in range(start + 1)])
  np.testing.assert_array_equal(before, [float(plain(s)) for s in range(start + 1)])
  during = np.array([float(cooled(s)) for s in range(start, decay + 1)])
  np.testing.assert_allclose(np.diff(during), -float(plain(start)) / cooldown, rtol=1e-4)
  assert float(cooled(decay)) == 0.0 and float(cooled(decay + 50)) == 0.0
  with pytest.raises(ConfigError, match=r'cooldown_steps \(195\) must end at decay_steps'):
    optim.make_schedule(
        optimizer_config(schedule=name, warmup_steps=warmup, decay_steps=decay, cooldown_steps=195))
  with pytest.raises(ConfigError, match='cooldown_steps applies to rsqrt and constant'):
    optim.make_schedule(
        optimizer_config(schedule='cosine', warmup_steps=warmup, decay_steps=decay,
                         cooldown_steps=20))


def test_optimizer_config_errors_name_the_problem():
  """An unknown schedule name, decay_steps <= warmup_steps and lr <= 0 are ConfigErrors."""
  with pytest.raises(ConfigError, match=r"optimizer.schedule must be one of .*'noam'"):
    optim.make_optimizer(optimizer_config(schedule='noam'))
  with pytest.raises(ConfigError, match=r'decay_steps \(100\) must exceed warmup_steps \(100\)'):
    optim.make_schedule(optimizer_config(schedule='cosine', warmup_steps=100, decay_steps=100))
  with pytest.raises(ConfigError, match='learning_rate > 0'):
    optim.make_schedule(optimizer_config(learning_rate=0.0))


# -- device mesh ---------------------------------------------------------------------------------


def test_mesh_shape_resolves_minus_one_against_the_device_count():
  """{'data': -1} takes every device (here the single CPU); -1 takes what the others leave."""
  assert sharding.mesh_shape({'data': -1}, 1) == (1, 1, 1)
  assert sharding.mesh_shape({'data': -1, 'fsdp': 1, 'tensor': 1},
                             len(jax.devices())) == (len(jax.devices()), 1, 1)
  assert sharding.mesh_shape({'data': -1, 'tensor': 2}, 8) == (4, 1, 2)
  assert sharding.mesh_shape({'data': 2, 'fsdp': -1}, 8) == (2, 4, 1)
  assert sharding.mesh_shape({'data': 2, 'fsdp': 2, 'tensor': 2}, 8) == (2, 2, 2)
  mesh = sharding.make_mesh({'data': -1})
  assert dict(mesh.shape) == {'data': len(jax.devices()), 'fsdp': 1, 'tensor': 1}


@pytest.mark.parametrize('mesh_config, num_devices, message', [
    ({'data': 2}, 1, r'does not fit 1 devices'),
    ({'data': 2, 'tensor': 2}, 8, r'uses 4 devices but 8 are present'),
    ({'data': 3, 'tensor': -1}, 8, r'does not fit 8 devices'),
    ({'data': -1, 'fsdp': -1}, 8, r"at most one axis may be -1, got \['data', 'fsdp'\]"),
    ({'data': -1, 'model': 2}, 8, r"unknown axes \['model'\]"),
    ({'data': 0}, 1, r'does not fit 1 devices'),
])
def test_mesh_shape_rejects_mismatched_shapes_with_a_clear_message(mesh_config, num_devices,
                                                                   message):
  """Mesh shapes that cannot tile the devices raise ConfigError saying why."""
  with pytest.raises(ConfigError, match=message):
    sharding.mesh_shape(mesh_config, num_devices)


@pytest.mark.slow
def test_tensorboard_writer_leaves_torch_unimported_and_importable(tmp_path):
  """tensorboardX imports PyTorch whenever it is installed (2-3 s and ~300 MB per run); the
  trainer's writer writes events without it, and torch still imports afterwards."""
  code = '\n'.join([
      'import glob, sys',
      'from transformer_jax.training.metrics_writer import _summary_writer',
      f'writer = _summary_writer({str(tmp_path)!r})',
      "writer.add_scalar('train/loss', 1.5, 0)",
      'writer.close()',
      "print('torch' in sys.modules, len(glob.glob(sys.argv[1] + '/events.out.tfevents.*')))",
      'try:',
      '  import torch',
      '  print(torch.ones(2).sum().item())',
      'except ImportError:',  # a machine without torch: nothing to leave importable
      '  print(2.0)',
  ])
  proc = subprocess.run([sys.executable, '-c', code, str(tmp_path)], capture_output=True, text=True,
                        timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.split() == ['False', '1', '2.0']
