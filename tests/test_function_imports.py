"""Imports sit at the top of their module, so tests/test_import_layers.py sees the package's
whole import graph and a reader sees a module's dependencies in one place.

An import inside a function is allowed for a heavy optional dependency (OPTIONAL_HEAVY), or with
its reason in a `# lazy: ...` comment: on the import's own line, or in the comment lines just
above it (one comment may head a group of consecutive imports). The reasons in use: an optional
extra (pyarrow, fsspec, protobuf), a start-up cost that was measured (matplotlib, Pallas), jax
not loaded before the allocator re-executes the process (cli/process.py), and modules that stay
free of jax for jax-free callers (precision.py, cli/validation.py).
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'transformer_jax'
MARKER = '# lazy:'
# Optional dependencies that take seconds or hundreds of MB to import, installed by extras
# (setup.cfg): TensorFlow (tfds), PyTorch and transformers (parity), Ray (ray), libtpu (tpu) and
# jax's CUDA plugin (gpu-plan).
OPTIONAL_HEAVY = frozenset({
    'tensorflow', 'tensorflow_datasets', 'torch', 'transformers', 'ray', 'libtpu', 'jax_plugins',
    'jax_cuda13_plugin'
})


def imported_modules(node: ast.Import | ast.ImportFrom) -> list[str]:
  """The top-level modules an import statement names ('.' for a relative import)."""
  if isinstance(node, ast.ImportFrom):
    return ['.' if node.level else node.module.split('.')[0]]
  return [alias.name.split('.')[0] for alias in node.names]


def _explained(node, lines: list[str], import_lines: set[int]) -> bool:
  """Whether a `# lazy:` comment is on the import's lines or heads it (or its group)."""
  if any(MARKER in lines[i - 1] for i in range(node.lineno, node.end_lineno + 1)):
    return True
  above = node.lineno - 1
  while above in import_lines:  # the imports just before it: the group it belongs to
    above -= 1
  while above >= 1 and lines[above - 1].lstrip().startswith('#'):
    if lines[above - 1].lstrip().startswith(MARKER):
      return True
    above -= 1
  return False


def unexplained_imports(source: str) -> list[tuple[int, str]]:
  """(line, statement) of each import inside a function that is neither of OPTIONAL_HEAVY
  modules only nor explained by a `# lazy:` comment."""
  tree = ast.parse(source)
  lines = source.splitlines()
  import_lines = {
      line for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
      for line in range(node.lineno, node.end_lineno + 1)
  }
  inside = {
      node for function in ast.walk(tree)
      if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
      for node in ast.walk(function) if isinstance(node, (ast.Import, ast.ImportFrom))
  }
  return sorted((node.lineno, ast.unparse(node))
                for node in inside
                if not set(imported_modules(node)) <= OPTIONAL_HEAVY and
                not _explained(node, lines, import_lines))


@pytest.mark.parametrize('path', sorted(PACKAGE.rglob('*.py')),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_inside_functions_say_why(path):
  found = unexplained_imports(path.read_text())
  assert not found, '\n'.join(
      f'{path.relative_to(PACKAGE.parent)}:{line}: {statement} inside a function: import it at '
      f'the top of the module, or say why not in a "{MARKER} ..." comment'
      for line, statement in found)


def test_the_check_catches_an_unexplained_import():
  """The checker itself: only the unexplained imports inside functions are reported."""
  source = '\n'.join([
      'import os',  # 1: at the top
      'def f():',
      '  import json',  # 3: unexplained
      '  import torch',  # 4: a heavy optional dependency
      '  from transformers import AutoModel',  # 5: likewise
      '  import numpy, torch',  # 6: numpy is not one
      '  import jax  # lazy: measured',  # 7: explained on its line
      '  # lazy: measured, in a comment',  # 8
      '  # of two lines',  # 9
      '  import flax',  # 10: explained above
      '  from flax import linen',  # 11: the same group
      '  x = 1',  # 12
      '  from . import sibling',  # 13: a relative import, unexplained
      '  # a comment without the marker',  # 14
      '  import optax',  # 15: unexplained
      '  def g():',
      '    from transformer_jax import errors',  # 17: in a nested function, reported once
      'class C:',
      '  import re',  # 19: in a class body, not in a function
      '  async def h(self):',
      '    import numpy as np',  # 21: in a method
  ])
  assert unexplained_imports(source) == [
      (3, 'import json'),
      (6, 'import numpy, torch'),
      (13, 'from . import sibling'),
      (15, 'import optax'),
      (17, 'from transformer_jax import errors'),
      (21, 'import numpy as np'),
  ]
