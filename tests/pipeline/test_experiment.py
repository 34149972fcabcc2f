"""End-to-end runs on a small real subset of Fashion-MNIST."""

import datetime
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from fedjax_mr.core import errors
from fedjax_mr.data import datasets
from fedjax_mr.data import partition as partition_lib
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import energy_report
from fedjax_mr.pipeline import experiment
from fedjax_mr.pipeline import records
from fedjax_mr.pipeline import registry
from fedjax_mr.runtime import distributed
from fedjax_mr.runtime import metrics_io
from fedjax_mr.runtime import tensorboard
from tests import helpers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _small(data_dir):
  # One local epoch: what the tests here check (resumes, records,
  # placements) does not depend on how many; each epoch adds about a
  # second of CPU to each round.
  return helpers.small_config(
    data_dir,
    partition='dirichlet',
    local_epochs=1,
    rounds=4,
    eval_every=2,
    checkpoint_every=2,
  )


@pytest.fixture
def small_config(small_fmnist_dir):
  return _small(small_fmnist_dir)


def _no_times(rows):
  return [{k: v for k, v in r.items() if not k.endswith('_s')} for r in rows]


def _quiet(line):
  del line


@pytest.fixture(scope='module')
def reference(small_fmnist_dir, tmp_path_factory):
  """`small_config` run uninterrupted (checkpoints after rounds 2 and 4):
  what the interrupted and resumed runs below must give, bit for bit. One
  run for all of them; tests that write to its workdir use a copy."""
  work = str(tmp_path_factory.mktemp('reference'))
  return experiment.train_and_evaluate(
    _small(small_fmnist_dir), work, log=_quiet
  )


def _copy_of(reference, tmp_path):
  copy = str(tmp_path / 'run')
  shutil.copytree(reference.workdir, copy)
  return copy


def _interrupt_at(r_stop, exc):
  def hook(r, row):
    del row
    if r == r_stop:
      raise exc

  return hook


@pytest.fixture(scope='module')
def crashed(small_fmnist_dir, tmp_path_factory):
  """`small_config` crashed after round 3 (a hard crash: its newest
  checkpoint is round 2's), its workdir as the crash left it (copied
  aside) and the resumed run, with its log."""
  cfg = _small(small_fmnist_dir)
  work = str(tmp_path_factory.mktemp('crashed') / 'w')
  with pytest.raises(RuntimeError, match='^x$'):
    experiment.train_and_evaluate(
      cfg, work, log=_quiet, on_round=_interrupt_at(3, RuntimeError('x'))
    )
  at_crash = str(tmp_path_factory.mktemp('at_crash') / 'w')
  shutil.copytree(work, at_crash)
  lines = []
  res = experiment.train_and_evaluate(cfg, work, log=lines.append)
  return work, at_crash, res, lines


def test_run_learns_and_writes_everything(small_config, tmp_path):
  lines = []
  cfg = small_config.replace(
    partition='iid', alpha=0.1, rounds=5, local_epochs=3
  )
  res = experiment.train_and_evaluate(cfg, str(tmp_path), log=lines.append)
  files = set(os.listdir(tmp_path))
  assert {
    'metrics.jsonl',
    'clients.jsonl',
    'config.json',
    'partition.json',
    'learning_curve.png',
    'checkpoints',
  } <= files
  rows = metrics_io.read(str(tmp_path / 'metrics.jsonl'))
  assert [r['round'] for r in rows] == [1, 2, 3, 4, 5]
  assert [('test_accuracy' in r) for r in rows] == [
    False,
    True,
    False,
    True,
    True,
  ]
  # Per-client records: the round's totals are their sums, its training
  # loss their example-weighted mean.
  per_client = metrics_io.read(str(tmp_path / 'clients.jsonl'))
  assert [c['round'] for c in per_client] == [1, 2, 3, 4, 5]
  for row, c in zip(rows, per_client):
    assert [x['id'] for x in c['clients']] == row['client_ids']
    assert sum(x['examples'] for x in c['clients']) == row['num_examples']
    assert sum(x['steps'] for x in c['clients']) == row['num_steps']
    for x in c['clients']:  # local_epochs of batch_size (all clients 150)
      steps = cfg.local.local_epochs * -(-x['examples'] // cfg.local.batch_size)
      assert x['steps'] == steps
    mean = sum(x['examples'] * x['loss'] for x in c['clients'])
    assert mean / row['num_examples'] == pytest.approx(row['train_loss'])
    assert 'local_accuracy' not in c  # FedAvg has one model
  # Evaluation is timed apart from the round, on the rounds that evaluate;
  # the elapsed time covers both.
  assert ['eval_time_s' in r for r in rows] == [
    'test_accuracy' in r for r in rows
  ]
  for before, row in zip(rows, rows[1:]):
    spent = row['elapsed_s'] - before['elapsed_s']
    assert 0 < row['round_time_s'] + row.get('eval_time_s', 0.0) <= spent
  # Real learning on real data: 10 classes, chance is 0.1. (This run ends
  # at 65 % of the test set on Intel Sapphire Rapids and a little above on
  # AMD EPYC: the bound leaves room for each CPU's rounding.)
  assert rows[-1]['test_accuracy'] >= 0.6
  assert rows[-1]['train_loss'] < rows[0]['train_loss']
  saved = json.load(open(tmp_path / 'config.json'))
  assert saved['partition'] == 'iid'
  # Provenance: one record of this process.
  (record,) = saved['provenance']
  assert record['packages']['jax'] == jax.__version__
  assert record['devices'] == {
    'platform': 'cpu',
    'kind': jax.devices()[0].device_kind,
    'count': 2,
    'processes': 1,
  }
  assert record['host'] == socket.gethostname()
  started = datetime.datetime.fromisoformat(record['start_time'])
  assert abs(time.time() - started.timestamp()) < 600
  head = subprocess.run(
    ['git', '-C', REPO, 'rev-parse', 'HEAD'], capture_output=True, text=True
  )
  if head.returncode == 0:  # the suite runs from a git checkout
    assert record['source']['commit'] == head.stdout.strip()
  # Two host devices with the default (im2col) gradient: bit-reproducible,
  # so no note (tests/pipeline/test_determinism.py).
  assert distributed.CPU_DEVICES_NOTE not in lines
  part = json.load(open(tmp_path / 'partition.json'))
  assert sum(part['sizes']) == 1500 and len(part['sizes']) == 10
  assert any(
    line.startswith('round 5/5 | train loss')
    and 'ETA' in line
    and 'rounds/s' in line
    and 'test acc' in line
    for line in lines
  )
  assert 'final test accuracy' in lines[-1]
  assert int(res.state.round) == 5


def test_energy_mix_replays_the_sampled_clients(small_config, tmp_path):
  from fedjax_mr.energy import coordinator
  from fedjax_mr.energy import profiles

  mixes = ['tx2_literal', 'tx2_chained@1:0.5,tx2_chained@0.5:0.5']
  cfg = small_config.replace(
    rounds=3, energy_mix=';'.join(mixes), energy_ms_per_sample=4
  )
  lines = []
  experiment.train_and_evaluate(cfg, str(tmp_path), log=lines.append)
  rows = metrics_io.read(str(tmp_path / 'metrics.jsonl'))
  sizes = json.load(open(tmp_path / 'partition.json'))['sizes']
  for row in rows:
    ids = row['client_ids']
    assert len(set(ids)) == 4 and all(0 <= i < 10 for i in ids)
  energy = json.load(open(tmp_path / energy_report.ENERGY_FILE))
  assert list(energy) == mixes
  # One device kind: the round time at the highest frequency is the largest
  # client's epochs x examples x 4 ms, sped up by the fastest config.
  tx2 = profiles.get_profile('tx2_literal')
  e = energy['tx2_literal']
  assert e['rounds_simulated'] == 3
  for row, r in zip(rows, e['rounds']):
    assert r['clients'] == row['client_ids']
    epochs = cfg.local.local_epochs
    work = max(epochs * sizes[i] * 0.004 for i in row['client_ids'])
    expected = coordinator.reference_time_s(tx2, base_time_s=work)
    helpers.assert_close(
      r['default_time_s'], expected / tx2.speedup[tx2.fastest], rtol=1e-9
    )
  # The first round has no previous round to set a deadline from.
  assert [r['deadline_s'] is None for r in e['rounds']] == [True, False, False]
  # tx2_literal's default (fastest) config is also its cheapest per unit of
  # work: above the 1.9 W idle, (8.55 - 1.9) W / 1.38 = 4.82 J a second of
  # config-1 work, against 5.6 and 6.18 J for the others: nothing to save.
  # Half the chained devices at half speed leave slack to slow the others.
  assert energy[mixes[0]]['energy_saving'] == 0.0
  assert 0.01 < energy[mixes[1]]['energy_saving'] < 1
  for mix in mixes:
    assert any(
      line.startswith(f'energy, {mix}: coordinator saves') for line in lines
    )


def _equals_reference(res, work, ref):
  helpers.tree_equal(jax.device_get(res.state), jax.device_get(ref.state))
  assert _no_times(res.history) == _no_times(ref.history)
  assert _no_times(metrics_io.read(os.path.join(work, 'metrics.jsonl'))) == (
    _no_times(ref.history)
  )
  assert metrics_io.read(os.path.join(work, 'clients.jsonl')) == (
    metrics_io.read(os.path.join(ref.workdir, 'clients.jsonl'))
  )


def test_kill_and_resume_equals_uninterrupted(
  small_config, reference, tmp_path
):
  # Ctrl-C / SIGTERM: saves round 3 on the way out.
  work = str(tmp_path / 'killed')
  with pytest.raises(KeyboardInterrupt):
    experiment.train_and_evaluate(
      small_config,
      work,
      log=_quiet,
      on_round=_interrupt_at(3, KeyboardInterrupt()),
    )
  lines = []
  res = experiment.train_and_evaluate(small_config, work, log=lines.append)
  assert lines[0] == f'resuming {work} after round 3'
  _equals_reference(res, work, reference)


def test_crash_and_resume_equals_uninterrupted(crashed, reference):
  # A hard crash: resumes from round 2's save.
  work, _, res, lines = crashed
  assert lines[0] == f'resuming {work} after round 2'
  _equals_reference(res, work, reference)


@pytest.mark.parametrize(
  'where,interrupts,expected_resume',
  [('append', 1, 3), ('append', 2, 2), ('log', 1, 3)],
)
def test_interrupt_while_a_rounds_row_is_written_loses_no_row(
  small_config,
  reference,
  tmp_path,
  monkeypatch,
  where,
  interrupts,
  expected_resume,
):
  """A signal between a round's update and its metrics row (a SIGTERM lands
  while the host waits for the round's results or its evaluation) must not
  checkpoint a round whose row is missing: the resumed run would skip it.
  One interrupt: the row is finished on the way out and round 3 is saved; a
  second one during that: round 2's checkpoint is kept. After the row is
  written (while logging it) the row must not be written twice."""
  ref = reference
  append = metrics_io.append
  left = [interrupts]

  def interrupted_append(path, row):
    # Between round 3's clients row and its metrics row.
    if path.endswith('metrics.jsonl') and row['round'] == 3 and left[0]:
      left[0] -= 1
      raise KeyboardInterrupt
    append(path, row)

  logged = []

  def interrupted_log(line):
    logged.append(line)
    if where == 'log' and line.startswith('round 3/') and left[0]:
      left[0] -= 1
      raise KeyboardInterrupt

  work = str(tmp_path / 'killed')
  if where == 'append':
    monkeypatch.setattr(metrics_io, 'append', interrupted_append)
  with pytest.raises(KeyboardInterrupt):
    experiment.train_and_evaluate(
      small_config,
      work,
      log=interrupted_log,
    )
  monkeypatch.setattr(metrics_io, 'append', append)
  assert left == [0]
  # Finishing round 3's record on the way out wrote its clients row once.
  with open(os.path.join(work, 'clients.jsonl')) as f:
    assert [json.loads(line)['round'] for line in f] == [1, 2, 3]
  assert logged[-1] == (
    f'interrupted: saved a checkpoint after round {expected_resume}'
    if expected_resume == 3
    else 'round 3 could not be finished; the run resumes after round 2'
  )
  lines = []
  res = experiment.train_and_evaluate(small_config, work, log=lines.append)
  assert lines[0] == f'resuming {work} after round {expected_resume}'
  helpers.tree_equal(jax.device_get(res.state), jax.device_get(ref.state))
  assert _no_times(metrics_io.read(os.path.join(work, 'metrics.jsonl'))) == (
    _no_times(ref.history)
  )


def test_resume_with_more_rounds_continues(small_config, reference, tmp_path):
  experiment.train_and_evaluate(
    small_config.replace(rounds=2), str(tmp_path), log=_quiet
  )
  res = experiment.train_and_evaluate(small_config, str(tmp_path), log=_quiet)
  helpers.tree_equal(jax.device_get(res.state), jax.device_get(reference.state))
  # The resuming process added its provenance record to the first one's.
  records = json.load(open(tmp_path / 'config.json'))['provenance']
  assert len(records) == 2
  assert records[0]['start_time'] <= records[1]['start_time']


def _same_scalars(workdir, rows):
  """The TensorBoard event files show exactly the metrics rows' numbers."""
  shown = tensorboard.read_scalars(os.path.join(workdir, 'tensorboard'))
  for key in ('train_loss', 'test_accuracy', 'round_time_s', 'num_steps'):
    expected = [(r['round'], r[key]) for r in rows if key in r]
    assert [s for s, _ in shown[key]] == [s for s, _ in expected], key
    helpers.assert_close(
      [v for _, v in shown[key]], [v for _, v in expected], rtol=1e-6
    )
  assert 'client_ids' not in shown and 'round' not in shown


def test_tensorboard_events_match_metrics_across_a_resume(
  crashed, small_config, tmp_path
):
  # The crash after round 3 (checkpoint 2) and its resume.
  work, at_crash, res, _ = crashed
  _same_scalars(
    at_crash, metrics_io.read(os.path.join(at_crash, 'metrics.jsonl'))
  )
  # Round 3 was run twice: TensorBoard shows it once, the second time.
  assert len(os.listdir(os.path.join(work, 'tensorboard'))) == 2
  _same_scalars(work, res.history)
  # Whether the folder is made does not depend on how many rounds run.
  off = small_config.replace(tensorboard=False, rounds=1)
  experiment.train_and_evaluate(off, str(tmp_path / 'off'), log=_quiet)
  assert not os.path.exists(tmp_path / 'off' / 'tensorboard')


def test_workdir_of_another_config_is_an_error(
  small_config, reference, tmp_path
):
  work = _copy_of(reference, tmp_path)
  with pytest.raises(errors.ConfigError, match=r'`alpha=0.5` there, 0.3 here'):
    experiment.train_and_evaluate(
      small_config.replace(alpha=0.3), work, log=_quiet
    )


def test_non_finite_loss_stops_with_round_and_keeps_files(
  small_config, tmp_path
):
  cfg = small_config.replace(lr=1e9, momentum=0.0)
  with pytest.raises(errors.NonFiniteError, match=r'at round 1; stopped'):
    experiment.train_and_evaluate(cfg, str(tmp_path), log=_quiet)
  rows = metrics_io.read(str(tmp_path / 'metrics.jsonl'))
  assert len(rows) == 1 and not np.isfinite(rows[0]['train_loss'])
  # The learning curve is drawn all the same (with the divergence marked).
  assert (tmp_path / records.CURVE_FILE).read_bytes()[:4] == b'\x89PNG'


@pytest.mark.parametrize(
  'changes,flag',
  [
    ({'algorithm': 'fedsgd'}, '`algorithm`'),
    ({'model': 'resnet1000'}, '`model`'),
    ({'dataset': 'imagenet'}, '`dataset`'),
    ({'partition': 'pathological'}, '`partition`'),
    ({'partition': 'file', 'alpha': 0.1}, '`partition_file'),
    (
      {'partition': 'shards', 'alpha': 0.1, 'shards_per_client': 151},
      '`num_clients=10` × `shards_per_client=151` = 1510 shards',
    ),
    ({'alpha': 0.0}, '`alpha`'),
    ({'alpha': -1.0}, '`alpha`'),
    ({'clients_per_round': 11}, '`clients_per_round'),
    ({'num_clients': 0}, '`num_clients`'),
    ({'batch_size': 0}, '`batch_size`'),
    ({'local_epochs': -1}, '`local_epochs`'),
    ({'rounds': 0}, '`rounds`'),
    ({'lr': 0.0}, '`lr`'),
    ({'lr': -0.1}, '`lr`'),
    ({'momentum': 1.0}, '`momentum`'),
    ({'eval_every': -1}, '`eval_every`'),
    ({'data_dir': '/nonexistent/dir'}, '`data_dir`'),
    ({'num_clients': 1000, 'clients_per_round': 4}, '`num_clients=1000`'),
    ({'clients_per_round': 1}, '`clients_per_round=1` is fewer than'),
    ({'num_devices': 3}, '`num_devices=3`'),
    ({'client_chunk': -1}, '`client_chunk`'),
    ({'process_id': 1}, '`process_id`'),
    ({'energy_mix': 'tx2_literal:1;nosuch:1'}, "`energy_mix`: 'nosuch:1'"),
    ({'energy_mix': 'tx2_literal@0:1'}, '`energy_mix`'),
    ({'energy_ms_per_sample': 0.0}, '`energy_ms_per_sample`'),
  ],
)
def test_bad_input_names_the_flag(small_config, tmp_path, changes, flag):
  with pytest.raises(errors.UserError) as e:  # building, or starting
    cfg = small_config.replace(**changes)
    experiment.train_and_evaluate(cfg, str(tmp_path), log=_quiet)
  assert flag in str(e.value)


def test_unreadable_data_dir(small_config, tmp_path):
  if os.geteuid() == 0:
    # root reads everything: use a file where a folder is expected instead.
    bad = tmp_path / 'file'
    bad.write_text('x')
  else:
    bad = tmp_path / 'locked'
    bad.mkdir()
    bad.chmod(0)
  cfg = small_config.replace(data_dir=str(bad))
  with pytest.raises(errors.DataError, match='`data_dir`'):
    experiment.train_and_evaluate(cfg, str(tmp_path / 'w'), log=_quiet)


def _binary(args, **kw):
  return subprocess.Popen(
    [sys.executable, '-m', 'experiments.run', *args],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    **kw,
  )


def _flags(cfg, workdir):
  return [f'--{k}={v}' for k, v in cfg.to_dict().items() if k != 'workdir'] + [
    f'--workdir={workdir}'
  ]


def _client_rows(exp):
  """Each client's example indices, as the device data holds them."""
  flat, offsets = np.asarray(exp.data.flat), np.asarray(exp.data.offsets)
  sizes = np.asarray(exp.data.sizes)
  return [flat[o : o + n].tolist() for o, n in zip(offsets, sizes)]


def test_shards_partition_runs(small_config, tmp_path):
  # Clients of 150 and 3 epochs: the round of the IID test above, compiled
  # once per session (the persistent compilation cache).
  cfg = small_config.replace(
    partition='shards',
    alpha=0.1,
    rounds=1,
    local_epochs=3,
    eval_every=1,
  )
  exp = experiment.setup(cfg)
  labels = datasets.load('fashion_mnist', cfg.data.data_dir).y_train
  want = partition_lib.shards(labels, 10, 2, cfg.run.seed)
  assert _client_rows(exp) == [p.tolist() for p in want]
  res = experiment.run(exp, str(tmp_path), log=_quiet)
  part = json.load(open(tmp_path / 'partition.json'))
  # 20 shards of 75 of 1,500 examples: 150 each, each client few classes
  # (at most 2 x 2 when its shards straddle class boundaries).
  assert part['sizes'] == [150] * 10 and part['unassigned'] == 0
  hists = part['label_histograms']
  assert hists == partition_lib.summary(want, labels, 10)['label_histograms']
  assert max(np.count_nonzero(h) for h in hists) <= 4
  assert json.load(open(tmp_path / 'config.json'))['shards_per_client'] == 2
  assert np.isfinite(res.history[-1]['test_accuracy'])


def test_dirichlet_equal_partition_gives_the_libraries_clients(small_config):
  cfg = small_config.replace(partition='dirichlet_equal', alpha=0.3)
  exp = experiment.setup(cfg)
  labels = datasets.load('fashion_mnist', cfg.data.data_dir).y_train
  want = partition_lib.dirichlet_equal(labels, 10, 0.3, cfg.run.seed)
  assert _client_rows(exp) == [p.tolist() for p in want]
  assert {len(p) for p in want} == {150}  # 1,500 examples, equal clients


def test_file_partition_runs_and_resumes_only_with_the_same_file(
  small_config, tmp_path
):
  # 10 clients over the first 1,400 of the 1,500 examples, in a shuffled
  # order, sizes 130..150; examples 1400-1499 are in no client.
  order = np.random.default_rng(0).permutation(1400)
  cuts = np.cumsum([150, 130, 140, 150, 130, 140, 150, 130, 140])
  clients = [c.tolist() for c in np.split(order, cuts)]
  path = tmp_path / 'split.json'
  path.write_text(json.dumps(clients))
  cfg = small_config.replace(
    partition='file',
    partition_file=str(path),
    alpha=0.1,
    rounds=1,
    local_epochs=3,
    eval_every=1,
  )
  sha = hashlib.sha256(path.read_bytes()).hexdigest()
  assert cfg.partition.sha256 == ''  # building a config reads no file
  cfg = config_lib.with_file_digest(cfg)  # what a run does where it starts
  assert cfg.partition.sha256 == sha
  exp = experiment.setup(cfg)
  assert _client_rows(exp) == clients  # the file's lists, in its order
  work = str(tmp_path / 'run')
  lines = []
  experiment.run(exp, work, log=lines.append)
  assert (
    'note: 100 of 1500 training examples are in no client (`partition=file`)'
    in lines
  )
  part = json.load(open(os.path.join(work, 'partition.json')))
  assert part['sizes'] == [len(c) for c in clients]
  assert part['unassigned'] == 100
  saved = json.load(open(os.path.join(work, 'config.json')))
  assert saved['partition_sha256'] == sha
  (row,) = metrics_io.read(os.path.join(work, 'clients.jsonl'))
  for c in row['clients']:
    assert c['examples'] == len(clients[c['id']])
  # The same content at another path resumes (nothing left to train) ...
  moved = tmp_path / 'moved.json'
  moved.write_bytes(path.read_bytes())
  again = config_lib.ExperimentConfig.from_flat(
    **{**cfg.to_dict(), 'partition_file': str(moved), 'partition_sha256': ''}
  )
  lines = []
  experiment.train_and_evaluate(again, work, log=lines.append)
  assert any(line.startswith('resuming') for line in lines)
  # ... another content, with the same flags, is refused.
  path.write_text(json.dumps(clients[::-1]))
  changed = config_lib.ExperimentConfig.from_flat(
    **{**cfg.to_dict(), 'partition_sha256': ''}
  )
  with pytest.raises(
    errors.ConfigError, match=rf"`partition_sha256='{sha}'` there"
  ):
    experiment.train_and_evaluate(changed, work, log=_quiet)


def test_file_partition_index_past_the_dataset(small_config, tmp_path):
  path = tmp_path / 'split.json'
  path.write_text(json.dumps([[i] for i in range(9)] + [[9, 1500]]))
  cfg = small_config.replace(
    partition='file', partition_file=str(path), alpha=0.1
  )
  checks.validate(cfg)  # the range needs the dataset
  with pytest.raises(errors.ConfigError) as e:
    experiment.setup(cfg)
  assert str(e.value) == (
    f'`partition_file={path}`: client 9 holds index 1500, out of range '
    '(the training set has 1500 examples)'
  )


# Memory-mapped only: the kill and the resume walk the same code whatever
# the placement (the training set on the devices, `auto` here, resumes
# after a hard crash in test_crash_and_resume_equals_uninterrupted).
def test_binary_sigkill_then_resume_matches(small_config, reference, tmp_path):
  """Killed once round 3 is logged and resumed: the rows of a run that was not
  killed; with the training set memory-mapped and each round's examples
  gathered while the round before trains, those of the set on the
  devices."""
  ref = reference
  cfg = small_config.replace(data_placement='memmap')
  work = str(tmp_path / 'bin')
  proc = _binary(_flags(cfg, work))
  for line in proc.stdout:
    if line.startswith('round 3/4'):
      proc.send_signal(signal.SIGKILL)
      break
  proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  proc = _binary(_flags(cfg, work))
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err
  assert 'resuming' in out and 'after round 2' in out
  assert 'memory-mapped from an unnamed file in the workdir' in out
  assert "the next round's gathered while one trains" in out
  rows = metrics_io.read(os.path.join(work, 'metrics.jsonl'))
  assert _no_times(rows) == _no_times(ref.history)


@pytest.mark.parametrize(
  'args,expected',
  [
    (['--alpha=-1'], 'error: --alpha must be finite and > 0'),
    (['--model=vgg99'], 'error: --model: unknown value'),
    (['--clients_per_round=500'], 'error: --clients_per_round=500 exceeds'),
  ],
)
def test_binary_bad_input_is_one_clear_line(tmp_path, args, expected):
  proc = _binary([*args, f'--workdir={tmp_path}'])
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 2
  assert err.strip().startswith(expected), err
  assert 'Traceback' not in err and len(err.strip().splitlines()) == 1


def test_binary_helpfull_documents_every_flag():
  proc = _binary(['--helpfull'])
  out, _ = proc.communicate(timeout=120)
  names = [f.name for f in config_lib.base_fields()]
  names += list(registry.all_flags())  # fedprox_mu, scaffold_control_dtype, ...
  assert 'fedprox_mu' in names and 'options' not in names
  for name in names:
    assert f'--{name}' in out or f'--[no]{name}' in out, name
  for algorithm in registry.REGISTRY:
    assert algorithm in out


def test_load_run_gives_back_config_state_model_and_history(
  small_config, reference, tmp_path
):
  # The reference run: 4 rounds, checkpoints after rounds 2 and 4.
  cfg, res = small_config, reference
  work = _copy_of(reference, tmp_path)
  back = experiment.load_run(work)
  assert back.config == cfg.replace(workdir='')
  assert back.round == 4 and back.history == res.history
  helpers.tree_equal(jax.device_get(back.state), jax.device_get(res.state))
  # The model is the run's: its logits on a batch are the state's.
  x = np.zeros((2, 28, 28, 1), np.float32)
  logits = back.model.apply_eval(back.state.server.params, x)
  assert logits.shape == (2, 10) and np.isfinite(logits).all()
  # An earlier checkpoint still kept, and a round without one.
  two = experiment.load_run(work, round_index=2)
  assert two.round == 2 and two.history == res.history[:2]
  assert not np.array_equal(
    jax.tree.leaves(jax.device_get(two.state.server.params))[0],
    jax.tree.leaves(jax.device_get(back.state.server.params))[0],
  )
  with pytest.raises(errors.ConfigError, match='no checkpoint of round 1$'):
    experiment.load_run(work, round_index=1)
  with pytest.raises(
    errors.ConfigError, match=r'config\.json: cannot read it: No such file'
  ):
    experiment.load_run(str(tmp_path / 'nothing'))
  assert not os.path.exists(tmp_path / 'nothing')


def test_a_run_started_from_python_gets_the_command_lines_devices(
  small_fmnist_dir, tmp_path
):
  # A fresh interpreter without the tests' device flags: setup() chooses
  # the host devices as experiments.run does (one per core, at most K).
  # The tests' compile flags (tests/xla_flags.py) stay: they change how
  # fast XLA compiles, not the devices, and let the interpreter read back
  # what this session compiled (the session's compilation cache).
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}
  env['XLA_FLAGS'] = ' '.join(
    f
    for f in env.get('XLA_FLAGS', '').split()
    if not f.startswith('--xla_force_host_platform_device_count')
  )
  code = (
    'import jax; from fedjax_mr.runtime import distributed; '
    'from fedjax_mr.pipeline import experiment; '
    'from tests import helpers; '
    f'cfg = helpers.small_config({small_fmnist_dir!r}, clients_per_round=3); '
    'e = experiment.setup(cfg); '
    'print(len(jax.devices()), e.mesh.devices.size, '
    'distributed.auto_host_devices(3))'
  )
  out = subprocess.run(
    [sys.executable, '-c', code],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.split()
  have, mesh, want = map(int, out)
  assert have == mesh == want


@pytest.mark.parametrize('algorithm', ['fedavg', 'scaffold', 'clusamp'])
def test_data_in_host_memory_gives_the_same_run(
  small_config, tmp_path, algorithm
):
  """`data_placement=host` and `memmap` (each round sends the devices its
  clients' examples, gathered while the round before trains; SCAFFOLD's
  controls in host memory too; CluSamp's sampler reads each round's
  result, so its rounds are gathered after it) against the whole set on
  every device: the same rows and final state, bit for bit, the first
  lines say which placement was chosen, and the memory-mapped file leaves
  nothing in the workdir."""
  runs = {}
  # `host` and `memmap` differ only in the training set's array (a
  # memory-mapped file's), not in what an algorithm does with it:
  # FedAvg's runs show both, the others' `memmap` alone.
  placements = ('host', 'memmap') if algorithm == 'fedavg' else ('memmap',)
  for placement in ('device', *placements):
    lines = []
    cfg = small_config.replace(
      algorithm=algorithm, data_placement=placement, rounds=2
    )
    result = experiment.train_and_evaluate(
      cfg, str(tmp_path / placement), log=lines.append
    )
    runs[placement] = (result, '\n'.join(lines))
  a, lines = runs['device']
  assert 'training data on every device' in lines
  if 'host' in runs:
    assert 'training data in host memory' in runs['host'][1]
  assert (
    'training data memory-mapped from an unnamed file in the workdir'
    in runs['memmap'][1]
  )
  ahead = (
    "not prefetched: the sampler reads each round's result"
    if algorithm == 'clusamp'
    else "the next round's gathered while one trains"
  )
  drop = lambda rows: [  # noqa: E731
    {k: v for k, v in r.items() if not k.endswith('_s')} for r in rows
  ]
  for placement in placements:
    b, lines_b = runs[placement]
    assert ahead in lines_b
    assert drop(a.history) == drop(b.history)
    for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert (
      open(tmp_path / 'device' / 'clients.jsonl').read()
      == open(tmp_path / placement / 'clients.jsonl').read()
    )
    assert sorted(os.listdir(tmp_path / placement)) == sorted(
      os.listdir(tmp_path / 'device')
    )


def test_auto_placement_keeps_a_small_set_on_the_devices(small_config):
  from fedjax_mr.pipeline import build

  ex = experiment.setup(small_config)
  assert build.data_placement(small_config, ex.data, ex.mesh) == 'device'
  # A machine whose memory a quarter of which the set exceeds: host.
  share = build.DEVICE_DATA_SHARE
  try:
    build.DEVICE_DATA_SHARE = 1e-9
    assert build.data_placement(small_config, ex.data, ex.mesh) == 'host'
    # ... and more than half of whose memory it takes: memory-mapped.
    host_share = build.HOST_DATA_SHARE
    try:
      build.HOST_DATA_SHARE = 1e-9
      assert build.data_placement(small_config, ex.data, ex.mesh) == 'memmap'
    finally:
      build.HOST_DATA_SHARE = host_share
  finally:
    build.DEVICE_DATA_SHARE = share


@pytest.mark.parametrize('name', ['fedmr', 'fedavg'])
def test_a_round_that_stacks_more_models_than_memory_is_refused(
  monkeypatch, name
):
  # FedMR keeps each of its K clients' models (STACKED_MODELS_PER_CLIENT
  # copies on the CPU's shared memory): refused one byte short of that
  # bound, before anything allocates; FedAvg sums the models as they
  # finish and is never refused.
  from fedjax_mr.models import model as model_lib
  from fedjax_mr.pipeline import build

  config = config_lib.ExperimentConfig.from_flat(
    algorithm=name, partition='iid', num_clients=100, clients_per_round=100
  )
  model = model_lib.get(config.model.name, 10, (28, 28, 1))
  variables = model.init(jax.random.key(0))
  algorithm = build.build_algorithm(
    config, model, variables, checks.hparams(config)
  )
  mesh = distributed.mesh_for(config.devices, config.server.clients_per_round)
  need = 100 * build.STACKED_MODELS_PER_CLIENT * 66_130 * 4  # float32
  monkeypatch.setattr(build, '_memory_bytes', lambda device: need)
  build.check_round_memory(config, algorithm, variables, mesh)
  monkeypatch.setattr(build, '_memory_bytes', lambda device: need - 1)
  if name == 'fedavg':
    build.check_round_memory(config, algorithm, variables, mesh)
    return
  with pytest.raises(errors.ConfigError) as e:
    build.check_round_memory(config, algorithm, variables, mesh)
  assert str(e.value) == (
    "`clients_per_round=100`: `algorithm=fedmr` keeps every client's model "
    'of a round, at least 0.1 GiB (4 models of 0.25 MiB a client), more '
    'than the 0.1 GiB of this machine'
  )
