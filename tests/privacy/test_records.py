"""The numbers of the privacy page, recomputed from their records
(docs/results/privacy/: each run's metrics.jsonl and config.json, the
cost of a round in cost.txt)."""

import json
import os
import re

from fedjax_mr import privacy
from fedjax_mr.runtime import metrics_io
from tests import docs_text
from tests import test_readme_records as readme_records

RECORDS = os.path.join(docs_text.REPO, 'docs', 'results', 'privacy')
PAGE = 'docs/howto/privacy.md'
TABLE = '| algorithm | no DP |'
SETTINGS = {
  'no DP': 'none',
  'clip alone (ε = ∞)': 'inf',
  'ε = 8': '8',
  'ε = 2': '2',
}
ALGORITHMS = {'FedAvg': 'fedavg', 'FedMut': 'fedmut', 'SCAFFOLD': 'scaffold'}


def _run(algorithm, setting):
  folder = os.path.join(RECORDS, algorithm, f'eps_{setting}')
  rows = metrics_io.read(os.path.join(folder, 'metrics.jsonl'))
  with open(os.path.join(folder, 'config.json')) as f:
    return rows, json.load(f)


def _cell(algorithm, setting):
  """A table cell: the final test accuracy and, under DP with noise, the
  final ε as the accountant gives it for the run's config; for a run
  that diverged, the round and its last evaluation before."""
  rows, config = _run(algorithm, setting)
  last = rows[-1]
  stopped = metrics_io.diverged_at(rows)
  if stopped is not None:
    evaluated = [r for r in rows if 'test_accuracy' in r][-1]
    return (
      f'diverged at round {stopped} ({100 * evaluated["test_accuracy"]:.2f} '
      f'% at round {evaluated["round"]})'
    )
  assert last['round'] == config['rounds'] == 200
  text = f'{100 * last["test_accuracy"]:.2f} %'
  if setting in ('8', '2'):
    n, k = config['num_clients'], config['clients_per_round']
    acct = privacy.Accountant(
      config['dp_noise_multiplier'], n, k, privacy.default_delta(n)
    )
    assert last['dp_epsilon'] == acct.epsilon(200)
    assert last['dp_epsilon'] <= float(setting)
    text += f' (ε {last["dp_epsilon"]:.2f})'
  return text


def check_table(text):
  """The privacy page's accuracy table in `text`, cell by cell from its
  records (tests/test_results_tables_tight.py moves each figure)."""
  table = readme_records._table(text, TABLE)
  header, body = table[0], table[1:]
  assert header == ['algorithm', *SETTINGS]
  assert [row[0] for row in body] == list(ALGORITHMS)
  for row in body:
    for cell, setting in zip(row[1:], SETTINGS.values()):
      assert cell == _cell(ALGORITHMS[row[0]], setting), (row[0], setting)


TABLES = {TABLE: check_table}


def test_the_accuracy_table_is_its_records():
  check_table(docs_text.read(PAGE))


def test_the_cost_line_is_its_record():
  text = docs_text.read(PAGE)
  with open(os.path.join(RECORDS, 'cost.txt')) as f:
    record = f.read()
  for algorithm in ALGORITHMS.values():
    line = re.search(rf'^{algorithm}: .*$', record, re.M)[0]
    assert f'`{line}`' in text, line


def _accuracy(algorithm, setting):
  return 100 * _run(algorithm, setting)[0][-1]['test_accuracy']


def test_the_prose_numbers_are_the_records():
  text = ' '.join(docs_text.read(PAGE).split())
  a = {s: _accuracy('fedavg', s) for s in ('none', 'inf', '8', '2')}
  assert (
    f'costs FedAvg {a["none"] - a["inf"]:.1f} points, the noise of ε = 8 '
    f'another {a["inf"] - a["8"]:.1f} and ε = 2 another {a["8"] - a["2"]:.1f}'
  ) in text
  mut = _accuracy('fedmut', 'none') - _accuracy('fedmut', '2')
  assert (
    f"FedMut loses {mut:.1f} points in all against FedAvg's "
    f'{a["none"] - a["2"]:.1f}'
  ) in text
  clip = _accuracy('scaffold', 'none') - _accuracy('scaffold', 'inf')
  rows, _ = _run('scaffold', '2')
  assert f'{clip:.1f} points to the clip alone' in text
  assert f'non-finite at round {metrics_io.diverged_at(rows)}' in text
  with open(os.path.join(RECORDS, 'synthetic_nodp.txt')) as f:
    final = re.search(r'final test accuracy ([\d.]+)', f.read())[1]
  assert f'({100 * float(final):.1f} % after 100 rounds' in text


def test_the_example_lines_are_the_runs_output():
  block = docs_text.read(PAGE).split('```text\n', 1)[1].split('```')[0]
  with open(os.path.join(RECORDS, 'run.log')) as f:
    log = f.read().splitlines()
  for line in block.splitlines():
    assert line in log, line
