"""The package's layers: every import points down (../shared/STYLE.md)."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).parent.parent / 'fedjax_mr'

# Rank of each subpackage: a module may import its own subpackage and any
# of lower rank, never one of equal or higher rank.
LAYERS = {
  'core': 0,
  'data': 1,
  'models': 1,
  'energy': 1,
  # Differential privacy of a round's sum: the engine's fold applies it.
  'privacy': 1,
  'training': 2,
  'algorithms': 3,
  'stitch': 3,
  'runtime': 3,
  'pipeline': 4,
  'analysis': 5,
  # The benchmark builds its runs as the run pipeline does.
  'bench': 5,
  # Deployment on Flower: the run pipeline's runs over a network.
  'deploy': 5,
}


def _imports(path: pathlib.Path):
  """(line, subpackage) of every `fedjax_mr.<subpackage>` a module imports,
  at its top or inside a function."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      names = [node.module]
      if node.module == 'fedjax_mr':
        names = [f'fedjax_mr.{a.name}' for a in node.names]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    else:
      continue
    for name in names:
      parts = name.split('.')
      if parts[0] == 'fedjax_mr' and len(parts) > 1:
        yield node.lineno, parts[1]


def test_every_subpackage_has_a_layer():
  found = {p.name for p in PACKAGE.iterdir() if (p / '__init__.py').exists()}
  assert found == set(LAYERS)


def test_imports_only_point_down():
  upward = []
  for path in sorted(PACKAGE.rglob('*.py')):
    rel = path.relative_to(PACKAGE)
    if len(rel.parts) == 1:
      continue  # fedjax_mr/__init__.py re-exports from every layer
    own = rel.parts[0]
    for line, other in _imports(path):
      if other != own and LAYERS[other] >= LAYERS[own]:
        upward.append(f'fedjax_mr/{rel}:{line} imports fedjax_mr.{other}')
  assert not upward, '\n'.join(upward)


def test_no_lazy_imports_below_the_top():
  # Packages load their modules plainly: a module-level __getattr__ is
  # kept only where it keeps jax out of host-only code (core, the top).
  lazy = [
    str(p.relative_to(PACKAGE))
    for p in PACKAGE.rglob('__init__.py')
    if 'def __getattr__' in p.read_text()
  ]
  assert sorted(lazy) == ['__init__.py', 'core/__init__.py']
