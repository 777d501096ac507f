r"""Which attention and loss paths 'auto' should take per platform, asked of the compilers.

  TRANSFORMER_JAX_LIBTPU_DIR=DIR TRANSFORMER_JAX_CUDA_PLUGIN_DIR=DIR2 \\
      python benchmarks/plan_defaults.py
  python benchmarks/plan_defaults.py --cases=gpt2-small/tpu-v5e-4/xla/plain   # a subset

For GPT-2 small and BERT-base, compiles the real train step (`transformer_jax/planning/`) for a
TPU v5e-4 (fsdp=4) and a host of 8 H100s (fsdp=8) once per candidate path and prints, per device,
the peak bytes, the bytes accessed, the FLOPs and the roofline step time side by side:

  attention  'chunked' (blocks skipped above the causal diagonal, gradient written out:
             kernels/scaled_dot_product.py `_attention_core`), 'xla'
             (`jax.nn.dot_product_attention`, XLA's implementation: the formula, differentiated
             by jax, as 'reference' is) and the
             platform's fused kernel ('pallas' on TPU; 'cudnn' on GPU, which does not compile
             without a GPU: the plan says so and the row is left out);
  loss       'plain' (whole [B, T, V] logits) or 'sliced' (a few positions at a time:
             layers/losses.py `_projected_sums`), each with the 'xla' attention.

Two more cases on the TPU tell the sequence length from the causal mask: BERT-base at 512 tokens
(64 rows) and GPT-2 small at 128 (512 rows), the same tokens per step (`model@length`).

BERT-base runs without attention dropout here (the fused kernels have none), so that every
attention row computes the same thing. Each case runs in a fresh process; the last line is one
JSON object with every case's figures. docs/scaling.md keeps the table.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.plan_targets import (  # noqa: E402
    _config, plan_and_print, run_in_fresh_processes, selected_cases)

TARGETS = {'tpu-v5e-4': {'fsdp': 4}, 'gpu-h100-8': {'fsdp': 8}}
FUSED = {'tpu-v5e-4': 'pallas', 'gpu-h100-8': 'cudnn'}
MODELS = ('gpt2-small', 'bert-base')


def cases() -> list[tuple[str, str, str, str]]:
  """(model, target, attention, loss) for every candidate."""
  found = []
  for model in MODELS:
    for target in TARGETS:
      for attention in ('chunked', 'xla', FUSED[target]):
        found.append((model, target, attention, 'plain'))
      found.append((model, target, 'xla', 'sliced'))
  for model in ('bert-base@512', 'gpt2-small@128'):
    for attention in ('chunked', 'pallas'):
      found.append((model, 'tpu-v5e-4', attention, 'plain'))
  return found


def case_name(model, target, attention, loss) -> str:
  return f'{model}/{target}/{attention}/{loss}'


def run_case(name: str):
  """One case, in this process: its plan (or its error) as one JSON line."""
  from transformer_jax.planning import runtime
  runtime.prepare()
  from transformer_jax.layers import losses
  model, target, attention, loss = name.split('/')
  model, _, length = model.partition('@')
  config = _config(model)
  if length:  # the same tokens per step in rows of `length`
    key = 'max_len' if 'max_len' in config.data else 'block_size'
    config.data.batch_size = config.data.batch_size * config.data[key] // int(length)
    config.data[key] = int(length)
  config.mesh.update({'data': 1, 'fsdp': 1, 'tensor': 1, **TARGETS[target]})
  config.model.attention_implementation = attention
  if 'attention_dropout_rate' in config.model:
    config.model.attention_dropout_rate = 0.0
  if loss == 'sliced':  # the path `_slicing_pays` keeps for cache-sized tables, forced
    losses._slicing_pays = lambda vocab, dim: True
  elif loss == 'plain':
    losses._slicing_pays = lambda vocab, dim: False
  plan_and_print(config, target, name)


def main():
  names = selected_cases(__doc__.splitlines()[0], [case_name(*c) for c in cases()], run_case)
  if names is None:
    return
  header = (f'{"case":36s} {"peak GiB":>8s} {"GB moved":>9s} {"TFLOP":>7s} {"ms/step":>8s} '
            f'{"bound":>7s} {"MFU":>5s}')
  print(header + '\n' + '-' * len(header), flush=True)
  rows = []
  for row in run_in_fresh_processes(__file__, names):
    name = row['case']
    rows.append(row)
    if row.get('attention_note'):
      row['error'] = row['attention_note']  # compiled another path: not this candidate's row
    if 'peak_bytes' not in row or row.get('attention_note'):
      print(f'{name:36s} not compiled: {row.get("error", "")[:150]}', flush=True)
      continue
    print(
        f'{name:36s} {row["peak_bytes"] / 2**30:8.2f} '
        f'{row["bytes_accessed_per_device"] / 1e9:9.1f} '
        f'{row["flops_per_device"] / 1e12:7.2f} {1e3 * row["step_time_s"]:8.2f} '
        f'{row["bound"]:>7s} {100 * row["mfu"]:4.0f}%', flush=True)
  print('(per device; GB moved and TFLOP: XLA:TPU\'s cost analysis on TPU, on GPU the kernels\' '
        'operands and results and XLA\'s count before optimisation (planning/compile.py))')
  keep = ('peak_bytes', 'bytes_accessed_per_device', 'flops_per_device', 'flops_source',
          'bytes_accessed_source', 'step_time_s', 'bound', 'mfu', 'compile_s', 'batch', 'error')
  print(json.dumps({r['case']: {k: r[k] for k in keep if k in r} for r in rows}))


if __name__ == '__main__':
  main()
