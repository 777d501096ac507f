"""Training for every model: the `Trainer` loop, the pure jitted step, the optimizer, gradient
accumulation, checkpoints, preemption and metric writing."""

from transformer_jax.training.train_step import TrainState, make_eval_step, make_train_step
from transformer_jax.training.trainer import EvalContext, NonFiniteError, Task, Trainer

__all__ = [
    'EvalContext', 'NonFiniteError', 'Task', 'TrainState', 'Trainer', 'make_eval_step',
    'make_train_step'
]
