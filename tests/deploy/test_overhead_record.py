"""The deploy page's round-time table is its record's
(docs/results/deploy/overhead.json, made by docs/results/deploy/
overhead.py); until the record exists, the page holds the placeholder
row that names the command, and no numbers."""

import json
import os
import statistics

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
RECORD = os.path.join(REPO, 'docs', 'results', 'deploy', 'overhead.json')
PLACEHOLDER = (
  '| not measured yet: run `python docs/results/deploy/overhead.py > '
  'docs/results/deploy/overhead.json` on a quiet machine | | | | |'
)


def _page():
  with open(os.path.join(REPO, 'docs', 'howto', 'deploy.md')) as f:
    return f.read()


def test_the_overhead_table_is_recomputed_from_its_record():
  text = _page()
  if not os.path.exists(RECORD):
    assert PLACEHOLDER in text
    return
  with open(RECORD) as f:
    record = json.load(f)
  assert PLACEHOLDER not in text
  # The default setting, not a quick check of the script.
  setting = record['setting']
  assert setting['dataset'] == 'fashion_mnist'
  assert setting['model'] == 'cnn_mnist'
  assert setting['clients_per_round'] == 10
  assert [d['nodes'] for d in record['deployed']] == [2, 5]
  assert record['machine'] in text
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
