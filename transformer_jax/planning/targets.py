"""The Cloud TPU slices and NVIDIA GPU hosts the planner compiles for.

A TPU target names a slice as Cloud TPU sells it (`tpu-v5e-16` = a v5e slice of 16 chips) and the
topology libtpu builds its compile-only devices from (`v5e:4x4`). One device is one chip: v4 and
v5p chips have two TensorCores each, run as one "megacore" device as on a real v4/v5p VM (and
Cloud TPU counts them twice in the name: `v4-8` and `v5p-8` are 4 chips).

A GPU target names the chip and the GPU count (`gpu-h100-8` = one host of 8 H100 SXM); its
topology is XLA:GPU's `slices x hosts per slice x GPUs per host` (`1x1x8`), compiled for with
jax's CUDA plugin and the chip's `target_config` (`chips.Chip.target_config`).

The chips' figures, and where they come from, are in `transformer_jax/chips.py`.
"""

import dataclasses

from transformer_jax.chips import CHIPS, GIB, Chip
from transformer_jax.errors import ConfigError

__all__ = ['CHIPS', 'GIB', 'Chip', 'TARGETS', 'Target', 'get', 'table']


@dataclasses.dataclass(frozen=True)
class Target:
  """A TPU slice or GPU host(s): its chip, its chip count and the topology that describes it."""
  name: str  # 'tpu-v5e-16', 'gpu-h100-8'
  chip: Chip
  chips: int  # devices of the compiled program (one per chip)
  topology: str  # libtpu's topology name ('v5e:4x4') or XLA:GPU's ('1x1x8')
  topology_kwargs: tuple[tuple[str, object], ...] = ()  # e.g. (('chip_config_name', 'megacore'),)

  @property
  def platform(self) -> str:
    """'tpu' or 'gpu', as `jax.default_backend()` names them."""
    return self.chip.platform

  def describe(self) -> str:
    c = self.chip
    return (f'{self.name}: {self.chips} x {c.name} ({c.device_kind}; {c.hbm_bytes / GIB:.1f} GiB '
            f'{"HBM" if c.platform == "tpu" else "memory"}, {c.peak_flops / 1e12:.0f} TFLOP/s '
            f'bf16, {c.hbm_bandwidth / 1e9:,.0f} GB/s per chip), topology {self.topology}')


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
        # One host of 1 or 8 GPUs (NVLink within it); checked to compile with
        # jax-cuda13-plugin 0.12.1.
        _target('gpu-h100-8', 'h100', 8, '1x1x8'),
        _target('gpu-h200-1', 'h200', 1, '1x1x1'),
        _target('gpu-h200-8', 'h200', 8, '1x1x8'),
        _target('gpu-a100-80g-8', 'a100-80g', 8, '1x1x8'),
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
