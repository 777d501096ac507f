"""The workdir of a run: created and proven writable first, the resolved config saved in it."""

import json
import os
import tempfile

import ml_collections
from absl import logging

from transformer_jax.cli import validation
from transformer_jax.errors import ConfigError
from transformer_jax.files import write_atomically

CONFIG_FILE = 'config.json'


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


def save_config(config, workdir: str):
  """Writes the resolved config next to the checkpoints (atomically) for later runs to read."""
  path = os.path.join(workdir, 'config.json')
  write_atomically(path, config.to_json_best_effort(indent=2, sort_keys=True))


def load_saved_config(workdir: str):
  """The config a workdir was trained with (for translate/generate modes)."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    raise ConfigError(f'{workdir} has no config.json: is it a trained workdir?')
  try:
    with open(path, encoding='utf-8') as f:
      config = ml_collections.ConfigDict(json.load(f))
  except ValueError as error:
    raise ConfigError(f'{path} is not valid JSON ({error}): is it a trained workdir?') from None
  unavailable = validation.attention_kernel_unavailable(config)
  if unavailable:  # e.g. trained on a TPU with Pallas, now translating on a laptop
    logging.warning("%s: using 'auto' for this run", unavailable)
    config.model.attention_implementation = 'auto'
  return config
