"""Files written whole or not at all, and never through a link."""

import errno
import os

import pytest

from fedjax_mr.core import files


def test_write_atomic_replaces_a_link_and_leaves_its_target(tmp_path):
  target = tmp_path / 'target.json'
  target.write_text('precious')
  link = tmp_path / 'config.json'
  os.symlink(target, link)
  files.write_atomic(str(link), lambda f: f.write('new'))
  assert target.read_text() == 'precious'
  assert not os.path.islink(link) and link.read_text() == 'new'


def test_write_atomic_never_writes_through_a_planted_temporary_link(
  tmp_path,
):
  target = tmp_path / 'target'
  target.write_text('precious')
  path = tmp_path / 'metrics.json'
  os.symlink(target, f'{path}.tmp.{os.getpid()}')
  files.write_atomic(str(path), lambda f: f.write('row'))
  assert target.read_text() == 'precious' and path.read_text() == 'row'
  assert sorted(os.listdir(tmp_path)) == ['metrics.json', 'target']


def test_append_line_refuses_a_link(tmp_path):
  target = tmp_path / 'target'
  target.write_text('precious\n')
  link = tmp_path / 'metrics.jsonl'
  os.symlink(target, link)
  with pytest.raises(OSError) as e:
    files.append_line(str(link), '{"round": 1}')
  assert e.value.errno == errno.ELOOP and e.value.filename == str(link)
  assert 'symbolic link' in e.value.strerror
  assert target.read_text() == 'precious\n'
  files.append_line(str(tmp_path / 'own.jsonl'), 'a')
  files.append_line(str(tmp_path / 'own.jsonl'), 'b')
  assert (tmp_path / 'own.jsonl').read_text() == 'a\nb\n'
