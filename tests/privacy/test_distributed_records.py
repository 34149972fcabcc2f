"""The distributed DP numbers of the secure-aggregation page, recomputed
from their records: docs/results/privacy/distributed/ (run.sh's runs,
cost.py's cost.txt) beside the central runs of docs/results/privacy/."""

import json
import math
import os
import re

from fedjax_mr.runtime import metrics_io
from tests import docs_text
from tests import test_readme_records as readme_records

PRIVACY = os.path.join(docs_text.REPO, 'docs', 'results', 'privacy')
RECORDS = os.path.join(PRIVACY, 'distributed')
PAGE = 'docs/howto/secure-aggregation.md'
TABLE = '| run | noise of a full round |'
# The page's rows: (algorithm, the central run's ε folder, the
# distributed run's folder or None for the central run).
ROWS = {
  'FedAvg, z 1.127, central': ('fedavg', 'eps_8', None),
  'FedAvg, z 1.127, distributed': ('fedavg', 'eps_8', 'eps_8'),
  'FedAvg, z 1.127, distributed, m = K': ('fedavg', 'eps_8', 'eps_8_all'),
  'FedMut, z 1.127, central': ('fedmut', 'eps_8', None),
  'FedMut, z 1.127, distributed': ('fedmut', 'eps_8', 'eps_8'),
  'FedMut, z 1.127, distributed, m = K': ('fedmut', 'eps_8', 'eps_8_all'),
  'FedAvg, z 1.8, central': ('fedavg', 'eps_2', None),
  'FedAvg, z 1.8, distributed': ('fedavg', 'eps_2', 'eps_2'),
  'FedMut, z 1.8, central': ('fedmut', 'eps_2', None),
  'FedMut, z 1.8, distributed': ('fedmut', 'eps_2', 'eps_2'),
}


def _folder(algorithm, central, distributed):
  if distributed is None:
    return os.path.join(PRIVACY, algorithm, central)
  return os.path.join(RECORDS, algorithm, distributed)


def _cells(algorithm, central, distributed):
  folder = _folder(algorithm, central, distributed)
  rows = metrics_io.read(os.path.join(folder, 'metrics.jsonl'))
  with open(os.path.join(folder, 'config.json')) as f:
    config = json.load(f)
  assert rows[-1]['round'] == 200
  noise = 1.0
  if distributed is not None:
    assert config['secure_aggregation'] and config['dp_noise_multiplier'] > 0
    k = config['clients_per_round']
    m = max(math.ceil(config['secagg_threshold'] * k - 1e-9), k // 2 + 1)
    noise = math.sqrt(k / m)
  return [
    f'{noise:.2f} × zC',
    f'{rows[-1]["dp_epsilon"]:.2f}',
    f'{100 * rows[-1]["test_accuracy"]:.2f} %',
  ]


# What a distributed run's flags may hold other than its central run's:
# secure aggregation's, where it writes, the central run's guard of its
# target ε, and what does not change a run (local evaluation, which a
# FedAvg run does not do; an adaptive quantile of 0 or none).
MAY_DIFFER = {'workdir', 'provenance', 'dp_target_epsilon', 'local_eval_every'}


def check_table(text):
  """The page's distributed DP table in `text`, cell by cell from its
  records (tests/test_results_tables_tight.py moves each figure)."""
  table = readme_records._table(text, TABLE)
  assert table[0] == [
    'run',
    'noise of a full round',
    'ε after 200 rounds',
    'final test accuracy',
  ]
  assert [row[0] for row in table[1:]] == list(ROWS)
  for row in table[1:]:
    assert row[1:] == _cells(*ROWS[row[0]]), row[0]


TABLES = {TABLE: check_table}


def test_the_distributed_table_is_its_records():
  check_table(docs_text.read(PAGE))


def test_the_runs_are_the_central_runs_but_for_the_noise():
  """Each distributed run has its central run's flags, and secure
  aggregation beside them."""
  for algorithm, central, distributed in ROWS.values():
    if distributed is None:
      continue
    configs = []
    for d in (None, distributed):
      path = os.path.join(_folder(algorithm, central, d), 'config.json')
      with open(path) as f:
        configs.append(json.load(f))
    plain, noised = configs
    differ = {
      k
      for k in set(plain) | set(noised)
      if plain.get(k) != noised.get(k)
      and not k.startswith(('secagg_', 'secure_'))
    }
    if not plain.get('dp_adaptive_quantile'):
      differ.discard('dp_adaptive_quantile')
    assert differ <= MAY_DIFFER, (algorithm, distributed, differ)
    assert noised['secure_aggregation'] and not plain.get('secure_aggregation')


def test_the_cost_lines_are_cost_txt():
  text = docs_text.read(PAGE)
  with open(os.path.join(RECORDS, 'cost.txt')) as f:
    lines = set(f.read().splitlines())
  quoted = re.findall(r'^- `(.*)`$', text, re.M)
  ours = [q for q in quoted if 'client variance' in q or 'distributed (S' in q]
  assert len(ours) >= 3
  for line in ours:
    assert line in lines, line


def _accuracy(name):
  return float(_cells(*ROWS[name])[2].rstrip(' %'))


def test_the_prose_numbers_are_the_records():
  text = ' '.join(docs_text.read(PAGE).split())

  def loss(alg, z):
    return _accuracy(f'{alg}, z {z}, central') - _accuracy(
      f'{alg}, z {z}, distributed'
    )

  assert (
    f'FedAvg loses {loss("FedAvg", 1.127):.2f} points at ε 8 and '
    f'{loss("FedAvg", 1.8):.2f} at ε 2, FedMut {loss("FedMut", 1.127):.2f} '
    f'and {loss("FedMut", 1.8):.2f}'
  ) in text
  same = {
    alg: _accuracy(f'{alg}, z 1.127, distributed, m = K')
    - _accuracy(f'{alg}, z 1.127, central')
    for alg in ('FedAvg', 'FedMut')
  }
  assert (
    f'FedAvg {same["FedAvg"]:+.2f}, FedMut {same["FedMut"]:+.2f} points'
  ) in text
  with open(os.path.join(RECORDS, 'cost.txt')) as f:
    cost = f.read()
  seconds = dict(
    re.findall(r'^(\w+, \d devices?) +([\d.]+) s a round', cost, re.M)
  )
  assert (
    f"takes {seconds['distributed, 1 device']} s against central DP's "
    f'{seconds["central, 1 device"]} s on one device '
    f"({seconds['central, 2 devices']} s on this machine's two)"
  ) in text
