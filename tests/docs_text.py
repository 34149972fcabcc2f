"""The documentation's text, for the tests that check it: README.md,
BUILD.md and every page of the site under docs/ (the records' own files
under docs/results/<folder>/ are records, not pages)."""

import functools
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, 'docs')


def pages() -> list[str]:
  """The documentation's files, relative to the checkout, sorted."""
  found = ['README.md', 'BUILD.md']
  for folder, dirs, files in os.walk(DOCS):
    rel = os.path.relpath(folder, REPO)
    # docs/results/<records>/...: records, not pages.
    if rel.count(os.sep) >= 2 and rel.startswith(
      os.path.join('docs', 'results')
    ):
      dirs[:] = []
      continue
    dirs.sort()
    found += [os.path.join(rel, f) for f in sorted(files) if f.endswith('.md')]
  return found


def read(name: str) -> str:
  with open(os.path.join(REPO, name)) as f:
    return f.read()


@functools.cache
def _all_text() -> str:
  return '\n'.join(read(name) for name in pages())


def all_text() -> str:
  """Every page's text, joined (a sentence is found wherever it moved)."""
  return _all_text()


def holding(line_start: str) -> str:
  """The one page with a line that starts with `line_start` (a table's
  header, wherever the table moved)."""
  names = [
    name
    for name in pages()
    if any(line.startswith(line_start) for line in read(name).splitlines())
  ]
  assert len(names) == 1, f'{line_start!r} is on {names or "no page"}'
  return names[0]
