"""The deploy page's payload table is its record's (docs/results/deploy/)."""

import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
NAMES = {
  'fedavg': 'FedAvg',
  'fedmr': 'FedMR',
  'fedmut': 'FedMut',
  'scaffold': 'SCAFFOLD',
}


PAYLOAD = '| algorithm | requests (B) | replies (B) | payload (B) |'


def check_payload_table(text):
  """Each row of the payload table, as its record's figures print it."""
  with open(os.path.join(REPO, 'docs/results/deploy/payload.json')) as f:
    rows = json.load(f)
  assert [r['algorithm'] for r in rows] == list(NAMES)
  for r in rows:
    total = r['request_bytes'] + r['reply_bytes']
    assert r['payload_bytes'] == total
    ratio = total / r['bytes_communicated']
    line = (
      f'| {NAMES[r["algorithm"]]} | {r["request_bytes"]:,} | '
      f'{r["reply_bytes"]:,} | {total:,} | '
      f'{r["bytes_communicated"]:,.0f} | {ratio:.3f} |'
    )
    assert line in text, line


# The table's header line (its start) and its check, for
# tests/test_results_tables_tight.py.
TABLES = {PAYLOAD: check_payload_table}


def test_the_payload_table_is_recomputed_from_its_record():
  with open(os.path.join(REPO, 'docs', 'howto', 'deploy.md')) as f:
    check_payload_table(f.read())
