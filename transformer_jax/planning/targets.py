"""The Cloud TPU slices the planner compiles for, and the figures of their chips.

A target names a slice as Cloud TPU sells it (`tpu-v5e-16` = a v5e slice of 16 chips) and the
topology libtpu builds its compile-only devices from (`v5e:4x4`). One device is one chip: v4 and
v5p chips have two TensorCores each, run as one "megacore" device as on a real v4/v5p VM (and
Cloud TPU counts them twice in the name: `v4-8` and `v5p-8` are 4 chips).

The chip figures are from the Cloud TPU system-architecture pages
(https://cloud.google.com/tpu/docs/v4, .../v5e, .../v5p, .../v6e; read 2026-12):

| chip | bf16 peak per chip | HBM per chip | HBM bandwidth per chip |
|---|---|---|---|
| v4   | 275 TFLOP/s | 32 GiB | 1,200 GB/s |
| v5e  | 197 TFLOP/s | 16 GiB |   819 GB/s |
| v5p  | 459 TFLOP/s | 95 GiB | 2,765 GB/s |
| v6e  | 918 TFLOP/s | 32 GiB | 1,640 GB/s |

Nominal peaks: a real step reaches a fraction of them (see `compile.predict`).
"""

import dataclasses

from transformer_jax.errors import ConfigError

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation's public per-chip figures."""
  name: str  # 'v5e'
  device_kind: str  # what jax's compile-only devices report, e.g. 'TPU v5 lite'
  peak_flops: float  # bf16 FLOP/s per chip
  hbm_bytes: int  # HBM per chip
  hbm_bandwidth: float  # bytes/s per chip


CHIPS = {
    'v4': Chip('v4', 'TPU v4', 275e12, 32 * GIB, 1200e9),
    'v5e': Chip('v5e', 'TPU v5 lite', 197e12, 16 * GIB, 819e9),
    'v5p': Chip('v5p', 'TPU v5', 459e12, 95 * GIB, 2765e9),
    'v6e': Chip('v6e', 'TPU v6 lite', 918e12, 32 * GIB, 1640e9),
}


@dataclasses.dataclass(frozen=True)
class Target:
  """A slice: its chip, its chip count and the libtpu topology that describes it."""
  name: str  # 'tpu-v5e-16'
  chip: Chip
  chips: int  # devices of the compiled program (one per chip)
  topology: str  # libtpu's topology name, e.g. 'v5e:4x4'
  topology_kwargs: tuple[tuple[str, object], ...] = ()  # e.g. (('chip_config_name', 'megacore'),)

  @property
  def platform(self) -> str:
    return 'tpu'

  def describe(self) -> str:
    c = self.chip
    return (f'{self.name}: {self.chips} x {c.name} ({c.device_kind}; {c.hbm_bytes / GIB:.0f} GiB '
            f'HBM, {c.peak_flops / 1e12:.0f} TFLOP/s bf16, {c.hbm_bandwidth / 1e9:,.0f} GB/s per '
            f'chip), topology {self.topology}')


def _target(name, chip, chips, topology, **kwargs) -> Target:
  return Target(name, CHIPS[chip], chips, topology, tuple(sorted(kwargs.items())))


# Topologies checked to load in libtpu 0.0.42.1 (jax 0.10.2) and 0.0.50.1 (jax 0.12.0.1): device
# counts and kinds as listed.
TARGETS = {
    t.name: t for t in (
        _target('tpu-v5e-1', 'v5e', 1, 'v5e:1x1', chips_per_host_bounds=(1, 1, 1)),
        _target('tpu-v5e-4', 'v5e', 4, 'v5e:2x2'),
        _target('tpu-v5e-8', 'v5e', 8, 'v5e:2x4'),
        _target('tpu-v5e-16', 'v5e', 16, 'v5e:4x4'),
        _target('tpu-v5e-64', 'v5e', 64, 'v5e:8x8'),
        _target('tpu-v5e-256', 'v5e', 256, 'v5e:16x16'),
        _target('tpu-v4-8', 'v4', 4, 'v4:2x2x1', chip_config_name='megacore'),
        _target('tpu-v5p-8', 'v5p', 4, 'v5p:2x2x1'),
        _target('tpu-v5p-128', 'v5p', 64, 'v5p:4x4x4'),
        _target('tpu-v6e-4', 'v6e', 4, 'v6e:2x2'),
        _target('tpu-v6e-16', 'v6e', 16, 'v6e:4x4'),
    )
}


def get(name: str) -> Target:
  """The target called `name`; ConfigError listing the known ones otherwise."""
  if name not in TARGETS:
    raise ConfigError(f'unknown target {name!r}; known targets: {", ".join(TARGETS)} '
                      '(--targets describes them)')
  return TARGETS[name]


def table() -> str:
  """One line per target, for `--targets`."""
  return '\n'.join(t.describe() for t in TARGETS.values())
