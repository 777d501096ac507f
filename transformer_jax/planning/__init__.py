"""Plan a run for a Cloud TPU slice before booking it, from a CPU-only host.

`compile.plan(config, target)` builds an experiment's real train step (the trainer's own
`training.train_step.build_train_step`) over the compile-only devices of a TPU topology that the
TPU compiler (libtpu) describes, compiles it ahead of time from abstract inputs (nothing is
allocated) and reads what XLA reports: bytes per device, FLOPs, the collectives of the program.

  targets.py      the Cloud TPU slices one can plan for, with their chips' public figures
  runtime.py      finding libtpu and the environment it needs, set before jax starts a backend
  compile.py      the abstract task, batch and step of a config; compile; analyse; predict
  collectives.py  counting the collectives in XLA:TPU's optimised HLO text

`experiments/plan.py` is the command line. Importing this package does not import jax.
"""
