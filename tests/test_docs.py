"""The documentation stays alive: links resolve, every page is reachable, examples run.

Checks README.md and every docs/*.md page. A fenced ```python block whose first line is
`# runs in the tests` is executed, and so is each command of a ```bash block marked the same
way (from the repository root, with /tmp/ paths moved into a temporary folder); other blocks
are text only (docs/architecture.md states the convention).
"""

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO_ROOT, 'README.md')
DOCS_DIR = os.path.join(REPO_ROOT, 'docs')
README_MAX_BYTES = 15_000
RUN_MARKER = '# runs in the tests'

# [text](target) and ![alt](target), with an optional "title" after the target.
_LINK = re.compile(r'!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)')
# A fenced block: its info string (e.g. 'python') and its body.
_FENCE = re.compile(r'^```([^\n`]*)\n(.*?)^```\s*$', re.MULTILINE | re.DOTALL)


def doc_pages() -> list[str]:
  return sorted(glob.glob(os.path.join(DOCS_DIR, '*.md')))


def all_docs() -> list[str]:
  return [README] + doc_pages()


def read(path: str) -> str:
  with open(path, encoding='utf-8') as f:
    return f.read()


def without_code(text: str) -> str:
  """The text outside fenced blocks and inline code spans (where a `[x](y)` is no link)."""
  text = _FENCE.sub('', text)
  return re.sub(r'`[^`\n]*`', '', text)


def relative_links(path: str) -> list[str]:
  """Link targets in a Markdown file that name a file of this repository."""
  targets = []
  for target in _LINK.findall(without_code(read(path))):
    if re.match(r'^[a-z][a-z0-9+.-]*:', target, re.IGNORECASE) or target.startswith('#'):
      continue  # http(s)://, mailto: and links within the page
    targets.append(target.split('#', 1)[0])
  return targets


def runnable_blocks(language: str = 'python') -> list:
  """(file:line, code) of every block in `language` marked to run, as pytest params."""
  params = []
  for path in all_docs():
    text = read(path)
    for match in _FENCE.finditer(text):
      info, body = match.group(1).strip().lower(), match.group(2)
      if info == language and body.lstrip().startswith(RUN_MARKER):
        line = text.count('\n', 0, match.start()) + 1
        where = f'{os.path.relpath(path, REPO_ROOT)}:{line}'
        params.append(pytest.param(body, id=where))
  return params


def test_docs_folder_has_pages():
  """docs/ holds the Markdown pages the README points to (guards the other tests)."""
  assert doc_pages(), f'no Markdown pages in {DOCS_DIR}'


@pytest.mark.parametrize('path', all_docs(), ids=lambda p: os.path.relpath(p, REPO_ROOT))
def test_relative_links_point_to_existing_files(path):
  """Every relative link and image in README.md and docs/*.md names a file that exists."""
  base = os.path.dirname(path)
  missing = [
      t for t in relative_links(path) if not os.path.exists(os.path.normpath(os.path.join(base, t)))
  ]
  assert not missing, f'{os.path.relpath(path, REPO_ROOT)} links to missing files: {missing}'


def test_every_docs_page_is_linked_from_the_readme():
  """No docs page is an orphan: README.md links to each docs/*.md."""
  linked = {os.path.normpath(os.path.join(REPO_ROOT, t)) for t in relative_links(README)}
  orphans = [os.path.relpath(p, REPO_ROOT) for p in doc_pages() if p not in linked]
  assert not orphans, f'README.md does not link to {orphans}'


def test_readme_stays_short():
  """README.md is for users: at most 15,000 bytes; the record belongs in docs/."""
  size = os.path.getsize(README)
  assert size <= README_MAX_BYTES, (
      f'README.md is {size} bytes (limit {README_MAX_BYTES}); move detail to a page in docs/')


def test_there_are_examples_to_run():
  """At least one python example is marked to run, so the next test is not vacuous."""
  assert runnable_blocks(), f'no ```python block starts with {RUN_MARKER!r}'


@pytest.mark.parametrize('code', runnable_blocks())
def test_marked_python_examples_run(code):
  """A python block marked `# runs in the tests` runs without raising, in a fresh namespace."""
  namespace = {'__name__': '__docs_example__'}
  exec(compile(code, '<docs example>', 'exec'), namespace)


def shell_commands(block: str) -> list[str]:
  """The commands of a bash block: comments dropped, backslash continuations joined."""
  joined = re.sub(r'\\\n\s*', ' ', block)
  return [
      line.strip()
      for line in joined.splitlines()
      if line.strip() and not line.strip().startswith('#')
  ]


def test_there_are_commands_to_run():
  """At least one bash block is marked to run, so the next test is not vacuous."""
  assert runnable_blocks('bash'), f'no ```bash block starts with {RUN_MARKER!r}'


@pytest.mark.parametrize('block', runnable_blocks('bash'))
def test_marked_shell_commands_run(block, tmp_path):
  """Each command of a bash block marked `# runs in the tests` exits 0 (files it writes under
  /tmp/ go to a temporary folder instead)."""
  for command in shell_commands(block):
    argv = [arg.replace('/tmp/', f'{tmp_path}/') for arg in shlex.split(command)]
    if argv[0] in ('python', 'python3'):
      argv[0] = sys.executable
    result = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, f'{command}\n{result.stderr[-3000:]}'
