"""One writer per output folder: the lock and the programs that take it."""

import os
import signal
import subprocess
import sys
import time

import pytest

from fedjax_mr.core import errors
from fedjax_mr.core import workdir
from fedjax_mr.runtime import metrics_io
from tests import helpers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
_HOLD = (
  'import sys, time; from fedjax_mr.core import workdir; '
  'workdir.acquire(sys.argv[1]); print("held", flush=True); time.sleep(600)'
)


def _holder(folder):
  proc = subprocess.Popen(
    [sys.executable, '-c', _HOLD, str(folder)],
    cwd=REPO,
    stdout=subprocess.PIPE,
    text=True,
  )
  assert proc.stdout.readline().strip() == 'held'
  return proc


def test_a_second_process_is_refused_until_the_holder_is_killed(tmp_path):
  folder = tmp_path / 'w'
  proc = _holder(folder)
  try:
    with pytest.raises(errors.ConfigError) as e:
      workdir.check_free(str(folder))
    assert str(e.value).startswith(f'`workdir={folder}` is in use')
    assert f'pid {proc.pid}' in str(e.value)
    with pytest.raises(errors.ConfigError, match='in use'):
      workdir.acquire(str(folder), 'out')
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  # kill -9 leaves the file but no lock.
  assert os.path.exists(folder / workdir.LOCK_FILE)
  workdir.check_free(str(folder))
  workdir.acquire(str(folder)).release()


def test_one_process_cannot_take_its_own_lock_twice(tmp_path):
  lock = workdir.acquire(str(tmp_path))
  with pytest.raises(errors.ConfigError, match='in use'):
    workdir.acquire(str(tmp_path))
  with pytest.raises(errors.ConfigError, match='in use'):
    workdir.check_free(str(tmp_path))
  lock.release()
  with workdir.acquire(str(tmp_path)):
    pass
  workdir.check_free(str(tmp_path))


def test_check_free_creates_nothing(tmp_path):
  workdir.check_free(str(tmp_path / 'new'))
  assert not os.path.exists(tmp_path / 'new')


def test_a_folder_that_cannot_exist_is_one_line(tmp_path):
  (tmp_path / 'file').write_text('x')
  with pytest.raises(errors.ConfigError) as e:
    workdir.acquire(str(tmp_path / 'file' / 'below'), 'out')
  assert str(e.value).startswith(f'`out={tmp_path}/file/below`: cannot')
  assert '\n' not in str(e.value)


def test_a_name_that_is_not_utf8_is_refused_before_anything_is_made(
  tmp_path,
):
  # b'run\xff' as Python gives it from a command line (surrogateescape).
  folder = os.fsdecode(os.fsencode(str(tmp_path)) + b'/run\xff')
  for check in (workdir.check_usable, workdir.check_free, workdir.acquire):
    with pytest.raises(errors.ConfigError) as e:
      check(folder, 'out')
    assert str(e.value) == (
      f'`out={tmp_path}/run\\xff`: the name is not valid UTF-8, and '
      'checkpoints need UTF-8 paths; choose a UTF-8 name'
    )
  assert os.listdir(tmp_path) == []
  workdir.check_free(str(tmp_path / 'rün'))  # UTF-8 beyond ASCII is fine


def test_two_runs_on_one_workdir(small_fmnist_dir, tmp_path):
  """The second `experiments.run` is refused in one line (exit 2); the
  first one's metrics hold every round once."""
  args = [
    f'--data_dir={small_fmnist_dir}',
    '--num_clients=10',
    '--clients_per_round=4',
    '--local_epochs=1',
    '--rounds=4',
    '--eval_every=1',
    f'--workdir={tmp_path}',
  ]
  first = subprocess.Popen(
    [sys.executable, '-m', 'experiments.run', *args],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  deadline = time.time() + 300
  while True:  # until the first run holds the lock
    try:
      workdir.check_free(str(tmp_path))
    except errors.ConfigError:
      break
    assert first.poll() is None and time.time() < deadline
    time.sleep(0.2)
  # Held stopped while the second one starts: a fast first run could
  # otherwise finish before the second one asks for the lock.
  first.send_signal(signal.SIGSTOP)
  try:
    second = helpers.run_module('experiments.run', *args)
  finally:
    first.send_signal(signal.SIGCONT)
  out, err = first.communicate(timeout=600)
  assert first.returncode == 0, err
  assert second.returncode == 2
  lines = second.stderr.strip().splitlines()
  assert len(lines) == 1 and 'in use by another running process' in lines[0]
  assert f'--workdir={tmp_path}' in lines[0]
  rows = metrics_io.read(str(tmp_path / 'metrics.jsonl'))
  assert [r['round'] for r in rows] == [1, 2, 3, 4]


def test_compare_refuses_before_running_anything(small_fmnist_dir, tmp_path):
  from fedjax_mr.analysis import compare

  base = helpers.small_config(small_fmnist_dir)
  runs = compare.configs(
    base.flat(), [('fedavg', {'algorithm': 'fedavg'})], [0, 1], str(tmp_path)
  )
  trained = []
  with workdir.acquire(runs[1][2].run.workdir):
    with pytest.raises(errors.ConfigError) as e:
      compare.run_matrix(runs, trained.append, log=lambda s: None)
  assert trained == []  # not even seed 0 ran
  assert str(e.value).startswith(f'`workdir={tmp_path}/fedavg/s1` is in use')


# -- the folder's files are its own (issue 55) -------------------------------


def test_a_lock_that_is_a_link_is_refused_and_never_written(tmp_path):
  outside = tmp_path / 'outside.txt'
  outside.write_text('precious')
  folder = tmp_path / 'w'
  folder.mkdir()
  os.symlink(outside, folder / workdir.LOCK_FILE)
  for check in (workdir.check_free, workdir.acquire):
    with pytest.raises(errors.ConfigError) as e:
      check(str(folder), 'out')
    assert str(e.value) == (
      f'`out={folder}`: .lock is a symbolic link (to {outside}); a run '
      'writes only its own files: remove the link, or pass another `out`'
    )
  assert outside.read_text() == 'precious'


def test_a_lock_that_is_a_folder_is_refused_by_check_free(tmp_path):
  (tmp_path / workdir.LOCK_FILE).mkdir()
  with pytest.raises(errors.ConfigError) as e:
    workdir.check_free(str(tmp_path))
  assert str(e.value) == (
    f'`workdir={tmp_path}`: .lock is a folder, where the run keeps a file; '
    'move it away, or pass another `workdir`'
  )


def test_a_place_that_takes_no_files_is_refused_by_check_usable(tmp_path):
  # As root, os.access says /proc is writable; a file cannot be made there.
  with pytest.raises(errors.ConfigError) as e:
    workdir.check_usable('/proc/fedjax_mr_run')
  assert str(e.value).startswith(
    '`workdir=/proc/fedjax_mr_run`: /proc does not take new files ('
  )
  workdir.check_usable(str(tmp_path))
  assert os.listdir(tmp_path) == []  # the probe is gone


def test_check_entries(tmp_path):
  (tmp_path / 'a.json').write_text('{}')
  (tmp_path / 'ckpt').mkdir()
  workdir.check_entries(str(tmp_path), ['a.json', 'gone'], ['ckpt', 'gone2'])
  with pytest.raises(errors.ConfigError, match=r'a\.json is a file, where'):
    workdir.check_entries(str(tmp_path), folders=['a.json'])
  with pytest.raises(errors.ConfigError, match='ckpt is a folder, where'):
    workdir.check_entries(str(tmp_path), files=['ckpt'])
  os.mkfifo(tmp_path / 'f')
  with pytest.raises(errors.ConfigError, match='f is a FIFO, where'):
    workdir.check_entries(str(tmp_path), files=['f'])


def test_a_folder_named_with_a_newline_is_named_on_one_line(tmp_path):
  folder = tmp_path / 'a\nb'
  (folder / workdir.LOCK_FILE).mkdir(parents=True)
  with pytest.raises(errors.ConfigError) as e:
    workdir.check_free(str(folder))
  assert str(e.value).startswith(f'`workdir={tmp_path}/a\\nb`: .lock is')
