r"""Plan a run for a Cloud TPU slice or NVIDIA GPUs before booking them: compile its train step
here, on a CPU.

  python -m experiments.plan --config=experiments/configs/gpt2_small.py --target=tpu-v5e-16 \
      --config.mesh.data=4 --config.mesh.fsdp=4
  python -m experiments.plan --config=experiments/configs/gpt2_small.py --target=gpu-h100-8 \
      --config.mesh.fsdp=8
  python -m experiments.plan --targets        # the slices and GPU hosts one can plan for
  python -m experiments.plan --config=experiments/configs/gpt2_small.py --target=tpu-v5e-4 \
      --config.mesh.data=4 --decode_batch=64 --decode_length=1024

Compiles the experiment's real train step ahead of time for the target's topology, from shapes
alone: no data is read, no tokenizer trained, nothing allocated. TPUs need XLA's TPU compiler
(libtpu: pip install -e ".[tpu]"), GPUs jax's CUDA plugin (pip install -e ".[gpu-plan]"); no
accelerator is needed for either. Prints per device the parameter, optimizer-state, activation
and total (peak) bytes against the chip's memory, the FLOPs per step, the collectives of the
program, a predicted step time and MFU; the last line is one JSON object. A config that does not
fit is one `error:` line (after the figures) naming what to change, and exit status 1.

With --decode_batch=B and --decode_length=S (a language model only: config.experiment 'lm'),
it plans the generation decode step instead of the train step: one call of the decode model on
tokens int32[B, 1] against a KV cache of S slots per row (`planning/decode.py`). It prints per
device the parameter and KV cache bytes (counted from the cache's shapes and shardings, and the
analytic 2 * layers * B * S * kv_heads * head_dim * dtype bytes beside them), XLA's peak, whether
it fits, and a memory-bound roofline: (parameter + cache bytes) / HBM bandwidth per step, B
tokens per step. One plan per command, so the last line is always that plan's JSON object; plan
the train step with a second command.
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
_DECODE_BATCH = flags.DEFINE_integer(
    'decode_batch', None, 'With --decode_length: plan a language model\'s generation decode step '
    'for this many rows instead of the train step.')
_DECODE_LENGTH = flags.DEFINE_integer(
    'decode_length', None, 'With --decode_batch: the KV cache slots per row of the planned decode '
    'step (at most the model\'s context, data.block_size).')


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
  decode = (_DECODE_BATCH.value, _DECODE_LENGTH.value)
  if (decode[0] is None) != (decode[1] is None):
    raise ConfigError('--decode_batch and --decode_length go together: the rows and the KV cache '
                      'slots of the decode step to plan')
  from transformer_jax.planning import compile as planning
  from transformer_jax.planning import decode as decode_planning
  if decode[0] is None:
    run_plan, format_plan = lambda: planning.plan(_CONFIG.value, target), planning.format_plan
  else:
    run_plan = lambda: decode_planning.plan_decode(_CONFIG.value, target, *decode)
    format_plan = decode_planning.format_decode_plan
  try:
    result = run_plan()
  except planning.DoesNotFitError as error:
    result = getattr(error, 'plan', None)
    if result is not None:  # the figures first, then the one error line
      print(format_plan(result))
      print(json.dumps(result), flush=True)
    raise
  print(format_plan(result))
  print(json.dumps(result))


if __name__ == '__main__':
  app.run(lambda argv: entrypoint.run(main, argv), flags_parser=entrypoint.parse_flags)
