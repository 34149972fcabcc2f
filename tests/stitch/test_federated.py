"""The FedStitch run: rounds, determinism, resume, state files, energy."""

import numpy as np
import pytest

from fedjax_mr.core import errors
from fedjax_mr.energy import discovery
from fedjax_mr.energy import fleet
from fedjax_mr.energy import power
from fedjax_mr.energy import profiles
from fedjax_mr.energy import simulation
from fedjax_mr.energy import sysfs_dvfs
from fedjax_mr.stitch import config as config_lib
from fedjax_mr.stitch import federated
from fedjax_mr.stitch import network
from fedjax_mr.stitch import pool as pool_lib
from fedjax_mr.stitch import server
from fedjax_mr.stitch import state as state_lib
from tests import helpers
from tests.energy import fake_sysfs
from tests.stitch import common


def test_init_state():
  pool = common.fake_pool()
  state = state_lib.init_state(pool, 4)
  assert state.round == 0
  np.testing.assert_array_equal(state.weights, np.full(4, 0.25))
  assert [lv.net.path for lv in state.live] == [
    (('a', 0),),
    (('b', 0),),
    (('c', 0),),
  ]
  assert all(lv.remaining == frozenset(range(9)) for lv in state.live)
  assert state.finished == () and state.log == ()
  state = state_lib.init_state(pool, 4, starts=[3])
  assert [lv.net.path for lv in state.live] == [(('b', 0),)]


_ZOO = ('cnn_mnist', 'cnn_femnist', 'cnn_cifar')


def _pool():
  return pool_lib.make_pool([common.chain(n) for n in _ZOO])


# --- The run ----------------------------------------------------------------

NUM_CLIENTS = 6
CONFIG = config_lib.Config(
  clients_per_round=3,
  batch_size=8,
  top_k=2,
  epsilon=0.3,
  rounds_per_selection=2,
  num_selections=2,
  max_depth=3,
  seed=0,
)


def batch_fn(client, round_):
  rng = np.random.default_rng([client, round_])
  return rng.uniform(0, 1, (8, 28, 28, 1)).astype(np.float32)


def _run(config=CONFIG, **kwargs):
  return federated.run(_pool(), batch_fn, NUM_CLIENTS, config, **kwargs)


@pytest.fixture(scope='module')
def baseline():
  return _run()


def _summary(state):
  """Everything in a state, as plain comparable values (no timings)."""

  def net(n):
    stitches = [
      None
      if s is None
      else (
        None if s.matrix is None else np.asarray(s.matrix).tolist(),
        None if s.bias is None else np.asarray(s.bias).tolist(),
        s.pool,
        s.size,
      )
      for s in n.stitches
    ]
    return (n.path, stitches)

  log = [
    {
      k: v
      for k, v in e.items()
      if k not in ('client_time_s', 'round_time_s', 'energy')
    }
    for e in state.log
  ]
  return {
    'round': state.round,
    'weights': np.asarray(state.weights).tolist(),
    'live': [
      (
        net(lv.net),
        sorted(lv.remaining),
        lv.votes.tolist(),
        lv.score_sum.tolist(),
        lv.share,
        getattr(lv, 'path_score', None),
      )
      for lv in state.live
    ],
    'finished': [
      (net(f.net), f.round, f.share, getattr(f, 'path_score', None))
      for f in state.finished
    ],
    'fit_ids': state.fit_ids,
    'log': log,
  }


def test_run_terminates_with_valid_networks(baseline):
  state = baseline
  pool = _pool()
  assert state.live == () and state.finished
  # (max_depth − 1) selections of rounds_per_selection rounds at most.
  assert federated.round_limit(CONFIG) == 4
  assert 0 < state.round <= federated.round_limit(CONFIG)
  x = batch_fn(0, 0)
  for f in state.finished:
    net = f.net
    kinds = [b.kind for b in net.blocks]
    assert kinds[0] == 'start' and kinds[-1] == 'end'
    assert set(kinds[1:-1]) <= {'middle'}
    assert len(set(net.path)) == len(net.path)  # no block twice
    assert 2 <= net.depth <= CONFIG.max_depth
    assert 0 < f.share <= 1 and 1 <= f.round <= state.round
    for prev, block, s in zip(net.blocks, net.blocks[1:], net.stitches[1:]):
      assert s.matrix.shape == (prev.out_spec[-1], block.in_spec[-1])
      assert s.bias is None
    out = np.asarray(network.apply(net, x))
    assert out.shape == (8, 10) and np.all(np.isfinite(out))
    assert all(b in pool.blocks for b in net.blocks)


def test_run_logs_one_entry_per_round(baseline):
  log = baseline.log
  assert [e['round'] for e in log] == list(range(baseline.round))
  n = CONFIG.rounds_per_selection
  for e in log:
    assert len(e['clients']) == CONFIG.clients_per_round
    assert len(set(e['clients'])) == CONFIG.clients_per_round
    assert all(0 <= c < NUM_CLIENTS for c in e['clients'])
    assert ('selected' in e) == ((e['round'] + 1) % n == 0)
    assert len(e['ranks']) == CONFIG.clients_per_round
    assert all(0 <= r <= 1 for r in e['ranks'])
    assert len(e['client_time_s']) == CONFIG.clients_per_round
    assert e['round_time_s'] >= sum(e['client_time_s'])
  sizes = [max(e['pool_sizes']) for e in log]
  assert sizes == sorted(sizes, reverse=True)  # non-increasing
  assert log[0]['pool_sizes'] == [6, 6, 6]  # 3 start blocks, 6 others
  for e in log:
    if e['depth'] == CONFIG.max_depth - 1:  # only the 3 end blocks
      assert max(e['pool_sizes']) <= 3


def test_run_weights_follow_the_logged_ranks(baseline):
  w = np.full(NUM_CLIENTS, 1 / NUM_CLIENTS)
  for e in baseline.log:
    w = server.update_weights(
      w,
      e['clients'],
      np.array(e['ranks']),
      reward=CONFIG.reward,
      penalty=CONFIG.penalty,
      threshold=CONFIG.threshold,
    )
  helpers.assert_close(baseline.weights, w, rtol=1e-12)
  assert not np.allclose(w, 1 / NUM_CLIENTS)  # the RL update did something


def test_run_is_deterministic(baseline):
  assert _summary(_run()) == _summary(baseline)


def test_run_resumes_after_a_stop(baseline, tmp_path):
  path = str(tmp_path / 'state.npz')
  first = _run(state_path=path, max_rounds=1)  # mid-selection
  assert first.round == 1
  second = _run(state_path=path, max_rounds=3)  # past a selection
  assert second.round == 3
  final = _run(state_path=path)
  assert _summary(final) == _summary(baseline)


def test_run_resumes_after_a_crash(baseline, tmp_path):
  path = str(tmp_path / 'state.npz')

  def crash(state):
    if state.round == 2:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    _run(state_path=path, on_round=crash)
  rounds = []
  final = _run(state_path=path, on_round=lambda s: rounds.append(s.round))
  assert rounds == list(range(3, baseline.round + 1))
  assert _summary(final) == _summary(baseline)


def test_save_and_load_state_round_trip(baseline, tmp_path):
  path = str(tmp_path / 'state.npz')
  state_lib.save_state(path, baseline, {'seed': 0})
  loaded = state_lib.load_state(path, _pool(), {'seed': 0})
  assert _summary(loaded) == _summary(baseline)
  # Everything comes back as it was, types included (tuples stay tuples).
  assert loaded.log == baseline.log and loaded.fit_ids == baseline.fit_ids
  np.testing.assert_array_equal(loaded.weights, baseline.weights)
  # No pickle anywhere: numpy reads the file with allow_pickle=False.
  with np.load(path, allow_pickle=False) as npz:
    assert all(npz[k].dtype != object for k in npz.files)
  x = batch_fn(1, 0)
  for a, b in zip(loaded.finished, baseline.finished):
    np.testing.assert_array_equal(
      network.apply(a.net, x), network.apply(b.net, x)
    )


def _simulated_energy():
  devices = simulation.assign_profiles(
    'tx2_chained@1:0.5,tx2_chained@0.5:0.5', NUM_CLIENTS
  )
  return fleet.Fleet(fleet.SimulatedBackend(devices), seconds_per_unit=0.001)


def test_energy_coordinators_in_the_loop(baseline, tmp_path):
  state = _run(energy=_simulated_energy())
  # The coordinators change no result.
  assert _summary(state) == _summary(baseline)
  records = [e['energy'] for e in state.log]
  assert records[0]['deadline_s'] is None
  assert all(r['deadline_s'] > 0 for r in records[1:])
  for e, rec in zip(state.log, records):
    assert [c['client'] for c in rec['clients']] == e['clients']
    assert rec['pool_size'] == sum(e['pool_sizes'])
    for c in rec['clients']:
      # The scoring work: 8 examples × every candidate of the round.
      assert c['units'] == 8 * sum(e['pool_sizes'])
      assert c['time_s'] > 0 and c['energy_j'] > 0
  # Resumed mid-run, the records continue exactly.
  path = str(tmp_path / 'state.npz')
  _run(state_path=path, max_rounds=2, energy=_simulated_energy())
  resumed = _run(state_path=path, energy=_simulated_energy())
  assert [e['energy'] for e in resumed.log] == records


def test_sysfs_clocks_restored_when_a_run_fails(tmp_path):
  fake_sysfs.build_tx2_tree(tmp_path)
  kernel = fake_sysfs.FakeKernel(
    tmp_path, profiles.TX2_TABLE2_CHAINED, fake_sysfs.TX2_RAIL_SHARES
  )
  before = fake_sysfs.control_files(kernel)
  info = discovery.discover(kernel)
  meter = power.SysfsPowerMeter(kernel, info.power_channels)
  backend = fleet.SysfsBackend(
    sysfs_dvfs.SysfsDvfs(kernel, info, settle_s=0),
    profiles.TX2_TABLE2_CHAINED,
    meter.total_w,
    threaded=False,
  )

  def crash(state):
    if state.round == 2:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    _run(energy=fleet.Fleet(backend, seconds_per_unit=0.001), on_round=crash)
  assert kernel.log  # Clocks were set, then put back.
  assert fake_sysfs.control_files(kernel) == before


def test_uniform_aggregation_leaves_weights_uniform():
  state = _run(CONFIG._replace(aggregation='uniform'))
  np.testing.assert_array_equal(state.weights, np.full(NUM_CLIENTS, 1 / 6))
  assert state.finished


def test_local_baseline_single_client():
  state = _run(population=[2])
  assert state.finished
  assert all(e['clients'] == [2] for e in state.log)
  assert all(r is None for e in state.log for r in e['ranks'])
  helpers.assert_close(state.weights, np.full(NUM_CLIENTS, 1 / 6), rtol=1e-12)


def test_starts_restrict_the_networks():
  state = _run(starts=[3])  # cnn_femnist's start block
  assert state.finished
  assert all(f.net.path[0] == ('cnn_femnist', 0) for f in state.finished)


def test_run_rejects_a_bad_config():
  with pytest.raises(errors.ConfigError, match='`top_k`'):
    _run(CONFIG._replace(top_k=0))


def test_no_prune_runs_and_greedy_depth_two():
  config = CONFIG._replace(prune=False, epsilon=0.0, max_depth=2)
  state = _run(config)
  # From depth 1 only end blocks; one selection.
  assert state.round == CONFIG.rounds_per_selection
  assert state.round == federated.round_limit(config)
  assert all(f.net.depth == 2 for f in state.finished)
  assert all(f.net.blocks[-1].kind == 'end' for f in state.finished)


def test_a_state_of_another_run_is_refused(baseline, tmp_path):
  path = str(tmp_path / 'state.npz')
  state_lib.save_state(path, baseline, {'seed': 0, 'partition': 'iid'})
  with pytest.raises(
    state_lib.StateFileError,
    match=r"`partition='iid'` there, 'dirichlet' here; `seed=0` there, 5",
  ):
    state_lib.load_state(path, _pool(), {'seed': 5, 'partition': 'dirichlet'})


@pytest.mark.parametrize(
  'content, message',
  [
    (b'', 'not a readable FedStitch state file'),
    (b'\x80\x04\x95 a pickle', 'not a readable FedStitch state file'),
    (None, 'not a FedStitch state file'),
  ],
)
def test_a_foreign_or_damaged_state_file_is_one_error(
  tmp_path, content, message
):
  path = str(tmp_path / 'state.npz')
  if content is None:  # an .npz of something else
    np.savez(path, x=np.zeros(3))
  else:
    with open(path, 'wb') as f:
      f.write(content)
  with pytest.raises(state_lib.StateFileError, match=message):
    state_lib.load_state(path, _pool())
