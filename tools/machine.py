"""What a benchmark figure was measured on and with: the CPU, its vector and matrix units, the
commit. Every benchmark's JSON line carries `description()`."""

import datetime
import os
import platform
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
  sys.path.insert(0, REPO_ROOT)

from transformer_jax import precision  # noqa: E402  (imports no jax)

# The CPU features that decide XLA:CPU's and PyTorch's speed here.
FLAGS_OF_INTEREST = ('avx2', 'avx512f', 'avx512_bf16', 'amx_bf16', 'amx_tile')


def cpu_model() -> str:
  """lscpu's 'Model name' (else /proc/cpuinfo's, else platform's)."""
  try:
    out = subprocess.run(['lscpu'], capture_output=True, text=True, timeout=10, check=False).stdout
    for line in out.splitlines():
      if line.startswith('Model name:'):
        return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return precision.cpuinfo_value('model name') or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
  """Which of FLAGS_OF_INTEREST /proc/cpuinfo lists (empty where it cannot be read)."""
  present = set((precision.cpuinfo_value('flags') or '').split())
  return [flag for flag in FLAGS_OF_INTEREST if flag in present]


def git_commit() -> str | None:
  """The short HEAD commit, '+dirty' when the tree has changes (untracked files included)."""
  run = lambda *args: subprocess.run(['git', '--no-optional-locks', *args], cwd=REPO_ROOT,
                                     capture_output=True, text=True, timeout=30, check=False)
  try:
    head = run('rev-parse', '--short', 'HEAD')
    if head.returncode != 0:
      return None
    dirty = run('status', '--porcelain').stdout.strip()
  except OSError:
    return None
  return head.stdout.strip() + ('+dirty' if dirty else '')


def description() -> dict:
  """{'date', 'commit', 'cpu', 'cpu_flags', 'cores', 'python'} for a benchmark's JSON line."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  return {
      'date': datetime.date.today().isoformat(), 'commit': git_commit(), 'cpu': cpu_model(),
      'cpu_flags': cpu_flags(), 'cores': cores, 'python': platform.python_version()
  }
