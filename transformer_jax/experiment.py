"""What every experiment entry point does the same way: errors, workdir, config, logging.

`run(main)` turns a `UserError` (bad config, bad data) into one readable line on stderr and
exit status 1, with no stack trace; anything else is a bug and keeps its traceback.
"""

import errno
import json
import os
import re
import sys
import tempfile

from absl import logging

from transformer_jax import runtime
from transformer_jax.errors import ConfigError, UserError
from transformer_jax.files import write_atomically

_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


class _QuietLibraries:
  """Drops INFO lines from orbax (dozens per checkpoint) so progress lines stay readable."""
  NOISY = ('/orbax/', '/jax/_src/xla_bridge.py')

  def filter(self, record) -> bool:
    noisy = any(p in record.pathname for p in self.NOISY)
    if noisy and record.exc_info:  # orbax logs background failures with their traceback;
      record.exc_info = record.exc_text = None  # the error they cause is reported in one line
    return record.levelno >= 30 or not noisy


def run(main, argv=None):
  """absl `app.run` body wrapper: one line and exit 1 for user errors; XLA's compilation cache
  on (`runtime.enable_compilation_cache`)."""
  logging.get_absl_handler().addFilter(_QuietLibraries())
  logging.info('%s', runtime.enable_compilation_cache())
  try:
    return main(argv)
  except UserError as error:
    _exit_with_error(str(error))
  except OSError as error:
    if error.errno not in _STORAGE_ERRNOS:
      raise
    # A full disk fails every writer (checkpoints, metrics, TensorBoard): report the first
    # explained failure, and exit at once, since exit handlers would only fail to write again.
    context = error.__context__
    while context is not None and not isinstance(context, UserError):
      context = context.__context__
    _exit_with_error(str(context) if context else
                     f'cannot write {error.filename or "to the workdir"} ({error.strerror}); '
                     'free space or choose another --workdir and rerun', immediately=True)


def parse_flags(argv: list[str]) -> list[str]:
  """`app.run(..., flags_parser=parse_flags)`: bad config flags become one 'error:' line.

  ml_collections raises plain exceptions for a `--config.key=value` override naming no key
  and defers a config file that cannot be loaded to its first use; absl would print both
  as stack traces. Other flag errors keep absl's one-line 'FATAL Flags parsing error'.
  """
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  try:
    remaining = app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError) as error:
    # ml_collections: AttributeError(KeyError("'key'[\nDid you mean ...?]")).
    if "has no attribute 'get_config'" in str(error):
      files = [a.split('=', 1)[1] for a in argv[1:] if a.startswith('--config=')]
      _exit_with_error(f'--config={files[0] if files else "FILE"} does not define get_config(); '
                       'a config file is Python defining get_config() that returns an '
                       'ml_collections.ConfigDict (see experiments/configs/)')
    inner = error
    while inner.args and isinstance(inner.args[0], BaseException):
      inner = inner.args[0]
    message = str(inner.args[0]) if inner.args else ''
    key = re.match(r"'([^']+)'", message)
    overrides = [a.split('=', 1)[0] for a in argv[1:]
                 if a.startswith('--') and '.' in a.split('=', 1)[0]]
    named = [o for o in overrides if key and key.group(1) in o.lstrip('-').split('.')[1:]]
    if not named:  # not an override naming a missing key: a bug, keep the traceback
      raise
    hint = ' '.join(message.splitlines()[1:])
    _exit_with_error(f'{named[0]}: the config has no key {key.group(1)!r}'
                     f'{"; " + hint if hint else ""} (check the spelling against the config '
                     'file)')
  except OSError as error:
    _exit_with_error(f'cannot load the config: {_last_line(error)}')
  except SyntaxError as error:  # the config file is not valid Python
    _exit_with_error(f'cannot load the config: {error.filename}:{error.lineno}: {error.msg}')
  for name in list(flags.FLAGS):
    flag = flags.FLAGS[name]
    if not flag.present:
      continue
    try:
      path = config_flags.get_config_filename(flag)
    except (TypeError, AttributeError, flags.Error):  # not a config-file flag
      continue
    try:
      if flag.value is not None:
        flag.value.keys()  # an unloadable config file raises on first use
    except OSError as error:
      _exit_with_error(f'--{name}={path} cannot be loaded: {_last_line(error)}')
  return remaining


def _last_line(error: BaseException) -> str:
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  return lines[-1] if lines else type(error).__name__


def _exit_with_error(message: str, immediately: bool = False):
  logging.flush()
  sys.stderr.write(f'error: {message}\n')
  sys.stderr.flush()
  if immediately:
    os._exit(1)  # pylint: disable=protected-access
  sys.exit(1)


def prepare_workdir(workdir: str | None) -> str:
  """Creates the workdir if needed and proves it writable before anything expensive runs."""
  if not workdir:
    raise ConfigError('--workdir is required: the directory for checkpoints, tokenizer and logs')
  workdir = os.path.abspath(os.path.expanduser(workdir))
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f'--workdir {workdir} exists and is not a directory')
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=workdir, prefix='.write_test_') as probe:
      probe.write(b'x' * 4096)
      probe.flush()
      os.fsync(probe.fileno())
  except OSError as error:
    raise ConfigError(f'workdir {workdir} is not writable ({error.strerror}); '
                      'choose another --workdir or free space') from None
  return workdir


def require_keys(config, section: str, keys: tuple[str, ...]):
  """Names a missing config key up front instead of failing deep inside training."""
  node = config
  for part in section.split('.'):
    if part not in node:
      raise ConfigError(f'config has no section {section!r}')
    node = node[part]
  missing = [k for k in keys if k not in node]
  if missing:
    raise ConfigError(f'config section {section!r} is missing {missing}')


def check_mesh(config, global_batch: int | None = None):
  """The mesh against the device count (and `global_batch` rows against data x fsdp), and a
  named attention kernel against the backend.

  Trainer checks these too, but only after the tokenizer and config.json are written; this
  runs first so that a wrong mesh or batch leaves the workdir untouched.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from transformer_jax import distributed, sharding  # pylint: disable=g-import-not-at-top
  distributed.initialize(config)  # multi-host: the global device count
  mesh = config.get('mesh', None)
  data, fsdp, _ = sharding.mesh_shape(dict(mesh or {'data': -1}), jax.device_count())
  if global_batch is not None and global_batch % (data * fsdp):
    raise ConfigError(f'batch of {global_batch} rows is not divisible by the data-parallel size '
                      f'{data * fsdp} (mesh data={data} x fsdp={fsdp} over {jax.device_count()} '
                      'devices); change data.batch_size or mesh.data/mesh.fsdp')
  unavailable = attention_kernel_unavailable(config)
  if unavailable:
    raise ConfigError(f"{unavailable}: use 'auto' (the best kernel per backend), 'chunked', "
                      "'xla' or 'reference'")


def attention_kernel_unavailable(config) -> str | None:
  """Why config.model.attention_implementation (a fused kernel) can't run here, or None."""
  # pylint: disable-next=g-import-not-at-top
  from transformer_jax.scaled_dot_product import KERNEL_BACKENDS
  implementation = config.get('model', {}).get('attention_implementation', 'auto')
  needs = KERNEL_BACKENDS.get(implementation)
  if needs is None:
    return None  # (asks for no backend, so jax's backend is not started here)
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() == needs:
    return None
  return (f'model.attention_implementation={implementation!r} runs on {needs.upper()} only, '
          f'and this run is on {jax.default_backend().upper()}')


def save_config(config, workdir: str):
  """Writes the resolved config next to the checkpoints (atomically) for later runs to read."""
  path = os.path.join(workdir, 'config.json')
  write_atomically(path, config.to_json_best_effort(indent=2, sort_keys=True))


def load_saved_config(workdir: str):
  """The config a workdir was trained with (for translate/generate modes)."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    raise ConfigError(f'{workdir} has no config.json: is it a trained workdir?')
  with open(path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  unavailable = attention_kernel_unavailable(config)
  if unavailable:  # e.g. trained on a TPU with Pallas, now translating on a laptop
    logging.warning("%s: using 'auto' for this run", unavailable)
    config.model.attention_implementation = 'auto'
  return config
