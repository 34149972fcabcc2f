"""FedStitch's client step, RL-weighted server step, search space and run."""

import re

import numpy as np
import pytest

from fedjax_mr.core import errors
from fedjax_mr.energy import discovery
from fedjax_mr.energy import dvfs
from fedjax_mr.energy import fleet
from fedjax_mr.energy import power
from fedjax_mr.energy import profiles
from fedjax_mr.energy import simulation
from fedjax_mr.stitch import blocks
from fedjax_mr.stitch import cka
from fedjax_mr.stitch import federated
from fedjax_mr.stitch import network
from tests import helpers
from tests.energy import fake_sysfs
from tests.stitch import common

# --- Server step by hand ----------------------------------------------------


def test_rank_fraction():
  s = np.array([0.1, 0.5, 0.9])
  assert federated.rank_fraction(s, 2) == 1.0
  assert federated.rank_fraction(s, 0) == 0.0
  assert federated.rank_fraction(s, 1) == 0.5
  ties = np.array([0.5, 0.5, 0.1])
  assert federated.rank_fraction(ties, 0) == 0.75  # (1 below + ½ tie) / 2
  assert federated.rank_fraction(np.array([0.3, 0.3]), 1) == 0.5
  assert federated.rank_fraction(np.array([0.2, 0.8, 0.4, 0.6]), 3) == (
    pytest.approx(2 / 3)
  )
  assert federated.rank_fraction(np.array([0.7]), 0) == 1.0


def test_cross_validated_ranks_three_clients():
  scores = np.array(
    [
      [0.9, 0.5, 0.1],
      [0.1, 0.5, 0.9],
      [0.9, 0.1, 0.5],
    ]
  )
  choices = [[0], [2], [0, 2]]
  # Client 0's choice 0: worst for client 1 (0), best for client 2 (1).
  # Client 1's choice 2: worst for client 0 (0), middle for client 2 (½).
  # Client 2's choices 0, 2: 1 and 0 for client 0, 0 and 1 for client 1.
  helpers.assert_close(
    federated.cross_validated_ranks(choices, scores), [0.5, 0.25, 0.5]
  )


def test_cross_validated_ranks_single_participant_is_nan():
  ranks = federated.cross_validated_ranks([[0, 1]], np.array([[0.2, 0.3]]))
  assert ranks.shape == (1,) and np.isnan(ranks[0])


def test_update_weights_by_hand():
  w0 = np.full(4, 0.25)
  new = federated.update_weights(
    w0,
    [0, 1, 3],
    np.array([0.75, 0.5, np.nan]),
    reward=0.2,
    penalty=0.5,
    threshold=0.75,
  )
  # 0: rank = threshold → × 1.2; 1: × 0.5; 2 absent, 3 NaN: unchanged.
  raw = np.array([0.3, 0.125, 0.25, 0.25])
  helpers.assert_close(new, raw / raw.sum(), rtol=1e-15)
  assert new.sum() == pytest.approx(1.0)
  np.testing.assert_array_equal(w0, 0.25)  # the input is not modified
  # All NaN: unchanged.
  same = federated.update_weights(
    w0, [0, 1], np.array([np.nan, np.nan]), reward=1, penalty=0.5, threshold=0
  )
  helpers.assert_close(same, w0, rtol=1e-15)


def test_update_weights_compounds_over_rounds():
  w = np.full(2, 0.5)
  for _ in range(3):
    w = federated.update_weights(
      w, [0, 1], np.array([1.0, 0.0]), reward=0.2, penalty=0.2, threshold=0.5
    )
  ratio = (1.2 / 0.8) ** 3
  helpers.assert_close(w, [ratio / (1 + ratio), 1 / (1 + ratio)])


def test_vote():
  v = federated.vote([1.0, 2.0, 0.5], [[0, 1], [1], [2, 0]], 4)
  helpers.assert_close(v, [1.5, 3.0, 0.5, 0.0])
  np.testing.assert_array_equal(federated.vote([], [], 2), [0, 0])


def test_select_greedy_is_top_k():
  scores = np.array([0.2, 0.9, 0.5, 0.9, 0.1])
  rng = np.random.default_rng(0)
  for _ in range(20):
    assert federated.select(scores, 2, 0.0, rng).tolist() == [1, 3]
  assert federated.select(scores, 3, 0.0, rng).tolist() == [1, 3, 2]
  assert sorted(federated.select(scores, 9, 0.0, rng).tolist()) == list(
    range(5)
  )


def test_select_explores_with_epsilon_one():
  scores = np.arange(10.0)
  seen = set()
  for seed in range(20):
    pos = federated.select(scores, 3, 1.0, np.random.default_rng(seed))
    assert len(pos) == 3 and len(set(pos.tolist())) == 3
    assert np.all((pos >= 0) & (pos < 10))
    assert pos.tolist() == sorted(pos.tolist())
    seen.add(tuple(pos.tolist()))
  assert len(seen) > 5  # random, not the top 3 (7, 8, 9) every time
  # Deterministic given a seeded generator.
  a = [federated.select(scores, 3, 0.5, np.random.default_rng(7)).tolist()]
  b = [federated.select(scores, 3, 0.5, np.random.default_rng(7)).tolist()]
  assert a == b
  rng1, rng2 = np.random.default_rng(8), np.random.default_rng(8)
  seq1 = [federated.select(scores, 2, 0.5, rng1).tolist() for _ in range(10)]
  seq2 = [federated.select(scores, 2, 0.5, rng2).tolist() for _ in range(10)]
  assert seq1 == seq2
  assert [9, 8] in seq1 and any(s != [9, 8] for s in seq1)  # both kinds


# --- Pools and the search space, with shape-only blocks ---------------------


def _block(model, index, kind, in_spec, out_spec):
  return blocks.Block(model, index, kind, (), (), in_spec, out_spec, {})


def _fake_pool():
  """Three 3-block models a, b, c; c's middle block outputs a vector."""
  chains = [
    [
      _block(m, 0, 'start', (8, 8, 1), (8, 8, 4)),
      _block(m, 1, 'middle', (8, 8, 4), (4, 4, 8)),
      _block(m, 2, 'end', (4, 4, 8), (10,)),
    ]
    for m in ('a', 'b')
  ]
  chains.append(
    [
      _block('c', 0, 'start', (8, 8, 1), (6, 6, 3)),
      _block('c', 1, 'middle', (6, 6, 3), (16,)),
      _block('c', 2, 'end', (16,), (10,)),
    ]
  )
  return federated.make_pool(chains)


def test_make_pool():
  pool = _fake_pool()
  assert pool.models == ('a', 'b', 'c')
  assert len(pool.blocks) == 9
  assert pool.ids_of('b') == [3, 4, 5]
  assert pool.starts() == [0, 3, 6]
  chain = list(pool.blocks[:3])
  with pytest.raises(errors.ConfigError, match='unique'):
    federated.make_pool([chain, chain])
  other = [_block('d', 0, 'start', (32, 32, 3), (4,))]
  with pytest.raises(errors.ConfigError, match='different inputs'):
    federated.make_pool([chain, other])


def test_candidates():
  pool = _fake_pool()
  everything = frozenset(range(9))
  net = network.start(pool.blocks[0])  # a[0] → (8, 8, 4)
  # Start blocks never; every other block (spatial output: all compatible).
  assert federated.candidates(pool, net, everything, 5) == [1, 2, 4, 5, 7, 8]
  assert federated.candidates(pool, net, frozenset({2, 3, 4}), 5) == [2, 4]
  # At depth max_depth − 1 only end blocks.
  assert federated.candidates(pool, net, everything, 2) == [2, 5, 8]
  net = network.extend(net, None, pool.blocks[4])  # → b[1]
  assert federated.candidates(pool, net, everything, 5) == [1, 2, 5, 7, 8]
  assert federated.candidates(pool, net, everything, 3) == [2, 5, 8]
  # After c[1] (a vector): no spatial block can follow.
  net = network.extend(network.start(pool.blocks[3]), None, pool.blocks[7])
  assert federated.candidates(pool, net, everything, 5) == [8]


def test_prune_by_hand():
  pool = _fake_pool()
  everything = frozenset(range(9))
  # a: best is a[2] (drops a[0], a[1]); b: best is b[1] (drops b[0]); c is
  # not scored and keeps everything.
  scored = {1: 0.3, 2: 0.8, 4: 0.9, 5: 0.2}
  assert federated.prune(pool, everything, scored) == frozenset(
    {2, 4, 5, 6, 7, 8}
  )
  # Only what remains is returned; nothing is added back.
  assert federated.prune(pool, frozenset({0, 1, 5}), scored) == {5}
  # Ties go to the shallower block.
  assert federated.prune(pool, everything, {1: 0.5, 2: 0.5}) == (
    everything - {0}
  )
  assert federated.prune(pool, everything, {}) == everything


def test_init_state():
  pool = _fake_pool()
  state = federated.init_state(pool, 4)
  assert state.round == 0
  np.testing.assert_array_equal(state.weights, np.full(4, 0.25))
  assert [lv.net.path for lv in state.live] == [
    (('a', 0),),
    (('b', 0),),
    (('c', 0),),
  ]
  assert all(lv.remaining == frozenset(range(9)) for lv in state.live)
  assert state.finished == () and state.log == ()
  state = federated.init_state(pool, 4, starts=[3])
  assert [lv.net.path for lv in state.live] == [(('b', 0),)]


_CONFIG_ERRORS = [
  ('clients_per_round', 0, '--clients_per_round'),
  ('batch_size', 1, '--batch_size'),
  ('top_k', 0, '--top_k'),
  ('epsilon', -0.1, '--epsilon'),
  ('epsilon', 1.5, '--epsilon'),
  ('epsilon_decay', 0.0, '--epsilon_decay'),
  ('epsilon_decay', 1.5, '--epsilon_decay'),
  ('reward', -0.1, '--reward'),
  ('penalty', 1.0, '--penalty'),
  ('penalty', -0.1, '--penalty'),
  ('threshold', 1.5, '--threshold'),
  ('aggregation', 'mean', '--aggregation'),
  ('num_selections', 0, '--num_selections'),
  ('rounds_per_selection', 0, '--rounds_per_selection'),
  ('max_depth', 1, '--max_depth'),
  ('view', 'pixels', '--view'),
  ('spatial', 'crop', '--spatial'),
  ('solver', 'lsqr', '--stitch_solver'),
]


@pytest.mark.parametrize(
  'field,value,flag',
  _CONFIG_ERRORS,
  ids=[f'{f}={v}' for f, v, _ in _CONFIG_ERRORS],
)
def test_check_config_names_the_flag(field, value, flag):
  config = federated.Config()._replace(**{field: value})
  with pytest.raises(errors.ConfigError, match=re.escape(flag) + ' must'):
    federated.check_config(config, 10)


def test_check_config_accepts_defaults_and_edges():
  federated.check_config(federated.Config(), 1)
  federated.check_config(
    federated.Config(epsilon=1.0, epsilon_decay=1.0, penalty=0.0, max_depth=2),
    1,
  )
  with pytest.raises(errors.ConfigError, match='client'):
    federated.check_config(federated.Config(), 0)


# --- Client step on real blocks ---------------------------------------------

_ZOO = ('cnn_mnist', 'cnn_femnist', 'cnn_cifar')


def _pool():
  return federated.make_pool([common.chain(n) for n in _ZOO])


def test_pool_inputs_and_score():
  pool = _pool()
  x = common.inputs(common.IMAGE, n=4)
  got = federated.pool_inputs(pool, [1, 2, 7], x)
  assert sorted(got) == [1, 2, 7]
  mnist = common.chain('cnn_mnist')
  h1 = mnist[0].apply(x)
  helpers.assert_close(got[1], h1, rtol=1e-6)
  helpers.assert_close(got[2], mnist[1].apply(h1), rtol=1e-6)
  cifar = common.chain('cnn_cifar')
  helpers.assert_close(got[7], cifar[0].apply(x), rtol=1e-6)
  out = np.asarray(mnist[0].apply(x))
  s = federated.score(out, got, [1, 2, 7])
  expected = [cka.linear_cka(out, got[i]) for i in (1, 2, 7)]
  helpers.assert_close(s, expected)
  assert s[0] == pytest.approx(1.0)  # its own next input


def test_compatible_fit_only_needs_a_block_that_runs():
  pool = federated.make_pool(
    [common.chain('cnn_mnist'), common.chain('cnn_fedavg')]
  )
  net = network.start(pool.blocks[0])  # → (12, 12, 20)
  conv_same, head = 4, 5  # cnn_fedavg[1] (14, 14, 32), [2] (7, 7, 64)
  assert federated.compatible(pool, net, conv_same, 'match')
  assert federated.compatible(pool, net, head, 'match')
  assert federated.compatible(pool, net, conv_same, 'fit_only')
  # Its flatten → dense head needs exactly 7 × 7 inputs.
  assert not federated.compatible(pool, net, head, 'fit_only')


# --- The run ----------------------------------------------------------------

NUM_CLIENTS = 6
CONFIG = federated.Config(
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
  assert 0 < state.round < 50
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
    w = federated.update_weights(
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
  federated.save_state(path, baseline, {'seed': 0})
  loaded = federated.load_state(path, _pool(), {'seed': 0})
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
    dvfs.SysfsDvfs(kernel, info, settle_s=0),
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
  with pytest.raises(errors.ConfigError, match='--top_k'):
    _run(CONFIG._replace(top_k=0))


def test_no_prune_runs_and_greedy_depth_two():
  config = CONFIG._replace(prune=False, epsilon=0.0, max_depth=2)
  state = _run(config)
  # From depth 1 only end blocks; one selection.
  assert state.round == CONFIG.rounds_per_selection
  assert all(f.net.depth == 2 for f in state.finished)
  assert all(f.net.blocks[-1].kind == 'end' for f in state.finished)


def test_a_state_of_another_run_is_refused(baseline, tmp_path):
  path = str(tmp_path / 'state.npz')
  federated.save_state(path, baseline, {'seed': 0, 'partition': 'iid'})
  with pytest.raises(
    federated.StateFileError,
    match=r"--partition='iid' there, 'dirichlet' here; --seed=0 there, 5",
  ):
    federated.load_state(path, _pool(), {'seed': 5, 'partition': 'dirichlet'})


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
  with pytest.raises(federated.StateFileError, match=message):
    federated.load_state(path, _pool())
