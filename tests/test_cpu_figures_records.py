"""The CPU benchmark tables of the "Scale and benchmarks" page (the
models' and datasets' costs, the `--matrix` settings, the PyTorch
comparison, each algorithm's round against FedAvg's), figure by figure,
from the records `scripts/cpu_figures.sh` wrote in one session
(docs/results/scale/cpu/<date>/, the date the page names).

Every printed figure must equal its record's value formatted to the
printed digits; the zoo's two tables are the rows `experiments.zoo_report`
printed, cell for cell.
"""

import os
import re

from tests import docs_text
from tests import test_build_md_records as build_md_records
from tests import test_readme_records as readme_records

REPO = os.path.dirname(os.path.dirname(__file__))
DATE = '2026-11-27'
RECORDS = os.path.join(REPO, 'docs', 'results', 'scale', 'cpu', DATE)

MODELS = '| model | input | parameters | compile (s) | epoch (s) |'
DATASETS = '| dataset | examples (train) | arrays (MiB) | peak host (MiB) |'
MATRIX = '| setting | devices | compile | round | limit | round/limit |'
PYTORCH = '| devices | fedjax_mr round | PyTorch round | round/pytorch |'
ALGORITHMS = '| algorithm | round/fedavg | its extra work per local step |'

_printed = build_md_records._printed
_figures = build_md_records._figures
# The benchmark's line for one setting: `[equal, 1 device(s), chunk 1] ...`.
_SETTING = re.compile(r'^\[(\w+), (\d+) device\(s\), chunk \d+\] (.*)$', re.M)


def _record(name):
  path = os.path.join(RECORDS, name)
  assert os.path.exists(path), f'no record {os.path.relpath(path, REPO)}'
  with open(path) as f:
    text = f.read()
  assert '# exit: 0' in text, f'{name}: the program failed'
  return text


def _page(header):
  text = docs_text.read(docs_text.holding(header))
  assert f'docs/results/scale/cpu/{DATE}' in text, 'the records are not named'
  return text


def _field(pattern, line, what):
  found = re.search(pattern, line)
  assert found, f'{what}: no {pattern!r}'
  return float(found.group(1))


def _settings(record):
  """{(sizes, devices): the rest of the benchmark's line} of a record."""
  return {(s, int(d)): rest for s, d, rest in _SETTING.findall(record)}


def _zoo_check(header):
  def check(text):
    printed = readme_records._table(text, header)
    recorded = readme_records._table(_record('zoo.txt'), header)
    assert printed == recorded, f'{header}: not the record zoo.txt'

  return check


check_models_table = _zoo_check(MODELS)
check_datasets_table = _zoo_check(DATASETS)

_SIZES = {'equal sizes': 'equal', 'Dirichlet(0.1)': 'dirichlet'}


def check_matrix_table(text):
  """`--matrix --nopytorch` (matrix.txt): compile, round, limit and their
  ratio, samples/s and the server's share, per setting and devices."""
  table = readme_records._table(text, MATRIX)
  settings = _settings(_record('matrix.txt'))
  assert len(table) - 1 == len(settings), 'not every setting of the record'
  for sizes, devices, *cells in table[1:]:
    line = settings.get((_SIZES.get(sizes), int(devices)))
    assert line, f'matrix.txt has no setting {sizes}, {devices} devices'
    what = f'matrix {sizes}, {devices}'
    compile_s, round_s, limit, ratio, samples, server = cells
    _figures(compile_s, [_field(r'compile ([\d.]+)s', line, what)], what)
    _figures(round_s, [_field(r'\| round ([\d.]+)s', line, what)], what)
    _figures(limit, [_field(r'\| limit ([\d.]+)s', line, what)], what)
    _figures(ratio, [_field(r'round/limit ([\d.]+)', line, what)], what)
    _figures(samples, [_field(r'\| (\d+) samples/s', line, what)], what)
    _figures(server, [_field(r'server ([\d.]+)% of round', line, what)], what)


def check_pytorch_table(text):
  """The default setting with the PyTorch loop beside it, on 1 and on 2
  devices (pytorch_1device.txt, pytorch_2devices.txt): fedjax_mr's and
  PyTorch's rounds, their ratio, GFLOP/s, the matmul peaks and the share
  of the float32 peak."""
  table = readme_records._table(text, PYTORCH)
  assert [row[0] for row in table[1:]] == ['1', '2'], table
  for devices, ours, theirs, ratio, gflops, peak, share in table[1:]:
    name = f'pytorch_{devices}device{"s" if devices != "1" else ""}.txt'
    record = _record(name)
    line = _settings(record)[('equal', int(devices))]
    _figures(ours, [_field(r'\| round ([\d.]+)s', line, name)], name)
    _figures(theirs, [_field(r'pytorch ([\d.]+)s', line, name)], name)
    _figures(ratio, [_field(r'round/pytorch ([\d.]+)', line, name)], name)
    _figures(gflops, [_field(r'\| ([\d.]+) GFLOP/s', line, name)], name)
    peaks = re.search(
      r'matmul peak: float32 ([\d.]+) GFLOP/s, bfloat16 ([\d.]+) GFLOP/s'
      r'.*?([\d.]+)% of the float32 peak',
      record,
    )
    assert peaks, f'{name}: no matmul peak line'
    _figures(
      peak.replace('bfloat16', ''), [float(peaks[1]), float(peaks[2])], name
    )
    _figures(share, [float(peaks[3])], name)


def check_algorithms_table(text):
  """Each algorithm's `round/fedavg ratio` (algorithm_<name>.txt); a row
  of two names (`fedasam / fedsam`) gives both, in order."""
  table = readme_records._table(text, ALGORITHMS)
  for names, ratios, _ in table[1:]:
    values = []
    for name in names.split(' / '):
      record = _record(f'algorithm_{name}.txt')
      values.append(
        _field_multiline(r'^round/fedavg ratio: ([\d.]+)$', record, name)
      )
    _figures(ratios, values, names)


def _field_multiline(pattern, text, what):
  found = re.search(pattern, text, re.M)
  assert found, f'{what}: no {pattern!r}'
  return float(found.group(1))


# Each table's header line (its start) and its check, for
# tests/test_results_tables_tight.py.
TABLES = {
  MODELS: check_models_table,
  DATASETS: check_datasets_table,
  MATRIX: check_matrix_table,
  PYTORCH: check_pytorch_table,
  ALGORITHMS: check_algorithms_table,
}


def test_zoo_tables_are_the_record():
  check_models_table(_page(MODELS))
  check_datasets_table(_page(DATASETS))


def test_matrix_table_is_its_record():
  check_matrix_table(_page(MATRIX))


def test_pytorch_table_is_its_records():
  check_pytorch_table(_page(PYTORCH))


def test_each_algorithms_round_against_fedavg_is_its_record():
  check_algorithms_table(_page(ALGORITHMS))


def test_the_pytorch_paragraphs_memory_is_its_records():
  text = ' '.join(_page(PYTORCH).split())
  found = re.search(
    r"the benchmark's peak host memory is ([\d,]+) MiB on one device and "
    r'([\d,]+) MiB on two',
    text,
  )
  assert found, 'the PyTorch memory sentence is gone'
  for cell, name in zip(
    found.groups(), ('pytorch_1device.txt', 'pytorch_2devices.txt')
  ):
    mib = _field_multiline(
      r'^peak host memory: (\d+) MiB$', _record(name), name
    )
    _printed(mib, cell, name)


def test_the_matrix_speed_ups_are_its_record():
  text = ' '.join(_page(MATRIX).split())
  found = re.search(
    r'2 devices are ([\d.]+)× \(equal\) and ([\d.]+)× \(Dirichlet\) faster '
    r'than 1',
    text,
  )
  assert found, 'the matrix speed-up sentence is gone'
  record = _record('matrix.txt')
  for cell, sizes in zip(found.groups(), ('equal', 'dirichlet')):
    pattern = rf'^{sizes}: 2 devices are ([\d.]+)x faster than 1'
    _printed(_field_multiline(pattern, record, sizes), cell, sizes)
