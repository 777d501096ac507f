"""A trained workdir's model for inference: the task, its params placed on the mesh, the mesh.

Training resumes through a `Trainer`, which builds the optimizer, reads the whole train state
(params, optimizer moments, step) and the data position, and opens the workdir for writing
(checkpoint manager, metrics). Inference needs the params alone: `restore` reads only them
(`checkpointing.restore_params_only`) into the shardings training gives them on the config's
mesh (`train_step.abstract_params`, from the model's logical axis names). No optimizer is built
and nothing is written to the workdir.
"""

import dataclasses
import os
from typing import Any

import jax

from transformer_jax.parallel import sharding
from transformer_jax.sections import Mesh, section_of
from transformer_jax.training import checkpointing, train_step


@dataclasses.dataclass(frozen=True)
class TrainedModel:
  """What inference takes from a workdir: the task, its latest params and the mesh they are
  placed on (decoding splits its batches over it)."""
  task: Any
  params: Any
  mesh: jax.sharding.Mesh
  tokenizer: Any = None  # a language model's; a translation task holds its two itself


def restore(config, task, workdir: str, *, tokenizer=None) -> TrainedModel:
  """`task` with the params of the latest readable checkpoint in `workdir`, placed on the mesh
  of `config` as training places them. ConfigError if there is no checkpoint, or the
  checkpoint's shapes are not `task`'s model."""
  mesh = sharding.make_mesh(section_of(config, 'mesh', Mesh).as_dict())
  params = checkpointing.restore_params_only(os.path.join(workdir, 'checkpoints'),
                                             train_step.abstract_params(task, mesh))
  return TrainedModel(task=task, params=params, mesh=mesh, tokenizer=tokenizer)
