"""Faults a run survives: damaged checkpoints and metrics, a --rounds below
what is done, a full disk, an unwritable workdir, a resume on another
client mapping (issue 25, items 6, 7, 9, 10 and 14)."""

import asyncio
import errno
import json
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint._src.path import atomicity

from fedjax_mr.core import errors
from fedjax_mr.core import files
from fedjax_mr.pipeline import experiment
from fedjax_mr.pipeline import resume
from fedjax_mr.runtime import checkpoint
from fedjax_mr.runtime import metrics_io
from tests import helpers


def _quiet(line):
  del line


def _no_times(rows):
  return [{k: v for k, v in r.items() if not k.endswith('_s')} for r in rows]


@pytest.fixture(scope='module')
def finished(small_fmnist_dir, tmp_path_factory):
  """A finished 4-round run (checkpoints after rounds 2 and 4) and its
  result."""
  cfg = helpers.small_config(
    small_fmnist_dir, rounds=4, checkpoint_every=2, eval_every=2
  )
  work = str(tmp_path_factory.mktemp('finished'))
  res = experiment.train_and_evaluate(cfg, work, log=_quiet)
  return cfg, work, res


def _resume_matches(cfg, work, ref, log=_quiet):
  """Resumes `work` to the end; its state and rows are the reference's."""
  res = experiment.train_and_evaluate(cfg, work, log=log)
  helpers.tree_equal(jax.device_get(res.state), jax.device_get(ref.state))
  rows = metrics_io.read(os.path.join(work, 'metrics.jsonl'))
  assert _no_times(rows) == _no_times(ref.history)
  clients = metrics_io.read(os.path.join(work, 'clients.jsonl'))
  assert clients == metrics_io.read(os.path.join(ref.workdir, 'clients.jsonl'))
  assert [r['round'] for r in clients] == [r['round'] for r in rows]


def _copy(finished, tmp_path):
  cfg, work, res = finished
  copy = str(tmp_path / 'run')
  shutil.copytree(work, copy)
  return cfg, copy, res


def _files(folder):
  for root, _, names in os.walk(folder):
    for name in names:
      yield os.path.join(root, name)


def _garble(step_dir):
  for path in _files(os.path.join(step_dir, 'default')):
    size = os.path.getsize(path)
    with open(path, 'wb') as f:
      f.write(bytes((i * 37 + 11) % 256 for i in range(size)))


def _drop_item(step_dir):
  shutil.rmtree(os.path.join(step_dir, 'default'))


def _empty(step_dir):
  shutil.rmtree(step_dir)
  os.makedirs(step_dir)


# (Truncated data files fall back exactly as garbled ones do; checked when
# this was written, one of the two runs here.)
@pytest.mark.parametrize('damage', [_garble, _drop_item, _empty])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(
  finished, tmp_path, damage
):
  cfg, work, ref = _copy(finished, tmp_path)
  damage(os.path.join(work, checkpoint.FOLDER, '4'))
  lines = []
  res = experiment.train_and_evaluate(cfg, work, log=lines.append)
  fallback = [line for line in lines if 'does not restore' in line]
  assert len(fallback) == 1 and 'resuming from round 2' in fallback[0]
  assert f'resuming {work} after round 2' in lines
  # Rounds 3 and 4 trained again: the same result, the same rows.
  helpers.tree_equal(jax.device_get(res.state), jax.device_get(ref.state))
  rows = metrics_io.read(os.path.join(work, 'metrics.jsonl'))
  assert _no_times(rows) == _no_times(ref.history)
  # The damaged checkpoint is kept aside, and round 4 was saved anew.
  aside = os.listdir(os.path.join(work, 'checkpoints_damaged'))
  assert len(aside) == 1 and aside[0].startswith('4.')
  assert checkpoint.Checkpointer(work).latest_round() == 4


def test_when_no_checkpoint_restores_nothing_is_touched(finished, tmp_path):
  cfg, work, _ = _copy(finished, tmp_path)
  for step in ('2', '4'):
    _garble(os.path.join(work, checkpoint.FOLDER, step))
  before = sorted(_files(work))
  with pytest.raises(checkpoint.CheckpointError, match='no checkpoint in'):
    experiment.train_and_evaluate(cfg, work, log=_quiet)
  assert sorted(_files(work)) == before


def test_rounds_below_those_done_is_refused_before_writing(finished, tmp_path):
  cfg, work, _ = _copy(finished, tmp_path)
  config_path = os.path.join(work, 'config.json')
  with open(config_path) as f:
    saved = f.read()
  with pytest.raises(errors.ConfigError, match='already past it'):
    experiment.train_and_evaluate(cfg.replace(rounds=2), work, log=_quiet)
  with open(config_path) as f:
    assert f.read() == saved
  assert json.loads(saved)['rounds'] == 4


# Other damage to the tail (round-less rows, binary data): test_metrics_io.
@pytest.mark.parametrize('tail', [b'{"round": 3, "train_lo'])
def test_a_damaged_metrics_tail_does_not_stop_a_resume(
  finished, tmp_path, tail
):
  cfg, work, ref = _copy(finished, tmp_path)
  shutil.rmtree(os.path.join(work, checkpoint.FOLDER, '4'))
  path = os.path.join(work, 'metrics.jsonl')
  rows = metrics_io.read(path)
  metrics_io.truncate(path, 2)
  with open(path, 'ab') as f:
    f.write(tail)
  lines = []
  res = experiment.train_and_evaluate(cfg, work, log=lines.append)
  assert any('unreadable line' in line for line in lines)
  helpers.tree_equal(jax.device_get(res.state), jax.device_get(ref.state))
  assert _no_times(metrics_io.read(path)) == _no_times(rows)


def test_a_missing_metrics_file_is_reported(finished, tmp_path):
  cfg, work, _ = _copy(finished, tmp_path)
  os.remove(os.path.join(work, 'metrics.jsonl'))
  lines = []
  experiment.train_and_evaluate(cfg, work, log=lines.append)
  assert any('metrics.jsonl is missing: rounds 1-4' in line for line in lines)


def test_the_config_inside_the_checkpoint_is_checked(finished, tmp_path):
  # Without config.json a changed --lr is still refused: the checkpoint
  # holds the config it was made with.
  cfg, work, _ = _copy(finished, tmp_path)
  os.remove(os.path.join(work, 'config.json'))
  before = sorted(_files(work))
  with pytest.raises(errors.ConfigError, match=r'`lr=0\.01` there, 0\.05 here'):
    experiment.train_and_evaluate(cfg.replace(lr=0.05), work, log=_quiet)
  assert sorted(_files(work)) == before
  # The same config resumes (and writes config.json again).
  experiment.train_and_evaluate(cfg, work, log=_quiet)
  assert os.path.exists(os.path.join(work, 'config.json'))


def test_checkpoints_without_metadata_still_resume(tmp_path):
  # Checkpoints made before the config was kept in them.
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  state = {'w': jax.numpy.arange(3.0)}
  ckpt.save(1, state)
  ckpt.save(2, state, {'config': {'lr': 0.1}})
  assert ckpt.metadata(1) == {}
  assert ckpt.metadata(2) == {'config': {'lr': 0.1}}
  assert ckpt.restore_newest(state, _quiet)[0] == 2


@pytest.mark.parametrize(
  'signum, during',
  [(signal.SIGINT, 'periodic'), (signal.SIGTERM, 'interrupted')],
)
def test_a_signal_during_a_checkpoint_write_waits_for_it(
  finished, tmp_path, monkeypatch, signum, during
):
  # 'periodic': the signal arrives while orbax writes round 2's regular
  # checkpoint. 'interrupted': the run is interrupted after round 3 (not a
  # checkpoint round) and a second signal arrives while the interrupt's
  # own save of round 3 is written. Either way the save completes, the run
  # ends with KeyboardInterrupt and resumes to the uninterrupted result.
  cfg, _, ref = finished
  work = str(tmp_path / 'run')
  target = 2 if during == 'periodic' else 3
  sent = []
  finalize = atomicity.AtomicRenameTemporaryPath.finalize

  async def finalize_with_a_signal(self, *args, **kwargs):
    # Mid-write: the data is in orbax's temporary folder, not yet renamed.
    if os.path.basename(str(self.get())).startswith(f'{target}.'):
      sent.append(target)
      os.kill(os.getpid(), signum)
      time.sleep(0.1)  # the handler runs here, in the main thread
    return await finalize(self, *args, **kwargs)

  def interrupt_after_3(r, row):
    del row
    if during == 'interrupted' and r == 3:
      raise KeyboardInterrupt

  monkeypatch.setattr(
    atomicity.AtomicRenameTemporaryPath, 'finalize', finalize_with_a_signal
  )
  with pytest.raises(KeyboardInterrupt):
    experiment.train_and_evaluate(
      cfg, work, log=_quiet, on_round=interrupt_after_3
    )
  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, 'finalize', finalize)
  assert sent == [target]
  assert checkpoint.Checkpointer(work).latest_round() == target
  lines = []
  _resume_matches(cfg, work, ref, log=lines.append)
  assert lines[0] == f'resuming {work} after round {target}'


def test_a_resume_on_another_client_mapping_says_so(finished, tmp_path):
  # The mapping of clients onto devices is kept in each checkpoint: a
  # resume that maps them otherwise groups the sums over clients otherwise.
  cfg, work, _ = _copy(finished, tmp_path)
  assert checkpoint.Checkpointer(work).metadata(4)['mapping'] == {
    'platform': 'cpu',
    'processes': 1,
    'devices': 2,
    'client_chunk': 1,
  }
  # One more round, its checkpoint saved with the new mapping.
  cfg = cfg.replace(rounds=5, client_chunk=2)
  lines = []
  experiment.train_and_evaluate(cfg, work, log=lines.append)
  notes = [line for line in lines if line.startswith('note: round')]
  assert notes == [
    'note: round 4 was run with 2 cpu device(s) in 1 process(es), '
    '`client_chunk=1`, this process runs 2 cpu device(s) in 1 process(es), '
    '`client_chunk=2`: the sums over clients are grouped differently, so '
    'the results are not bit-identical to an uninterrupted run (differences '
    'start in the last digits)'
  ]
  # Resumed with the mapping it was saved with: not a word (the note is
  # logged with the resume, even with no round left to train).
  lines = []
  experiment.train_and_evaluate(cfg, work, log=lines.append)
  assert lines[0] == f'resuming {work} after round 5'
  assert not [line for line in lines if line.startswith('note: round')]


def _fill_disk_at(monkeypatch, round_index):
  """orbax fails the save of `round_index` as it does on a full disk."""
  save = ocp.CheckpointManager.save

  def save_or_fail(self, step, *args, **kwargs):
    if step == round_index:
      raise ValueError(
        'RESOURCE_EXHAUSTED: Error writing "server.params" in OCDBT '
        'database: Failed to write 130761 bytes to file 15: No space left '
        "on device [os_error_code='28']"
      )
    return save(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, 'save', save_or_fail)


def test_a_full_disk_during_a_checkpoint_loses_nothing(
  finished, tmp_path, monkeypatch
):
  cfg, _, ref = finished
  work = str(tmp_path / 'run')
  _fill_disk_at(monkeypatch, 4)
  with pytest.raises(
    errors.StorageError,
    match=r'^cannot write the checkpoint after round 4 in .*: No space left '
    r'on device; stopped\. .* it resumes after round 2$',
  ):
    experiment.train_and_evaluate(cfg, work, log=_quiet)
  monkeypatch.undo()
  assert checkpoint.Checkpointer(work).latest_round() == 2
  _resume_matches(cfg, work, ref)


def test_a_failed_save_leaves_no_late_asyncio_reports(
  tmp_path, monkeypatch, caplog
):
  # When one write of a save fails, orbax's other writes end in futures
  # holding their own copy of the error; asyncio logs each ("exception was
  # never retrieved") whenever it is collected, which on a loaded machine
  # was after the one-line report. Those reports are dropped, other
  # asyncio errors are not, and the raised error holds no reference to
  # orbax's exception (which would keep the futures alive).
  _fill_disk_at(monkeypatch, 1)
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  with pytest.raises(errors.StorageError) as raised:
    ckpt.save(1, {'w': np.zeros(3, np.float32)})
  assert raised.value.__context__ is None
  assert raised.value.__cause__ is None
  folder = os.path.join(str(tmp_path), checkpoint.FOLDER)
  loop = asyncio.new_event_loop()

  def orphan(where):
    future = loop.create_future()
    future.set_exception(
      ValueError(
        f'RESOURCE_EXHAUSTED: Error writing at local file "{where}/1.orbax-'
        'checkpoint-tmp/d": No space left on device'
      )
    )

  with caplog.at_level(logging.ERROR, logger='asyncio'):
    orphan(folder)
    orphan('/another/folder')
  loop.close()
  reports = [r.getMessage() for r in caplog.records if r.name == 'asyncio']
  assert len(reports) == 1, reports
  assert 'never retrieved' in reports[0] and '/another/folder' in reports[0]


@pytest.mark.parametrize('name', ['metrics.jsonl', 'clients.jsonl'])
def test_a_full_disk_while_a_row_is_written_loses_nothing(
  finished, tmp_path, monkeypatch, name
):
  cfg, _, ref = finished
  work = str(tmp_path / 'run')
  append = files.append_line

  def append_or_fail(path, line):
    if path.endswith(name) and line.startswith('{"round": 3,'):
      with open(path, 'a') as f:
        f.write(line[:25])  # what a full disk leaves: part of the row
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    append(path, line)

  monkeypatch.setattr(files, 'append_line', append_or_fail)
  with pytest.raises(
    errors.StorageError,
    match=rf'^cannot write .*{re.escape(name)}: No space left on device; '
    r'stopped\. .* it resumes after round 2$',
  ):
    experiment.train_and_evaluate(cfg, work, log=_quiet)
  monkeypatch.undo()
  lines = []
  _resume_matches(cfg, work, ref, log=lines.append)
  assert any(
    name in line and 'dropped 1 unreadable line' in line for line in lines
  )


def test_an_unwritable_workdir_is_refused_before_anything(
  finished, tmp_path, monkeypatch
):
  # As a read-only mount answers (root included): access() says no.
  cfg, work, _ = _copy(finished, tmp_path)
  before = {p: open(p, 'rb').read() for p in _files(work)}
  access = os.access

  def read_only(path, mode, **kwargs):
    if os.path.abspath(path) == work and mode & os.W_OK:
      return False
    return access(path, mode, **kwargs)

  monkeypatch.setattr(os, 'access', read_only)
  with pytest.raises(
    errors.ConfigError, match=r'^`workdir=.*`: it is not writable'
  ):
    experiment.train_and_evaluate(cfg.replace(rounds=6), work, log=_quiet)
  assert {p: open(p, 'rb').read() for p in _files(work)} == before


def _mount_tmpfs(folder, size):
  """Mounts a tmpfs of `size` at `folder`; False where this is not allowed
  (not root, no mount in a container)."""
  os.makedirs(folder)
  proc = subprocess.run(
    ['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', folder],
    capture_output=True,
  )
  return proc.returncode == 0


def test_a_real_full_disk_is_one_line_and_resumes(small_fmnist_dir, tmp_path):
  # The real thing where the machine allows it: a 3 MiB tmpfs that fills
  # up while orbax writes a checkpoint.
  disk = str(tmp_path / 'disk')
  if shutil.which('mount') is None or not _mount_tmpfs(disk, '3m'):
    pytest.skip('cannot mount a tmpfs here (needs root)')
  try:
    work = os.path.join(disk, 'w')
    cfg = helpers.small_config(
      small_fmnist_dir, rounds=4, eval_every=2, checkpoint_every=1
    )
    # The rounds before the disk fills, and the resume once it has room
    # again, run in this process: only the failing run is about what the
    # program prints and its exit status.
    experiment.train_and_evaluate(cfg.replace(rounds=2), work, log=_quiet)
    ref = metrics_io.read(os.path.join(work, 'metrics.jsonl'))
    free = shutil.disk_usage(disk).free
    with open(os.path.join(disk, 'filler'), 'wb') as f:
      f.write(bytes(free - 150_000))  # less than a checkpoint
    flags = [
      f'--data_dir={small_fmnist_dir}',
      '--num_clients=10',
      '--clients_per_round=4',
      '--alpha=0.5',
      '--local_epochs=1',
      '--eval_every=2',
      '--checkpoint_every=1',
      f'--workdir={work}',
    ]
    proc = helpers.run_module('experiments.run', *flags, '--rounds=4')
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1, proc.stderr
    assert (
      err[0].startswith('error: cannot write the checkpoint after round 3')
      and 'No space left on device' in err[0]
    ), err[0]
    assert err[0].endswith('it resumes after round 2')
    assert checkpoint.Checkpointer(work).latest_round() == 2
    assert metrics_io.read(os.path.join(work, 'metrics.jsonl'))[:2] == ref
    os.remove(os.path.join(disk, 'filler'))
    lines = []
    experiment.train_and_evaluate(cfg, work, log=lines.append)
    assert lines[0] == f'resuming {work} after round 2'
  finally:
    subprocess.run(['umount', disk], capture_output=True)


@pytest.mark.parametrize('signum', [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_during_a_round_is_announced_at_once(
  small_fmnist_dir, tmp_path, signum
):
  # While a round computes, the main thread waits in XLA, where Python runs
  # no signal handler: Ctrl-C said nothing until the round ended (about
  # 20 s). Here round 2 waits in C (select) for the announcement, up to
  # 10 s, while the signal lands on another thread (as on XLA's).
  # Python's own handler, also where the suite runs with SIGINT ignored.
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  read, write = os.pipe()
  said = []

  def log(line):
    said.append(line)
    if line == resume.INTERRUPTED:
      os.write(write, b'!')

  def make_round(exp, chunk):
    compiled = experiment._compile_round(exp, chunk)
    calls = []

    def round_fn(state, data, key):
      calls.append(1)
      if len(calls) == 2:
        # Sent once this thread waits in select: from Python it would
        # be handled at the next bytecode.
        threading.Timer(
          0.5, lambda: signal.pthread_kill(threading.get_ident(), signum)
        ).start()
        t0 = time.monotonic()
        try:  # the handler raises KeyboardInterrupt as select returns
          select.select([read], [], [], 10)
        finally:
          waited.append(time.monotonic() - t0)
      return compiled(state, data, key)

    return round_fn

  waited = []
  cfg = helpers.small_config(small_fmnist_dir, rounds=3)
  try:
    with pytest.raises(KeyboardInterrupt):
      experiment.train_and_evaluate(
        cfg, str(tmp_path / 'run'), log=log, make_round=make_round
      )
  finally:
    signal.signal(signal.SIGINT, previous)
    os.close(read)
    os.close(write)
  # Said once, while the round still waited (which it ended).
  assert said.count(resume.INTERRUPTED) == 1
  assert len(waited) == 1 and waited[0] < 10
