"""The numbers of the secure-aggregation page, recomputed from their
records (docs/results/secure/: each run's metrics.jsonl and config.json,
made by run.sh; cost.txt by cost.py; flower.txt by flower.sh)."""

import os
import re

from fedjax_mr.runtime import metrics_io
from tests import docs_text
from tests import test_readme_records as readme_records

RECORDS = os.path.join(docs_text.REPO, 'docs', 'results', 'secure')
PAGE = 'docs/howto/secure-aggregation.md'
TABLE = '| run | seed 0 |'
ROWS = {
  'FedAvg, floats': ('fedavg', 'float'),
  'FedAvg, secure': ('fedavg', 'secure'),
  'FedMut (momentum 0.5), floats': ('fedmut_m0.5', 'float'),
  'FedMut (momentum 0.5), secure': ('fedmut_m0.5', 'secure'),
}


def _accuracy(variant, mode, seed=0):
  folder = os.path.join(RECORDS, variant, mode + (f'_s{seed}' if seed else ''))
  rows = metrics_io.read(os.path.join(folder, 'metrics.jsonl'))
  assert rows[-1]['round'] == 20
  return 100 * rows[-1]['test_accuracy']


def _row(variant, mode):
  seeds = [_accuracy(variant, mode, s) for s in (0, 1, 2)]
  return [f'{a:.2f} %' for a in seeds] + [f'{sum(seeds) / 3:.2f} %']


def check_table(text):
  """The page's accuracy table in `text`, cell by cell from its records
  (tests/test_results_tables_tight.py moves each figure)."""
  table = readme_records._table(text, TABLE)
  assert table[0] == ['run', 'seed 0', 'seed 1', 'seed 2', 'mean']
  assert [row[0] for row in table[1:]] == list(ROWS)
  for row in table[1:]:
    assert row[1:] == _row(*ROWS[row[0]]), row[0]


TABLES = {TABLE: check_table}


def test_the_accuracy_table_is_its_records():
  check_table(docs_text.read(PAGE))


def _gap(variant):
  def mean(mode):
    return sum(_accuracy(variant, mode, s) for s in (0, 1, 2)) / 3

  return mean('secure') - mean('float')


def test_the_prose_numbers_are_the_records():
  text = ' '.join(docs_text.read(PAGE).split())
  avg, mut = _gap('fedavg'), _gap('fedmut_m0.5')
  assert f'FedAvg {avg:+.2f} points, FedMut {mut:+.2f}' in text
  devices = {
    v: _accuracy(v, 'float_1device') - _accuracy(v, 'float')
    for v in ('fedavg', 'fedmut_m0.5')
  }
  assert (
    f'FedAvg by {devices["fedavg"]:+.2f} points and FedMut by '
    f'{devices["fedmut_m0.5"]:+.2f}'
  ) in text


def test_the_cost_lines_are_their_records():
  text = docs_text.read(PAGE)
  quoted = re.findall(r'^- `(.*)`$', text, re.M)
  assert quoted
  records = ''
  for name in ('cost.txt', 'flower.txt', '../privacy/distributed/cost.txt'):
    with open(os.path.join(RECORDS, name)) as f:
      records += f.read()
  lines = set(records.splitlines())
  for line in quoted:
    assert line in lines, line


def test_the_flower_cost_before_is_its_record():
  # The ratio when every stage set the run up, from its own record.
  with open(os.path.join(RECORDS, 'flower_3991ea0.txt')) as f:
    (ratio,) = re.findall(r'^secure / plain: (\S+)x$', f.read(), re.M)
  text = ' '.join(docs_text.read(PAGE).split())
  assert f'set the run up, {ratio}x: `flower_3991ea0.txt`' in text


def test_the_first_ranges_cost_is_its_records():
  """The page's account of the first range (10^4 for every value):
  range_1e4/ holds those secure runs, and the steps it names."""
  from fedjax_mr.privacy import fixed_point

  text = ' '.join(docs_text.read(PAGE).split())
  first = os.path.join(RECORDS, 'range_1e4', 'fedmut_m0.5')
  gaps = []
  for seed in (0, 1, 2):
    name = 'secure' + (f'_s{seed}' if seed else '')
    rows = metrics_io.read(os.path.join(first, name, 'metrics.jsonl'))
    gaps.append(
      100 * rows[-1]['test_accuracy'] - _accuracy('fedmut_m0.5', 'float', seed)
    )
  assert f'uniformly weighted FedMut {-sum(gaps) / 3:.1f} point' in text
  levels = fixed_point.levels(32, 10)
  assert f'{1e4 / levels:.1e}' == '4.7e-05'
  assert f'{10 / levels:.1e}' == '4.7e-08'
  assert '4.7 · 10⁻⁵ apart' in text and '4.7 · 10⁻⁸ apart' in text
