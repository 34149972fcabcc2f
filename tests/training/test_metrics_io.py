import json
import os

import pytest

from fedjax_mr.training import metrics_io


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
  assert metrics_io.truncate(path, 2) == [
    {'round': 1, 'x': 10},
    {'round': 2, 'x': 20},
  ]
  assert [r['round'] for r in metrics_io.read(path)] == [1, 2]
