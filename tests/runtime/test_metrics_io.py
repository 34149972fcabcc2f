import json
import os

import pytest

from fedjax_mr.runtime import metrics_io


def test_write_json_replaces_the_whole_file(tmp_path):
  path = str(tmp_path / 'config.json')
  metrics_io.write_json(path, {'a': 1, 'long': 'x' * 1000})
  metrics_io.write_json(path, {'a': 2})
  with open(path) as f:
    assert json.load(f) == {'a': 2}
  assert os.listdir(tmp_path) == ['config.json']


def test_write_json_keeps_the_old_file_when_writing_fails(tmp_path):
  path = str(tmp_path / 'config.json')
  metrics_io.write_json(path, {'a': 1})
  with pytest.raises(TypeError):
    metrics_io.write_json(path, {'a': object()})  # not serialisable
  with open(path) as f:
    assert json.load(f) == {'a': 1}
  assert os.listdir(tmp_path) == ['config.json']  # no temporary left


def test_truncate_keeps_rows_up_to_a_round(tmp_path):
  path = str(tmp_path / 'metrics.jsonl')
  for r in (1, 2, 3):
    metrics_io.append(path, {'round': r, 'x': r * 10})
  assert metrics_io.truncate(path, 2) == (
    [{'round': 1, 'x': 10}, {'round': 2, 'x': 20}],
    '',
  )
  assert [r['round'] for r in metrics_io.read(path)] == [1, 2]


@pytest.mark.parametrize(
  'tail, dropped',
  [
    (b'{"round": 4, "x"', 1),  # a crash mid-write
    (b'{"x": 1}\n', 1),  # a row without a round
    (b'{"round": "4"}\n[1, 2]\nnot json\n', 3),
    (bytes(range(256)) + b'\n\x00\xff', 3),  # binary: 3 lines
  ],
)
def test_a_damaged_tail_is_dropped_and_named(tmp_path, tail, dropped):
  path = str(tmp_path / 'metrics.jsonl')
  for r in (1, 2, 3):
    metrics_io.append(path, {'round': r})
  with open(path, 'ab') as f:
    f.write(tail)
  rows, note = metrics_io.truncate(path, 2)
  assert rows == [{'round': 1}, {'round': 2}]
  assert note.startswith(f'dropped {dropped} unreadable line')
  # The file is whole again.
  assert metrics_io.read_checked(path) == ([{'round': 1}, {'round': 2}], 0)


def test_truncate_keeps_each_round_once_and_creates_nothing(tmp_path):
  path = str(tmp_path / 'metrics.jsonl')
  for r in (1, 2, 1, 2):
    metrics_io.append(path, {'round': r, 'n': 0})
  rows, note = metrics_io.truncate(path, 5)
  assert [r['round'] for r in rows] == [1, 2]
  assert note == 'dropped 2 repeated rows of a round'
  missing = str(tmp_path / 'none.jsonl')
  assert metrics_io.truncate(missing, 3) == ([], '')
  assert not os.path.exists(missing)
