"""One trainer for every model: it knows a `Task` (loss and extra evaluation), not the model.

    state = init_or_restore()                 # sharded over the mesh, or resumed from a checkpoint
    provenance                                # code, versions, devices, config: one line per start
    loop: batch -> train_step (jit, donated state) -> log / eval / checkpoint

The step functions are pure (`train_step.py`); everything stateful on the host (data position,
timers, metric writers) lives here. The config is validated before a Trainer is built
(`cli/validation.py`, called by each workflow's `validate`), so nothing here re-checks it.
"""

import dataclasses
import math
import os
import time
from typing import Callable, Iterator, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from transformer_jax import onednn_lifetime, precision
from transformer_jax.errors import ConfigError, UserError
from transformer_jax.model_config import TransformerConfig
from transformer_jax.sections import ModelChoices, RunSections
from transformer_jax.parallel import sharding
from transformer_jax.training import elastic, preemption, provenance
from transformer_jax.training.batch_record import BatchRecord
from transformer_jax.training.checkpointing import Checkpointer
from transformer_jax.training.metrics_writer import MetricsWriter
from transformer_jax.training.model_flops import ModelFlops
from transformer_jax.training.optimizer import make_optimizer
from transformer_jax.training.profiling import ProfileWindow, profile_window
from transformer_jax.training.train_step import (Batch, Metrics, TrainState, build_train_step,
                                                 step_compiler_options, make_eval_step,
                                                 make_train_step)

__all__ = [
    'EvalContext', 'NonFiniteError', 'Task', 'TrainState', 'Trainer', 'count_slots', 'count_tokens',
    'make_eval_step', 'make_train_step'
]


@dataclasses.dataclass(frozen=True)
class EvalContext:
  """What a task's `evaluate` may use of the run: the mesh, batch placement and a text log."""
  mesh: jax.sharding.Mesh
  to_global: Callable[[Batch], dict[str, jax.Array]]
  write_text: Callable[[int, str, str], None]


class Task(Protocol):
  """What the trainer needs to know about a model family."""
  cfg: TransformerConfig  # the model's config: its matmul_dtype sets the steps' XLA options

  def init_variables(self, rng: jax.Array) -> dict:
    """Boxed (logically partitioned) variables {'params': ...} from `model.init`."""

  def loss_fn(self, params, batch: Batch, rng: jax.Array | None,
              deterministic: bool) -> tuple[jnp.ndarray, Metrics]:
    """(mean loss to differentiate, metric *sums* incl. 'weight' = number of scored tokens)."""

  def evaluate(self, context: EvalContext, params, step: int) -> dict[str, float]:
    """Extra evaluation (BLEU, samples) run after the eval loss; may return {}."""

  # Optional: `count_tokens(batch) -> int`, the tokens a batch trains on (for tokens/s); the
  # default counts non-padding ids in 'inputs' and 'targets'.
  # Optional: `count_slots(batch) -> int`, the token positions of the batch those tokens fill
  # (train/padding_fraction = 1 - tokens / slots); the default is the size of 'inputs' and
  # 'targets'. A task whose count_tokens counts only 'inputs' counts only 'inputs' here too.
  # Optional: `model_flops(params, batch) -> float`, the model FLOPs of a training step on the
  # batch (transformer_jax/flops.py); with it the progress line shows MFU.
  # Optional: `summary_images(params) -> {tag: uint8 [H, W, 3]}`, pictures (attention maps of a
  # fixed sample) written to TensorBoard at every evaluation; run on every process.


class NonFiniteError(UserError):
  """Too many consecutive non-finite steps: the run stops, keeping the last good checkpoint."""


def _host_sums(metric_list: list[Metrics]) -> dict[str, float]:
  if not metric_list:
    return {}
  stacked = jax.device_get(metric_list)
  return {k: float(np.sum([m[k] for m in stacked])) for k in stacked[0]}


def format_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f'{h}h{m:02d}m' if h else f'{m}m{s:02d}s'


def count_tokens(batch: Batch) -> int:
  """Non-padding tokens in the model's inputs and targets (what tokens/s counts)."""
  return int(sum(np.count_nonzero(batch[k]) for k in ('inputs', 'targets') if k in batch))


def count_slots(batch: Batch) -> int:
  """Token positions of the model's inputs and targets, padding included (count_tokens' whole)."""
  return int(sum(np.size(batch[k]) for k in ('inputs', 'targets') if k in batch))


class Trainer:
  """Owns the mesh, the jitted steps, checkpoints, metric writing and the train loop."""

  def __init__(self, config, task: Task, workdir: str, mesh=None):
    self.config = config
    self.run = run = RunSections.of(config)
    self.task = task
    self.workdir = workdir
    self.mesh = mesh if mesh is not None else sharding.make_mesh(run.mesh.as_dict())
    self.rules = sharding.LOGICAL_AXIS_RULES
    train = run.train
    self.tx, self.schedule = make_optimizer(run.optimizer)
    self.checkpointer = Checkpointer(os.path.join(workdir, 'checkpoints'),
                                     keep=train.keep_checkpoints, save_every=train.checkpoint_every)
    # The layout of the run this one resumes (None when fresh): it may have had other devices.
    saved = self.checkpointer.run_layout()
    self.resumed_from = (elastic.Layout.from_json(saved[1], self.checkpointer.directory)
                         if saved is not None else None)
    self.accumulation_steps = elastic.accumulation_steps(self.resumed_from, self.mesh,
                                                         train.accumulation_steps,
                                                         train.elastic_accumulation)
    self.layout = elastic.current(self.mesh, self.accumulation_steps, self.resumed_from)
    if self.resumed_from is not None and self.resumed_from != self.layout:
      logging.info('resuming the run saved at step %d on %s, now on %s', saved[0],
                   self.resumed_from.describe(), self.layout.describe())
    sharded = build_train_step(task, self.tx, self.mesh, seed=run.seed,
                               accumulation_steps=self.accumulation_steps, rules=self.rules)
    self._create_state = sharded.create_state
    self.state_shardings, self.abstract_state = sharded.state_shardings, sharded.abstract_state
    self.checkpointer.check_fits(self.abstract_state)  # a changed model fails before any write
    self.is_chief = jax.process_index() == 0
    self.metrics = MetricsWriter(workdir, self.is_chief)
    self.batch_record = BatchRecord(workdir, train.record_batches, self.is_chief)
    self._batch_sharding = sharded.batch_sharding
    self.eval_context = EvalContext(self.mesh, self.to_global, self.metrics.text)
    self._train_step = sharded.step
    self._eval_step = onednn_lifetime.jit(
        make_eval_step(task.loss_fn),
        in_shardings=(self.state_shardings.params, self._batch_sharding),
        compiler_options=step_compiler_options(task, self.mesh))
    matmul = task.cfg.matmul_dtype
    logging.info(
        'matmuls in %s (%s)',
        jnp.dtype(matmul).name if matmul else 'model.dtype '
        f'{jnp.dtype(task.cfg.dtype).name}', self.matmul_reason())

  def matmul_reason(self) -> str:
    """Why the model's matmuls run in the dtype they do (model.matmul_dtype's choice)."""
    setting = ModelChoices.of(self.config).matmul_dtype
    platform = self.mesh.devices.flat[0].platform
    choice = precision.resolve(setting, platform)
    mine = self.task.cfg.matmul_dtype
    if (choice.matmul_dtype or None) != (jnp.dtype(mine).name if mine else None):
      # A model config that did not come from config.model (a pretrained model's, kept).
      return 'the model config of the checkpoint it starts from'
    return choice.reason

  # -- state ----------------------------------------------------------------------------------

  @property
  def batch_multiple(self) -> int:
    """Rows of length-bucketed and packed global training batches are a multiple of this: the
    data x fsdp x accumulation steps of the run's first layout (kept on resume: elastic.py)."""
    return self.layout.batch_multiple

  def check_batch_rows(self, rows):
    """ConfigError unless global batches of each of `rows` rows split over this layout."""
    elastic.check_rows(rows, self.layout, self.resumed_from)

  def init_state(self) -> TrainState:
    """Fresh parameters, created directly in their shards (never whole on one device)."""
    init = jax.jit(lambda rng: nn.meta.unbox(self._create_state(rng)),
                   out_shardings=self.state_shardings)
    with sharding.use_mesh(self.mesh, self.rules):
      return init(jax.random.key(self.run.seed))

  def init_or_restore(self, data=None) -> TrainState:
    """The latest good checkpoint if there is one (and the data position), else a fresh state."""
    restored = self.checkpointer.restore(self.abstract_state)
    if restored is None:
      logging.info('no checkpoint in %s: starting from scratch', self.checkpointer.directory)
      return self.init_state()
    state, data_state, step = restored
    if data is not None and data_state:
      data.restore(data_state)
    logging.info('restored checkpoint at step %d from %s', step, self.checkpointer.directory)
    return state

  def restore_params(self):
    """Params of the latest good checkpoint, for inference; ConfigError if there is none."""
    restored = self.checkpointer.restore(self.abstract_state)
    if restored is None:
      raise ConfigError(f'no checkpoint in {self.checkpointer.directory}: train first')
    logging.info('loaded checkpoint at step %d', restored[2])
    return restored[0].params

  def num_params(self) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract_state.params)))

  # -- device placement -----------------------------------------------------------------------

  def to_global(self, batch: Batch) -> dict[str, jax.Array]:
    """Host batch (this process's rows) -> global arrays sharded over data x fsdp."""
    return {
        k: jax.make_array_from_process_local_data(self._batch_sharding, v)
        for k, v in batch.items()
        if k != 'index'
    }

  # -- evaluation -----------------------------------------------------------------------------

  def evaluate(self, params, eval_batches: Iterator[Batch], max_batches: int = 0) -> dict:
    """Eval loss (NLL per scored token), accuracy and perplexity over the eval batches."""
    sums = []
    with sharding.use_mesh(self.mesh, self.rules):
      for i, batch in enumerate(eval_batches):
        if max_batches and i >= max_batches:
          break
        sums.append(self._eval_step(params, self.to_global(batch)))
    totals = _host_sums(sums)
    weight = max(totals.get('weight', 0.0), 1.0)
    out = {('accuracy' if k == 'correct' else k): v / weight
           for k, v in totals.items()
           if k != 'weight'}
    if 'loss' in out:
      out['perplexity'] = float(np.exp(min(out['loss'], 50.0)))
    return out

  def _evaluate_and_log(self, params, step: int, eval_batches_fn) -> dict[str, float]:
    """Eval loss, the task's own evaluation and pictures; written, logged and returned."""
    if eval_batches_fn is None:
      return {}
    metrics = self.evaluate(params, eval_batches_fn(), self.run.train.eval_max_batches)
    metrics.update(self.task.evaluate(self.eval_context, params, step) or {})
    summary_images = getattr(self.task, 'summary_images', None)
    if summary_images is not None:  # computed on every process, written by the chief
      self.metrics.images(step, summary_images(params) or {})
    self.metrics.scalars(step, metrics, 'eval')
    logging.info('eval at step %d: %s', step, ', '.join(f'{k} {v:.4g}' for k, v in metrics.items()))
    return {f'eval_{k}': v for k, v in metrics.items()}

  # -- the loop -------------------------------------------------------------------------------

  def fit(self, train_data, eval_batches_fn: Callable[[], Iterator[Batch]] | None = None,
          state: TrainState | None = None) -> dict:
    """Trains to train.num_steps (or train.max_minutes); returns the final metrics.

    SIGTERM/SIGINT finish the current step, checkpoint and return (preemption); with several
    processes all of them stop after the same step.
    """
    train = self.run.train
    num_steps, log_every, eval_every = train.num_steps, train.log_every, train.eval_every
    state = state if state is not None else self.init_or_restore(train_data)
    step = int(jax.device_get(state.step))
    logging.info('model has %s parameters; training from step %d to %d on mesh %s',
                 f'{self.num_params():,}', step, num_steps, dict(self.mesh.shape))
    self._write_provenance(step)
    progress = _Progress(step, num_steps, train.max_minutes, log_every)
    model_flops = ModelFlops(self.task, self.abstract_state.params, self.mesh)
    guard = _NonFiniteGuard(train.max_nonfinite, self.checkpointer.directory)
    profiler = ProfileWindow(profile_window(train.profile_steps),
                             os.path.join(self.workdir, 'profile'), step)
    tokens_in = getattr(self.task, 'count_tokens', count_tokens)
    slots_in = getattr(self.task, 'count_slots', count_slots)
    iterator, pending, final, stop = iter(train_data), [], {}, None
    try:
      with sharding.use_mesh(self.mesh, self.rules), preemption.StopSignal() as stop_signal:
        while step < num_steps and stop is None:
          batch = next(iterator)
          progress.add_tokens(
              tokens_in(batch) * jax.process_count(),
              slots_in(batch) * jax.process_count(),
              model_flops.of(batch) * jax.process_count())
          profiler.before_step(step)
          self.batch_record.add(step + 1, batch)
          state, metrics = self._train_step(state, self.to_global(batch))
          step += 1
          pending.append(metrics)
          profiler.after_step(step, metrics)
          progress.first_step_done(metrics)
          if progress.max_minutes and len(pending) > 1:
            # Dispatch runs ahead of the device by up to log_every steps; the budget's clock
            # must see finished steps (waiting on the one before keeps one step in flight).
            jax.block_until_ready(pending[-2])
          stop = stop_signal.check(step) or progress.stop_reason(step)
          if step % log_every == 0 or stop:
            final.update(self._log_train(step, _host_sums(pending), progress, guard, model_flops))
            pending = []
          if eval_every and step % eval_every == 0 and not stop:
            final.update(self._evaluate_and_log(state.params, step, eval_batches_fn))
          if self.checkpointer.maybe_save(step, state, train_data.state(), self.layout.to_json(),
                                          force=bool(stop)):
            logging.info('saved checkpoint at step %d', step)
        interrupted = stop not in (None, _DONE, _OUT_OF_TIME)
        if interrupted:
          logging.warning(
              'received %s: checkpoint written at step %d, exiting cleanly; rerun '
              'the same command to resume', stop, step)
        else:
          if stop == _OUT_OF_TIME:
            logging.info('time budget of %.1f minutes reached at step %d', progress.max_minutes,
                         step)
          final.update(self._evaluate_and_log(state.params, step, eval_batches_fn))
    finally:
      profiler.stop()  # also when the loop ends early inside the window, or raises
      self.checkpointer.wait()
      self.metrics.flush()
    self.state = state
    return {**final, **progress.totals(step), 'interrupted': interrupted}

  def _write_provenance(self, step: int):
    """One line of WORKDIR/provenance.jsonl and TensorBoard text 'provenance' (chief only)."""
    if not self.is_chief:
      return
    matmul = {
        'dtype': jnp.dtype(self.task.cfg.matmul_dtype or self.task.cfg.dtype).name,
        'reason': self.matmul_reason()
    }
    resumed_from = self.resumed_from.to_json() if self.resumed_from is not None and step else None
    record = provenance.collect(self.config, self.mesh, step, matmul, self.layout.to_json(),
                                resumed_from)
    if record['git']['error']:
      logging.info('provenance: no git commit for the code (%s)', record['git']['error'])
    path = provenance.append(self.workdir, record)
    self.metrics.text(step, 'provenance', provenance.as_markdown(record))
    logging.info('provenance of this run (start step %d) appended to %s', step, path)

  def _log_train(self, step: int, sums: dict[str, float], progress: '_Progress',
                 guard: '_NonFiniteGuard', model_flops: ModelFlops) -> dict[str, float]:
    """One progress line and the train/* scalars for the steps since the last one."""
    steps, seconds, tokens, slots, flops_done = progress.interval(step)
    weight = max(sums.get('weight', 0.0), 1.0)
    scalars = {
        'loss': sums.get('loss', 0.0) / weight,
        'accuracy': sums.get('correct', 0.0) / weight,
        'grad_norm': sums.get('grad_norm', 0.0) / max(steps, 1),
        'learning_rate': float(self.schedule(step - 1)),
        'steps_per_s': steps / seconds,
        'tokens_per_s': tokens / seconds,
        # Slots the batches held but no token filled (bucket or row padding), this interval.
        'padding_fraction': 1.0 - tokens / slots if slots else 0.0,
        'skipped_nonfinite': guard.add(int(sums.get('skipped', 0))),
    }
    utilisation = ''
    if flops_done:
      scalars['model_flops_per_s'] = flops_done / seconds
      mfu, utilisation = model_flops.utilisation(scalars['model_flops_per_s'])
      if mfu is not None:
        scalars['mfu'] = mfu
    self.metrics.scalars(step, scalars, 'train')
    logging.info(
        'step %d/%d | loss %.4f | acc %.3f | lr %.2e | gnorm %.2f | %.2f steps/s | %s '
        'tok/s | pad %.1f%%%s | elapsed %s | ETA %s', step, progress.num_steps, scalars['loss'],
        scalars['accuracy'], scalars['learning_rate'], scalars['grad_norm'], scalars['steps_per_s'],
        f"{scalars['tokens_per_s']:,.0f}", 100 * scalars['padding_fraction'], utilisation,
        format_duration(progress.elapsed()),
        format_duration(progress.remaining(step, scalars['steps_per_s'])))
    guard.check(step)
    return {f'train_{k}': v for k, v in scalars.items()}

  def close(self):
    self.checkpointer.close()
    self.metrics.close()


_DONE, _OUT_OF_TIME = 'done', 'time budget'


class _Progress:
  """The loop's clock: tokens, slots and steps per log interval, the time budget, the ETA."""

  def __init__(self, step: int, num_steps: int, max_minutes: float, log_every: int):
    self.num_steps, self.max_minutes, self.log_every = num_steps, max_minutes, log_every
    self.start = self.last_time = time.time()
    self.last_step, self.tokens_since_log, self.total_tokens = step, 0, 0
    self.slots_since_log, self.flops_since_log = 0, 0.0
    self.first_step_seconds = None

  def add_tokens(self, tokens: int, slots: int = 0, model_flops: float = 0.0):
    """`tokens` trained on, in batches of `slots` positions (padding included), costing
    `model_flops`."""
    self.tokens_since_log += tokens
    self.total_tokens += tokens
    self.slots_since_log += slots
    self.flops_since_log += model_flops

  def first_step_done(self, metrics):
    if self.first_step_seconds is None:
      jax.block_until_ready(metrics)
      self.first_step_seconds = time.time() - self.start
      logging.info('first step (including compilation) took %.1f s', self.first_step_seconds)

  def elapsed(self) -> float:
    return time.time() - self.start

  def stop_reason(self, step: int) -> str | None:
    """'time budget' once train.max_minutes have passed (agreed by all processes at log steps:
    hosts' clocks differ), 'done' at the last step, else None."""
    out_of_time = bool(self.max_minutes) and self.elapsed() / 60.0 >= self.max_minutes
    if self.max_minutes and jax.process_count() > 1:
      out_of_time = step % self.log_every == 0 and preemption.any_process(out_of_time)
    if out_of_time:
      return _OUT_OF_TIME
    return _DONE if step >= self.num_steps else None

  def interval(self, step: int) -> tuple[int, float, int, int, float]:
    """(steps, seconds, tokens, slots, model FLOPs) since the last call; starts the next
    interval."""
    now = time.time()
    out = (step - self.last_step, max(now - self.last_time, 1e-9), self.tokens_since_log,
           self.slots_since_log, self.flops_since_log)
    self.last_step, self.last_time, self.tokens_since_log, self.slots_since_log = step, now, 0, 0
    self.flops_since_log = 0.0
    return out

  def remaining(self, step: int, steps_per_s: float) -> float:
    remaining = (self.num_steps - step) / max(steps_per_s, 1e-9)
    if self.max_minutes:
      remaining = min(remaining, self.max_minutes * 60 - self.elapsed())
    return remaining

  def totals(self, step: int) -> dict[str, float]:
    elapsed = self.elapsed()
    return dict(step=step, minutes=elapsed / 60.0, tokens=self.total_tokens,
                tokens_per_s=self.total_tokens / max(elapsed, 1e-9),
                first_step_seconds=self.first_step_seconds or 0.0)


class _NonFiniteGuard:
  """Counts skipped (non-finite) steps; too many in a row stop the run with one line."""

  def __init__(self, max_consecutive: int, checkpoint_dir: str):
    self.max_consecutive, self.checkpoint_dir = max_consecutive, checkpoint_dir
    self.consecutive = self.total = 0

  def add(self, skipped: int) -> int:
    """Adds one log interval's skipped steps; returns the total so far."""
    self.total += skipped
    self.consecutive = self.consecutive + skipped if skipped else 0
    return self.total

  def check(self, step: int):
    """NonFiniteError once `max_consecutive` steps in a row were skipped."""
    if self.consecutive >= self.max_consecutive:
      raise NonFiniteError(
          f'{self.consecutive} consecutive steps had a non-finite loss or gradient (up to step '
          f'{step}); updates were skipped and the last good checkpoint is in '
          f'{self.checkpoint_dir}. Lower optimizer.learning_rate or raise '
          'optimizer.warmup_steps.')
