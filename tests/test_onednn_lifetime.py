"""Programs compiled with XLA:CPU's oneDNN fusions never abort the process when freed
(transformer_jax/onednn_lifetime.py).

The stress test runs on any x86-64 CPU: the policy's oneDNN options are the jaxlib's, whatever the
CPU's bf16 flags, and float32 dots abort as bf16 ones do. On this code's parent (plain `jax.jit`,
`tests/onednn_worker.py --unprotected`), 7 of 30 worker processes aborted, 3 at a time on a 2-core
AMD EPYC (Zen 4); and 1 of 30 aborted at exit with the programs kept but no exit wait.
"""

import ast
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest

from transformer_jax import onednn_lifetime, precision

REPO = pathlib.Path(__file__).resolve().parent.parent
ONEDNN = {'xla_cpu_use_onednn': True}


@pytest.fixture
def fresh_registry(monkeypatch):
  """An empty list of kept programs and no exit hook registered by this test."""
  monkeypatch.setattr(onednn_lifetime, '_KEPT', [])
  monkeypatch.setattr(onednn_lifetime.atexit, 'register', lambda fn: fn)


def test_only_onednn_programs_are_kept(fresh_registry, monkeypatch):
  monkeypatch.setattr(onednn_lifetime.xla_options, 'jaxlib_version', lambda: '0.12.1')
  onednn_lifetime.jit(lambda x: x + 1)
  onednn_lifetime.jit(lambda x: x + 1,
                      compiler_options={'xla_cpu_experimental_ynn_fusion_type': 'dot'})
  assert onednn_lifetime.kept() == 0
  kept = onednn_lifetime.jit(lambda x: x * 2, compiler_options=ONEDNN)
  assert onednn_lifetime.kept() == 1 and onednn_lifetime._KEPT[0] is kept
  assert onednn_lifetime.uses_onednn(
      precision.compiler_options('bfloat16')) == (precision.has_fast_bf16_dots())


def test_the_jaxlibs_it_covers(fresh_registry, monkeypatch):
  assert not onednn_lifetime.affected('0.10.2')  # never takes the oneDNN options
  assert onednn_lifetime.affected('0.11.2') and onednn_lifetime.affected('0.12.1')
  monkeypatch.setattr(onednn_lifetime, 'FIXED_IN', '0.13.0')
  assert onednn_lifetime.affected('0.12.1') and not onednn_lifetime.affected('0.13.0')
  monkeypatch.setattr(onednn_lifetime.xla_options, 'jaxlib_version', lambda: '0.13.0')
  onednn_lifetime.jit(lambda x: x * 2, compiler_options=ONEDNN)
  assert onednn_lifetime.kept() == 0  # a fixed jaxlib frees them as usual


def test_the_exit_wait_lasts_while_another_thread_runs():
  spin_s = 0.3
  started = threading.Event()

  def spin():
    started.set()
    end = time.perf_counter() + spin_s
    while time.perf_counter() < end:
      pass

  thread = threading.Thread(target=spin)
  thread.start()
  started.wait()
  assert onednn_lifetime.busy_threads(), 'the spinning thread is running'
  waited = onednn_lifetime.wait_for_worker_threads(limit_s=30.0)
  thread.join()
  assert spin_s * 0.5 <= waited < 30.0
  assert onednn_lifetime.wait_for_worker_threads(limit_s=30.0) < 30.0  # all asleep: it returns


def _jit_calls_with_compiler_options(path: pathlib.Path):
  """(line, source of the compiler_options value) of every `jax.jit(...)` or
  `functools.partial(jax.jit, ...)` in `path` that sets compiler_options."""
  tree = ast.parse(path.read_text(), str(path))
  found = []
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call):
      continue
    names = [ast.unparse(node.func)] + [ast.unparse(a) for a in node.args[:1]]
    if 'jax.jit' not in names:
      continue
    for keyword in node.keywords:
      if keyword.arg == 'compiler_options':
        found.append((node.lineno, ast.unparse(keyword.value)))
  return found


def test_programs_with_oneDNN_options_are_jitted_through_onednn_lifetime():
  """A `jax.jit` given compiler options anywhere in the code, benchmarks or tests would free its
  oneDNN programs: only the decoding loops' options (YNNPACK dots, which return their runtime
  before the results are ready) and a test that compiles a sum under each option may use it."""
  allowed_values = {'search.decode_compiler_options()', 'decode_compiler_options()'}
  allowed_files = {'transformer_jax/onednn_lifetime.py', 'tests/test_xla_options.py'}
  offenders = []
  for folder in ('transformer_jax', 'experiments', 'benchmarks', 'tests', 'tools'):
    for path in sorted((REPO / folder).rglob('*.py')):
      name = str(path.relative_to(REPO))
      for line, value in _jit_calls_with_compiler_options(path):
        if value not in allowed_values and name not in allowed_files:
          offenders.append(f'{name}:{line}: compiler_options={value}')
  assert not offenders, 'use onednn_lifetime.jit:\n' + '\n'.join(offenders)


def test_the_scan_finds_a_plain_jit(tmp_path):
  source = tmp_path / 'bad.py'
  source.write_text('import functools, jax\n'
                    'f = jax.jit(g, compiler_options=precision.compiler_options(d))\n'
                    '@functools.partial(jax.jit, compiler_options=OPTIONS)\n'
                    'def h(x): return x\n'
                    'k = jax.jit(g)\n')
  assert _jit_calls_with_compiler_options(source) == [(2, 'precision.compiler_options(d)'),
                                                      (3, 'OPTIONS')]


def _run(command: list[str]) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS='cpu', TRANSFORMER_JAX_ALLOCATOR='system')
  return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_freeing_onednn_programs_under_load_never_aborts(tmp_path):
  """30 processes, 3 at a time on however many cores, each creating, running and dropping six
  programs compiled with the policy's options and exiting right after the MFU probe's matmul;
  with them, a short training run of each model kind under model.matmul_dtype=bfloat16 (two
  Trainers per process, the first dropped before the second starts)."""
  if not precision.has_fast_bf16_dots():
    # jaxlib 0.10.2: the policy never compiles a oneDNN program, so nothing can abort.
    assert precision.compiler_options('bfloat16') is None
    assert not onednn_lifetime.affected()
    return
  commands = [[sys.executable, 'tests/onednn_worker.py'] for _ in range(30)]
  for family in ('lm', 'bert', 'translation'):
    runs = [{'name': name, 'mesh': None, 'model': {'matmul_dtype': 'bfloat16'}}
            for name in ('first', 'second')]
    spec = {'family': family, 'steps': 2, 'workdir': str(tmp_path / family), 'runs': runs}
    commands.append([sys.executable, 'tests/mesh_worker.py', json.dumps(spec)])
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    results = list(pool.map(_run, commands))
  failed = [(r.args[1], r.returncode, r.stderr[-1500:]) for r in results if r.returncode != 0]
  assert not failed, f'{len(failed)} of {len(results)} processes failed; first: {failed[0]}'
  assert all(r.stdout.startswith('ok ') for r in results[:30])
  trained = [json.loads(line) for r in results[30:] for line in r.stdout.splitlines()]
  assert len(trained) == 6 and all(len(run['loss']) == 2 for run in trained)
