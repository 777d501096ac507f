"""What every entry point does the same way: flags, errors and logging.

    app.run(lambda argv: entrypoint.run(main, argv), flags_parser=entrypoint.parse_flags)

`run(main)` turns a `UserError` (bad config, bad data) into one readable line on stderr and
exit status 1, with no stack trace; anything else is a bug and keeps its traceback. It also turns
on XLA's compilation cache and synchronous CPU dispatch (cli/process.py).
`parse_flags` does the same for config files and `--config.key=value` overrides.
"""

import difflib
import errno
import importlib.util
import os
import sys

from absl import app, logging

from transformer_jax.cli import process
from transformer_jax.errors import UserError

_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
CONFIG_FLAG = 'config'  # every experiment's config-file flag (`--config=FILE`)


class _QuietLibraries:
  """Drops INFO lines from orbax (dozens per checkpoint) so progress lines stay readable."""
  NOISY = ('/orbax/', '/jax/_src/xla_bridge.py')

  def filter(self, record) -> bool:
    noisy = any(p in record.pathname for p in self.NOISY)
    if noisy and record.exc_info:  # orbax logs background failures with their traceback;
      record.exc_info = record.exc_text = None  # the error they cause is reported in one line
    return record.levelno >= 30 or not noisy


def run(main, argv=None, uses_jax: bool = True):
  """absl `app.run` body wrapper: one line and exit 1 for user errors; XLA's compilation cache
  on (`process.enable_compilation_cache`). `uses_jax=False` (corpus preparation) leaves jax
  unimported."""
  logging.get_absl_handler().addFilter(_QuietLibraries())
  if uses_jax:
    logging.info('%s', process.enable_compilation_cache())
    logging.info('%s', process.synchronous_cpu_dispatch())
  try:
    return main(argv)
  except UserError as error:
    exit_with_error(str(error))
  except OSError as error:
    if error.errno not in _STORAGE_ERRNOS:
      raise
    # A full disk fails every writer (checkpoints, metrics, TensorBoard): report the first
    # explained failure, and exit at once, since exit handlers would only fail to write again.
    context = error.__context__
    while context is not None and not isinstance(context, UserError):
      context = context.__context__
    exit_with_error(
        str(context)
        if context else f'cannot write {error.filename or "to the workdir"} ({error.strerror}); '
        'free space or choose another --workdir and rerun', immediately=True)


# -- flags --------------------------------------------------------------------------------------


def parse_flags(argv: list[str]) -> list[str]:
  """`app.run(..., flags_parser=parse_flags)`: a bad config file or override is one 'error:' line.

  ml_collections would raise a stack trace for an override naming no key, and defers a config
  file that cannot be loaded to its first use. Both are checked here first, against the config
  file loaded on its own; other flag errors keep absl's one-line 'FATAL Flags parsing error'.
  """
  config_file = _flag_value(argv, CONFIG_FLAG)
  if config_file is not None:
    check_overrides(load_config_file(config_file), _overrides(argv, CONFIG_FLAG))
  return app.parse_flags_with_usage(argv)


def load_config_file(spec: str):
  """The ConfigDict of `--config=FILE[:ARG]`; one error line and exit 1 if it can't be built
  (flag parsing runs before `run` could catch an error)."""
  path, arg = spec, None
  if not os.path.exists(path) and ':' in spec:
    path, arg = spec.rsplit(':', 1)
  if not os.path.isfile(path):
    exit_with_error(f'cannot load the config: {path}: No such file')
  module_spec = importlib.util.spec_from_file_location('_transformer_jax_config', path)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except SyntaxError as error:  # the config file is not valid Python
    exit_with_error(f'cannot load the config: {error.filename}:{error.lineno}: {error.msg}')
  except (OSError, ImportError) as error:
    exit_with_error(f'cannot load the config: {path}: {error}')
  if not callable(getattr(module, 'get_config', None)):
    exit_with_error(f'--{CONFIG_FLAG}={spec} does not define get_config(); a config file is '
                    'Python defining get_config() that returns an ml_collections.ConfigDict '
                    '(see experiments/configs/)')
  return module.get_config(arg) if arg is not None else module.get_config()


def check_overrides(config, overrides: list[str]):
  """Every `--config.a.b=...` names a key of `config`; else one line with the nearest keys."""
  for override in overrides:
    node, walked = config, []
    for key in override.split('.')[1:]:
      keys = list(node.keys()) if hasattr(node, 'keys') else []
      if key not in keys:
        close = difflib.get_close_matches(key, [str(k) for k in keys], n=3)
        hint = f'; did you mean {", ".join(close)}?' if close else ''
        where = '.'.join(walked) or 'the config'
        exit_with_error(f'--{override}: {where} has no key {key!r}{hint} (check the spelling '
                        'against the config file)')
      node, walked = node[key], walked + [key]


def _flag_value(argv: list[str], name: str) -> str | None:
  for i, arg in enumerate(argv[1:], 1):
    if arg.startswith(f'--{name}='):
      return arg.split('=', 1)[1]
    if arg == f'--{name}' and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _overrides(argv: list[str], name: str) -> list[str]:
  return [a[2:].split('=', 1)[0] for a in argv[1:] if a.startswith(f'--{name}.')]


# -- errors -------------------------------------------------------------------------------------


def exit_with_error(message: str, immediately: bool = False):
  logging.flush()
  sys.stderr.write(f'error: {message}\n')
  sys.stderr.flush()
  if immediately:
    os._exit(1)
  sys.exit(1)
