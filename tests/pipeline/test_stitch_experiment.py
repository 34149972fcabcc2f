"""What a FedStitch run prints: its round lines (timing, energy
configurations) and the Local baseline's lines, on hand-made entries and a
fake clock."""

import json
import os
import types

import numpy as np
import pytest

from fedjax_mr.core import errors
from fedjax_mr.pipeline import evaluation
from fedjax_mr.pipeline import progress
from fedjax_mr.pipeline import stitch_config
from fedjax_mr.pipeline import stitch_experiment
from fedjax_mr.runtime import checkpoint
from fedjax_mr.stitch import federated
from fedjax_mr.stitch import pool as pool_lib
from fedjax_mr.stitch import state as state_lib
from tests.stitch import common
from tests.stitch import test_federated as federated_tests

Pace = progress.Pace


def _entry(r, configs=('table2_3_MAXN',) * 3, deadline_s=None):
  """A log entry of round `r` (from 0) with one client per config."""
  return {
    'round': r,
    'clients': [0, 1, 2],
    'depth': 3,
    'pool_sizes': [7, 5],
    'client_time_s': [0.5, 0.25, 1.0],
    'weights': {'effective_clients': 2.94, 'max': 1.2, 'min': 0.8},
    'energy': {
      'energy_j': 12.34,
      'default_energy_j': 15.0,
      'deadline_s': deadline_s,
      'clients': [
        {'config': c, 'met': None if deadline_s is None else i != 1}
        for i, c in enumerate(configs)
      ],
    },
  }


_HEAD = (
  'round   4  depth 3  pool 7,5  selection 1.75 s  weights: effective 2.9 '
  'clients, max 1.20×, min 0.80×'
)


def test_a_round_prints_the_configurations_once_each_with_their_count():
  entry = _entry(
    4, ('table2_2', 'table2_3_MAXN', 'table2_2', 'table2_1'), deadline_s=1.5
  )
  entry['selected'] = [
    {'network': 'a[0] → b[1]', 'block': 'c[2]', 'votes': 1.5, 'mean_cka': 0.75},
    {'network': 'x[0]', 'dropped': 'no candidates'},
  ]
  assert progress.stitch_round_lines(entry) == [
    _HEAD,
    '    energy 12.3 J (highest frequency 15.0 J); deadline 1.50 s, met by '
    '3/4; configs table2_2 ×2, table2_3_MAXN ×1, table2_1 ×1',
    '    a[0] → b[1]  +  c[2]  (votes 1.5, CKA 0.750)',
  ]
  assert progress.stitch_round_lines(_entry(4))[1] == (
    '    energy 12.3 J (highest frequency 15.0 J); no deadline yet; configs '
    'table2_3_MAXN ×3'
  )
  del entry['energy']
  assert progress.stitch_round_lines(entry)[:2] == [
    _HEAD,
    '    a[0] → b[1]  +  c[2]  (votes 1.5, CKA 0.750)',
  ]


def test_equal_counts_keep_the_order_the_clients_are_in():
  clients = [{'config': c} for c in ('b', 'a', 'a', 'c', 'b')]
  assert progress.configs_text(clients) == 'b ×2, a ×2, c ×1'


def test_the_eta_bounds_the_rounds_left_at_this_process_pace():
  # Resumed after round 1: this process ran rounds 2, 3 and 4 in 30 s, so
  # 10 s a round; 5 of at most 35 are done, 30 may be left.
  lines = progress.stitch_round_lines(_entry(4), Pace(30.0, 3, 35))
  assert lines[0] == (
    f'{_HEAD} | 5/≤35 rounds | elapsed 30.0s | 0.10 rounds/s | ETA ≤ 300s'
  )
  # The last possible round leaves none.
  assert progress.pace_text(Pace(70.0, 35, 35), 35) == (
    '35/≤35 rounds | elapsed 70.0s | 0.50 rounds/s | ETA ≤ 0s'
  )


def test_the_round_limit_is_the_selections_to_max_depth_times_their_rounds():
  config = stitch_config.library_config(
    stitch_config.StitchConfig.from_flat(max_depth=8, rounds_per_selection=5)
  )
  assert federated.round_limit(config) == 35
  assert federated.round_limit(config, max_rounds=20) == 20


def _setup(tmp_path, **fields):
  config = stitch_config.StitchConfig.from_flat(workdir=str(tmp_path), **fields)
  return stitch_experiment.Setup(
    config, None, None, [], None, None, None, None, None, None
  )


def _clock(*times):
  return iter(times).__next__


def _fake_rounds(monkeypatch, stop_at=None, end_at=None):
  """`federated.run_round` replaced: round r adds `_entry(r)` to the log;
  interrupted before round `stop_at` (from 0), no network left after
  round `end_at`."""

  def run_round(pool, state, clients, config, *, population, energy):
    del pool, clients, config, population, energy
    r = state.round
    if r == stop_at:
      raise KeyboardInterrupt
    live = () if r + 1 == end_at else state.live
    return state._replace(round=r + 1, live=live, log=state.log + (_entry(r),))

  monkeypatch.setattr(federated, 'run_round', run_round)


def test_a_resumed_run_times_only_the_rounds_it_ran(tmp_path, monkeypatch):
  s = _setup(tmp_path, max_depth=5, rounds_per_selection=5)  # ≤ 20 rounds
  s = s._replace(pool=common.fake_pool())
  _fake_rounds(monkeypatch, stop_at=10)
  with pytest.raises(KeyboardInterrupt):
    opened = stitch_experiment.open_run(s, print)
    stitch_experiment.run_stitching(s, None, opened, print)
  _fake_rounds(monkeypatch, end_at=12)
  lines = []
  opened = stitch_experiment.open_run(s, lines.append)
  assert opened.start == 10 and len(opened.state.log) == 10
  stitch_experiment.run_stitching(
    s, None, opened, lines.append, _clock(100.0, 112.0, 120.0)
  )
  rounds = [x.split(' | ', 1)[1] for x in lines if x.startswith('round')]
  assert rounds == [
    '11/≤20 rounds | elapsed 12.0s | 0.08 rounds/s | ETA ≤ 108s',
    '12/≤20 rounds | elapsed 20.0s | 0.10 rounds/s | ETA ≤ 80s',
  ]
  # The records hold every round once, numbered as the state after it.
  rows = [json.loads(x) for x in open(tmp_path / 'metrics.jsonl')]
  assert [r['round'] for r in rows] == list(range(1, 13))
  # The files keep every client's configuration.
  energy = (tmp_path / 'energy.jsonl').read_text().splitlines()
  assert len(energy) == 12
  assert [c['config'] for c in json.loads(energy[0])['clients']] == [
    'table2_3_MAXN'
  ] * 3


def test_local_lines_count_the_searches_and_time_them(tmp_path, monkeypatch):
  def alone(pool, batch_fn, num_clients, config, population, clients):
    del pool, batch_fn, num_clients, clients
    assert config.clients_per_round == 1 and len(population) == 1
    return types.SimpleNamespace(
      finished=[types.SimpleNamespace(net=k) for k in range(3)]
    )

  monkeypatch.setattr(federated, 'run', alone)
  lines = []
  s = _setup(tmp_path, num_clients=40, local_clients=2)
  local = evaluation.local_baseline(
    s,
    None,
    lambda net: {'head': (0.5, 0.866, 0.7)[net]},
    lines.append,
    _clock(0.0, 100.0, 250.0),
  )
  a, b = local['clients']
  assert lines == [
    f'Local 1/2 (client {a} alone): best 86.60 % of 3 networks | elapsed '
    '100.0s | ETA 100s',
    f'Local 2/2 (client {b} alone): best 86.60 % of 3 networks | elapsed '
    '250.0s | ETA 0s',
  ]
  assert progress.stitch_local_line(2, [3, 25, 40], 0.866, 20, 208.0) == (
    'Local 2/3 (client 25 alone): best 86.60 % of 20 networks | elapsed '
    '208.0s | ETA 104s'
  )


def test_public_indices_outside_the_dataset_are_one_line(tmp_path):
  pool = stitch_config.Pool(pool=str(tmp_path))
  ds = types.SimpleNamespace(name='fashion_mnist', y_train=np.zeros(5, int))
  path = tmp_path / 'public.json'
  path.write_text('{"dataset": "fashion_mnist", "indices": [1, 3]}')
  public, private = stitch_experiment.public_examples(pool, ds)
  assert public.tolist() == [1, 3] and private.tolist() == [0, 2, 4]
  for indices, what in [('[1, 5]', 'index 5'), ('[1, 1]', 'an index twice')]:
    path.write_text(f'{{"dataset": "fashion_mnist", "indices": {indices}}}')
    with pytest.raises(errors.DataError) as e:
      stitch_experiment.public_examples(pool, ds)
    assert str(e.value) == (
      f'`pool`: {tmp_path}/public.json holds {what}; `dataset=fashion_mnist` '
      'has 5 training examples'
    )


# --- The host loop of every run, on a small real search ----------------------

# The library's test run (tests/stitch/test_federated.py), as a program's.
_ZOO = federated_tests._ZOO
_batch = federated_tests.batch_fn


def _real_setup(workdir):
  """The library's test run of 3 random-weight models' blocks over 6
  clients, 3 a round (≤ 4 rounds), without data or energy coordinators."""
  lib = federated_tests.CONFIG
  config = stitch_config.StitchConfig.from_flat(
    workdir=str(workdir),
    num_clients=federated_tests.NUM_CLIENTS,
    **{
      name: getattr(lib, name)
      for name in (
        'clients_per_round',
        'batch_size',
        'top_k',
        'epsilon',
        'rounds_per_selection',
        'num_selections',
        'max_depth',
        'seed',
      )
    },
  )
  pool = pool_lib.make_pool([common.chain(n) for n in _ZOO])
  models = [types.SimpleNamespace(id=n) for n in _ZOO]
  s = stitch_experiment.Setup(
    config, None, None, models, None, pool, None, None, None, None
  )
  return s, federated.LocalClients(pool, _batch)


def _stitched(workdir, log=print):
  s, clients = _real_setup(workdir)
  opened = stitch_experiment.open_run(s, log)
  return stitch_experiment.run_stitching(s, clients, opened, log)


def _timeless_rows(workdir, name):
  rows = [json.loads(x) for x in open(workdir / name)]
  for row in rows:
    for key in ('round_time_s', 'client_time_s'):
      row.pop(key, None)
    for client in row.get('clients', ()):
      if isinstance(client, dict):
        client.pop('time_s', None)
  return rows


def _same_run(a, b):
  """Two FedStitch workdirs hold the same run: their final states'
  documents (times left out) and their records."""
  docs = []
  for workdir in (a, b):
    ckpt = checkpoint.Checkpointer(str(workdir))
    try:
      found = ckpt.find(None)
    finally:
      ckpt.close()
    payload, identity = state_lib.parse_document(
      found.state[state_lib.CHECKPOINT_ENTRY].tobytes(), str(workdir)
    )
    for entry in payload['log']:
      del entry['round_time_s'], entry['client_time_s']
    docs.append((found.round, payload, identity))
  (ra, pa, ia), (rb, pb, ib) = docs
  assert ra == rb and ia == ib
  assert json.dumps(pa, default=np.ndarray.tolist) == json.dumps(
    pb, default=np.ndarray.tolist
  )
  for name in ('metrics.jsonl', 'clients.jsonl'):
    assert _timeless_rows(a, name) == _timeless_rows(b, name)


@pytest.fixture(scope='module')
def whole(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('whole')
  state = _stitched(workdir)
  assert state.round >= 3 and state.finished and not state.live
  return workdir


def test_a_workdir_of_an_earlier_version_resumes_from_its_state_npz(
  whole, tmp_path
):
  s, clients = _real_setup(tmp_path)
  identity = stitch_config.identity(s.config, list(_ZOO))
  old = federated.run(
    s.pool,
    _batch,
    6,
    stitch_config.library_config(s.config),
    state_path=str(tmp_path / 'state.npz'),
    identity=identity,
    max_rounds=2,
  )
  assert old.round == 2
  kept = (tmp_path / 'state.npz').read_bytes()
  lines = []
  opened = stitch_experiment.open_run(s, lines.append)
  assert opened.imported and opened.start == 2
  assert 'state format 1) after round 1 (rounds counted' in lines[0]
  stitch_experiment.run_stitching(s, clients, opened, lines.append)
  _same_run(tmp_path, whole)
  assert (tmp_path / 'state.npz').read_bytes() == kept
  # Of another run: refused in one line, nothing written.
  other = tmp_path / 'other'
  other.mkdir()
  (other / 'state.npz').write_bytes(kept)
  s, _ = _real_setup(other)
  s = s._replace(config=s.config.replace(top_k=3))
  with pytest.raises(state_lib.StateFileError, match='`top_k=2` there, 3'):
    stitch_experiment.open_run(s, print)
  assert sorted(os.listdir(other)) == ['state.npz']


def test_a_cut_row_rolls_the_run_back_and_it_ends_the_same(whole, tmp_path):
  _stitched(tmp_path)
  rows = (tmp_path / 'metrics.jsonl').read_text().splitlines(keepends=True)
  # The last row cut mid-way: rounds from there on are recomputed from the
  # checkpoint before it (the newer one is deleted).
  (tmp_path / 'metrics.jsonl').write_text(''.join(rows[:-1]) + rows[-1][:9])
  lines = []
  _stitched(tmp_path, lines.append)
  assert any(
    'are recomputed, from the checkpoint after round' in x for x in lines
  )
  assert sum(x.startswith('round') for x in lines) == 1
  _same_run(tmp_path, whole)


def test_another_config_is_refused_before_anything_is_written(whole):
  s, _ = _real_setup(whole)
  s = s._replace(config=s.config.replace(epsilon=0.5))
  before = {p: p.read_bytes() for p in whole.rglob('*') if p.is_file()}
  with pytest.raises(errors.ConfigError, match='`epsilon=0.3` there, 0.5'):
    stitch_experiment.open_run(s, print)
  after = {p: p.read_bytes() for p in whole.rglob('*') if p.is_file()}
  assert after == before
