"""The results tables' checks are tight: one unit more or less in the last
printed digit of any figure of any results table of the documentation
(README.md, BUILD.md, the site's pages under docs/) fails its check.

Each figure of each body row (the labels' too: a row's label picks its
record) is changed alone, in memory, in the text of the page that holds it
(+1 in its last digit, −1 where that digit is 9); the table's check must
then fail. Figures inside identifiers (`resnet18_w16`, a commit, a record
name) and inside `code` are names, not figures, and are left alone.
"""

import os
import re

import pytest

from tests import docs_text
from tests import test_build_md_records as build_md_records
from tests import test_cpu_figures_records as cpu_figures_records
from tests import test_docs_tables as docs_tables
from tests import test_readme_records as readme_records
from tests.deploy import test_overhead_record as overhead_record
from tests.deploy import test_payload_record as payload_record
from tests.privacy import test_distributed_records as distributed_records
from tests.privacy import test_records as privacy_records
from tests.privacy import test_secure_records as secure_records

REPO = os.path.dirname(os.path.dirname(__file__))
# A figure: digits (thousands with commas, a decimal part), not inside a
# word or a number.
FIGURE = re.compile(r'(?<![\w.,])[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?(?![\w])')
CODE = re.compile(r'`[^`]*`')


def _read(name):
  with open(os.path.join(REPO, name)) as f:
    return f.read()


def _body_lines(text, header_start):
  """Indices of the body rows of the table whose header starts so."""
  lines = text.splitlines()
  (start,) = [
    i for i, line in enumerate(lines) if line.startswith(header_start)
  ]
  end = start + 2
  while end < len(lines) and lines[end].startswith('|'):
    end += 1
  return lines, range(start + 2, end)


def _mutations(line):
  """(cell index, figure, line with that figure one unit off)."""
  names = [m.span() for m in CODE.finditer(line)]
  for m in FIGURE.finditer(line):
    if any(a <= m.start() < b for a, b in names):
      continue
    figure = m.group()
    last = int(figure[-1])
    changed = figure[:-1] + str(last + 1 if last < 9 else last - 1)
    cell = line[: m.start()].count('|') - 1
    yield cell, figure, line[: m.start()] + changed + line[m.end() :]


# Each table on the page that holds it now, wherever it moved.
CASES = [
  (docs_text.holding(header), header, check)
  for header, check in {
    **readme_records.TABLES,
    **build_md_records.TABLES,
    **cpu_figures_records.TABLES,
    **payload_record.TABLES,
    **overhead_record.TABLES,
    **docs_tables.TABLES,
    **privacy_records.TABLES,
    **secure_records.TABLES,
    **distributed_records.TABLES,
  }.items()
]


@pytest.mark.parametrize(
  'name, header, check', CASES, ids=[c[1].strip('| ') for c in CASES]
)
def test_every_figure_one_unit_off_fails_its_check(name, header, check):
  text = _read(name)
  check(text)  # as printed, it passes
  lines, body = _body_lines(text, header)
  cells, figures = set(), 0
  for i in body:
    for cell, figure, changed in _mutations(lines[i]):
      mutated = '\n'.join(lines[:i] + [changed] + lines[i + 1 :])
      with pytest.raises(AssertionError):
        check(mutated)
        pytest.fail(f'{name} line {i + 1}, cell {cell}: {figure} one off')
      cells.add((i, cell))
      figures += 1
  print(f'{name} {header!r}: {figures} figures in {len(cells)} cells')
  assert figures


def _tables_with_figures(text):
  """The header lines of the tables of `text` with a figure in a body row
  (outside `code`)."""
  lines = text.splitlines()
  found = []
  for i, line in enumerate(lines):
    if not (line.startswith('|') and i + 1 < len(lines)):
      continue
    if not lines[i + 1].startswith('|---') or (
      i > 0 and lines[i - 1].startswith('|')
    ):
      continue
    end = i + 2
    while end < len(lines) and lines[end].startswith('|'):
      end += 1
    body = ' '.join(CODE.sub('', row) for row in lines[i + 2 : end])
    if FIGURE.search(body):
      found.append(line)
  return found


# Tables with figures that are not measurements: names of things, counts
# of what a file holds, step numbers.
NOT_MEASUREMENTS = [
  ('README.md', '| | what | where |'),
  ('docs/configs.md', '| file | dataset | model | partition | table |'),
  ('docs/energy.md', '| module | what it does |'),
  ('docs/howto/experiments.md', '| flagfile | setting |'),
  ('docs/howto/gpu.md', '| # | item | what it prints |'),
  # Defaults (tests/pipeline/test_secure_config.py reads them).
  ('docs/howto/secure-aggregation.md', '| flag | default | meaning |'),
  ('docs/results/README.md', '| folder | what | made by |'),
  ('docs/results/scale.md', '| algorithm | the server needs | streamed |'),
]


def test_every_results_table_with_figures_is_checked():
  # Every page of the documentation: a table of measured figures has a
  # check above (recomputing it from its records, tight); only the tables
  # listed, whose figures are not measurements, go without.
  headers = [h for _, h, _ in CASES]
  unchecked = []
  for name in docs_text.pages():
    for header in _tables_with_figures(_read(name)):
      if not any(header.startswith(h) for h in headers):
        unchecked.append((name, header))
  assert unchecked == NOT_MEASUREMENTS, unchecked
