"""The CPU precision policy: bf16 matmuls where the CPU has bf16 matrix units, float32 elsewhere.

In the spirit of PyTorch's `torch.autocast("cpu", dtype=torch.bfloat16)`: the matmuls (dense
layers, attention's score and value products) take bf16 operands and give bf16 results, which
the next op reads as float32; parameters, the optimizer, norms, softmax, the loss and every
elementwise op stay float32. `model.matmul_dtype` selects it:

  'auto'       this module decides (`choose`): bf16 on a CPU with `amx_bf16` or `avx512_bf16`
               where a one-time probe shows the bf16 dot faster, float32 otherwise; accelerators
               keep `model.dtype` (bf16 compute there is the whole model's dtype).
  'bfloat16'   the policy, wherever the run is.
  'none'       no policy: the matmuls run in `model.dtype`.

Why bf16 results, and why compiler options (measured on a 2-core Xeon with AMX, jax 0.12,
docs/performance.md): XLA:CPU's default dot library, YNNPACK, multiplies bf16 operands fast only
as [M, K] @ [K, N] row-major and silently computes every other orientation, such as the
gradient's x^T g and g w^T, in float32. oneDNN's dot fusion runs every orientation at the bf16
rate (1,000-2,500 GFLOP/s against 230-300 for float32) but only with bf16 results. So a model
under the policy is compiled with `compiler_options(...)`: dots to oneDNN, YNNPACK kept for
reductions. oneDNN's fusion of a dot with the elementwise ops after it (a bias add) computes
wrong gradients (2-layer GPT, jax 0.12.0.1); the policy's matmuls end in an optimization
barrier so nothing is fused into them, and tests/test_precision.py checks the gradients of a
GPT, a BERT and a translation model against float32 on every supported jax.

The probe (a fraction of a second: two 1024^3 products) is cached per machine and jaxlib in
$XDG_CACHE_HOME/transformer_jax/cpu_matmul_probe.json. TRANSFORMER_JAX_AUTO_MATMUL_DTYPE
(float32 or bfloat16) fixes what 'auto' picks (the test suite sets float32, so results do not
depend on the CPU the tests run on).

This module imports jax only inside the functions that need it: tools/machine.py reads the CPU
through it in benchmark processes that never start jax (benchmarks/prepare.py measures their
peak memory), where importing jax would add 0.6-1.2 s and 125 MB of peak RSS (measured).
"""

import dataclasses
import json
import os
import platform
import time
import warnings

from transformer_jax import files, xla_options
from transformer_jax.errors import ConfigError

# Settings of model.matmul_dtype.
SETTINGS = ('auto', 'none', 'float32', 'bfloat16')
POLICY_DTYPE = 'bfloat16'
# CPU flags (/proc/cpuinfo) of bf16 matrix hardware: Intel AMX (Sapphire Rapids on), AVX512-BF16
# (Cooper Lake, Zen 4 on).
BF16_CPU_FLAGS = ('amx_bf16', 'avx512_bf16')
# The policy is picked when the probe's bf16 dot is at least this much faster than float32.
MIN_PROBE_SPEEDUP = 1.5
PROBE_SIZE = 1024
AUTO_VARIABLE = 'TRANSFORMER_JAX_AUTO_MATMUL_DTYPE'
# The first jaxlib checked to run bf16 dots fast on CPU (0.10.2: 230 GFLOP/s, slower than its
# float32) and to take the oneDNN options (0.10.2 dies of an illegal instruction with them).
FAST_BF16_JAXLIB = '0.11.2'
_PROBED: dict[str, float] = {}  # this process's probe results, by CPU model and jaxlib
_MATMULS: dict = {}  # (dtype name, transposed) -> the jitted product matmul_seconds times


@dataclasses.dataclass(frozen=True)
class Choice:
  """What `model.matmul_dtype` resolved to: a dtype name or None (no policy), and why."""
  matmul_dtype: str | None
  reason: str


def compiler_options(matmul_dtype, platform: str = 'cpu') -> dict | None:
  """`jax.jit(..., compiler_options=...)` for the steps of a model whose matmuls run in
  `matmul_dtype`: on CPU under the policy, dots to oneDNN and YNNPACK for reductions only; None
  (XLA's defaults) otherwise."""
  if platform != 'cpu' or matmul_dtype is None or _name(matmul_dtype) != POLICY_DTYPE:
    return None
  if not has_fast_bf16_dots():
    return None
  # XLA cannot store a program with oneDNN fusions in the compilation cache ("ToProto is not
  # implemented for thunk kind: onednn-fusion"): such steps compile on every run (~5 s for the
  # mid GPT); jax's warning about it on every compile says nothing more.
  warnings.filterwarnings(
      'ignore', message='Error writing persistent compilation cache entry.*'
      'onednn-fusion')
  return xla_options.compiler_options(
      xla_cpu_use_onednn=True, xla_cpu_experimental_onednn_fusion_type='LIBRARY_FUSION_TYPE_DOT',
      xla_cpu_experimental_ynn_fusion_type='LIBRARY_FUSION_TYPE_REDUCE') or None


def resolve(setting: str | None, platform: str | None = None) -> Choice:
  """The Choice for a `model.matmul_dtype` setting (one of SETTINGS; None is 'none')."""
  setting = 'none' if setting in (None, '', 'None') else setting
  if setting not in SETTINGS:
    raise ConfigError(f'model.matmul_dtype must be one of {list(SETTINGS)}, got {setting!r}')
  if setting == 'auto':
    return choose(platform)
  if setting == 'none':
    return Choice(None, 'model.matmul_dtype=none: the matmuls run in model.dtype')
  return Choice(setting, f'model.matmul_dtype={setting}')


def choose(platform: str | None = None, cpu_flags: set[str] | None = None, probe=None) -> Choice:
  """'auto': the policy on a CPU with bf16 matrix units where the probe shows it faster.

  `cpu_flags` (default: /proc/cpuinfo's) and `probe` (default: `probe_speedup`, cached) are
  parameters so that tests can fake a machine.
  """
  forced = os.environ.get(AUTO_VARIABLE, '')
  if forced:
    if forced not in ('float32', 'bfloat16'):
      raise ConfigError(f'{AUTO_VARIABLE} must be float32 or bfloat16, got {forced!r}')
    return Choice(None if forced == 'float32' else forced, f'{AUTO_VARIABLE}={forced}')
  if platform is None:
    import jax  # lazy: jax-free module (the module docstring)
    platform = jax.default_backend()
  if platform != 'cpu':
    return Choice(None, f'{platform}: matmuls in model.dtype (the policy is for CPUs)')
  if not has_fast_bf16_dots():
    return Choice(
        None, f'jaxlib {xla_options.jaxlib_version()} has no fast bf16 dot on CPU '
        f'(jaxlib >= {FAST_BF16_JAXLIB} has)')
  flags = cpu_bf16_flags() if cpu_flags is None else set(cpu_flags) & set(BF16_CPU_FLAGS)
  if not flags:
    return Choice(None, 'this CPU has no bf16 matrix units (neither amx_bf16 nor avx512_bf16)')
  speedup = (probe or probe_speedup)()
  have = '+'.join(sorted(flags))
  if speedup < MIN_PROBE_SPEEDUP:
    return Choice(
        None, f'CPU has {have} but the bf16 dot is only {speedup:.2f}x float32 here '
        f'(below {MIN_PROBE_SPEEDUP}x)')
  return Choice(POLICY_DTYPE, f'CPU has {have}; the bf16 dot is {speedup:.1f}x float32')


def has_fast_bf16_dots(version: str | None = None) -> bool:
  """Whether jaxlib `version` (default: the installed one) runs bf16 dots fast on CPU."""
  version = version or xla_options.jaxlib_version()
  return xla_options.version_tuple(version) >= xla_options.version_tuple(FAST_BF16_JAXLIB)


def cpuinfo_value(key: str, cpuinfo: str = '/proc/cpuinfo') -> str | None:
  """The value of the first `key` line of /proc/cpuinfo ('flags', 'model name'); None where the
  file or the line is missing."""
  try:
    with open(cpuinfo, encoding='utf-8') as f:
      for line in f:
        if line.startswith(key):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return None


def cpu_bf16_flags(cpuinfo: str = '/proc/cpuinfo') -> set[str]:
  """The BF16_CPU_FLAGS this machine's CPU reports (empty where /proc/cpuinfo is missing)."""
  return set((cpuinfo_value('flags', cpuinfo) or '').split()) & set(BF16_CPU_FLAGS)


def probe_speedup(cache_path: str | None = None) -> float:
  """float32 time / bf16 time of a PROBE_SIZE^3 matmul, from the cache when this CPU model and
  jaxlib were probed before."""
  import jax  # lazy: jax-free module (the module docstring)
  cache_path = cache_path or _cache_path()
  key = f'{cpu_model()} | jaxlib {jax.lib.__version__}'
  if key in _PROBED:
    return _PROBED[key]
  cached = _read_json(cache_path)
  if key in cached:
    _PROBED[key] = float(cached[key])
    return _PROBED[key]
  speedup = _PROBED[key] = round(_time_dot('float32') / _time_dot(POLICY_DTYPE), 3)
  cached[key] = speedup
  try:
    os.makedirs(os.path.dirname(cache_path), exist_ok=True)
    with open(cache_path + '.tmp', 'w') as f:
      json.dump(cached, f, indent=1)
    os.replace(cache_path + '.tmp', cache_path)
  except OSError:
    pass  # a read-only home only costs the probe again next run
  return speedup


def _time_dot(dtype: str) -> float:
  """The probe's product: PROBE_SIZE^3 with a transposed operand, as the gradient's matmuls
  have."""
  return matmul_seconds(dtype, PROBE_SIZE, transposed=True)


def matmul_seconds(dtype, n: int, *, transposed: bool = False, repeats: int = 5) -> float:
  """Best of `repeats` timings of one jitted n^3 matmul in `dtype` (a.T @ b when `transposed`),
  compiled as the steps are (`compiler_options`)."""
  import jax.numpy as jnp  # lazy: jax-free module (the module docstring)
  a = jnp.ones((n, n), dtype)
  dot = _matmul_program(_name(jnp.dtype(dtype)), transposed)
  dot(a, a).block_until_ready()
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    dot(a, a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return best


def _matmul_program(dtype: str, transposed: bool):
  """The jitted product `matmul_seconds` times, one per dtype and orientation for the whole
  process: with the policy's options it is a oneDNN program, which is never freed
  (`onednn_lifetime`), so a new one per probe would only add up."""
  key = (dtype, transposed)
  if key not in _MATMULS:
    from transformer_jax import onednn_lifetime  # lazy: it imports jax (the module docstring)
    product = (lambda a, b: a.T @ b) if transposed else (lambda a, b: a @ b)
    _MATMULS[key] = onednn_lifetime.jit(product, compiler_options=compiler_options(dtype))
  return _MATMULS[key]


def _name(dtype) -> str:
  """'bfloat16' for 'bfloat16', jnp.bfloat16 or its numpy dtype."""
  if isinstance(dtype, str):
    return dtype
  name = getattr(dtype, 'name', None)
  return name if isinstance(name, str) else getattr(dtype, '__name__', str(dtype))


def _cache_path() -> str:
  return files.cache_path('cpu_matmul_probe.json')


def cpu_model() -> str:
  """The CPU's model name (/proc/cpuinfo), else what the platform module says."""
  return cpuinfo_value('model name') or platform.processor() or platform.machine()


def _read_json(path: str) -> dict:
  try:
    with open(path) as f:
      value = json.load(f)
    return value if isinstance(value, dict) else {}
  except (OSError, ValueError):
    return {}
