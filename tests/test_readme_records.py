"""Every number of the README's Fashion-MNIST tables comes from a record.

The transfer table, too: it is `experiments.stitch_figures --figure=table3`
of the records in docs/results/transfer100, as that prints it.

Each cell of the results table and of FedMut's α ablation is recomputed
from the runs archived in docs/results/fmnist_table (scripts/
archive_runs.py) as `experiments.compare` computes a table: per seed, the
mean test accuracy of the last 10 evaluations; over seeds, their mean ±
population std; a run whose train loss became non-finite diverged at
that round. Every number printed in a cell must be one that the parser
below knows how to recompute, so a cell cannot gain a number without a
record behind it.
"""

import functools
import json
import os
import re

import numpy as np
import pytest

from fedjax_mr.analysis import compare
from fedjax_mr.analysis import stitch_tables
from fedjax_mr.runtime import metrics_io
from tests import docs_text

REPO = os.path.dirname(os.path.dirname(__file__))
RECORDS = os.path.join(REPO, 'docs', 'results', 'fmnist_table')
LAST = 10  # evaluations averaged into a run's final accuracy
# The transfer table's runs (experiments.stitch_figures --runs).
TRANSFER_RUNS = os.path.join(
  'docs', 'results', 'transfer100', 'figs', 'runs.json'
)
# The FedStitch Dir(1.0) run of the README's FedStitch section.
STITCH_RUN = os.path.join(REPO, 'docs', 'results', 'stitch_readme', 'dir1.0')

# The results table: its row labels, each a variant of
# experiments/configs/fmnist_table.flags' comparison.
ROWS = {
  'FedAvg': 'fedavg',
  'FedMR': 'fedmr',
  'FedMR, two-stage (20 rounds of FedAvg first)': 'fedmr_2stage20',
  'FedMR-p, 2 segments': 'fedmr_p2',
  'Indep (whole models, never mixed)': 'indep',
  'FedMut (α 4, β₀ 0.3, T_b 50)': 'fedmut',
  'FedProx (μ 0.01)': 'fedprox',
  'SCAFFOLD (option II, momentum-aware step count)': 'scaffold',
  'SCAFFOLD, option II literally (steps_i · lr)': 'scaffold_taken',
  'FedExP (ε 1e-3, mean of the last two iterates)': 'fedexp',
  'FedASAM (ρ 0.7, η 0.2)': 'fedasam',
  'CluSamp (Algorithm 2, cosine)': 'clusamp',
  'MOON (μ 1, τ 0.5, projection 256)': 'moon',
  "FedGen (the authors' settings: α = β = 10)": 'fedgen',
  'FedGen, α = β = 1': 'fedgen_a1',
  'FedAvgM (server SGD, momentum 0.9, rate 10^−0.5)': 'fedavgm',
  'FedAdam (server rate 10^−2.5, τ 10⁻⁴)': 'fedadam',
  'FedYogi (server rate 10^−2.5, τ 10⁻⁴)': 'fedyogi',
  'FedAdagrad (server rate 10⁻¹, τ 10⁻²)': 'fedadagrad',
}
# Its columns after the first: (records folder, variant suffix).
COLUMNS = {
  'Dir(0.1), momentum 0.9 (the papers)': ('dir0.1', ''),
  "Dir(0.1), momentum 0.5 (the authors' code)": ('dir0.1', '_m0.5'),
  'Dir(0.5), momentum 0.9': ('dir0.5', ''),
  'IID, momentum 0.9': ('iid', ''),
}
# FedMut's α ablation (Dir(0.1)): the variant of each α.
ALPHAS = {
  '0 (= unweighted FedAvg)': 'fedmut_a0',
  '1': 'fedmut_a1',
  '2': 'fedmut_a2',
  "4 (the papers')": 'fedmut',
  '5': 'fedmut_a5',
}

NUMBER = r'\d+(?:\.\d+)?'
NUMBERS = rf'{NUMBER}(?:, {NUMBER})*'


def _readme():
  """Every page of the documentation, README.md's and the site's (a
  sentence's figures are found wherever it moved)."""
  return docs_text.all_text()


def _page(header):
  """The text of the page that holds the table whose header starts so."""
  return docs_text.read(docs_text.holding(header))


def _table(text, header_start):
  """The rows (lists of cell texts) of the README table whose header line
  starts with `header_start`, the header first."""
  lines = text.splitlines()
  starts = [i for i, line in enumerate(lines) if line.startswith(header_start)]
  assert len(starts) == 1, f'{header_start!r}: {len(starts)} tables'
  rows = []
  for line in lines[starts[0] :]:
    if not line.startswith('|'):
      break
    rows.append([c.strip() for c in line.strip().strip('|').split('|')])
  del rows[1]  # |---|---|
  return rows


class Run:
  """What one archived run's metrics.jsonl says."""

  def __init__(self, column, variant, seed):
    path = os.path.join(RECORDS, column, variant, f's{seed}', 'metrics.jsonl')
    assert os.path.exists(path), f'no record {os.path.relpath(path, REPO)}'
    self.rows = metrics_io.read(path)
    with open(os.path.join(os.path.dirname(path), 'config.json')) as f:
      self.config = json.load(f)
    self.name = f'{column}/{variant}/s{seed}'
    self.diverged = metrics_io.diverged_at(self.rows)
    evaluated = [r for r in self.rows if 'test_accuracy' in r]
    if self.diverged is None:
      assert self.rows[-1]['round'] == self.config['rounds'], (
        f'{self.name} did not finish'
      )
      assert len(evaluated) >= LAST, self.name
    self.final = compare.final_accuracy(self.rows, LAST)
    best = max(evaluated, key=lambda r: r['test_accuracy'], default=None)
    self.best = best and best['test_accuracy']
    self.best_round = best and best['round']

  def last(self, key):
    return [r[key] for r in self.rows if key in r][-1]


@functools.cache
def _run(column, variant, seed):
  """The record of one run, read once (checks only read it)."""
  return Run(column, variant, seed)


def _printed(value, text, what):
  """`value` (a fraction, or a count) printed as `text`, to its digits."""
  digits = len(text.partition('.')[2])
  assert f'{value:.{digits}f}' == text, f'{what}: {value} is not {text}'


def _percent(fraction, text, what):
  _printed(100 * fraction, text, what)


def check_cell(cell, column, variant):
  """Recomputes every number of `cell` from the records of `variant` in
  records folder `column`; returns the seeds it read."""
  where = f'{variant} in {column}: {cell!r}'
  text = cell.replace('**', '')
  if text == '–':
    return []
  rest = text

  def take(pattern, at_start=False):
    nonlocal rest
    match = (re.match if at_start else re.search)(pattern, rest)
    if match:
      rest = rest[: match.start()] + ' ' + rest[match.end() :]
    return match

  def listed(group):
    return group.split(', ')

  if m := take(
    rf'^diverged on every seed \(non-finite loss in rounds '
    rf'({NUMBERS})\)$'
  ):
    rounds = listed(m.group(1))
    runs = [_run(column, variant, s) for s in range(len(rounds))]
    for run, r in zip(runs, rounds):
      assert run.diverged == int(r), f'{where}: {run.name} {run.diverged}'
  elif m := take(r'^diverged \(round (\d+)\)$'):
    runs = [_run(column, variant, 0)]
    assert runs[0].diverged == int(m.group(1)), where
  elif m := take(rf'^({NUMBER}) ± ({NUMBER}) % \((.*)\)$'):
    mean, std, inner = m.groups()
    rest = inner
    chance = take(r'^chance on every seed;', at_start=True)
    seeds = take(rf'^({NUMBERS});', at_start=True)
    best = take(rf'best ({NUMBERS}) %')
    assert best, f'{where}: no best accuracies'
    bests = listed(best.group(1))
    runs = [_run(column, variant, s) for s in range(len(bests))]
    assert len(runs) >= 2, f'{where}: a mean over one seed'
    for run in runs:
      assert run.diverged is None, f'{where}: {run.name} diverged'
    finals = [run.final for run in runs]
    _percent(float(np.mean(finals)), mean, f'{where}: mean')
    _percent(float(np.std(finals)), std, f'{where}: std')
    if seeds:
      assert len(listed(seeds.group(1))) == len(runs), where
      for run, t in zip(runs, listed(seeds.group(1))):
        _percent(run.final, t, f'{where}: {run.name}')
    elif chance:
      for run in runs:
        _percent(run.final, '10.00', f'{where}: {run.name} at chance')
    else:
      raise AssertionError(f'{where}: no per-seed accuracies')
    for run, t in zip(runs, bests):
      _percent(run.best, t, f'{where}: {run.name} best')
    if at := take(rf'at rounds ({NUMBERS})'):
      best_rounds = [str(r.best_round) for r in runs]
      assert listed(at.group(1)) == best_rounds, (
        f'{where}: best at rounds {best_rounds}'
      )
  elif m := take(rf'^({NUMBER}) % \((.*)\)$'):
    final, inner = m.groups()
    rest = inner
    runs = [_run(column, variant, 0)]
    assert runs[0].diverged is None, where
    _percent(runs[0].final, final, where)
    best = take(rf'best ({NUMBER}) %')
    assert best, f'{where}: no best accuracy'
    _percent(runs[0].best, best.group(1), f'{where}: best')
    if at := take(r'at round (\d+)'):
      assert int(at.group(1)) == runs[0].best_round, (
        f'{where}: best at round {runs[0].best_round}'
      )
  else:
    raise AssertionError(f'{where}: not a form this test recomputes')
  if cosine := take(rf'cosine ({NUMBER})'):
    for run in runs:  # the K models' mean pairwise cosine, last round
      _printed(run.last('pairwise_cosine'), cosine.group(1), where)
  if k_models := take(rf'the K models ({NUMBER}) %'):
    for run in runs:  # their mean test accuracy, last evaluated
      _percent(run.last('local_accuracy_mean'), k_models.group(1), where)
  assert not re.search(r'\d', rest), (
    f'{where}: numbers without a rule to recompute them: {rest!r}'
  )
  return runs


def check_results_table(text):
  """Recomputes every cell of the results table in README text `text`."""
  table = _table(text, '| method | Dir(0.1)')
  header, body = table[0], table[1:]
  assert header[0] == 'method'
  assert set(header[1:]) <= set(COLUMNS), header
  assert {row[0] for row in body} <= set(ROWS), [r[0] for r in body]
  for row in body:
    for title, cell in zip(header[1:], row[1:]):
      column, suffix = COLUMNS[title]
      check_cell(cell, column, ROWS[row[0]] + suffix)
  # The papers' column has a record behind every row.
  papers = header.index('Dir(0.1), momentum 0.9 (the papers)')
  assert all(row[papers] != '–' for row in body)


def check_alpha_table(text):
  """Recomputes every cell of FedMut's α ablation in README text `text`:
  a difference to α 0 is printed as the table prints it, to 2 decimals
  with its sign, from the two runs' unrounded final accuracies."""
  table = _table(text, '| α |')
  header, body = table[0], table[1:]
  assert set(header[1:]) == set(ALPHAS), header
  rows = {row[0]: row[1:] for row in body}
  assert list(rows) == ['final accuracy', 'difference to α 0, same seed']
  finals = {}
  for title, cell in zip(header[1:], rows.pop('final accuracy')):
    runs = check_cell(cell, 'dir0.1', ALPHAS[title])
    finals[title] = [r.final for r in runs if r.diverged is None]
  base = finals[header[1]]
  differences = rows.pop('difference to α 0, same seed')
  for title, cell in zip(header[1:], differences):
    if title == header[1] or not finals[title]:
      assert cell == '–', (title, cell)
      continue
    assert len(finals[title]) == len(base), title
    expected = ', '.join(
      f'{100 * (a - b):+.2f}' for a, b in zip(finals[title], base)
    )
    assert cell == expected, f'{title}: {cell!r} is not {expected!r}'


def test_results_table_cells_recompute_from_their_records():
  check_results_table(_page('| method | Dir(0.1)'))


def test_alpha_ablation_cells_recompute_from_their_records():
  check_alpha_table(_page('| α |'))


@pytest.mark.parametrize(
  'cell, says',
  [
    # Seeds 0 and 1 are 80.28 and 77.25 %.
    (
      '**80.28 ± 0.00 %** (80.28, 80.28; best 85.50, 85.50 %)',
      r'mean: 78\.76\d* is not 80\.28(?:\n|$)',
    ),
    ('80.28 % (best 85.50 %; 3 runs)', 'numbers without a rule'),
    (
      '80.29 % (best 85.50 %)',
      r': 80\.28\d* is not 80\.29(?:\n|$)',
    ),  # last digit
    ('80.28 % (best 85.5 %, at round 99)', r'best at round 97(?:\n|$)'),
    ('about 80 %', 'not a form this test recomputes'),
  ],
)
def test_a_cell_without_its_record_fails(cell, says):
  # FedAvg seed 0 at Dir(0.1): 80.28 %, best 85.50 % (round 97).
  assert check_cell('80.28 % (best 85.50 %)', 'dir0.1', 'fedavg')
  with pytest.raises(AssertionError, match=says):
    check_cell(cell, 'dir0.1', 'fedavg')


def test_the_main_jobs_figures_recompute_from_its_record():
  # The set-up section's "measured X % and Y %" for FedAvg and FedMR: the
  # main job run as written from a fresh clone (docs/results/main_job).
  found = re.search(
    rf'measured ({NUMBER}) % and ({NUMBER}) %', _readme().replace('\n', ' ')
  )
  assert found, 'the main job\'s "measured X % and Y %" is gone'
  for variant, text in zip(('fedavg', 'fedmr'), found.groups()):
    folder = os.path.join(REPO, 'docs', 'results', 'main_job', variant, 's0')
    rows = metrics_io.read(os.path.join(folder, 'metrics.jsonl'))
    with open(os.path.join(folder, 'config.json')) as f:
      assert json.load(f)['rounds'] == rows[-1]['round'] == 20
    _percent(compare.final_accuracy(rows, LAST), text, f'main job {variant}')


@functools.cache
def _transfer_table():
  """The lines of `stitch_figures`' table3 of the transfer records."""
  cwd = os.getcwd()
  os.chdir(REPO)  # runs.json names its records relative to the checkout
  try:
    runs = stitch_tables.parse_runs(TRANSFER_RUNS)
    paths = [p for cols in runs.values() for p in cols.values()]
    assert all(os.path.isdir(p) for p in paths), 'a record is missing'
    _, text = stitch_tables.accuracy_table(runs, LAST)
  finally:
    os.chdir(cwd)
  return [line for line in text.splitlines() if line.startswith('|')]


def check_transfer_table(text):
  """The transfer table in README text `text` is table3 of the records
  runs.json names (only finished, archived runs): every row, in order,
  to the printed digits."""
  expected = _transfer_table()
  lines = text.splitlines()
  assert expected[0] in lines, 'the transfer table is gone from the README'
  start = lines.index(expected[0])
  printed = _table(text, expected[0])
  assert len(printed) == len(expected) - 1, 'rows added or left out'
  for want, got in zip(expected, lines[start:]):
    assert got == want, f'{got!r} is not {want!r}'


def check_stitch_table(text):
  """The FedStitch Dir(1.0) table in README text `text`, row by row as its
  records give it (docs/results/stitch_readme/dir1.0): the run's
  results.json, and stitch.log for the networks each Local search
  evaluated, which results.json does not keep."""
  with open(os.path.join(STITCH_RUN, 'results.json')) as f:
    res = json.load(f)
  with open(os.path.join(STITCH_RUN, '..', 'stitch.log')) as f:
    log = f.read()
  local = res['local']
  searched = {
    int(c): int(n)
    for c, n in re.findall(
      r'^Local \d+/\d+ \(client (\d+) alone\): best [\d.]+ % of (\d+) '
      r'networks',
      log,
      re.M,
    )
  }
  own = res['pool_models']
  pool = sorted(own, key=lambda m: -own[m]['head'])
  lone = {f'{100 * b:.2f}' for b in local['best']}
  assert len(lone) == 1, 'the Local searches differ: not "each"'
  matches = [m for m in pool if own[m]['head'] in local['best']]
  voting = {'rl': 'RL-weighted voting', 'uniform': 'uniform voting'}
  assert res['partition'] == 'dirichlet'
  expected = [
    ['run', 'networks found', 'best network', 'accuracy'],
    [
      f'FedStitch, Dir({res["dirichlet_alpha"]:.1f}), '
      f'{voting[res["config"]["aggregation"]]}',
      f'{len(res["networks"])} in {res["rounds"]} rounds',
      res['best']['path'],
      f'{100 * res["best"]["head"]:.2f} %',
    ],
    [
      'Local: one client stitches alone (clients '
      + ', '.join(str(c) for c in local['clients'])
      + ')',
      ', '.join(str(searched[c]) for c in local['clients']),
      f'as accurate as {matches[0]} alone',
      f'{lone.pop()} % each, mean {100 * local["mean_best"]:.2f} %',
    ],
    [
      'each pool model alone',
      '–',
      ' / '.join(pool),
      ' / '.join(f'{100 * own[m]["head"]:.2f}' for m in pool) + ' %',
    ],
  ]
  assert _table(text, '| run | networks found |') == expected


# The pool of the FedStitch section trained on two CPUs: each
# `pretrain.log` (experiments.pretrain_zoo's output) and its column.
POOL_LOGS = {
  'Intel Sapphire Rapids (the record above)': 'pretrain.log',
  'AMD EPYC': os.path.join('pool_amd_epyc', 'pretrain.log'),
}


def check_pool_cpu_table(text):
  """The pool's test accuracies per CPU in text `text`, row by row as
  each machine's `pretrain_zoo` printed them."""
  columns = {}
  for title, log in POOL_LOGS.items():
    with open(os.path.join(os.path.dirname(STITCH_RUN), log)) as f:
      columns[title] = dict(
        re.findall(r'^(\w+): test accuracy ([\d.]+) %', f.read(), re.M)
      )
  models = list(columns[next(iter(POOL_LOGS))])
  expected = [['pool model', *POOL_LOGS]] + [
    [m, *(f'{columns[t][m]} %' for t in POOL_LOGS)] for m in models
  ]
  assert _table(text, '| pool model |') == expected


# Each table's header line (its start) and its check, for
# tests/test_results_tables_tight.py.
TABLES = {
  '| method | Dir(0.1)': check_results_table,
  '| α |': check_alpha_table,
  '| run | networks found |': check_stitch_table,
  '| method | IID |': check_transfer_table,
  '| pool model |': check_pool_cpu_table,
}


def test_the_pool_per_cpu_table_is_its_two_logs():
  check_pool_cpu_table(_page('| pool model |'))


def test_the_pools_difference_is_the_cpus_as_the_page_says():
  # The record's commit, on the AMD machine, trains cnn_mnist as the
  # AMD column says (the code did not change it; the CPU did).
  text = ' '.join(_readme().split())
  said = re.search(
    r'the record\'s own commit, (\w+), trains cnn_mnist on the AMD machine '
    rf'to ({NUMBER}) % too \(`(pretrain_\w+\.log)`\)',
    text,
  )
  assert said, 'the per-CPU sentence is gone'
  folder = os.path.join(os.path.dirname(STITCH_RUN), 'pool_amd_epyc')
  with open(os.path.join(folder, said.group(3))) as f:
    old = re.search(r'^cnn_mnist: test accuracy ([\d.]+) %', f.read(), re.M)
  with open(os.path.join(folder, 'pretrain.log')) as f:
    new = re.search(r'^cnn_mnist: test accuracy ([\d.]+) %', f.read(), re.M)
  assert old[1] == new[1] == said.group(2)
  assert said.group(1) in said.group(3)


def test_the_transfer_table_is_table3_of_its_records():
  check_transfer_table(_page('| method | IID |'))


def test_the_fedstitch_table_recomputes_from_its_record():
  check_stitch_table(_page('| run | networks found |'))


def test_the_resnet_cells_still_rising_are_as_the_readme_counts():
  # "8 of their 12 cells were still rising": the transfer table's
  # training cells of the rows that train no CNN (resnet20, resnet18_w16).
  rows = [
    [c.strip() for c in line.strip('|').split('|')]
    for line in _transfer_table()[2:]
  ]
  cells = [
    cell
    for row in rows
    if 'cnn_' not in row[0]
    for cell in row[1::2]
    if 'rounds,' in cell
  ]
  rising = [cell for cell in cells if cell.endswith('rising)')]
  assert all(' 100 rounds,' in cell for cell in cells), cells
  text = ' '.join(_readme().split())
  said = f'{len(rising)} of their {len(cells)} cells were still rising'
  assert said in text, said


def _elapsed(log):
  """`/usr/bin/time -v`'s wall clock in `log`, in seconds."""
  clock = re.search(
    r'Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (.*)', log
  )
  seconds = 0.0
  for part in clock.group(1).split(':'):
    seconds = 60 * seconds + float(part)
  return seconds


def test_the_fedstitch_sections_figures_recompute_from_its_record():
  # The commands' times and peak (/usr/bin/time -v in pretrain.log and
  # stitch.log), the search's selection time and the energy figures
  # (results.json).
  text = ' '.join(_readme().split())
  folder = os.path.dirname(STITCH_RUN)
  with open(os.path.join(folder, 'pretrain.log')) as f:
    pretrain = f.read()
  with open(os.path.join(folder, 'stitch.log')) as f:
    stitch = f.read()
  with open(os.path.join(STITCH_RUN, 'results.json')) as f:
    res = json.load(f)
  times = re.search(
    r'took (\d+) min (\d+) s \(`pretrain_zoo`\) and (\d+) min (\d+) s '
    rf'\(`stitch`, peak host memory ({NUMBER}) GiB\)',
    text,
  )
  assert times, "the FedStitch commands' times are gone"
  for log, (minutes, seconds) in zip(
    (pretrain, stitch), (times.groups()[:2], times.groups()[2:4])
  ):
    printed = 60 * int(minutes) + int(seconds)
    assert printed == round(_elapsed(log)), (printed, _elapsed(log))
  kib = int(
    re.search(r'Maximum resident set size \(kbytes\): (\d+)', stitch)[1]
  )
  _printed(kib / 1024**2, times.group(5), 'stitch peak')
  energy = res['energy']
  spent = re.search(
    r'used ([\d,]+) J against ([\d,]+) J at the highest frequency '
    rf'\(a ({NUMBER}) % saving; rounds ({NUMBER}) % longer; no missed',
    text,
  )
  assert spent, 'the FedStitch energy sentence is gone'
  assert spent.group(1) == f'{energy["coordinated_energy_j"]:,.0f}'
  assert spent.group(2) == f'{energy["default_energy_j"]:,.0f}'
  _percent(energy['energy_saving'], spent.group(3), 'energy saving')
  _percent(energy['time_change'], spent.group(4), 'time change')
  assert energy['missed'] == 0
  selection = re.search(r'([\d,]+) s of it the clients\' block selection', text)
  assert selection, 'the selection time is gone'
  assert selection.group(1) == f'{res["selection_seconds_total"]:,.0f}'


def test_the_transfer_records_commits_are_as_the_readme_says():
  # The training runs' commit (config.json's provenance), the probes'
  # (probe.json's source: "N at <commit>") and the FedStitch runs'
  # provenance.json, as the paragraph above the transfer table gives them.
  root = os.path.join(REPO, 'docs', 'results', 'transfer100')
  trained, probed = set(), {}
  for setting in ('iid', 'dir0.1'):
    for method in sorted(os.listdir(os.path.join(root, setting))):
      folder = os.path.join(root, setting, method)
      with open(os.path.join(folder, 'config.json')) as f:
        for record in json.load(f)['provenance']:
          assert not record['source']['modified'], folder
          trained.add(record['source']['commit'][:7])
      with open(os.path.join(folder, 'probe.json')) as f:
        source = json.load(f)['source']
      assert not source['modified'], folder
      probed[source['commit'][:7]] = probed.get(source['commit'][:7], 0) + 1
  text = ' '.join(_readme().split())
  said = re.search(
    r'The baselines trained with code at (\w+) .*?; their `probe\.json`s '
    r'were made later, by code at: (.*?), as each file',
    text,
  )
  assert said, "the transfer records' commits are not given"
  assert trained == {said.group(1)}, trained
  counts = re.findall(r'(\d+) at ([0-9a-f]{7})', said.group(2))
  assert {c: int(n) for n, c in counts} == probed, probed
  for setting in ('iid', 'dir0.1'):
    folder = os.path.join(root, 'stitch', f'transfer_{setting}')
    with open(os.path.join(folder, 'provenance.json')) as f:
      record = json.load(f)
    assert record['source'] is None  # not recorded, and not invented
    with open(os.path.join(folder, 'results.json')) as f:
      results = json.load(f)
    command = record['known']['documented_command']
    assert f'--eval={results["eval"]}' in command
    assert f'--knn_at={results["knn_at"]}' in command
    assert f'--partition={results["partition"]}' in command


def test_docs_results_readme_describes_every_folder():
  """docs/results/README.md names each folder of records (and those under
  scale/ and transfer/), so none is there without its description."""
  root = os.path.join(REPO, 'docs', 'results')
  with open(os.path.join(root, 'README.md')) as f:
    text = f.read()
  wanted = []
  for name in sorted(os.listdir(root)):
    if os.path.isdir(os.path.join(root, name)):
      wanted.append(f'`{name}/')
      if name in ('scale', 'transfer'):
        for sub in sorted(os.listdir(os.path.join(root, name))):
          if os.path.isdir(os.path.join(root, name, sub)):
            pattern = '<iid or dir0.1>' if sub in ('iid', 'dir0.1') else sub
            wanted.append(f'`{name}/{pattern}/')
  missing = [w for w in wanted if w not in text]
  assert not missing, missing
