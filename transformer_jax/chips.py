"""The accelerator chips the project knows, with their public figures: one table for the planner
(`planning/targets.py`: slices and GPU hosts built from these chips) and for the training log's
MFU (`flops.peak_flops_per_device`: a chip's nominal peak, found by the `device_kind` jax reports).

TPU figures are from the Cloud TPU system-architecture pages (https://cloud.google.com/tpu/docs/v4,
.../v5e, .../v5p, .../v6e; read 2026-12). GPU figures are from NVIDIA's data sheets (H100 Tensor
Core GPU, SXM5; H200 Tensor Core GPU, SXM; A100 Tensor Core GPU, SXM4 80GB; L4; read 2026-12):
the dense (not 2:4 sparse) bf16 Tensor Core rate, the SXM memory bandwidth, and the memory as the
CUDA driver reports it (`nvidia-smi`'s total: 81,559 MiB on an H100 80GB).

| chip | bf16 dense peak | memory per chip | memory bandwidth | compute capability, SMs |
|---|---|---|---|---|
| TPU v4   | 275 TFLOP/s | 32 GiB  | 1,200 GB/s | |
| TPU v5e  | 197 TFLOP/s | 16 GiB  |   819 GB/s | |
| TPU v5p  | 459 TFLOP/s | 95 GiB  | 2,765 GB/s | |
| TPU v6e  | 918 TFLOP/s | 32 GiB  | 1,640 GB/s | |
| H100 SXM | 989 TFLOP/s | 80 GB   | 3,350 GB/s | 9.0, 132 |
| H200 SXM | 989 TFLOP/s | 141 GB  | 4,800 GB/s | 9.0, 132 |
| A100 SXM 80GB | 312 TFLOP/s | 80 GB | 2,039 GB/s | 8.0, 108 |
| L4       | 121 TFLOP/s | 24 GB   |   300 GB/s | 8.9, 58 |

Nominal peaks: a real step reaches a fraction of them. This module imports nothing heavy.
"""

import dataclasses
import re

GIB = 1024**3
MIB = 1024**2
KIB = 1024


@dataclasses.dataclass(frozen=True)
class Gpu:
  """What XLA:GPU needs to compile for an NVIDIA GPU it cannot see (`target_config`): the
  architecture (compute capability) and the figures its cost model and tiling read."""
  compute_capability: tuple[int, int]
  multiprocessors: int
  fp32_cores_per_multiprocessor: int
  clock_ghz: float  # boost clock
  l2_bytes: int
  shared_memory_per_multiprocessor: int  # bytes
  shared_memory_per_block_optin: int  # bytes a kernel may opt in to
  threads_per_multiprocessor: int = 2048  # 1,536 on compute capability 8.6 and 8.9
  cudnn_version: tuple[int, int] = (9, 10)  # the cuDNN the compiled program assumes


@dataclasses.dataclass(frozen=True)
class Chip:
  """One chip's public figures; `gpu` is set for NVIDIA GPUs."""
  name: str  # 'v5e', 'h100'
  device_kind: str  # what jax's devices of this chip report, e.g. 'TPU v5 lite'
  peak_flops: float  # dense bf16 FLOP/s per chip
  hbm_bytes: int  # device memory per chip
  hbm_bandwidth: float  # bytes/s per chip
  gpu: Gpu | None = None

  @property
  def platform(self) -> str:
    return 'gpu' if self.gpu else 'tpu'

  def target_config(self) -> str:
    """XLA's `GpuTargetConfigProto` for this GPU, in protobuf text format: what
    `jax.experimental.topologies.get_topology_desc(platform='cuda', target_config=...)` needs to
    describe compile-only devices of it. The per-block and per-thread limits are those of every
    CUDA GPU since compute capability 7.0."""
    if self.gpu is None:
      raise ValueError(f'{self.name} is not a GPU')
    g = self.gpu
    major, minor = g.compute_capability
    return '\n'.join([
        'gpu_device_info {',
        '  threads_per_block_limit: 1024',
        '  threads_per_warp: 32',
        '  shared_memory_per_block: 49152',
        f'  shared_memory_per_core: {g.shared_memory_per_multiprocessor}',
        f'  threads_per_core_limit: {g.threads_per_multiprocessor}',
        f'  core_count: {g.multiprocessors}',
        f'  fpus_per_core: {g.fp32_cores_per_multiprocessor}',
        '  block_dim_limit_x: 2147483647',
        '  block_dim_limit_y: 65535',
        '  block_dim_limit_z: 65535',
        f'  memory_bandwidth: {int(self.hbm_bandwidth)}',
        f'  l2_cache_size: {g.l2_bytes}',
        f'  clock_rate_ghz: {g.clock_ghz}',
        f'  device_memory_size: {self.hbm_bytes}',
        f'  shared_memory_per_block_optin: {g.shared_memory_per_block_optin}',
        f'  cuda_compute_capability {{ major: {major} minor: {minor} }}',
        '  registers_per_core_limit: 65536',
        '  registers_per_block_limit: 65536',
        '}',
        'platform_name: "CUDA"',
        f'dnn_version_info {{ major: {g.cudnn_version[0]} minor: {g.cudnn_version[1]} }}',
        f'device_description_str: "{self.device_kind}"',
    ]) + '\n'


_HOPPER = Gpu(compute_capability=(9, 0), multiprocessors=132, fp32_cores_per_multiprocessor=128,
              clock_ghz=1.98, l2_bytes=50 * MIB, shared_memory_per_multiprocessor=228 * KIB,
              shared_memory_per_block_optin=227 * KIB)
_AMPERE = Gpu(compute_capability=(8, 0), multiprocessors=108, fp32_cores_per_multiprocessor=64,
              clock_ghz=1.41, l2_bytes=40 * MIB, shared_memory_per_multiprocessor=164 * KIB,
              shared_memory_per_block_optin=163 * KIB)
_ADA_L4 = Gpu(compute_capability=(8, 9), multiprocessors=58, fp32_cores_per_multiprocessor=128,
              clock_ghz=2.04, l2_bytes=48 * MIB, shared_memory_per_multiprocessor=100 * KIB,
              shared_memory_per_block_optin=99 * KIB, threads_per_multiprocessor=1536)

CHIPS = {
    c.name: c for c in (
        Chip('v4', 'TPU v4', 275e12, 32 * GIB, 1200e9),
        Chip('v5e', 'TPU v5 lite', 197e12, 16 * GIB, 819e9),
        Chip('v5p', 'TPU v5', 459e12, 95 * GIB, 2765e9),
        Chip('v6e', 'TPU v6 lite', 918e12, 32 * GIB, 1640e9),
        Chip('h100', 'NVIDIA H100 80GB HBM3', 989e12, 81_559 * MIB, 3350e9, _HOPPER),
        Chip('h200', 'NVIDIA H200', 989e12, 143_771 * MIB, 4800e9, _HOPPER),
        Chip('a100-80g', 'NVIDIA A100-SXM4-80GB', 312e12, 81_920 * MIB, 2039e9, _AMPERE),
        Chip('l4', 'NVIDIA L4', 121e12, 23_034 * MIB, 300e9, _ADA_L4),
    )
}


def for_device_kind(device_kind: str) -> Chip | None:
  """The chip whose devices report `device_kind`, or None. jax's kinds name TPUs exactly ('TPU v5
  lite'); GPU kinds carry the board's name ('NVIDIA H100 80GB HBM3', 'NVIDIA H100 PCIe',
  'NVIDIA A100-SXM4-40GB'), so a GPU matches on its family ('H100', with the SXM figures)."""
  for chip in CHIPS.values():
    if device_kind == chip.device_kind:
      return chip
  if device_kind.startswith('NVIDIA '):
    family = re.split(r'[ -]', device_kind.removeprefix('NVIDIA '))[0].upper()
    for chip in CHIPS.values():
      if chip.gpu is not None and chip.name.split('-')[0].upper() == family:
        return chip
  return None
