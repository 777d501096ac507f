"""Resuming on another mesh, device count or process count, with the same global batches.

Three things could change when a run comes back on another layout (a v5e-16 job resumed on a
v5e-8, 8 GPUs on 4, 2 processes on 1):
  - the arrays: orbax restores each into the new mesh's sharding, every process reading only
    its own shards (checkpointing.py), so nothing depends on the layout that saved them;
  - the data position: every pipeline saves a position in the stream of *global* batches (each
    process cuts its contiguous rows out of the same global batch), so it is the same number
    whatever the process count;
  - the global batch itself, where its rows are rounded to the data-parallel ways (the length
    buckets and packed rows of translation: `rows = batch_tokens // length`, rounded down to a
    multiple of data x fsdp x accumulation steps). The run's first layout fixes that multiple
    (`Layout.batch_multiple`) and every resume keeps it, so the stream continues token for
    token; a mesh that cannot split those rows is one ConfigError before anything is written.

`train.elastic_accumulation=True` keeps the per-device batch instead of the device count's
share of it: a run of 8 data-parallel devices resumed on 2 takes 4 accumulation steps (the
global batch, and so the update, stay the same; each device holds what it held before).

The layout is saved with every checkpoint (its 'run' item) and the run's provenance line
records the layout it resumed from.
"""

import dataclasses
import math

import jax

from transformer_jax.errors import ConfigError
from transformer_jax.parallel import sharding


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where a run's steps ran: saved with each checkpoint, compared on resume."""
  devices: int
  processes: int
  mesh: dict[str, int]
  accumulation_steps: int
  # Rows of length-bucketed and packed global batches are multiples of this: the data x fsdp x
  # accumulation steps of the run's first layout, kept by every resume.
  batch_multiple: int

  @property
  def ways(self) -> int:
    """Data-parallel ways (data x fsdp) of the mesh."""
    return self.mesh.get('data', 1) * self.mesh.get('fsdp', 1)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, record: dict, where: str) -> 'Layout':
    """The layout of a checkpoint's 'run' item; a one-line ConfigError naming `where` if it is
    not one."""
    try:
      layout = cls(devices=int(record['devices']), processes=int(record['processes']),
                   mesh={str(k): int(v) for k, v in dict(record['mesh']).items()},
                   accumulation_steps=int(record['accumulation_steps']),
                   batch_multiple=int(record['batch_multiple']))
    except (KeyError, TypeError, ValueError):
      raise ConfigError(f'the run layout saved in {where} is malformed ({record!r}); resume '
                        'from an older checkpoint or use a new --workdir') from None
    return layout

  def describe(self) -> str:
    """'8 devices in 1 process, mesh data=8, 1 accumulation step'."""
    mesh = ' x '.join(f'{axis}={size}' for axis, size in self.mesh.items() if size > 1) or 'of 1'
    steps = 'step' if self.accumulation_steps == 1 else 'steps'
    processes = 'process' if self.processes == 1 else 'processes'
    return (f'{self.devices} device{"s" if self.devices > 1 else ""} in {self.processes} '
            f'{processes}, mesh {mesh}, {self.accumulation_steps} accumulation {steps}')


def accumulation_steps(saved: Layout | None, mesh, configured: int, elastic: bool) -> int:
  """The accumulation steps of this start: `configured`, or with `elastic` on a resume whose
  data-parallel ways changed, the saved steps x saved ways / new ways where that is a whole
  number (the per-device batch kept, the global batch unchanged)."""
  ways = sharding.data_parallel_size(mesh)
  if not elastic or saved is None or saved.ways == ways:
    return configured
  steps = saved.accumulation_steps * saved.ways
  if steps % ways:
    raise ConfigError(
        f'train.elastic_accumulation cannot keep the per-device batch of the run saved on '
        f'{saved.describe()}: {steps} micro-batches of its global batch do not split over '
        f'data x fsdp = {ways} devices; resume on a mesh whose mesh.data x mesh.fsdp divides '
        f'{steps}, or set train.elastic_accumulation=False')
  return steps // ways


def current(mesh, accumulation: int, saved: Layout | None) -> Layout:
  """This start's layout; the batch multiple is the saved run's (or, fresh, this mesh's)."""
  ways = sharding.data_parallel_size(mesh)
  return Layout(devices=int(mesh.size), processes=jax.process_count(),
                mesh={str(axis): int(size) for axis, size in mesh.shape.items()},
                accumulation_steps=accumulation,
                batch_multiple=saved.batch_multiple if saved is not None else ways * accumulation)


def check_rows(rows, layout: Layout, saved: Layout | None):
  """ConfigError unless every global batch of `rows` rows splits into the layout's accumulation
  steps over its data-parallel devices (one line naming what to change)."""
  need = layout.ways * layout.accumulation_steps
  bad = sorted({int(r) for r in rows if int(r) % need})
  if not bad:
    return
  fits = math.gcd(*{int(r) for r in rows})
  origin = (f'kept from the run saved on {saved.describe()}'
            if saved is not None else 'set by data.batch_tokens')
  raise ConfigError(
      f'global batches of {bad[0]} rows ({origin}) cannot be split into '
      f'{layout.accumulation_steps} accumulation step(s) over data x fsdp = {layout.ways} '
      f'devices (mesh {layout.mesh}); resume on a mesh whose mesh.data x mesh.fsdp x '
      f'train.accumulation_steps divides {fits}, set train.elastic_accumulation=True, or change '
      'data.batch_tokens in a new --workdir')
