"""Optimizer and learning-rate schedules from the `config.optimizer` section."""

import optax
import jax
import jax.numpy as jnp

from transformer_jax.errors import ConfigError

SCHEDULES = ('rsqrt', 'cosine', 'linear', 'constant')


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
  lr, warmup = float(opt.learning_rate), int(opt.warmup_steps)
  if opt.schedule not in SCHEDULES:
    raise ConfigError(f'optimizer.schedule must be one of {SCHEDULES}, got {opt.schedule!r}')
  if lr <= 0 or warmup < 0:
    raise ConfigError(
        f'optimizer: need learning_rate > 0 and warmup_steps >= 0 (got {lr}, {warmup})')
  warmup_fn = lambda step: lr * jnp.minimum(1.0, (step + 1) / max(warmup, 1))
  end_lr = float(opt.get('end_learning_rate', 0.0))
  decay_steps = int(opt.get('decay_steps', 0))
  cooldown = int(opt.get('cooldown_steps', 0))
  if opt.schedule == 'rsqrt':
    base = lambda step: jnp.minimum(warmup_fn(step),
                                    lr * jnp.sqrt(max(warmup, 1) / jnp.maximum(step + 1, 1)))
  elif opt.schedule == 'constant':
    base = warmup_fn
  if cooldown < 0:
    raise ConfigError(f'optimizer.cooldown_steps must be >= 0, got {cooldown}')
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
  schedule = make_schedule(opt)
  parts = []
  if opt.get('grad_clip_norm', 0.0):
    parts.append(optax.clip_by_global_norm(float(opt.grad_clip_norm)))
  parts.append(
      optax.adamw(schedule, b1=float(opt.b1), b2=float(opt.b2), eps=float(opt.eps),
                  weight_decay=float(opt.weight_decay), mask=_decay_mask))
  return optax.chain(*parts), schedule
