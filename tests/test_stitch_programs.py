"""pretrain_zoo and stitch run end to end on real data; bad flags are clear."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from fedjax_mr.stitch import state as state_lib
from tests import fork_server
from tests.energy import fake_sysfs

# Each program in a process of its own, forked from one that imported the
# libraries once (tests/fork_server.py); the SIGTERM test's
# interrupted run is a process of the test's own.
_run = fork_server.run_module
_LOG = re.compile(r'^[IWEF]\d{4} ')  # absl log lines (not errors)


@pytest.fixture(scope='module')
def small_pool(small_fmnist_dir, tmp_path_factory):
  out = tmp_path_factory.mktemp('pool')
  proc = _run(
    'experiments.pretrain_zoo',
    f'--data_dir={small_fmnist_dir}',
    '--models=cnn_mnist,cnn_femnist',
    '--public_size=500',
    '--epochs=3',
    f'--workdir={out}',
  )
  assert proc.returncode == 0, proc.stderr
  return out, proc.stdout


def test_pretrain_zoo_saves_a_pool(small_pool):
  out, stdout = small_pool
  assert re.search(r'^cnn_mnist: test accuracy [\d.]+ %', stdout, re.M)
  split = json.load(open(os.path.join(out, 'public.json')))
  assert len(split['indices']) == 500
  meta = json.load(open(os.path.join(out, 'cnn_femnist', 'meta.json')))
  assert meta['model'] == 'cnn_femnist' and meta['input_shape'] == [28, 28, 1]
  # Trained on 500 real examples, it beats chance (10 %) by far.
  assert meta['test_accuracy'] > 0.4


def _small_stitch(small_pool, small_fmnist_dir):
  """The program and the flags of a small FedStitch run."""
  pool_dir, _ = small_pool
  return (
    'experiments.stitch',
    f'--pool={pool_dir}',
    f'--data_dir={small_fmnist_dir}',
    '--num_clients=6',
    '--clients_per_round=3',
    '--rounds_per_selection=2',
    '--batch_size=32',
  )


def test_stitch_runs_evaluates_and_resumes(
  small_pool, small_fmnist_dir, tmp_path
):
  args = (
    *_small_stitch(small_pool, small_fmnist_dir),
    '--eval=both',
    '--knn_reference=300',
    '--local_clients=1',
    f'--workdir={tmp_path}',
  )
  proc = _run(*args)
  assert proc.returncode == 0, proc.stderr
  out = proc.stdout
  # At most (max_depth 8 − 1) × 2 rounds; the ETA bounds those left.
  assert re.search(
    r'^round +0 +depth 1 +pool \d+,\d+ .* \| 1/≤14 rounds \| elapsed '
    r'[\d.]+s \| [\d.]+ rounds/s \| ETA ≤ \d+s$',
    out,
    re.M,
  )
  # Without a deadline every client runs at the highest frequency.
  assert re.search(
    r'^    energy [\d.]+ J \(highest frequency [\d.]+ J\); no deadline yet;'
    r' configs table2_3_MAXN ×3$',
    out,
    re.M,
  )
  assert re.search(
    r'^Local 1/1 \(client \d+ alone\): best [\d.]+ % of \d+ networks \| '
    r'elapsed [\d.]+s \| ETA 0s$',
    out,
    re.M,
  )
  assert re.search(
    r'^energy \(simulated, tx2_chained@1:0.3,.*\): local coordinators '
    r'[\d.]+ J vs [\d.]+ J at the highest frequency, saving',
    out,
    re.M,
  )
  check_recording(tmp_path)
  results = json.load(open(tmp_path / 'results.json'))
  nets = results['networks']
  assert nets, 'no stitched network'
  for n in nets:
    assert 0 <= n['head'] <= 1 and 0 <= n['knn'] <= 1
  # Pool models trained on 500 real examples; stitched networks of their
  # blocks still classify far above chance.
  assert results['best']['head'] > 0.4
  assert set(results['pool_models']) == {'cnn_mnist', 'cnn_femnist'}
  assert len(results['local']['best']) == 1
  assert results['peak_host_mib'] > 0
  rounds = [json.loads(line) for line in open(tmp_path / 'log.jsonl')]
  assert [r['round'] for r in rounds] == list(range(len(rounds)))
  # The clients' energy coordinators ran in the loop: every round records
  # every participant's configuration, time and energy.
  energy = (tmp_path / 'energy.jsonl').read_text()
  records = [json.loads(line) for line in energy.splitlines()]
  assert [r['round'] for r in records] == list(range(len(rounds)))
  for r, e in zip(rounds, records):
    assert [c['client'] for c in e['clients']] == r['clients']
    for c in e['clients']:
      assert c['config'].startswith('table2_') and c['energy_j'] > 0
      assert c['units'] == 32 * sum(r['pool_sizes'])
  assert all(e['deadline_s'] > 0 for e in records[1:])
  assert results['energy']['rounds'] == len(rounds)
  assert results['energy']['coordinated_energy_j'] == pytest.approx(
    sum(e['energy_j'] for e in records)
  )
  # The records of every run: a row per round, a checkpoint per round.
  rows = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  assert [r['round'] for r in rows] == [r['round'] + 1 for r in rounds]
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == sorted(
    str(len(rounds) - k) for k in (0, 1)
  )
  # A re-run resumes from its checkpoint: same networks, no new rounds.
  again = _run(*args)
  assert again.returncode == 0, again.stderr
  assert 'round ' not in again.stdout.split('stitched networks')[0]
  assert json.load(open(tmp_path / 'results.json'))['networks'] == nets
  assert (tmp_path / 'energy.jsonl').read_text() == energy
  # The networks are stored without a pickle, with the run's flags.
  finished, identity = state_lib.read_document(str(tmp_path / 'networks.npz'))
  assert sorted(f['round'] for f in finished) == sorted(
    n['round'] for n in nets
  )
  assert identity['seed'] == 0 and identity['num_clients'] == 6
  # Another setting on the same workdir is refused in one line, and
  # nothing in it is written.
  before = _files(tmp_path)
  other = _run(*args, '--partition=iid')
  assert other.returncode == 2
  assert other.stderr.count('\n') == 1 and "--partition='dirichlet'" in (
    other.stderr
  )
  assert _files(tmp_path) == before
  # A pickle left by an older version is never loaded.
  old = tmp_path / 'old'
  old.mkdir()
  (old / 'state.pkl').write_bytes(b'\x80\x04\x95 whatever')
  refused = _run(*args[:-1], f'--workdir={old}')
  assert refused.returncode == 2 and 'never unpickles' in refused.stderr


# The FedStitch run's recording (beside the training algorithms' in
# tests/pipeline/regression/, by the same rules: one exact entry per kind of
# machine, else within the cross-machine tolerance; FEDJAX_MR_RECORD=1 or
# add re-records, saying so in the commit).
STITCH_RECORDING = os.path.join(
  os.path.dirname(__file__), 'pipeline', 'regression', 'fedstitch.json'
)


def _files(folder) -> dict[str, bytes]:
  """Every file under `folder` by its path there, with its bytes (but
  the lock's, which names the last process that asked for it)."""
  return {
    str(p.relative_to(folder)): p.read_bytes()
    for p in sorted(folder.rglob('*'))
    if p.is_file() and p.name != '.lock'
  }


def _state_document(workdir) -> bytes:
  """The state document of the newest checkpoint of a FedStitch workdir
  (what state.npz held before runs kept their states in checkpoints)."""
  from fedjax_mr.runtime import checkpoint

  ckpt = checkpoint.Checkpointer(str(workdir))
  try:
    found = ckpt.find(None)
  finally:
    ckpt.close()
  return found.state[state_lib.CHECKPOINT_ENTRY].tobytes()


def _timeless(value):
  """`value` without the fields that are wall-clock times or memory."""
  if isinstance(value, dict):
    return {
      k: _timeless(v)
      for k, v in value.items()
      if not (
        k.endswith(('_time_s', '_seconds', 'seconds_per_round'))
        or k in ('run_seconds', 'selection_seconds_total', 'peak_host_mib')
      )
    }
  if isinstance(value, list):
    return [_timeless(v) for v in value]
  return value


def stitch_recording(workdir) -> dict:
  """What a FedStitch workdir's bits are: results.json, log.jsonl,
  energy.jsonl and the JSON documents of its final state (its newest
  checkpoint's, recorded under the name of the file that held it before,
  state.npz) and networks file without times, and the SHA-256 of every
  array of those documents."""
  import hashlib
  import io

  import numpy as np

  def lines(name):
    return [json.loads(x) for x in open(os.path.join(workdir, name))]

  arrays, documents = {}, {}
  with open(os.path.join(workdir, 'networks.npz'), 'rb') as f:
    held = {'state.npz': _state_document(workdir), 'networks.npz': f.read()}
  for name, data in held.items():
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
      for key in sorted(z.files):
        a = np.ascontiguousarray(z[key])
        if key == '__document__':  # JSON, holding the rounds' times
          documents[name] = _timeless(json.loads(a.tobytes()))
          continue
        h = hashlib.sha256(f'{a.shape}{a.dtype}'.encode() + a.tobytes())
        arrays[f'{name}:{key}'] = h.hexdigest()
  return {
    'results': _timeless(
      json.load(open(os.path.join(workdir, 'results.json')))
    ),
    'log': _timeless(lines('log.jsonl')),
    'energy': _timeless(lines('energy.jsonl')),
    'documents': documents,
    'arrays': arrays,
  }


def _assert_close(got, want, where=''):
  """Equal structure, strings and integers; floats within the
  cross-machine tolerance."""
  from tests.pipeline import test_regression

  if isinstance(want, dict):
    assert got.keys() == want.keys(), where
    for k in want:
      _assert_close(got[k], want[k], f'{where}/{k}')
  elif isinstance(want, list):
    assert len(got) == len(want), where
    for i, (g, w) in enumerate(zip(got, want)):
      _assert_close(g, w, f'{where}[{i}]')
  elif isinstance(want, float):
    assert got == pytest.approx(
      want, rel=test_regression.CROSS_MACHINE_RTOL, abs=1e-6
    ), where
  else:
    assert got == want, where


def check_recording(workdir) -> None:
  """The run in `workdir` against the FedStitch recording: every bit on a
  machine that has an entry, else within the cross-machine tolerance (its
  arrays' hashes are not compared then)."""
  from tests.pipeline import test_regression

  got = stitch_recording(workdir)
  numerics = test_regression.machine_numerics()
  machines = {}
  if os.path.exists(STITCH_RECORDING):
    machines = json.load(open(STITCH_RECORDING))['machines']
  mode = os.environ.get('FEDJAX_MR_RECORD')
  if mode:
    if mode == 'add' and machines:
      want = next(iter(machines.values()))
      _assert_close({**got, 'arrays': {}}, {**want, 'arrays': {}})
    else:
      machines = {}
    machines[numerics] = got
    with open(STITCH_RECORDING, 'w') as f:
      json.dump({'machines': machines}, f, indent=1)
    return
  if numerics in machines:
    assert got == machines[numerics]
    return
  want = next(iter(machines.values()))
  _assert_close({**got, 'arrays': {}}, {**want, 'arrays': {}})


def test_sigterm_says_so_and_the_run_resumes_to_the_same_networks(
  small_pool, small_fmnist_dir, tmp_path
):
  args = (
    *_small_stitch(small_pool, small_fmnist_dir),
    '--eval_examples=200',
  )
  whole = _run(*args, f'--workdir={tmp_path / "whole"}')
  assert whole.returncode == 0, whole.stderr
  cut = tmp_path / 'cut'
  proc = subprocess.Popen(
    [sys.executable, '-m', *args, f'--workdir={cut}'],
    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'},
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  lines = []
  for line in proc.stdout:  # the first round ends, its state is saved
    lines.append(line)
    if line.startswith('round   1 '):
      proc.send_signal(signal.SIGTERM)
      break
  out, err = proc.communicate(timeout=300)
  out = ''.join(lines) + out
  assert proc.returncode == 130, err
  said = [x for x in err.splitlines() if x.strip() and not _LOG.match(x)]
  assert said == ['interrupted; re-run with the same flags to resume']
  done = re.findall(r'state after round (\d+)', out)
  assert len(done) == 1 and int(done[0]) >= 1, out
  assert not (cut / 'results.json').exists()
  again = _run(*args, f'--workdir={cut}')
  assert again.returncode == 0, again.stderr
  first = re.search(r'^round +(\d+) ', again.stdout, re.M)
  assert first and int(first.group(1)) == int(done[0]) + 1
  results = [
    json.load(open(tmp_path / w / 'results.json')) for w in ('whole', 'cut')
  ]
  assert results[0]['networks'] and (
    results[1]['networks'] == results[0]['networks']
  )


def test_transfer_setting_pool_on_five_classes_clients_on_the_others(
  small_fmnist_dir, tmp_path
):
  pool_dir = tmp_path / 'pool'
  made = _run(
    'experiments.pretrain_zoo',
    f'--data_dir={small_fmnist_dir}',
    '--models=cnn_mnist',
    '--public_size=500',
    '--epochs=2',
    '--classes=0-4',
    f'--workdir={pool_dir}',
  )
  assert made.returncode == 0, made.stderr
  meta = json.load(open(pool_dir / 'cnn_mnist' / 'meta.json'))
  assert meta['classes'] == [0, 1, 2, 3, 4] and meta['num_classes'] == 5
  # Its test accuracy is over the five classes it learnt (chance 20 %).
  assert meta['test_accuracy'] > 0.5
  args = (
    'experiments.stitch',
    f'--pool={pool_dir}',
    f'--data_dir={small_fmnist_dir}',
    '--classes=5-9',
    '--num_clients=4',
    '--clients_per_round=2',
    '--rounds_per_selection=1',
    '--num_selections=2',
    '--batch_size=16',
    '--knn_reference=200',
  )
  # The pool's head answers classes 0-4: evaluating by it is refused.
  head = _run(*args, f'--workdir={tmp_path / "head"}')
  assert head.returncode == 2 and head.stderr.count('\n') == 1
  assert 'use --eval=knn' in head.stderr
  assert not (tmp_path / 'head').exists()
  run = tmp_path / 'run'
  shards = ('--partition=shards', '--shards_per_client=1')
  probe = ('--eval=knn', '--knn_at=trunk')
  proc = _run(*args, *shards, *probe, f'--workdir={run}')
  assert proc.returncode == 0, proc.stderr
  results = json.load(open(run / 'results.json'))
  # The probe read each finished network's features, not its five logits
  # of the pool's classes.
  assert results['knn_at'] == 'trunk'
  # A kNN probe on features learnt from the other five classes still
  # tells these five apart far above chance (20 %).
  assert results['pool_models']['cnn_mnist']['knn'] > 0.4
  assert results['networks']
  # The clients: every non-public example of classes 5-9 once, in label-
  # sorted shards (one shard each: at most two classes per client).
  clients = json.load(open(run / 'client_indices.json'))['clients']
  public = set(json.load(open(pool_dir / 'public.json'))['indices'])
  held = sorted(i for c in clients for i in c)
  assert len(clients) == 4 and len(held) == len(set(held))
  assert not public & set(held)
  hist = json.load(open(run / 'partition.json'))['label_histograms']
  assert sum(map(sum, hist)) == len(held)
  assert all(sum(1 for n in h if n) <= 2 for h in hist)
  # The training baselines learn from the same clients: fine-tuning the
  # pool model (a new classifier: it learnt other classes) on them.
  tuned = _run(
    'experiments.run',
    f'--data_dir={small_fmnist_dir}',
    '--classes=5-9',
    '--num_clients=4',
    '--clients_per_round=4',
    '--host_devices=1',
    '--partition=file',
    f'--partition_file={run / "client_indices.json"}',
    f'--init_from={pool_dir / "cnn_mnist"}',
    '--rounds=1',
    '--local_epochs=5',
    '--batch_size=25',
    '--lr=0.05',
    '--eval_every=1',
    f'--workdir={tmp_path / "tuned"}',
  )
  assert tuned.returncode == 0, tuned.stderr
  row = json.loads(open(tmp_path / 'tuned' / 'metrics.jsonl').readline())
  # Five classes (chance 20 %), all four clients (about 125 examples
  # each, 25 local steps) from the pool's features: above chance after one
  # round (27.6 %; bit-reproducible on one device). The exact variables it
  # starts from are tests/pipeline/test_transfer_setting.py's.
  assert row['test_accuracy'] > 0.25
  saved = json.load(open(tmp_path / 'tuned' / 'config.json'))
  assert saved['classes'] == '5-9' and saved['init_from'].endswith('cnn_mnist')
  summary = json.load(open(tmp_path / 'tuned' / 'partition.json'))
  assert summary['sizes'] == [len(c) for c in clients]


@pytest.mark.parametrize('backend', ['sysfs', 'dry_run'])
def test_stitch_sets_a_jetsons_clocks_per_client_and_restores_them(
  small_pool, small_fmnist_dir, tmp_path, backend
):
  pool_dir, _ = small_pool
  tree = fake_sysfs.build_tx2_tree(tmp_path / 'tx2')

  def files():  # (A written value has no newline; that is no change.)
    return {
      str(p): p.read_bytes().strip()
      for p in sorted(tree.rglob('*'))
      if p.is_file() and not p.is_symlink()
    }

  before = files()
  proc = _run(
    'experiments.stitch',
    f'--pool={pool_dir}',
    f'--data_dir={small_fmnist_dir}',
    '--num_clients=4',
    '--clients_per_round=2',
    '--rounds_per_selection=1',
    '--max_depth=2',
    '--batch_size=16',
    '--eval_examples=50',
    f'--energy_backend={backend}',
    '--energy_profile=tx2_chained',
    f'--energy_sysfs_root={tree}',
    f'--workdir={tmp_path / "w"}',
  )
  assert proc.returncode == 0, proc.stderr
  records = [json.loads(line) for line in open(tmp_path / 'w' / 'energy.jsonl')]
  assert records and all(r['backend'] == backend for r in records)
  # The first client of the run sets MAXN (its GPU minimum, among others).
  first = records[0]['clients'][0]
  gpu_min = 'sys/class/devfreq/17000000.gp10b/min_freq'
  assert first['config'] == 'table2_3_MAXN'
  assert [gpu_min, '1300500000'] in first['writes']
  writes = sum(len(c['writes']) for r in records for c in r['clients'])
  planned = ', planned only' if backend == 'dry_run' else ''
  assert f'; {writes} sysfs writes{planned}); per client' in proc.stdout
  # Written and put back, or (dry run) never written.
  assert files() == before


def test_stitch_without_a_pool_says_how_to_make_one(small_fmnist_dir, tmp_path):
  proc = _run(
    'experiments.stitch',
    f'--pool={tmp_path}',
    f'--data_dir={small_fmnist_dir}',
    f'--workdir={tmp_path / "w"}',
  )
  assert proc.returncode != 0
  assert 'pretrain_zoo' in proc.stderr and 'Traceback' not in proc.stderr
