r"""Plan a run for a Cloud TPU slice or NVIDIA GPUs before booking them: compile its train step
here, on a CPU.

  python -m experiments.plan --config=experiments/configs/gpt2_small.py --target=tpu-v5e-16 \
      --config.mesh.data=4 --config.mesh.fsdp=4
  python -m experiments.plan --config=experiments/configs/gpt2_small.py --target=gpu-h100-8 \
      --config.mesh.fsdp=8
  python -m experiments.plan --targets        # the slices and GPU hosts one can plan for

Compiles the experiment's real train step ahead of time for the target's topology, from shapes
alone: no data is read, no tokenizer trained, nothing allocated. TPUs need XLA's TPU compiler
(libtpu: pip install -e ".[tpu]"), GPUs jax's CUDA plugin (pip install -e ".[gpu-plan]"); no
accelerator is needed for either. Prints per device the parameter, optimizer-state, activation
and total (peak) bytes against the chip's memory, the FLOPs per step, the collectives of the
program, a predicted step time and MFU; the last line is one JSON object. A config that does not
fit is one `error:` line (after the figures) naming what to change, and exit status 1.
"""

from transformer_jax.planning import runtime

runtime.prepare()  # before jax is imported: jax stays on the CPU, the compilers are found and quiet

import json

from absl import app, flags
from ml_collections import config_flags

from transformer_jax.cli import entrypoint
from transformer_jax.errors import ConfigError
from transformer_jax.planning import targets

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file (Python).',
                                          lock_config=True)
_TARGET = flags.DEFINE_string(
    'target', None, 'The TPU slice or GPU host, e.g. tpu-v5e-16 or gpu-h100-8 (see '
    '--targets).')
_TARGETS = flags.DEFINE_bool('targets', False, 'List the targets and exit.')


def main(argv):
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {argv[1:]}; options are --flag=value')
  if _TARGETS.value:
    print(targets.table())
    return
  if _TARGET.value is None:
    raise ConfigError(f'--target is required: one of {", ".join(targets.TARGETS)}')
  target = targets.get(_TARGET.value)
  if _CONFIG.value is None:
    raise ConfigError('--config is required, e.g. --config=experiments/configs/gpt2_small.py')
  from transformer_jax.planning import compile as planning
  try:
    result = planning.plan(_CONFIG.value, target)
  except planning.DoesNotFitError as error:
    result = getattr(error, 'plan', None)
    if result is not None:  # the figures first, then the one error line
      print(planning.format_plan(result))
      print(json.dumps(result), flush=True)
    raise
  print(planning.format_plan(result))
  print(json.dumps(result))


if __name__ == '__main__':
  app.run(lambda argv: entrypoint.run(main, argv), flags_parser=entrypoint.parse_flags)
