"""One trainer for every model: it knows a `Task` (loss and extra evaluation), not the model.

    state = init_or_restore()                 # sharded over the mesh, or resumed from a checkpoint
    loop: batch -> train_step (jit, donated state) -> log / eval / checkpoint

`train_step` and `eval_step` are pure functions of (state, batch); everything stateful on the
host (data position, timers, writers) lives in `Trainer`. The dropout key for step s is
fold_in(key(seed), s), so a resumed run draws exactly the same randomness.
"""

import json
import math
import os
import sys
import time
from typing import Any, Callable, Iterator, Protocol

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from transformer_jax import distributed, preemption, sharding
from transformer_jax.accumulation import accumulated_value_and_grad
from transformer_jax.checkpointing import Checkpointer
from transformer_jax.errors import ConfigError, UserError
from transformer_jax.optim import make_optimizer

Batch = dict[str, np.ndarray]
Metrics = dict[str, jnp.ndarray]


def _summary_writer(logdir: str):
  """A tensorboardX SummaryWriter, imported without PyTorch.

  tensorboardX imports torch whenever it is installed (only to accept torch tensors), which cost
  every run 2-3 s and ~300 MB here. A None entry in sys.modules makes that import fail at once,
  and is removed straight after, so torch stays importable.
  """
  # pylint: disable=g-import-not-at-top
  if 'torch' in sys.modules or 'tensorboardX' in sys.modules:
    from tensorboardX import SummaryWriter
  else:
    sys.modules['torch'] = None
    try:
      from tensorboardX import SummaryWriter
    finally:
      del sys.modules['torch']
  return SummaryWriter(logdir)


class Task(Protocol):
  """What the trainer needs to know about a model family."""

  def init_variables(self, rng: jax.Array) -> dict:
    """Boxed (logically partitioned) variables {'params': ...} from `model.init`."""

  def loss_fn(self, params, batch: Batch, rng: jax.Array | None, deterministic: bool
              ) -> tuple[jnp.ndarray, Metrics]:
    """(mean loss to differentiate, metric *sums* incl. 'weight' = number of scored tokens)."""

  def evaluate(self, trainer: 'Trainer', params, step: int) -> dict[str, float]:
    """Extra evaluation (BLEU, samples) run after the eval loss; may return {}."""

  # Optional: `count_tokens(batch) -> int`, the tokens a batch trains on (for tokens/s); the
  # default counts non-padding ids in 'inputs' and 'targets'.
  # Optional: `summary_images(params) -> {tag: uint8 [H, W, 3]}`, pictures (attention maps of a
  # fixed sample) written to TensorBoard at every evaluation; run on every process.


@flax.struct.dataclass
class TrainState:
  step: jnp.ndarray
  params: Any
  opt_state: Any


class NonFiniteError(UserError):
  """Too many consecutive non-finite steps: the run stops, keeping the last good checkpoint."""


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation, seed: int,
                    accumulation_steps: int = 1):
  """(state, batch) -> (state, metrics); a non-finite loss or gradient skips the update.

  With accumulation_steps k > 1 the batch is k micro-batches, run one at a time
  (`accumulation.py`): the same update with 1/k of the activation memory.
  """
  base_key = jax.random.key(seed)

  def train_step(state: TrainState, batch: Batch):
    rng = jax.random.fold_in(base_key, state.step)
    if accumulation_steps > 1:
      (loss, metrics), grads = accumulated_value_and_grad(loss_fn, state.params, batch, rng,
                                                          accumulation_steps)
    else:
      grad_fn = jax.value_and_grad(lambda p: loss_fn(p, batch, rng, False), has_aux=True)
      (loss, metrics), grads = grad_fn(state.params)
    grad_norm = optax.global_norm(grads)
    updates, new_opt_state = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = TrainState(step=state.step + 1, params=keep(new_params, state.params),
                           opt_state=keep(new_opt_state, state.opt_state))
    metrics = dict(metrics, grad_norm=grad_norm, skipped=(~finite).astype(jnp.int32),
                   loss_mean=loss)
    return new_state, metrics

  return train_step


def make_eval_step(loss_fn: Callable):
  def eval_step(params, batch: Batch) -> Metrics:
    return loss_fn(params, batch, None, True)[1]
  return eval_step


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


class Trainer:
  """Owns the mesh, the jitted steps, checkpoints, logging and the train loop."""

  def __init__(self, config, task: Task, workdir: str, mesh=None):
    self.config = config
    self.task = task
    self.workdir = workdir
    distributed.initialize(config)  # multi-host jobs: before anything touches the devices
    self.mesh = mesh if mesh is not None else sharding.make_mesh(config.get('mesh', None))
    self.rules = sharding.LOGICAL_AXIS_RULES
    train = config.train
    for key in ('num_steps', 'log_every', 'eval_every', 'checkpoint_every'):
      if int(train[key]) < 0 or (key in ('num_steps', 'log_every') and int(train[key]) == 0):
        raise ConfigError(f'train.{key} must be positive, got {train[key]}')
    self.tx, self.schedule = make_optimizer(config.optimizer)
    self.accumulation_steps = int(train.get('accumulation_steps', 1))
    if self.accumulation_steps < 1:
      raise ConfigError(f'train.accumulation_steps must be >= 1, got {self.accumulation_steps}')
    self.checkpointer = Checkpointer(os.path.join(workdir, 'checkpoints'),
                                     max_to_keep=int(train.get('keep_checkpoints', 3)),
                                     save_every=int(train.checkpoint_every))
    self._build_state_shardings()
    self.checkpointer.check_fits(self.abstract_state)  # a changed model fails before any write
    self.is_chief = jax.process_index() == 0
    self._writer = None  # created on first write: restoring for inference writes nothing
    self._batch_sharding = sharding.batch_sharding(self.mesh)
    self._train_step = jax.jit(
        make_train_step(task.loss_fn, self.tx, int(config.seed), self.accumulation_steps),
        in_shardings=(self.state_shardings, self._batch_sharding),
        out_shardings=(self.state_shardings, None), donate_argnums=(0,))
    self._eval_step = jax.jit(make_eval_step(task.loss_fn),
                              in_shardings=(self.state_shardings.params, self._batch_sharding))
    self._stop_requested = None

  # -- state ----------------------------------------------------------------------------------

  def _create_state(self, rng) -> TrainState:
    params = self.task.init_variables(rng)['params']
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=self.tx.init(params))

  def _build_state_shardings(self):
    boxed = jax.eval_shape(self._create_state, jax.random.key(0))
    self.state_shardings = sharding.tree_shardings(self.mesh, boxed, self.rules)
    unboxed = nn.meta.unbox(boxed)
    self.abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), unboxed,
        self.state_shardings)

  def init_state(self) -> TrainState:
    """Fresh parameters, created directly in their shards (never whole on one device)."""
    init = jax.jit(lambda rng: nn.meta.unbox(self._create_state(rng)),
                   out_shardings=self.state_shardings)
    with sharding.use_mesh(self.mesh, self.rules):
      return init(jax.random.key(int(self.config.seed)))

  def init_or_restore(self, data=None) -> TrainState:
    """The latest good checkpoint if there is one (and the data position), else a fresh state."""
    restored = self.checkpointer.restore(self.abstract_state)
    if restored is None:
      logging.info('no checkpoint in %s: starting from scratch', self.checkpointer.directory)
      return self.init_state()
    state, data_state, step = restored
    if data is not None and data_state:
      data.set_state(data_state)
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
    return {k: jax.make_array_from_process_local_data(self._batch_sharding, v)
            for k, v in batch.items() if k != 'index'}

  def check_batch(self, batch: Batch):
    rows = next(iter(batch.values())).shape[0] * jax.process_count()
    ways = sharding.data_parallel_size(self.mesh)
    if rows % ways:
      raise ConfigError(f'global batch of {rows} rows is not divisible by the data-parallel '
                        f'size {ways} (mesh data x fsdp); adjust the batch size or the mesh')
    k = self.accumulation_steps
    if k > 1 and rows % (ways * k):
      raise ConfigError(f'global batch of {rows} rows cannot be cut into train.accumulation_steps'
                        f'={k} micro-batches over {ways} data-parallel devices; make the batch '
                        f'a multiple of {ways * k} rows')

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
           for k, v in totals.items() if k != 'weight'}
    if 'loss' in out:
      out['perplexity'] = float(np.exp(min(out['loss'], 50.0)))
    return out

  @property
  def writer(self):
    """The chief's TensorBoard writer (None on other processes)."""
    if self._writer is None and self.is_chief:
      self._writer = _summary_writer(os.path.join(self.workdir, 'tensorboard'))
    return self._writer

  def write_scalars(self, step: int, scalars: dict[str, float], prefix: str):
    record = {'step': step, **{f'{prefix}/{k}': v for k, v in scalars.items()}}
    if not self.is_chief:
      return
    for key, value in scalars.items():
      self.writer.add_scalar(f'{prefix}/{key}', value, step)
    with open(os.path.join(self.workdir, 'metrics.jsonl'), 'a') as f:
      f.write(json.dumps(record) + '\n')

  def write_text(self, step: int, tag: str, text: str):
    if self.is_chief:
      self.writer.add_text(tag, text, step)

  def write_images(self, step: int, params):
    """The task's `summary_images` (if it has them) to TensorBoard; every process computes."""
    summary_images = getattr(self.task, 'summary_images', None)
    if summary_images is None:
      return
    images = summary_images(params) or {}
    if self.is_chief:
      for tag, image in images.items():
        self.writer.add_image(tag, image, step, dataformats='HWC')

  # -- the loop -------------------------------------------------------------------------------

  def fit(self, train_data, eval_batches_fn: Callable[[], Iterator[Batch]] | None = None,
          state: TrainState | None = None) -> dict:
    """Trains to train.num_steps (or train.max_minutes); returns the final metrics."""
    train = self.config.train
    num_steps, log_every = int(train.num_steps), int(train.log_every)
    eval_every = int(train.eval_every)
    max_minutes = float(train.get('max_minutes', 0) or 0)
    max_nonfinite = int(train.get('max_nonfinite', 10))
    eval_max_batches = int(train.get('eval_max_batches', 0))
    state = state if state is not None else self.init_or_restore(train_data)
    step = int(jax.device_get(state.step))
    logging.info('model has %s parameters; training from step %d to %d on mesh %s',
                 f'{self.num_params():,}', step, num_steps, dict(self.mesh.shape))
    self._stop_requested = None
    iterator = iter(train_data)
    token_counter = getattr(self.task, 'count_tokens', count_tokens)
    pending: list[Metrics] = []
    tokens_since_log, consecutive_nonfinite, total_skipped, total_tokens = 0, 0, 0, 0
    start_time = last_log_time = time.time()
    first_step_time = None
    last_log_step = step
    final: dict[str, float] = {}

    def run_eval(step):
      if eval_batches_fn is None:
        return
      eval_metrics = self.evaluate(state.params, eval_batches_fn(), eval_max_batches)
      extra = self.task.evaluate(self, state.params, step) or {}
      eval_metrics.update(extra)
      self.write_images(step, state.params)
      self.write_scalars(step, eval_metrics, 'eval')
      logging.info('eval at step %d: %s', step,
                   ', '.join(f'{k} {v:.4g}' for k, v in eval_metrics.items()))
      final.update({f'eval_{k}': v for k, v in eval_metrics.items()})

    try:
      # SIGTERM/SIGINT finish the current step, checkpoint and exit cleanly (preemption); with
      # several processes all of them stop after the same step.
      with sharding.use_mesh(self.mesh, self.rules), preemption.StopSignal() as stop_signal:
        while step < num_steps:
          batch = next(iterator)
          if step == last_log_step and not pending:
            self.check_batch(batch)
          batch_tokens = token_counter(batch) * jax.process_count()
          tokens_since_log += batch_tokens
          total_tokens += batch_tokens
          state, metrics = self._train_step(state, self.to_global(batch))
          step += 1
          pending.append(metrics)
          if first_step_time is None:
            jax.block_until_ready(metrics)
            first_step_time = time.time() - start_time
            logging.info('first step (including compilation) took %.1f s', first_step_time)
          out_of_time = max_minutes and (time.time() - start_time) / 60.0 >= max_minutes
          if max_minutes and jax.process_count() > 1:  # hosts' clocks differ: agree, per log
            out_of_time = step % log_every == 0 and preemption.any_process(out_of_time)
          self._stop_requested = stop_signal.check(step)
          stop = self._stop_requested or out_of_time or step >= num_steps
          if step % log_every == 0 or stop:
            sums = _host_sums(pending)
            pending = []
            now = time.time()
            skipped = int(sums.get('skipped', 0))
            total_skipped += skipped
            consecutive_nonfinite = consecutive_nonfinite + skipped if skipped else 0
            steps_done = step - last_log_step
            weight = max(sums.get('weight', 0.0), 1.0)
            scalars = {
                'loss': sums.get('loss', 0.0) / weight,
                'accuracy': sums.get('correct', 0.0) / weight,
                'grad_norm': sums.get('grad_norm', 0.0) / max(steps_done, 1),
                'learning_rate': float(self.schedule(step - 1)),
                'steps_per_s': steps_done / max(now - last_log_time, 1e-9),
                'tokens_per_s': tokens_since_log / max(now - last_log_time, 1e-9),
                'skipped_nonfinite': total_skipped,
            }
            self.write_scalars(step, scalars, 'train')
            if max_minutes:
              remaining = max_minutes * 60 - (now - start_time)
              remaining = min(remaining, (num_steps - step) / max(scalars['steps_per_s'], 1e-9))
            else:
              remaining = (num_steps - step) / max(scalars['steps_per_s'], 1e-9)
            logging.info('step %d/%d | loss %.4f | acc %.3f | lr %.2e | gnorm %.2f | %.2f steps/s'
                         ' | %s tok/s | elapsed %s | ETA %s', step, num_steps, scalars['loss'],
                         scalars['accuracy'], scalars['learning_rate'], scalars['grad_norm'],
                         scalars['steps_per_s'], f"{scalars['tokens_per_s']:,.0f}",
                         format_duration(now - start_time), format_duration(remaining))
            final.update({f'train_{k}': v for k, v in scalars.items()})
            last_log_time, last_log_step, tokens_since_log = now, step, 0
            if consecutive_nonfinite >= max_nonfinite:
              raise NonFiniteError(
                  f'{consecutive_nonfinite} consecutive steps had a non-finite loss or gradient '
                  f'(up to step {step}); updates were skipped and the last good checkpoint is in '
                  f'{self.checkpointer.directory}. Lower optimizer.learning_rate or raise '
                  'optimizer.warmup_steps.')
          if eval_every and step % eval_every == 0 and not stop:
            run_eval(step)
          if self.checkpointer.maybe_save(step, state, train_data.get_state(), force=bool(stop)):
            logging.info('saved checkpoint at step %d', step)
          if stop:
            if self._stop_requested:
              logging.warning('received %s: checkpoint written at step %d, exiting cleanly; '
                              'rerun the same command to resume', self._stop_requested, step)
            elif out_of_time:
              logging.info('time budget of %.1f minutes reached at step %d', max_minutes, step)
            break
        if not self._stop_requested:
          run_eval(step)
    finally:
      self.checkpointer.wait()
      if self._writer is not None:
        self._writer.flush()
    self.state = state
    elapsed = time.time() - start_time
    final.update(step=step, minutes=elapsed / 60.0, tokens=total_tokens,
                 tokens_per_s=total_tokens / max(elapsed, 1e-9),
                 first_step_seconds=first_step_time or 0.0,
                 interrupted=bool(self._stop_requested))
    return final

  def close(self):
    self.checkpointer.close()
    if self._writer is not None:
      self._writer.close()
