"""XLA flags and compiler options, only those the installed jaxlib knows.

XLA aborts the whole process on an unknown name in `XLA_FLAGS` ("Unknown flag in XLA_FLAGS",
before Python can catch anything), and `jax.jit(..., compiler_options=...)` fails with "No such
compile option". Flags come and go between jaxlib releases: `xla_cpu_use_fusion_emitters`, which
the tests set on jax 0.10.2 to compile faster, is gone from 0.11.2. So every flag or option the
project sets (tests, benchmarks, entry points, the library) is built here, from one table that
says which jaxlib releases know each name. tests/test_xla_options.py checks the table against
the installed jaxlib in both directions: the names it says are known start a process, the others
abort one.

This module imports nothing from jax: `XLA_FLAGS` must be set before jax starts its backend, so
the version is read from the installed package's metadata.
"""

import dataclasses
import importlib.metadata
import os
import re


@dataclasses.dataclass(frozen=True)
class Known:
  """The jaxlib releases that know a flag: from `since` (inclusive) to `removed_in` (exclusive).

  None is open-ended. Versions are the ones checked, so a bound says "checked to exist here and
  not there", not the release that changed it.
  """
  since: str | None = None
  removed_in: str | None = None


# Every XLA flag or compiler option the project sets, and why.
KNOWN = {
    # Tests: LLVM at level 0 compiles a tiny translation train step in 4.8 s instead of 13.6 s.
    'xla_backend_optimization_level': Known(),
    # Tests, jax 0.10.2: the older (non-MLIR) fusion emitters compile ~30% faster. 0.11.2 knows
    # only the MLIR emitters (the name is gone).
    'xla_cpu_use_fusion_emitters': Known(removed_in='0.11.2'),
    # Simulated devices on one CPU (tests, benchmarks, launch/local_multiprocess.sh).
    'xla_force_host_platform_device_count': Known(),
    # Which ops XLA:CPU hands to its YNNPACK fusions (inference/search.py, cli/process.py).
    'xla_cpu_experimental_ynn_fusion_type': Known(),
    # XLA:CPU's oneDNN dot fusion, checked by benchmarks/cpu_bf16_paths.py (fast bf16 dots of
    # every orientation, but wrong gradients for a small GPT: precision.py does not use it).
    'xla_cpu_use_onednn': Known(),
    'xla_cpu_experimental_onednn_fusion_type': Known(),
}


def version_tuple(version: str) -> tuple[int, ...]:
  """'0.12.0.1' -> (0, 12, 0, 1); a suffix such as 'rc1' or '.dev2026' is dropped."""
  match = re.match(r'\d+(\.\d+)*', version)
  if not match:
    raise ValueError(f'not a version: {version!r}')
  return tuple(int(part) for part in match.group(0).split('.'))


def jaxlib_version() -> str:
  """The installed jaxlib's version, read without importing jax."""
  return importlib.metadata.version('jaxlib')


def knows(name: str, version: str | None = None) -> bool:
  """Whether jaxlib `version` (default: the installed one) knows the flag or option `name`.

  A name missing from KNOWN is a bug in the caller: add it to the table, with the releases
  checked, before setting it.
  """
  if name not in KNOWN:
    raise KeyError(f'{name!r} is not in xla_options.KNOWN; add it with the jaxlib releases '
                   'that know it')
  known = KNOWN[name]
  current = version_tuple(version or jaxlib_version())
  if known.since is not None and current < version_tuple(known.since):
    return False
  return known.removed_in is None or current < version_tuple(known.removed_in)


def _flag_text(name: str, value) -> str:
  if isinstance(value, bool):
    value = str(value).lower()
  return f'--{name}={value}'


def flags(version: str | None = None, **values) -> list[str]:
  """`--name=value` for each of `values` the jaxlib knows (booleans written true/false)."""
  return [_flag_text(name, value) for name, value in values.items() if knows(name, version)]


def _flag_name(text: str) -> str:
  return text.lstrip('-').split('=', 1)[0]


def with_flags(existing: str | None, *extra: str) -> str:
  """`existing` XLA_FLAGS text with the `extra` flags appended; where both set a flag, `extra`'s
  value replaces the existing one."""
  replaced = {_flag_name(flag) for flag in extra}
  kept = [flag for flag in (existing or '').split() if _flag_name(flag) not in replaced]
  return ' '.join(kept + list(extra))


def add_flags(env=None, version: str | None = None, **values) -> str:
  """Appends the known ones of `values` to env['XLA_FLAGS'] (default os.environ); returns it.

  Call before jax starts a backend (for this process) or for a subprocess's environment.
  """
  env = os.environ if env is None else env
  env['XLA_FLAGS'] = with_flags(env.get('XLA_FLAGS'), *flags(version, **values))
  return env['XLA_FLAGS']


def host_devices_env(count: int, env=None) -> dict[str, str]:
  """A copy of `env` (default os.environ) whose XLA_FLAGS simulate `count` CPU devices."""
  env = dict(os.environ if env is None else env)
  add_flags(env, xla_force_host_platform_device_count=count)
  return env


def compiler_options(version: str | None = None, **values) -> dict:
  """`jax.jit(..., compiler_options=...)` of the known ones of `values`.

  Values keep their Python type: XLA parses a boolean option from a bool, not from 'false'.
  """
  return {name: value for name, value in values.items() if knows(name, version)}
