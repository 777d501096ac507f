"""transformer_jax: pure-functional Flax Transformers, jit-compiled and sharded over a Mesh.

The subpackages are layers of one stack; each imports only from the ones below it
(tests/test_import_layers.py checks this):

  errors, files, special_tokens, model_config   the base every layer shares
  sections     typed config sections (train, mesh, distributed, optimizer), checked once
  precision    the CPU precision policy: bf16 matmuls where the CPU has bf16 units
  chips        TPU and NVIDIA GPU chips' public figures (peak, memory, bandwidth)
  flops        model FLOPs of a training step and the peaks MFU divides by
  kernels/     attention kernels (reference, chunked, XLA/cuDNN, Pallas) and masks
  parallel/    the device mesh, logical-axis rules, multi-host start-up
  data/        corpora, tokenizers, batching
  inference/   greedy, beam and sampling search over a KV cache
  layers/      Flax modules: attention, feed-forward, norms, positions, blocks, losses
  models/      EncoderDecoder, GPT, Bert and their presets
  training/    the trainer, the pure train step, optimizer, checkpoints, metric writing
  convert/     Hugging Face checkpoint import
  visualize/   pictures: attention maps read from the model, position encodings, curves
  tasks/       what a model family trains on and evaluates (the trainer's Task)
  cli/         what every entry point does: flags, one-line errors, the workdir, validation
  workflows/   one experiment per family: data -> task -> trainer -> evaluation
  planning/    compile a workflow's train step ahead of time for a TPU slice or GPU host:
               memory, FLOPs, collectives, predicted step time (experiments/plan.py)

Importing the package itself stays cheap: import what you need from its modules.
"""

__version__ = '0.1.0'
