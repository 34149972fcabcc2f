"""Writes the API reference at build time (mkdocs-gen-files): one page per
public module of fedjax_mr, found by walking the package, so a module that
is added, moved or removed changes the reference with no list to edit."""

import os

import mkdocs_gen_files

PACKAGE = 'fedjax_mr'
ROOT = os.path.join(os.path.dirname(os.path.dirname(__file__)), PACKAGE)


def public_modules(root=ROOT, package=PACKAGE):
  """Dotted names of the package's public modules and subpackages, sorted;
  a name with a part starting with `_` (other than `__init__`) is private."""
  names = []
  for folder, dirs, files in os.walk(root):
    dirs[:] = sorted(
      d
      for d in dirs
      if not d.startswith(('_', '.'))
      and os.path.exists(os.path.join(folder, d, '__init__.py'))
    )
    rel = os.path.relpath(folder, root)
    parts = [package] + ([] if rel == '.' else rel.split(os.sep))
    for name in sorted(files):
      if name == '__init__.py':
        names.append('.'.join(parts))
      elif name.endswith('.py') and not name.startswith('_'):
        names.append('.'.join(parts + [name[:-3]]))
  return sorted(names)


def page(name):
  """The reference page's path, relative to docs/."""
  return 'reference/' + name.replace('.', '/') + '.md'


def main():
  names = public_modules()
  with mkdocs_gen_files.open('reference/index.md', 'w') as f:
    f.write('# API reference\n\n')
    f.write(
      'Generated from the docstrings of every public module of '
      '`fedjax_mr` at build time.\n\n'
    )
    for name in names:
      depth = name.count('.')
      link = page(name)[len('reference/') :]
      f.write(f'{"  " * depth}- [`{name}`]({link})\n')
  for name in names:
    with mkdocs_gen_files.open(page(name), 'w') as f:
      f.write(f'::: {name}\n')


if __name__ == '<run_path>':  # mkdocs-gen-files runs it so
  main()
elif __name__ == '__main__':
  print('\n'.join(public_modules()))
