"""The package is a stack of layers: no module imports from a layer above its own.

Every `import` and `from ... import` of transformer_jax in the package's source, including the
ones inside functions (imported late to keep start-up cheap), is checked against the order
below, the one transformer_jax/__init__.py and docs/architecture.md describe. Within one
subpackage modules may import each other.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'transformer_jax'

# Lowest first. A unit is a top-level module or a subpackage of transformer_jax.
LEVELS = {
    'errors': 0,
    'files': 0.25,  # atomic writes and JSON objects read with one error line (errors)
    'special_tokens': 0,
    'xla_options': 0,
    'chips': 0,  # accelerator chips' public figures: the planner's targets and the MFU peak
    'precision': 0.5,  # between errors and model_config, which resolves model.matmul_dtype
    'model_config': 1,
    'flops': 1,  # model FLOPs and the MFU peak: used by tasks, the trainer and the planner
    'kernels': 2,
    'parallel': 2,
    'data': 2,
    'inference': 2,
    'layers': 3,
    'models': 4,
    'training': 5,
    'convert': 5,
    'visualize': 5,
    'tasks': 6,
    'cli': 6,
    'workflows': 7,
    'planning': 8,
}


def unit_of(dotted: str) -> str | None:
  parts = dotted.split('.')
  return parts[1] if parts[0] == 'transformer_jax' and len(parts) > 1 else None


def package_imports(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, imported unit) for every transformer_jax import in the file."""
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module == 'transformer_jax':  # from transformer_jax import x
        found += [(node.lineno, alias.name) for alias in node.names]
      elif unit_of(node.module):
        found.append((node.lineno, unit_of(node.module)))
    elif isinstance(node, ast.Import):
      found += [(node.lineno, unit_of(a.name)) for a in node.names if unit_of(a.name)]
  return sorted(found)


def modules():
  return sorted(p for p in PACKAGE.rglob('*.py') if p.name != '__init__.py' or p.parent != PACKAGE)


def test_every_unit_has_a_level():
  """A new top-level module or subpackage must be placed in the order, not slip past it."""
  units = {p.stem if p.parent == PACKAGE else p.relative_to(PACKAGE).parts[0] for p in modules()}
  assert units <= set(LEVELS), f'place {sorted(units - set(LEVELS))} in LEVELS'


@pytest.mark.parametrize('path', modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
  own = path.stem if path.parent == PACKAGE else path.relative_to(PACKAGE).parts[0]
  upward = [
      f'line {line}: {own} (level {LEVELS[own]}) imports {unit} (level {LEVELS[unit]})'
      for line, unit in package_imports(path)
      if unit != own and LEVELS[unit] >= LEVELS[own]
  ]
  assert not upward, '\n'.join(upward)


def test_the_check_catches_an_upward_import(tmp_path):
  """The checker itself: a layer importing the trainer is reported."""
  bad = tmp_path / 'bad.py'
  bad.write_text('def f():\n  from transformer_jax.training.trainer import Trainer\n'
                 'from transformer_jax import errors\n')
  assert package_imports(bad) == [(2, 'training'), (3, 'errors')]
