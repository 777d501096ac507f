"""The package is a stack of layers: no module imports from a layer above its own, and no two
modules import each other.

Every `import` and `from ... import` of transformer_jax in the package's source is checked
against the order below, the one transformer_jax/__init__.py and docs/architecture.md describe:
the imports at the top of each module (where tests/test_function_imports.py keeps them) and the
few left inside functions alike. Within one subpackage modules may import each other, but not in
a cycle: data flows one way there too.
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
    'onednn_lifetime': 0.25,  # programs compiled with oneDNN kept alive (xla_options)
    'chips': 0,  # accelerator chips' public figures: the planner's targets and the MFU peak
    'sections': 0.5,  # typed config sections (errors only); read by parallel, training, cli
    'precision': 0.5,  # between errors and model_config, which resolves model.matmul_dtype
    'model_config': 1,
    'flops': 1,  # model FLOPs and the MFU peak: used by tasks, the trainer and the planner
    'kernels': 2,
    'parallel': 2,
    'data': 2,
    'corpus': 2.5,  # corpora tokenized once into shards (data's tokenizers; read by workflows)
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


def absolute_imports(path: pathlib.Path) -> list[tuple[int, str, tuple[str, ...]]]:
  """(line, module, names) for every absolute import in the file, inside functions too:
  `from module import names`, or `import module` with no names."""
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      found.append((node.lineno, node.module, tuple(alias.name for alias in node.names)))
    elif isinstance(node, ast.Import):
      found += [(node.lineno, alias.name, ()) for alias in node.names]
  return found


def package_imports(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, imported unit) for every transformer_jax import in the file."""
  found = []
  for line, module, names in absolute_imports(path):
    if module == 'transformer_jax' and names:  # from transformer_jax import x
      found += [(line, name) for name in names]
    elif unit_of(module):
      found.append((line, unit_of(module)))
  return sorted(found)


def module_name(path: pathlib.Path, package: pathlib.Path = PACKAGE) -> str:
  """The dotted name a file of the package is imported by (a package by its __init__.py)."""
  parts = path.relative_to(package.parent).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
  """Each module of the package -> the modules of the package it imports by name.

  `from p import m` names the module p.m when there is one, else p (its __init__.py). The
  parent packages Python imports on the way are left out: an __init__.py that re-exports its
  modules would otherwise close a loop with every module of its subpackage.
  """
  files = {module_name(p, package): p for p in package.rglob('*.py')}
  graph = {}
  for name, path in files.items():
    imported = set()
    for _, module, names in absolute_imports(path):
      imported.update({f'{module}.{n}' if f'{module}.{n}' in files else module for n in names} or
                      {module})
    graph[name] = (imported & set(files)) - {name}
  return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The groups of modules that reach each other through imports (sorted; one per group)."""
  reach = {}
  for start in graph:
    seen, todo = set(), [start]
    while todo:
      for module in graph[todo.pop()] - seen:
        seen.add(module)
        todo.append(module)
    reach[start] = seen
  groups = {tuple(sorted(m for m in reach[start] if start in reach[m])) for start in graph}
  return sorted(list(group) for group in groups if len(group) > 1)


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


def test_no_import_cycles():
  """No module imports another (directly or through a chain) that imports it back: the one
  below must not need the one above; what picks between them belongs above both."""
  cycles = import_cycles(import_graph())
  assert not cycles, '\n'.join('import cycle: ' + ', '.join(group) for group in cycles)


def test_the_check_catches_a_cycle(tmp_path):
  """The checker itself: a -> b -> c -> a through a late import, by module and by package."""
  package = tmp_path / 'transformer_jax'
  (package / 'sub').mkdir(parents=True)
  (package / '__init__.py').write_text('')
  (package / 'sub' / '__init__.py').write_text('from transformer_jax.sub.b import g\n')
  (package / 'sub' / 'a.py').write_text('from transformer_jax.sub import b\n')
  (package / 'sub' / 'b.py').write_text('import transformer_jax.sub.c\n')
  (package / 'sub' / 'c.py').write_text('def f():\n  from transformer_jax.sub.a import x\n')
  (package / 'lone.py').write_text('from transformer_jax import sub\nimport os\n')
  graph = import_graph(package)
  assert graph['transformer_jax.lone'] == {'transformer_jax.sub'}
  assert graph['transformer_jax.sub'] == {'transformer_jax.sub.b'}
  assert import_cycles(graph) == [[
      'transformer_jax.sub.a', 'transformer_jax.sub.b', 'transformer_jax.sub.c'
  ]]
