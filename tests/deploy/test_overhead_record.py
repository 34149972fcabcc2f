"""The deploy page's round-time tables are their records' (docs/results/
deploy/overhead.json, Flower's own launcher, and overhead_warm.json, the
warm SuperExec, on the AMD EPYC; overhead_warm_intel.json, the warm one on
the Intel Xeon; made by docs/results/deploy/overhead.py), and name the
machine and the load they were measured at."""

import json
import os
import statistics

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
RECORDS = os.path.join(REPO, 'docs', 'results', 'deploy')
OVERHEAD = '| nodes | simulated (s/round) | deployed (s/round) |'
OVERHEAD_WARM = '| nodes | simulated (s/round) | deployed warm (s/round) |'
OVERHEAD_WARM_INTEL = (
  '| nodes (Intel Xeon) | simulated (s/round) | deployed warm (s/round) |'
)


def check_overhead_table(
  text, name='overhead.json', launcher='flower', date='2026-11-27'
):
  """Each row of the round-time table of record `name`, as its figures
  print it, and the prose beside it: the machine, the commit, the load."""
  with open(os.path.join(RECORDS, name)) as f:
    record = json.load(f)
  assert record.get('launcher', 'flower') == launcher
  # The default setting, not a quick check of the script.
  setting = record['setting']
  assert setting['dataset'] == 'fashion_mnist'
  assert setting['model'] == 'cnn_mnist'
  assert setting['clients_per_round'] == 10
  assert [d['nodes'] for d in record['deployed']] == [2, 5]
  said = (
    f'Measured on an {record["machine"]} ({record["cpus"]} cores) on '
    f'{date} at commit {record["commit"]}'
  )
  assert said in ' '.join(text.split()), said
  before, after = (
    record['load_average_before'][0],
    record['load_average_after'][0],
  )
  load = f'load average: {before:.1f} before, {after:.1f} after'
  assert load in ' '.join(text.split()), load
  sim = record['simulated']
  assert sim['median_s'] == statistics.median(sim['round_times_s'][1:])
  for d in record['deployed']:
    assert d['median_s'] == statistics.median(d['round_times_s'][1:])
    over = d['median_s'] - sim['median_s']
    assert d['overhead_ms'] == pytest.approx(1000 * over)
    assert d['overhead_pct'] == pytest.approx(100 * over / sim['median_s'])
    line = (
      f'| {d["nodes"]} | {sim["median_s"]:.2f} | {d["median_s"]:.2f} | '
      f'{d["overhead_ms"]:,.0f} | {d["overhead_pct"]:.1f} |'
    )
    assert line in text, line


def check_overhead_warm_table(text):
  check_overhead_table(text, 'overhead_warm.json', 'warm')


def check_overhead_warm_intel_table(text):
  check_overhead_table(text, 'overhead_warm_intel.json', 'warm', '2026-11-28')


# Each table's header line (its start) and its check, for
# tests/test_results_tables_tight.py.
TABLES = {
  OVERHEAD: check_overhead_table,
  OVERHEAD_WARM: check_overhead_warm_table,
  OVERHEAD_WARM_INTEL: check_overhead_warm_intel_table,
}


@pytest.mark.parametrize('header', sorted(TABLES))
def test_the_overhead_tables_are_recomputed_from_their_records(header):
  with open(os.path.join(REPO, 'docs', 'howto', 'deploy.md')) as f:
    TABLES[header](f.read())
