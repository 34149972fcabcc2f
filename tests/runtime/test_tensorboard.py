"""The TensorBoard event writer and the reader the tests check it with."""

import os

import pytest

from fedjax_mr.runtime import tensorboard


def _rows(rounds, offset=0.0):
  return [
    {
      'round': r,
      'train_loss': 1.0 / r + offset,
      'test_accuracy': None if r % 2 else 0.5 + r / 100,
      'client_ids': [1, 2],
      'algorithm': 'fedavg',
      'diverged': False,
      'num_examples': r * 10,
    }
    for r in rounds
  ]


def _write(folder, rows, purge_step=None):
  writer = tensorboard.EventWriter(folder, purge_step=purge_step)
  for row in rows:
    writer.scalars(row['round'], row)
  writer.close()
  return writer.path


def test_numbers_become_scalars_at_their_round(tmp_path):
  _write(str(tmp_path), _rows([1, 2, 3]))
  shown = tensorboard.read_scalars(str(tmp_path))
  # Lists, strings, booleans, None and the round itself are left out.
  assert sorted(shown) == ['num_examples', 'test_accuracy', 'train_loss']
  assert shown['test_accuracy'] == [(2, pytest.approx(0.52))]
  assert shown['num_examples'] == [(1, 10.0), (2, 20.0), (3, 30.0)]
  assert [s for s, _ in shown['train_loss']] == [1, 2, 3]
  assert shown['train_loss'][1][1] == pytest.approx(0.5)


def test_a_resumed_file_drops_the_rounds_it_redoes(tmp_path):
  folder = str(tmp_path)
  first = _write(folder, _rows([1, 2, 3, 4]))
  second = _write(folder, _rows([3, 4, 5], offset=10.0), purge_step=3)
  assert sorted(os.listdir(folder)) == sorted(
    os.path.basename(p) for p in (first, second)
  )
  loss = tensorboard.read_scalars(folder)['train_loss']
  assert [s for s, _ in loss] == [1, 2, 3, 4, 5]
  assert [v > 10 for _, v in loss] == [False, False, True, True, True]
  # Without the session start, TensorBoard keeps both copies of a round.
  _write(str(tmp_path / 'plain'), _rows([1, 2]))
  _write(str(tmp_path / 'plain'), _rows([2, 3]))
  loss = tensorboard.read_scalars(str(tmp_path / 'plain'))['train_loss']
  assert [s for s, _ in loss] == [1, 2, 2, 3]


def test_a_cut_record_is_skipped_and_a_damaged_one_refused(tmp_path):
  path = _write(str(tmp_path / 'cut'), _rows([1, 2, 3]))
  with open(path, 'rb') as f:
    data = f.read()
  with open(path, 'wb') as f:
    f.write(data[:-5])  # a crash in the middle of round 3's record
  shown = tensorboard.read_scalars(str(tmp_path / 'cut'))
  assert [s for s, _ in shown['train_loss']] == [1, 2]
  damaged = bytearray(data)
  damaged[-10] ^= 0xFF
  with open(path, 'wb') as f:
    f.write(bytes(damaged))
  with pytest.raises(ValueError, match='is damaged'):
    tensorboard.read_scalars(str(tmp_path / 'cut'))


def test_a_write_that_fails_names_the_file(tmp_path):
  blocker = tmp_path / 'file'
  blocker.write_text('')
  with pytest.raises(OSError) as e:
    tensorboard.EventWriter(str(blocker / 'tensorboard'))
  assert str(blocker) in str(e.value)
