"""Nothing silently wrong (issue 41): checkpoints prove their content,
record rows are recomputed rather than dropped, and the data are part of a
run's identity."""

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest

from fedjax_mr.core import errors
from fedjax_mr.data import datasets
from fedjax_mr.pipeline import build
from fedjax_mr.pipeline import experiment
from fedjax_mr.pipeline import records
from fedjax_mr.runtime import checkpoint
from fedjax_mr.runtime import metrics_io
from tests import conftest
from tests import helpers


def _quiet(line):
  del line


def _no_times(rows):
  return [{k: v for k, v in r.items() if not k.endswith('_s')} for r in rows]


# -- the digest, on its own -------------------------------------------------


def test_the_digest_sees_every_bit_dtype_shape_and_the_metadata():
  state = {'a': np.arange(6, dtype=np.float32), 'b': np.zeros((2, 3), np.int8)}
  ref = checkpoint.digest(state, {'config': {'lr': 0.1}})
  assert ref == checkpoint.digest(
    jax.tree.map(np.copy, state), {'config': {'lr': 0.1}}
  )
  flipped = state['a'].copy()
  flipped.view(np.uint8)[5] ^= 1
  others = [
    ({**state, 'a': flipped}, {'config': {'lr': 0.1}}),
    ({**state, 'b': np.zeros((3, 2), np.int8)}, {'config': {'lr': 0.1}}),
    ({**state, 'b': np.zeros((2, 3), np.uint8)}, {'config': {'lr': 0.1}}),
    ({'b': state['a'], 'a': state['b']}, {'config': {'lr': 0.1}}),
    (state, {'config': {'lr': 0.2}}),
  ]
  digests = {checkpoint.digest(s, m) for s, m in others}
  assert len(digests) == len(others) and ref not in digests


def _two_checkpoints(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  like = {'w': jax.numpy.zeros(4096, jax.numpy.float32)}
  for r in (1, 2):
    ckpt.save(r, {'w': jax.numpy.arange(4096.0) * r}, {'config': {'r': r}})
  return ckpt, like


def test_a_flipped_byte_is_found_and_the_older_checkpoint_read(tmp_path):
  ckpt, like = _two_checkpoints(tmp_path)
  assert ckpt.metadata(2) == {'config': {'r': 2}}  # the digest left out
  helpers.flip_checkpoint_byte(
    os.path.join(str(tmp_path), checkpoint.FOLDER, '2')
  )
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  found = ckpt.find(like)
  assert found.round == 1 and found.verified
  assert found.metadata == {'config': {'r': 1}}
  np.testing.assert_array_equal(found.state['w'], np.arange(4096.0))
  assert found.damaged == [
    (2, 'its arrays or metadata do not match their sha256 digest')
  ]
  # Unchecked, orbax reads the damaged arrays without a word.
  assert not np.array_equal(ckpt.restore(2, like)['w'], 2 * np.arange(4096.0))


def test_checkpoints_without_a_digest_are_read_unverified(tmp_path):
  # As this project wrote them before digests: the metadata file holds the
  # config, no digest.
  ckpt, like = _two_checkpoints(tmp_path)
  path = os.path.join(
    str(tmp_path), checkpoint.FOLDER, '2', '_CHECKPOINT_METADATA'
  )
  with open(path) as f:
    saved = json.load(f)
  del saved['custom_metadata'][checkpoint.DIGEST_KEY]
  del saved['custom_metadata'][checkpoint.ROUND_KEY]
  with open(path, 'w') as f:
    json.dump(saved, f)
  found = checkpoint.Checkpointer(str(tmp_path)).find(like)
  assert (found.round, found.verified, found.damaged) == (2, False, [])


@pytest.mark.parametrize(
  'key, renamed, reason',
  [
    (
      'sha256',
      'sha257',
      'its metadata has no sha256 digest but keys that only checkpoints '
      "with one have: ['round', 'sha257']",
    ),
    (
      'custom_metadata',
      'custom_metadatb',
      'holds a key that orbax does not write: ',
    ),
  ],
)
def test_a_renamed_metadata_key_is_damage_not_an_earlier_version(
  tmp_path, key, renamed, reason
):
  # One byte of a key's name changed: the file still reads, but without
  # the digest (or with no custom metadata at all, so without the config)
  # the checkpoint was taken unverified, as if made before digests.
  ckpt, like = _two_checkpoints(tmp_path)
  path = os.path.join(
    str(tmp_path), checkpoint.FOLDER, '2', '_CHECKPOINT_METADATA'
  )
  with open(path) as f:
    text = f.read()
  with open(path, 'w') as f:
    f.write(text.replace(f'"{key}"', f'"{renamed}"'))
  found = checkpoint.Checkpointer(str(tmp_path)).find(like)
  assert (found.round, found.verified) == (1, True)
  [(step, why)] = found.damaged
  assert step == 2 and reason in why


# -- a run: damaged checkpoints ----------------------------------------------


@pytest.fixture(scope='module')
def finished(small_fmnist_dir, tmp_path_factory):
  """A finished 4-round run (checkpoints after rounds 2 and 4)."""
  cfg = helpers.small_config(
    small_fmnist_dir, rounds=4, checkpoint_every=2, eval_every=2
  )
  work = str(tmp_path_factory.mktemp('finished'))
  res = experiment.train_and_evaluate(cfg, work, log=_quiet)
  return cfg, work, res


def _copy(finished, tmp_path):
  cfg, work, res = finished
  copy = str(tmp_path / 'run')
  shutil.copytree(work, copy)
  return cfg, copy, res


def _matches(work, res, ref):
  """`work`'s rows and `res`'s state are the reference run's, bit for bit
  (times aside)."""
  helpers.tree_equal(jax.device_get(res.state), jax.device_get(ref.state))
  rows = metrics_io.read(os.path.join(work, records.METRICS_FILE))
  assert _no_times(rows) == _no_times(ref.history)
  assert [r['round'] for r in rows] == [1, 2, 3, 4]
  clients = metrics_io.read(os.path.join(work, records.CLIENTS_FILE))
  assert clients == metrics_io.read(
    os.path.join(ref.workdir, records.CLIENTS_FILE)
  )


def test_a_flipped_byte_in_the_newest_checkpoint_falls_back(finished, tmp_path):
  cfg, work, ref = _copy(finished, tmp_path)
  helpers.flip_checkpoint_byte(os.path.join(work, checkpoint.FOLDER, '4'))
  # Read back (as experiments.landscape does): the intact round 2, nothing
  # moved.
  loaded = experiment.load_run(work)
  assert loaded.round == 2 and [r['round'] for r in loaded.history] == [1, 2]
  assert checkpoint.Checkpointer(work).all_rounds() == [2, 4]
  lines = []
  res = experiment.train_and_evaluate(cfg, work, log=lines.append)
  damaged = [line for line in lines if 'checkpoint after round 4' in line]
  assert damaged == [
    'checkpoint after round 4 does not restore (its arrays or metadata do '
    'not match their sha256 digest); resuming from round 2, the damaged one '
    f'moved to {os.path.join(work, "checkpoints_damaged", "")}'
    + os.listdir(os.path.join(work, 'checkpoints_damaged'))[0]
  ]
  assert f'resuming {work} after round 2' in lines
  _matches(work, res, ref)


def test_garbled_checkpoint_metadata_does_not_skip_the_config_check(
  finished, tmp_path
):
  # orbax reads a garbled metadata file as empty, which skipped the check
  # of the config kept in the checkpoint: now the checkpoint is damaged,
  # and the older one's config refuses the changed `lr`.
  cfg, work, _ = _copy(finished, tmp_path)
  os.remove(os.path.join(work, records.CONFIG_FILE))
  path = os.path.join(work, checkpoint.FOLDER, '4', '_CHECKPOINT_METADATA')
  with open(path, 'w') as f:
    f.write('{"custom_metadata": {"config": ')
  with pytest.raises(
    errors.ConfigError,
    match=r'^the checkpoint after round 2 .*\(`lr=0\.01` there, 0\.05 here',
  ):
    experiment.train_and_evaluate(cfg.replace(lr=0.05), work, log=_quiet)
  # Nothing moved before the refusal.
  assert os.path.exists(path)


def _flags(cfg, work, data_dir=None, rounds=None):
  return [
    f'--data_dir={data_dir or cfg.data.data_dir}',
    f'--num_clients={cfg.partition.num_clients}',
    f'--clients_per_round={cfg.server.clients_per_round}',
    f'--alpha={cfg.partition.alpha}',
    f'--local_epochs={cfg.local.local_epochs}',
    f'--rounds={rounds or cfg.run.rounds}',
    f'--eval_every={cfg.evaluation.eval_every}',
    f'--checkpoint_every={cfg.run.checkpoint_every}',
    f'--workdir={work}',
  ]


def test_no_intact_checkpoint_is_one_line_and_exit_2(finished, tmp_path):
  cfg, work, _ = _copy(finished, tmp_path)
  for step in ('2', '4'):
    helpers.flip_checkpoint_byte(os.path.join(work, checkpoint.FOLDER, step))
  proc = helpers.run_module('experiments.run', *_flags(cfg, work))
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.splitlines() == [
    f'error: no checkpoint in {os.path.join(work, checkpoint.FOLDER)} '
    'restores (the newest, after round 4: its arrays or metadata do not '
    'match their sha256 digest); if the workdir holds a run of another '
    'setting, pass another --workdir'
  ]
  assert sorted(os.listdir(os.path.join(work, checkpoint.FOLDER))) == [
    '2',
    '4',
  ]


def _truncate_arrays(step_dir):
  d = os.path.join(step_dir, 'default', 'ocdbt.process_0', 'd')
  path = max((os.path.join(d, n) for n in os.listdir(d)), key=os.path.getsize)
  with open(path, 'r+b') as f:
    f.truncate(1000)


def _garble_metadata(step_dir):
  with open(os.path.join(step_dir, '_CHECKPOINT_METADATA'), 'w') as f:
    f.write('{garbled')


def _rename_metadata_key(step_dir):
  # orbax logs "Provided metadata contains unknown key custom_metadatb".
  path = os.path.join(step_dir, '_CHECKPOINT_METADATA')
  with open(path) as f:
    text = f.read()
  with open(path, 'w') as f:
    f.write(text.replace('"custom_metadata"', '"custom_metadatb"'))


@pytest.mark.parametrize(
  'damage', [_truncate_arrays, _garble_metadata, _rename_metadata_key]
)
def test_orbax_says_nothing_of_a_damaged_checkpoint(finished, tmp_path, damage):
  # orbax raises (a truncated file: ~130 lines of its tracebacks before) or
  # logs (a metadata file it cannot parse); the user sees the one line.
  cfg, work, _ = _copy(finished, tmp_path)
  damage(os.path.join(work, checkpoint.FOLDER, '4'))
  proc = helpers.run_module('experiments.run', *_flags(cfg, work))
  assert proc.returncode == 0, proc.stderr
  assert proc.stderr == ''
  lines = proc.stdout.splitlines()
  assert lines[0].startswith('checkpoint after round 4 does not restore (')
  assert 'resuming from round 2, the damaged one moved to' in lines[0]
  assert lines[1] == f'resuming {work} after round 2'
  if damage is _truncate_arrays:  # which array, not TensorStore's spec
    assert re.search(r'\(array server\.[\w.]+\)\); resuming', lines[0])
    assert 'TensorStore' not in lines[0]


# -- a run: damaged records ---------------------------------------------------


def _cut_last_line(path):
  with open(path, 'rb') as f:
    data = f.read()
  start = data.rstrip(b'\n').rfind(b'\n') + 1
  with open(path, 'wb') as f:
    f.write(data[: start + (len(data) - start) // 2])


def test_a_cut_last_metrics_row_is_recomputed(finished, tmp_path):
  cfg, work, ref = _copy(finished, tmp_path)
  path = os.path.join(work, records.METRICS_FILE)
  _cut_last_line(path)
  assert [r['round'] for r in metrics_io.read(path)] == [1, 2, 3]
  lines = []
  res = experiment.train_and_evaluate(cfg, work, log=lines.append)
  assert (
    f'{path}: line 4 (after round 3) is cut or garbled; the rounds from 3 on '
    'are recomputed, from the checkpoint after round 2'
  ) in lines
  assert f'resuming {work} after round 2' in lines
  _matches(work, res, ref)
  assert checkpoint.Checkpointer(work).all_rounds() == [2, 4]


def test_a_whole_last_metrics_row_removed_is_recomputed(finished, tmp_path):
  # Cut at the end of line 3: the file reads whole, but ends before the
  # checkpoint after round 4 (a round's rows are written before it).
  cfg, work, ref = _copy(finished, tmp_path)
  path = os.path.join(work, records.METRICS_FILE)
  with open(path, 'rb') as f:
    rows = f.read().splitlines(keepends=True)
  with open(path, 'wb') as f:
    f.writelines(rows[:3])
  lines = []
  res = experiment.train_and_evaluate(cfg, work, log=lines.append)
  assert (
    f'{path} ends at round 3; the rounds from 3 on are recomputed, from the '
    'checkpoint after round 2'
  ) in lines
  assert f'resuming {work} after round 2' in lines
  _matches(work, res, ref)
  assert checkpoint.Checkpointer(work).all_rounds() == [2, 4]


def test_a_garbled_middle_clients_row_is_recomputed(finished, tmp_path):
  # Row 2 garbled: no checkpoint at or before round 1, the run starts over.
  cfg, work, ref = _copy(finished, tmp_path)
  path = os.path.join(work, records.CLIENTS_FILE)
  with open(path, 'rb') as f:
    rows = f.read().splitlines(keepends=True)
  rows[1] = rows[1][:10] + b'\xff\x00garbled' + rows[1][20:]
  with open(path, 'wb') as f:
    f.writelines(rows)
  lines = []
  res = experiment.train_and_evaluate(cfg, work, log=lines.append)
  assert (
    f'{path}: line 2 (after round 1) is cut or garbled; the rounds from 1 on '
    'are recomputed, from the start'
  ) in lines
  assert not [line for line in lines if line.startswith('resuming')]
  _matches(work, res, ref)


def test_a_roll_back_deletes_no_checkpoint_of_another_config(
  finished, tmp_path
):
  # The first metrics row cut, config.json gone: the run would start over
  # and delete checkpoints 2 and 4, which were made with another `lr`.
  cfg, work, _ = _copy(finished, tmp_path)
  os.remove(os.path.join(work, records.CONFIG_FILE))
  path = os.path.join(work, records.METRICS_FILE)
  with open(path, 'r+b') as f:
    f.truncate(10)
  before = _contents(work)
  with pytest.raises(
    errors.ConfigError, match=r'^the checkpoint after round 4 .*`lr=0\.01`'
  ):
    experiment.train_and_evaluate(cfg.replace(lr=0.05), work, log=_quiet)
  assert _contents(work) == before


@pytest.mark.parametrize(
  'text, expected',
  [
    (None, (0, '')),
    ('', (0, 'it holds no rows')),
    ('{"round": 1}\n{"round": 2}\n', (2, '')),
    ('{"round": 5}\n{"round": 6}\n', (6, '')),  # a file that starts late
    ('{"round": 1}\n{"round": 1}\n{"round": 2}\n', (2, '')),  # repeated
    (
      '{"round": 1}\n{"round": 2}\n{"rou',
      (2, 'line 3 (after round 2) is cut or garbled'),
    ),
    (
      '{"round": 1}\n[1]\n{"round": 3}\n',
      (1, 'line 2 (after round 1) is cut or garbled'),
    ),
    ('{"round": 1}\n{"round": 3}\n', (1, 'line 2 skips from round 1 to 3')),
    ('{"x": 1}\n{"round": 2}\n', (0, 'line 1 (first) is cut or garbled')),
  ],
)
def test_intact_prefix(tmp_path, text, expected):
  path = str(tmp_path / 'metrics.jsonl')
  if text is not None:
    with open(path, 'w') as f:
      f.write(text)
  assert metrics_io.intact_prefix(path) == expected


# -- a run: the data ----------------------------------------------------------


def _copy_data(small_fmnist_dir, folder, relabel=False):
  ds = datasets.load('fashion_mnist', small_fmnist_dir)
  y_train = ds.y_train.copy()
  if relabel:
    y_train[7] = (y_train[7] + 1) % 10
  return conftest.write_idx_dataset(
    folder, ds.x_train[..., 0], y_train, ds.x_test[..., 0], ds.y_test
  )


def _contents(work):
  """Every file of `work` and its bytes, but the lock (it holds the pid
  of the last process that held it)."""
  return {
    os.path.join(r, n): open(os.path.join(r, n), 'rb').read()
    for r, _, names in os.walk(work)
    for n in names
    if n != '.lock'
  }


def test_the_data_fingerprint(small_fmnist_dir, tmp_path):
  ref = build.data_fingerprint(datasets.load('fashion_mnist', small_fmnist_dir))
  assert (ref['train'], ref['test']) == (1500, 500)
  same = _copy_data(small_fmnist_dir, str(tmp_path / 'same'))
  other = _copy_data(small_fmnist_dir, str(tmp_path / 'other'), relabel=True)
  assert build.data_fingerprint(datasets.load('fashion_mnist', same)) == ref
  changed = build.data_fingerprint(datasets.load('fashion_mnist', other))
  assert changed['sha256'] != ref['sha256']


def test_a_resume_on_other_data_is_refused(
  finished, small_fmnist_dir, tmp_path
):
  cfg, work, _ = _copy(finished, tmp_path)
  with open(os.path.join(work, records.CONFIG_FILE)) as f:
    saved = json.load(f)
  assert saved[records.DATA_KEY] == build.data_fingerprint(
    datasets.load('fashion_mnist', small_fmnist_dir)
  )
  other = _copy_data(small_fmnist_dir, str(tmp_path / 'other'), relabel=True)
  before = _contents(work)
  proc = helpers.run_module(
    'experiments.run', *_flags(cfg, work, data_dir=other, rounds=5)
  )
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.splitlines() == [
    f'error: --data_dir={other}: the fashion_mnist data loaded from it '
    f'differ from those the run in {work} was made with (sha256 differ); '
    'pass the folder of the same data, or another --workdir'
  ]
  assert _contents(work) == before
  # Without config.json, the checkpoint's own fingerprint refuses it.
  os.remove(os.path.join(work, records.CONFIG_FILE))
  with pytest.raises(errors.ConfigError, match=r'^`data_dir=.*sha256 differ'):
    experiment.train_and_evaluate(
      cfg.replace(data_dir=other, rounds=5), work, log=_quiet
    )


def test_the_same_data_elsewhere_resumes(finished, small_fmnist_dir, tmp_path):
  cfg, work, _ = _copy(finished, tmp_path)
  moved = _copy_data(small_fmnist_dir, str(tmp_path / 'moved'))
  lines = []
  res = experiment.train_and_evaluate(
    cfg.replace(data_dir=moved, rounds=5), work, log=lines.append
  )
  assert lines[0] == f'resuming {work} after round 4'
  assert [r['round'] for r in res.history] == [1, 2, 3, 4, 5]
  with open(os.path.join(work, records.CONFIG_FILE)) as f:
    assert json.load(f)['data_dir'] == moved


def test_orbax_read_coroutines_left_by_a_failed_restore_are_dropped(
  monkeypatch,
):
  # A restore of a damaged checkpoint fails in one line; the read
  # coroutines it abandoned report their own errors when collected, later,
  # through sys.unraisablehook: those are dropped, others are not.
  import os
  import sys
  import types as pytypes

  from fedjax_mr.runtime import checkpoint

  seen = []
  monkeypatch.setattr(sys, 'unraisablehook', seen.append)
  checkpoint._ignore_closed_loop_callbacks()

  def report(filename):
    code = pytypes.SimpleNamespace(co_filename=filename)
    sys.unraisablehook(
      pytypes.SimpleNamespace(
        exc_value=Exception('Encountered error while reading array index'),
        object=pytypes.SimpleNamespace(cr_code=code),
      )
    )

  report(os.path.join('site-packages', 'orbax', 'checkpoint', 'x.py'))
  assert seen == []
  report(os.path.join('site-packages', 'mine', 'x.py'))
  assert len(seen) == 1


# -- second pass (issue 55): a checkpoint bound to its place ---------------


def test_a_checkpoint_copied_into_another_rounds_folder_is_damaged(tmp_path):
  ckpt, like = _two_checkpoints(tmp_path)
  folder = os.path.join(str(tmp_path), checkpoint.FOLDER)
  shutil.copytree(os.path.join(folder, '1'), os.path.join(folder, '3'))
  found = checkpoint.Checkpointer(str(tmp_path)).find(like)
  assert found.round == 2 and found.damaged == [
    (
      3,
      'it holds the state after round 1, not 3: a copy or a roll back in '
      'the wrong folder',
    )
  ]
  # The caller's own check is one more reason to skip a checkpoint.
  found = checkpoint.Checkpointer(str(tmp_path)).find(
    like, check=lambda step, state, meta: 'no' if step == 2 else ''
  )
  assert found.round == 1 and [s for s, _ in found.damaged] == [3, 2]


def _strip_to_an_earlier_version(step_dir):
  """The checkpoint's metadata as versions before digests wrote it: the
  config and the mapping only (taken unverified)."""
  path = os.path.join(step_dir, '_CHECKPOINT_METADATA')
  with open(path) as f:
    saved = json.load(f)
  custom = saved['custom_metadata']
  saved['custom_metadata'] = {k: custom[k] for k in ('config', 'mapping')}
  with open(path, 'w') as f:
    json.dump(saved, f)


@pytest.mark.parametrize('earlier_version', [False, True])
def test_a_rolled_back_checkpoint_is_skipped_and_the_run_is_exact(
  finished, tmp_path, earlier_version
):
  # checkpoints/4 replaced by a copy of checkpoints/2: it resumed "after
  # round 4" with round 2's state and trained round 3's clients as round 5.
  # Made by an earlier version (no round, no digest), the state's own
  # round still tells.
  cfg, work, ref = _copy(finished, tmp_path)
  folder = os.path.join(work, checkpoint.FOLDER)
  shutil.rmtree(os.path.join(folder, '4'))
  shutil.copytree(os.path.join(folder, '2'), os.path.join(folder, '4'))
  if earlier_version:
    _strip_to_an_earlier_version(os.path.join(folder, '4'))
  lines = []
  res = experiment.train_and_evaluate(cfg, work, log=lines.append)
  assert lines[0].startswith(
    'checkpoint after round 4 does not restore (it holds the state after '
    'round 2, not 4: a copy or a roll back in the wrong folder); resuming '
    'from round 2, the damaged one moved to '
  )
  assert f'resuming {work} after round 2' in lines
  _matches(work, res, ref)


def _edit_row(path, round_index, edit):
  with open(path) as f:
    rows = [json.loads(line) for line in f]
  edit(rows[round_index - 1])
  with open(path, 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)


def test_a_checkpoint_saved_after_other_rows_is_skipped(finished, tmp_path):
  # Row 3's loss changed (its clients still agree): the checkpoint after
  # round 4 was not saved after these rows; the one after round 2 was.
  cfg, work, ref = _copy(finished, tmp_path)
  path = os.path.join(work, records.METRICS_FILE)
  _edit_row(path, 3, lambda r: r.update(train_loss=r['train_loss'] + 1))
  lines = []
  res = experiment.train_and_evaluate(cfg, work, log=lines.append)
  assert lines[0].startswith(
    'checkpoint after round 4 does not restore (it was saved after other '
    'rows than metrics.jsonl and clients.jsonl hold up to round 4 (a row '
    'changed, or the checkpoint is of another attempt)); resuming from '
    'round 2'
  )
  _matches(work, res, ref)


def test_a_metrics_row_naming_other_clients_is_recomputed(finished, tmp_path):
  cfg, work, ref = _copy(finished, tmp_path)
  path = os.path.join(work, records.METRICS_FILE)
  _edit_row(path, 3, lambda r: r['client_ids'].reverse())
  lines = []
  res = experiment.train_and_evaluate(cfg, work, log=lines.append)
  assert (
    f'{work}: round 3 of metrics.jsonl and clients.jsonl name other '
    'clients; the rounds from 3 on are recomputed, from the checkpoint '
    'after round 2'
  ) in lines
  _matches(work, res, ref)
  assert checkpoint.Checkpointer(work).all_rounds() == [2, 4]


def test_stray_checkpoint_folders_are_moved_aside_not_obeyed(
  finished, tmp_path
):
  # An empty checkpoints/7 and a copy of checkpoints/2 named 99 made the
  # run refuse: "already past it (99 rounds done); pass --rounds=99".
  cfg, work, ref = _copy(finished, tmp_path)
  folder = os.path.join(work, checkpoint.FOLDER)
  os.mkdir(os.path.join(folder, '7'))
  shutil.copytree(os.path.join(folder, '2'), os.path.join(folder, '99'))
  lines = []
  res = experiment.train_and_evaluate(cfg, work, log=lines.append)
  aside = [line for line in lines if 'moved to' in line]
  assert [line.split('; resuming')[0] for line in aside] == [
    'checkpoint after round 99 does not restore (the folder holds round '
    "2's, not round 99's)",
    'checkpoint after round 7 does not restore (the folder holds no '
    "checkpoint, not round 7's)",
  ]
  assert f'resuming {work} after round 4' in lines
  assert len(os.listdir(os.path.join(work, 'checkpoints_damaged'))) == 2
  assert checkpoint.Checkpointer(work).all_rounds() == [2, 4]
  _matches(work, res, ref)


def test_emptied_checkpoints_start_over_and_say_so(finished, tmp_path):
  cfg, work, ref = _copy(finished, tmp_path)
  folder = os.path.join(work, checkpoint.FOLDER)
  for step in os.listdir(folder):
    shutil.rmtree(os.path.join(folder, step))
  lines = []
  res = experiment.train_and_evaluate(cfg, work, log=lines.append)
  assert lines[0] == (
    f'{folder} holds no checkpoint to resume from, but the records hold '
    'rows up to round 4: the run starts over from round 1, and those rows '
    'are recomputed'
  )
  _matches(work, res, ref)


def test_a_save_after_a_kill_mid_save_warns_of_nothing(tmp_path, caplog):
  # orbax's "Attempted to create temporary directory ... which already
  # exists" reached the user after a kill during a checkpoint's save.
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  partial = os.path.join(
    str(tmp_path), checkpoint.FOLDER, '2.orbax-checkpoint-tmp'
  )
  os.makedirs(os.path.join(partial, 'default'))
  with caplog.at_level('WARNING'):
    ckpt.save(2, {'w': jax.numpy.zeros(3)})
  assert [r.getMessage() for r in caplog.records] == []
  assert ckpt.all_rounds() == [2] and not os.path.exists(partial)


# -- second pass: a run writes only its own files ---------------------------


def _no_data(*args, **kwargs):
  raise AssertionError('the data were loaded before the workdir was checked')


def _link_lock(work, outside):
  os.remove(os.path.join(work, '.lock'))
  os.symlink(os.path.join(outside, 'x'), os.path.join(work, '.lock'))
  return '.lock is a symbolic link (to '


def _link_metrics(work, outside):
  os.remove(os.path.join(work, records.METRICS_FILE))
  os.symlink(
    os.path.join(outside, 'x'), os.path.join(work, records.METRICS_FILE)
  )
  return 'metrics.jsonl is a symbolic link (to '


def _link_checkpoints(work, outside):
  # The outside folder holds the run's checkpoints and a file of its own.
  folder = os.path.join(work, checkpoint.FOLDER)
  for step in os.listdir(folder):
    shutil.move(os.path.join(folder, step), outside)
  os.rmdir(folder)
  os.symlink(outside, folder)
  return 'checkpoints is a symbolic link (to '


def _link_a_checkpoint(work, outside):
  step = os.path.join(work, checkpoint.FOLDER, '4')
  shutil.move(step, outside)
  os.symlink(os.path.join(outside, '4'), step)
  return 'checkpoints/4 is a symbolic link (to '


def _lock_folder(work, outside):
  del outside
  os.remove(os.path.join(work, '.lock'))
  os.mkdir(os.path.join(work, '.lock'))
  return '.lock is a folder, where the run keeps a file'


def _checkpoints_file(work, outside):
  del outside
  shutil.rmtree(os.path.join(work, checkpoint.FOLDER))
  with open(os.path.join(work, checkpoint.FOLDER), 'w') as f:
    f.write('not a folder')
  return 'checkpoints is a file, where the run keeps a folder'


@pytest.mark.parametrize(
  'defect',
  [
    _link_lock,
    _link_metrics,
    _link_checkpoints,
    _link_a_checkpoint,
    _lock_folder,
    _checkpoints_file,
  ],
)
def test_a_workdir_whose_files_are_not_its_own_is_refused_before_loading(
  finished, tmp_path, monkeypatch, defect
):
  cfg, work, _ = _copy(finished, tmp_path)
  outside = str(tmp_path / 'outside')
  os.mkdir(outside)
  with open(os.path.join(outside, 'x'), 'w') as f:
    f.write('precious')
  fragment = defect(work, outside)
  before = {**_contents(work), **_contents(outside)}
  monkeypatch.setattr(build, 'load_clients', _no_data)
  with pytest.raises(errors.ConfigError) as e:
    experiment.train_and_evaluate(cfg.replace(rounds=6), work, log=_quiet)
  assert str(e.value).startswith(f'`workdir={work}`: {fragment}')
  assert '\n' not in str(e.value)
  assert {**_contents(work), **_contents(outside)} == before
