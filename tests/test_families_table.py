"""docs/families.md's families x uses table is what tools/families_table.py writes from the
registry and the tests, and every test it names exists (so a renamed or deleted test, or a new
family, shows in the table or fails here)."""

import ast
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from tools import families_table as table
from transformer_jax.convert import families

REFERENCE = re.compile(r'^(tests/[\w/]+\.py)::(\w+)(?:\[([\w-]+)\])?$')


def _test_exists(reference: str) -> str:
  """'' if `reference` names a test function of the suite (and, with [PARAM], a file that spells
  PARAM as a string literal: its parametrize or fixture params), else what is wrong."""
  match = REFERENCE.match(reference)
  if not match:
    return 'not tests/FILE.py::FUNCTION[PARAM]'
  path, function, param = match.groups()
  full = os.path.join(REPO_ROOT, path)
  if not os.path.isfile(full):
    return f'{path} does not exist'
  with open(full, encoding='utf-8') as f:
    tree = ast.parse(f.read())
  if not any(isinstance(node, ast.FunctionDef) and node.name == function for node in tree.body):
    return f'{path} has no function {function}'
  if param and not any(
      isinstance(node, ast.Constant) and node.value == param for node in ast.walk(tree)):
    return f'{path} never spells the case {param!r}'
  return ''


def test_the_doc_is_what_the_script_writes():
  result = subprocess.run([sys.executable, 'tools/families_table.py', '--check'], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr


def test_every_named_test_exists():
  wrong = {
      key: problem for key, reference in table.TESTS.items() if (problem := _test_exists(reference))
  }
  assert not wrong, wrong


def test_cells_name_known_uses_and_families_and_only_applicable_ones():
  kinds = {name: kind for name, _, kind in table.columns()}
  uses = {use.key: use for use in table.USES}
  for use, name in list(table.TESTS) + list(table.NOT_BUILT):
    assert use in uses and name in kinds, (use, name)
    assert table.applies(uses[use], name, kinds[name]), f'{use} does not apply to {name}'
  assert not set(table.TESTS) & set(table.NOT_BUILT)


def test_a_new_registry_family_is_a_column_of_untested_cells(monkeypatch):
  new = families.Family('mamba', families.CAUSAL_LM, 'transformer_jax.convert.hf_gpt2', ('mamba',),
                        title='Mamba')
  monkeypatch.setattr(families, 'FAMILIES', families.FAMILIES + (new,))
  rendered = table.render()
  header = next(line for line in rendered.splitlines() if line.startswith('| use |'))
  assert header.endswith(f'| Mamba | {table.ORIGINAL_TITLE} |'), header
  status = table.cells()
  assert status['perplexity', 'mamba'] == 'untested'
  assert status['fill_mask', 'mamba'] == 'n/a'


def test_the_check_finds_a_missing_test():
  assert _test_exists('tests/test_families_table.py::test_every_named_test_exists') == ''
  assert 'has no function' in _test_exists('tests/test_families_table.py::test_gone')
  assert 'never spells' in _test_exists(
      'tests/test_lm_evaluate.py::test_hf_bits_per_byte_matches_transformers_logits[mamba]')
  assert 'does not exist' in _test_exists('tests/test_nowhere.py::test_x')


def test_a_hand_edit_of_the_table_is_rewritten():
  with open(table.DOC, encoding='utf-8') as f:
    text = f.read()
  edited = text.replace('| [1](#t1) |', '| works |', 1)  # a cell of the generated table
  assert edited != text
  assert table.rewritten(edited) == text
  with pytest.raises(ValueError, match='lacks the lines'):
    table.rewritten('no table here')
