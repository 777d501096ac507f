"""Optimizer and learning-rate schedules from the `config.optimizer` section."""

import optax
import jax
import jax.numpy as jnp

from transformer_jax.errors import ConfigError
from transformer_jax.sections import Optimizer


def _section(opt) -> Optimizer:
  """The typed `optimizer` section of `opt` (a record already, or the config's section)."""
  return opt if isinstance(opt, Optimizer) else Optimizer.of(opt, 'optimizer')


def make_schedule(opt) -> optax.Schedule:
  """Linear warmup to `learning_rate`, then:
    rsqrt:    lr * sqrt(warmup / step)  (the original Transformer's "Noam" decay)
    cosine:   cosine decay to `end_learning_rate` at `decay_steps`
    linear:   linear decay to `end_learning_rate` at `decay_steps` (BERT)
    constant: stays at lr.
  rsqrt and constant take `cooldown_steps` > 0: the last `cooldown_steps` before `decay_steps`
  fall linearly from wherever the schedule is to `end_learning_rate` ("warmup-stable-decay").
  Before the cooldown the schedule is unchanged, so a run trained without one can be resumed
  with it and ends exactly as if it had been planned from the start.
  """
  opt = _section(opt)  # schedule, learning rate and steps checked there
  lr, warmup, end_lr = opt.learning_rate, opt.warmup_steps, opt.end_learning_rate
  decay_steps, cooldown = opt.decay_steps, opt.cooldown_steps
  warmup_fn = lambda step: lr * jnp.minimum(1.0, (step + 1) / max(warmup, 1))
  if opt.schedule == 'rsqrt':
    base = lambda step: jnp.minimum(warmup_fn(step),
                                    lr * jnp.sqrt(max(warmup, 1) / jnp.maximum(step + 1, 1)))
  elif opt.schedule == 'constant':
    base = warmup_fn
  if opt.schedule in ('rsqrt', 'constant'):
    if not cooldown:
      return base
    start = decay_steps - cooldown
    if start < warmup:
      raise ConfigError(f'optimizer.cooldown_steps ({cooldown}) must end at decay_steps '
                        f'({decay_steps}) and start after warmup_steps ({warmup})')
    peak = float(base(start))  # where the cooldown starts from

    def with_cooldown(step):
      frac = jnp.clip((step - start) / cooldown, 0.0, 1.0)
      return jnp.where(step < start, base(step), peak + (end_lr - peak) * frac)

    return with_cooldown
  if cooldown:
    raise ConfigError(f'optimizer.cooldown_steps applies to rsqrt and constant; '
                      f'{opt.schedule} already decays to end_learning_rate at decay_steps')
  if decay_steps <= warmup:
    raise ConfigError(f'optimizer.decay_steps ({decay_steps}) must exceed warmup_steps ({warmup})')
  if opt.schedule == 'cosine':
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, decay_steps, end_lr)
  return optax.join_schedules([
      optax.linear_schedule(0.0, lr, warmup),
      optax.linear_schedule(lr, end_lr, decay_steps - warmup)
  ], [warmup])


def _decay_mask(params):
  # Decay matrices only: biases, norm scales and 1-D tables are not regularised (as in GPT-2/BERT).
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(opt) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with gradient clipping; returns (transformation, schedule) for logging the lr."""
  opt = _section(opt)
  schedule = make_schedule(opt)
  parts = []
  if opt.grad_clip_norm:
    parts.append(optax.clip_by_global_norm(opt.grad_clip_norm))
  parts.append(
      optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay,
                  mask=_decay_mask))
  return optax.chain(*parts), schedule
