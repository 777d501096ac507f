"""The pure step functions the trainer jits: (state, batch) -> (state, metrics), and eval.

The dropout key for step s is fold_in(key(seed), s), so a resumed run draws exactly the same
randomness. A non-finite loss or gradient keeps the old state (the step is counted as skipped);
the trainer stops the run after too many in a row.

`build_train_step` places the step on a mesh: the state's shardings from the parameters' logical
axis names, the abstract (shape-only) state and the jitted step with donated state. The trainer
runs it; the planner (`transformer_jax/planning/`) compiles it ahead of time for a TPU topology.
"""

import dataclasses
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from transformer_jax import onednn_lifetime, precision
from transformer_jax.parallel import sharding
from transformer_jax.training.accumulation import accumulated_value_and_grad

Batch = dict[str, np.ndarray]
Metrics = dict[str, jnp.ndarray]


@flax.struct.dataclass
class TrainState:
  step: jnp.ndarray
  params: Any
  opt_state: Any


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
    grad_norm = optax.tree.norm(grads)
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
  """params, batch -> metric sums of the deterministic loss (no dropout)."""

  def eval_step(params, batch: Batch) -> Metrics:
    return loss_fn(params, batch, None, True)[1]

  return eval_step


@dataclasses.dataclass(frozen=True)
class ShardedTrainStep:
  """The train step placed on a mesh; nothing here holds an array."""
  step: Callable  # jitted (state, batch) -> (state, metrics); the state argument is donated
  create_state: Callable  # rng -> TrainState with boxed (logically named) params
  state_shardings: TrainState  # a NamedSharding per state leaf
  abstract_state: TrainState  # a jax.ShapeDtypeStruct (with its sharding) per state leaf
  batch_sharding: jax.sharding.NamedSharding  # rows split over data x fsdp


def step_compiler_options(task, mesh: jax.sharding.Mesh) -> dict | None:
  """XLA options for `task`'s steps on `mesh`'s platform: the CPU precision policy's when the
  model's matmuls run in bf16 on CPU (`precision.compiler_options`), else None."""
  return precision.compiler_options(task.cfg.matmul_dtype, mesh.devices.flat[0].platform)


def _placed(boxed_abstract, mesh: jax.sharding.Mesh, rules):
  """(shardings, abstract tree) of a `jax.eval_shape` tree of logically named boxes: a
  NamedSharding per leaf (`sharding.tree_shardings`) and the unboxed leaves as
  jax.ShapeDtypeStructs carrying them."""
  shardings = sharding.tree_shardings(mesh, boxed_abstract, rules)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          nn.meta.unbox(boxed_abstract), shardings)
  return shardings, abstract


def abstract_params(task, mesh: jax.sharding.Mesh, rules=sharding.LOGICAL_AXIS_RULES):
  """`task`'s params as jax.ShapeDtypeStructs placed as `build_train_step` places them in the
  train state (the params alone: no optimizer is built), e.g. for a params-only restore."""
  boxed = jax.eval_shape(lambda rng: task.init_variables(rng)['params'], jax.random.key(0))
  return _placed(boxed, mesh, rules)[1]


def build_train_step(task, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh, *, seed: int,
                     accumulation_steps: int = 1,
                     rules=sharding.LOGICAL_AXIS_RULES) -> ShardedTrainStep:
  """The jitted train step of `task` over `mesh`, and the state it takes, shapes only.

  The state's shardings come from the logical axis names of `jax.eval_shape(create_state)`
  (`sharding.tree_shardings`), so building this allocates nothing: lower and compile
  `step` with `abstract_state` and a batch of `jax.ShapeDtypeStruct`s on `batch_sharding`
  (inside `sharding.use_mesh(mesh, rules)`) to see the program without running it.
  """

  def create_state(rng) -> TrainState:
    params = task.init_variables(rng)['params']
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  state_shardings, abstract_state = _placed(jax.eval_shape(create_state, jax.random.key(0)), mesh,
                                            rules)
  batch_sharding = sharding.batch_sharding(mesh)
  step = onednn_lifetime.jit(make_train_step(task.loss_fn, tx, seed, accumulation_steps),
                             in_shardings=(state_shardings, batch_sharding),
                             out_shardings=(state_shardings, None), donate_argnums=(0,),
                             compiler_options=step_compiler_options(task, mesh))
  return ShardedTrainStep(step=step, create_state=create_state, state_shardings=state_shardings,
                          abstract_state=abstract_state, batch_sharding=batch_sharding)
