"""What every experiment entry point does the same way: errors, workdir, config, logging.

`run(main)` turns a `UserError` (bad config, bad data) into one readable line on stderr and
exit status 1, with no stack trace; anything else is a bug and keeps its traceback.
"""

import json
import os
import sys
import tempfile

from absl import logging

from transformer_jax.errors import ConfigError, UserError


class _QuietLibraries:
  """Drops INFO lines from orbax (dozens per checkpoint) so progress lines stay readable."""
  NOISY = ('/orbax/', '/jax/_src/xla_bridge.py')

  def filter(self, record) -> bool:
    return record.levelno >= 30 or not any(p in record.pathname for p in self.NOISY)


def run(main, argv=None):
  """absl `app.run` body wrapper: one line and exit 1 for user errors."""
  logging.get_absl_handler().addFilter(_QuietLibraries())
  try:
    return main(argv)
  except UserError as error:
    logging.flush()
    sys.stderr.write(f'error: {error}\n')
    sys.stderr.flush()
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


def save_config(config, workdir: str):
  """Writes the resolved config next to the checkpoints (atomically) for later runs to read."""
  path = os.path.join(workdir, 'config.json')
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  os.replace(tmp, path)


def load_saved_config(workdir: str):
  """The config a workdir was trained with (for translate/generate modes)."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    raise ConfigError(f'{workdir} has no config.json: is it a trained workdir?')
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))
