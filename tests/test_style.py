"""House rules a reader relies on (../shared/STYLE.md): the library speaks
of its arguments, not of the programs' flags, and no function runs past
a screen or two."""

import ast
import io
import pathlib
import re
import tokenize

REPO = pathlib.Path(__file__).parent.parent
PACKAGE = REPO / 'fedjax_mr'

# A command-line flag: two dashes, then a lower-case word. XLA's own flags
# (`XLA_FLAGS=--xla_...`, which a user sets in the environment) are not
# ours, so they are not the programs' vocabulary leaking in.
_FLAG = re.compile(r'(?<![\w-])--(?!xla_)[a-z][a-z0-9_]*')

# A function is the whole `def`, decorators, docstring and nested functions
# included: a factory that closes over a dozen steps is as long as they are.
MAX_FUNCTION_LINES = 80

_CAPS: dict[pathlib.Path, int] = {}  # folders with a cap of their own


def _flag_lines(path: pathlib.Path):
  """(line, text) of each string or comment of `path` that names a flag."""
  tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
  for token in tokens:
    if token.type in (tokenize.STRING, tokenize.COMMENT) or (
      token.type.__class__ is int
      and tokenize.tok_name.get(token.type, '').startswith('FSTRING')
    ):
      if _FLAG.search(token.string):
        yield token.start[0], token.string.strip().splitlines()[0][:70]


def test_the_library_names_arguments_not_flags():
  # Library errors and messages name their argument or config field in
  # backticks; experiments/cli.py renders the programs' flags (issue 39).
  found = [
    f'{path.relative_to(REPO)}:{line}: {text}'
    for path in sorted(PACKAGE.rglob('*.py'))
    for line, text in _flag_lines(path)
  ]
  assert not found, '\n'.join(found)


def test_the_check_finds_a_flag_where_there_is_one(tmp_path):
  path = tmp_path / 'm.py'
  path.write_text(
    'x = "pass --rounds=5"\n'
    "y = f'{z} --lr'\n"
    '# see --workdir\n'
    'w = "XLA_FLAGS=--xla_cpu_x a-b -- c"\n'
  )
  assert [line for line, _ in _flag_lines(path)] == [1, 2, 3]


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  """Lines of a whole `def`: from its first decorator to its last line,
  nested functions and classes included."""
  first = min([node.lineno] + [d.lineno for d in node.decorator_list])
  return node.end_lineno - first + 1


def _cap(path: pathlib.Path) -> int:
  for folder, cap in _CAPS.items():
    if folder in path.parents:
      return cap
  return MAX_FUNCTION_LINES


def _long_functions(path: pathlib.Path):
  cap = _cap(path)
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      lines = function_lines(node)
      if lines > cap:
        yield node.name, node.lineno, lines


def test_no_function_is_longer_than_80_lines():
  found = [
    f'{path.relative_to(REPO)}:{line}: {name} ({lines} lines)'
    for folder in (PACKAGE, REPO / 'experiments', REPO / 'scripts')
    for path in sorted(folder.rglob('*.py'))
    for name, line, lines in _long_functions(path)
  ]
  assert not found, '\n'.join(found)


def test_a_function_counts_its_decorators_and_nested_functions(tmp_path):
  body = '\n'.join(f'    x{i} = {i}' for i in range(MAX_FUNCTION_LINES - 4))
  path = tmp_path / 'm.py'
  path.write_text(
    f'@decorator\ndef outer():\n  def inner():\n{body}\n  return inner\n'
  )
  node = ast.parse(path.read_text()).body[0]
  assert function_lines(node) == MAX_FUNCTION_LINES
  assert not list(_long_functions(path))
  path.write_text('@a\n' + path.read_text())
  assert [name for name, _, _ in _long_functions(path)] == ['outer']


# A module holds one concern: at most 700 lines. A package holds at most 14
# modules (`__init__` counted), but `algorithms/` (one module per algorithm,
# by design). A program (flags -> one library call -> print) is at most 200
# lines; a program is a module of experiments/ with a console script's
# `entry()`, the others there (cli.py, deploy_flags.py, the PyTorch
# reference) are shared helpers, held to a module's size.
MAX_MODULE_LINES = 700
MAX_PACKAGE_MODULES = 14
MAX_PROGRAM_LINES = 200


def _lines(path: pathlib.Path) -> int:
  return len(path.read_text().splitlines())


def test_modules_packages_and_programs_stay_small():
  over = []
  for path in sorted(PACKAGE.rglob('*.py')):
    if _lines(path) > MAX_MODULE_LINES:
      over.append(str(path.relative_to(REPO)))
  for path in sorted((REPO / 'experiments').glob('*.py')):
    program = 'def entry()' in path.read_text()
    if _lines(path) > (MAX_PROGRAM_LINES if program else MAX_MODULE_LINES):
      over.append(str(path.relative_to(REPO)))
  assert not over, '\n'.join(over)
  crowded = [
    p.name
    for p in PACKAGE.iterdir()
    if (p / '__init__.py').exists()
    and p.name != 'algorithms'
    and len(list(p.glob('*.py'))) > MAX_PACKAGE_MODULES
  ]
  assert not crowded


def test_the_suites_longest_files_exist():
  # tests/conftest.py's LONGEST_FIRST names files by path: a renamed or
  # removed one would silently lose its place at the front.
  from tests import conftest

  repo = pathlib.Path(__file__).resolve().parent.parent
  for path in conftest.LONGEST_FIRST:
    assert (repo / path).is_file(), path
  assert len(set(conftest.LONGEST_FIRST)) == len(conftest.LONGEST_FIRST)
