"""Deprecated APIs the project calls: recorded while the suite runs, each one a test failure.

`-W error::DeprecationWarning:transformer_jax` would miss most of them: a library usually
attributes its warning to its own module (optax.global_norm to optax/_src/linear_algebra.py), not
to the caller. So `warnings.warn` is wrapped (tests/conftest.py installs it before jax, flax or
optax is imported) and each DeprecationWarning is traced up its call stack: past the frames of
the package that warns, the first frame is the code that called the deprecated API. When that
frame is the project's (transformer_jax, experiments, benchmarks, tools), the call is recorded;
conftest's autouse fixture fails the test that made it. A deprecated API that a library calls on
its own (flax calling jax) is the library's business and is left alone.
"""

import sys
import warnings

PROJECT_PACKAGES = ('transformer_jax', 'experiments', 'benchmarks', 'tools')

calls: list[str] = []
_original_warn = warnings.warn


def _package(frame) -> str:
  return (frame.f_globals.get('__name__') or '').split('.')[0]


def project_caller(frame) -> str | None:
  """'path:line' of the project frame that called into the warning package, else None.

  `frame` is the frame that called `warnings.warn`.
  """
  warner = _package(frame)
  while frame is not None and _package(frame) == warner:
    frame = frame.f_back
  if frame is None or _package(frame) not in PROJECT_PACKAGES:
    return None
  return f'{frame.f_code.co_filename}:{frame.f_lineno}'


def _warn(message, category=None, stacklevel=1, source=None, **kwargs):
  kind = category or (type(message) if isinstance(message, Warning) else UserWarning)
  if issubclass(kind, DeprecationWarning):
    caller = project_caller(sys._getframe(1))  # pylint: disable=protected-access
    if caller is not None:
      calls.append(f'{caller}: {message}')
  # One frame more than the caller asked for: this wrapper's own.
  return _original_warn(message, category, stacklevel + 1, source, **kwargs)


def install():
  warnings.warn = _warn


def take() -> list[str]:
  """The calls recorded since the last take(), cleared."""
  found = list(calls)
  calls.clear()
  return found
