r"""What real configs need on Cloud TPU slices: the planner over five models and a few targets.

  TRANSFORMER_JAX_LIBTPU_DIR=/path/to/libtpu_folder python benchmarks/plan_targets.py
  python benchmarks/plan_targets.py --cases=gpt2-small/tpu-v5e-4/data   # a subset

For GPT-2 small (124M) and medium (355M) at context 1024, a 1.1B LLaMA-style model (rotary,
RMSNorm, SwiGLU, grouped-query attention: TinyLlama's shape, from `llama_config`), BERT-base
(`bert_pretrain_wikipedia.py`) and the WMT'14 Transformer-base (`wmt14.py`), each case compiles
the real train step for the target (`transformer_jax/planning/`) in a fresh process and prints
the bytes per device, the predicted step time and MFU (roofline; see `planning/compile.py`).
The last line is one JSON object with every case's figures.
"""

import argparse
import json
import os
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# TinyLlama-1.1B's shape with the project's LLaMA-style architecture (llama_config).
LLAMA_1B = dict(emb_dim=2048, num_heads=32, num_kv_heads=4, mlp_dim=5632, num_decoder_layers=22,
                vocab_size=32_000)


def _config(model: str):
  """The ConfigDict of one of the five models (no data is read when planning)."""
  import ml_collections
  if model in ('gpt2-small', 'gpt2-medium', 'llama-1b'):
    from experiments.configs import gpt2_small
    config = gpt2_small.get_config()
    if model == 'gpt2-medium':
      config.model.update(dict(emb_dim=1024, num_heads=16, mlp_dim=4096, num_decoder_layers=24))
    if model == 'llama-1b':
      import dataclasses
      from transformer_jax.models.gpt import llama_config
      cfg = llama_config(**{k: v for k, v in LLAMA_1B.items() if k != 'vocab_size'})
      values = {
          f.name: getattr(cfg, f.name)
          for f in dataclasses.fields(cfg)
          if f.name not in ('vocab_size', 'max_len', 'dtype', 'param_dtype', 'decode',
                            'num_encoder_layers')
      }
      config.model = ml_collections.ConfigDict(
          dict(values, dtype='bfloat16', param_dtype='float32', attention_implementation='auto'))
      config.tokenizer.vocab_size = LLAMA_1B['vocab_size']
    return config
  if model == 'bert-base':
    from experiments.configs import bert_pretrain_wikipedia
    return bert_pretrain_wikipedia.get_config()
  if model == 'wmt14-base':
    from experiments.configs import wmt14
    return wmt14.get_config()
  raise ValueError(model)


# (model, target, mesh, batch rows or None for the config's own)
CASES = [
    ('gpt2-small', 'tpu-v5e-4', {'data': 4}, None),
    ('gpt2-small', 'tpu-v5e-4', {'fsdp': 4}, None),
    ('gpt2-small', 'tpu-v6e-4', {'fsdp': 4}, None),
    ('gpt2-medium', 'tpu-v5e-4', {'fsdp': 4}, None),
    ('gpt2-medium', 'tpu-v5e-16', {'data': 4, 'fsdp': 4}, None),
    ('llama-1b', 'tpu-v5e-16', {'fsdp': 16}, None),
    ('llama-1b', 'tpu-v5p-8', {'fsdp': 4}, None),
    ('bert-base', 'tpu-v5e-4', {'data': 4}, None),
    ('bert-base', 'tpu-v5e-16', {'data': 16}, None),
    ('wmt14-base', 'tpu-v5e-4', {'data': 4}, None),
    ('wmt14-base', 'tpu-v5e-16', {'fsdp': 16}, None),
]


def case_name(model, target, mesh, batch) -> str:
  mesh_text = ','.join(f'{k}={v}' for k, v in mesh.items())
  return f'{model}/{target}/{mesh_text}' + (f'/batch={batch}' if batch else '')


def plan_and_print(config, target: str, name: str):
  """Plans `config` for `target` in this process and prints the plan (or its one error) as one
  JSON line tagged with the case `name`."""
  from transformer_jax.errors import UserError
  from transformer_jax.planning import compile as planning, targets
  start = time.time()
  try:
    result = planning.plan(config, targets.get(target))
  except planning.DoesNotFitError as error:
    result = dict(getattr(error, 'plan', {}), error=str(error))
  except UserError as error:
    result = dict(error=str(error))
  print(json.dumps(dict(result, case=name, seconds=round(time.time() - start, 1))), flush=True)


def run_in_fresh_processes(script: str, names: list[str]):
  """Yields each case's plan (a dict; {'case', 'error'} when its process printed none), every
  case planned by `script --case=NAME` in a process of its own."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  env['PYTHONPATH'] = os.pathsep.join(filter(None, [REPO_ROOT, env.get('PYTHONPATH')]))
  for name in names:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(script), f'--case={name}'], cwd=REPO_ROOT, env=env,
        capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{')]
    yield json.loads(lines[-1]) if lines else dict(case=name, error=proc.stderr[-500:])


def run_case(name: str):
  """One case, in this process: prints its plan (or its error) as one JSON line."""
  from transformer_jax.planning import runtime
  runtime.prepare()
  model, target, mesh, batch = next(c for c in CASES if case_name(*c) == name)
  config = _config(model)
  config.mesh.update({'data': 1, 'fsdp': 1, 'tensor': 1, **mesh})
  if batch:
    config.data.batch_size = batch
  plan_and_print(config, target, name)


def selected_cases(description: str, names: list[str], run_one) -> list[str] | None:
  """A plan benchmark's command line: `--case=NAME` plans that case here (`run_one`) and gives
  None; otherwise the names `--cases` selects, all of them by default."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument('--cases', default='', help='comma-separated case names (default: all)')
  parser.add_argument('--case', default='', help=argparse.SUPPRESS)  # one case, in-process
  args = parser.parse_args()
  if args.case:
    run_one(args.case)
    return None
  return [n for n in names if n in args.cases.split(',')] if args.cases else names


def main():
  names = selected_cases(__doc__.splitlines()[0], [case_name(*c) for c in CASES], run_case)
  if names is None:
    return
  header = (f'{"case":44s} {"params":>8s} {"param":>7s} {"opt":>7s} {"act":>7s} {"peak":>7s} '
            f'{"HBM":>4s} {"ms/step":>8s} {"bound":>7s} {"MFU":>5s} {"tok/s":>9s} {"compile":>7s}')
  print(header + '\n' + '-' * len(header), flush=True)
  rows = []
  for row in run_in_fresh_processes(__file__, names):
    name = row['case']
    rows.append(row)
    if 'peak_bytes' not in row:
      print(f'{name:44s} error: {row["error"]}', flush=True)
      continue
    gib = lambda key, r=row: f'{r[key] / 2**30:7.2f}'
    print(
        f'{name:44s} {row["parameters"] / 1e6:7.0f}M {gib("parameter_bytes")} '
        f'{gib("optimizer_state_bytes")} {gib("activation_bytes")} {gib("peak_bytes")} '
        f'{row["hbm_bytes"] / 2**30:4.0f} {1e3 * row["step_time_s"]:8.1f} {row["bound"]:>7s} '
        f'{100 * row["mfu"]:4.0f}% {row["tokens_per_s"]:9.0f} {row["compile_s"]:6.1f}s' +
        ('' if row['fits'] else '  DOES NOT FIT'), flush=True)
  print('(bytes in GiB per device; act = activations and temporaries at the peak; ms/step and MFU '
        'from the roofline time = max(flops / peak, bytes accessed / HBM bandwidth))')
  keep = ('parameters', 'parameter_bytes', 'optimizer_state_bytes', 'activation_bytes',
          'peak_bytes', 'hbm_bytes', 'fits', 'flops_per_device', 'bytes_accessed_per_device',
          'step_time_s', 'bound', 'mfu', 'tokens_per_s', 'collectives', 'compile_s',
          'attention_implementation', 'batch', 'error')
  print(json.dumps({r['case']: {k: r[k] for k in keep if k in r} for r in rows}))


if __name__ == '__main__':
  main()
