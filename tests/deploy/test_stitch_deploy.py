"""FedStitch deployed, in one process: the server's `DeployedClients` and
the nodes' `stitch_node.serve` over a transport that packs each node's
requests into one message, as Flower's grid does, against the
simulation's `LocalClients`: the same run, bit for bit (scores, choices,
weights, stitches, energy records); a node that fails leaves its clients
out of the round; a malformed reply is refused before anything reads it;
a node refuses what is not its own. The real federation's run is in
test_deploy_program.py."""

import json
import types

import numpy as np
import pytest
from flwr.app import ConfigRecord

from fedjax_mr.deploy import adapter
from fedjax_mr.deploy import codec
from fedjax_mr.deploy import node as node_lib
from fedjax_mr.deploy import stitch_node
from fedjax_mr.deploy import stitch_server
from fedjax_mr.energy import fleet
from fedjax_mr.energy import simulation
from fedjax_mr.stitch import federated
from tests.stitch import test_federated

NODES = 2
TIMES = ('client_time_s', 'round_time_s')
# The FedStitch run tests/stitch/test_federated.py runs.
CONFIG, NUM_CLIENTS = test_federated.CONFIG, test_federated.NUM_CLIENTS
batch_fn, _pool = test_federated.batch_fn, test_federated._pool


MIX, SECONDS_PER_UNIT = 'tx2_chained@1:0.5,tx2_chained@0.5:0.5', 0.001


def _fleet():
  devices = simulation.assign_profiles(MIX, NUM_CLIENTS)
  return fleet.Fleet(
    fleet.SimulatedBackend(devices), seconds_per_unit=SECONDS_PER_UNIT
  )


# What the server knows of the clients' devices: the nodes' model.
ENERGY = stitch_server.EnergyModel(
  simulation.assign_profiles(MIX, NUM_CLIENTS), SECONDS_PER_UNIT, False
)


class Nodes:
  """The transport: each node's requests packed into one message, served
  by `stitch_node.serve` (its replies passed through `change`, a node in
  `dead` answering nothing), the replies arriving node by node or, with
  `backwards`, all of them in the reverse of that order."""

  def __init__(self, pool, dead=(), change=None, backwards=False):
    self.held = [
      adapter.StitchNode(pool, CONFIG, _fleet(), NUM_CLIENTS, batch_fn)
      for _ in range(NODES)
    ]
    self.dead, self.change, self.messages = set(dead), change, 0
    self.backwards = backwards

  def exchange(self, requests, timeout):
    replies = list(self._replies(requests, timeout))
    yield from reversed(replies) if self.backwards else replies

  def _replies(self, requests, timeout):
    del timeout
    by_node = {}
    for r in requests:
      by_node.setdefault(r.node, {})[r.position] = r.content
    for n, parts in sorted(by_node.items()):
      self.messages += 1
      if n in self.dead:
        yield from ((p, None) for p in parts)
        continue
      message = node_lib.pack(parts, '{}', node_lib.STITCH)
      reply = stitch_node.serve(self.held[n], message, n, NODES)
      for p, part in node_lib.unpack(reply).items():
        yield p, part if self.change is None else self.change(p, part)


def _deployed(pool, log=None, **kw):
  lines = [] if log is None else log
  return stitch_server.DeployedClients(
    pool, Nodes(pool, **kw), NODES, log=lines.append, energy=ENERGY
  )


def _run(pool, clients, energy=True):
  return federated.run(
    pool,
    None,
    NUM_CLIENTS,
    CONFIG,
    clients=clients,
    energy=_fleet() if energy else None,
  )


def _log(state):
  return [{k: v for k, v in e.items() if k not in TIMES} for e in state.log]


def _nets(state):
  return [
    (
      f.net.path,
      [
        None if s is None else (np.asarray(s.matrix), s.bias, s.pool, s.size)
        for s in f.net.stitches
      ],
    )
    for f in state.finished
  ]


@pytest.fixture(scope='module')
def simulated():
  pool = _pool()
  return pool, _run(pool, federated.LocalClients(pool, batch_fn))


@pytest.mark.parametrize('backwards', [False, True])
def test_the_deployed_run_is_the_simulation_bit_for_bit(simulated, backwards):
  # Replies node by node, or backwards: the sums (scores, statistics) in
  # the sampled order either way.
  pool, sim = simulated
  clients = _deployed(pool, backwards=backwards)
  dep = _run(pool, clients)
  assert dep.round == sim.round > 1 and dep.finished
  # Every log entry: clients, weights, ranks, choices and their votes,
  # the selected blocks' CKA, and every client's energy record.
  assert _log(dep) == _log(sim)
  assert all(len(e['energy']['clients']) == 3 for e in dep.log)
  np.testing.assert_array_equal(dep.weights, sim.weights)
  for (pa, sa), (pb, sb) in zip(_nets(dep), _nets(sim), strict=True):
    assert pa == pb
    for x, y in zip(sa, sb, strict=True):
      if x is None:
        assert y is None
        continue
      np.testing.assert_array_equal(x[0], y[0])
      assert x[1:] == y[1:]
  # One message a node a round (and a selection's statistics).
  assert clients.transport.messages >= NODES * dep.round


def test_a_client_stitching_alone_on_its_node_is_the_simulation(simulated):
  # The "Local" baseline: one client's run, on the node that serves it.
  pool, _ = simulated
  alone = CONFIG._replace(clients_per_round=1)
  runs = [
    federated.run(pool, None, NUM_CLIENTS, alone, population=[3], clients=c)
    for c in (federated.LocalClients(pool, batch_fn), _deployed(pool))
  ]
  assert _log(runs[0]) == _log(runs[1])
  assert all(e['clients'] == [3] for e in runs[1].log)
  assert [f.net.path for f in runs[0].finished] == [
    f.net.path for f in runs[1].finished
  ]


def test_a_dead_node_leaves_its_clients_out_of_the_round(simulated):
  pool, _ = simulated
  lines = []
  state = _run(pool, _deployed(pool, lines, dead={1}), energy=False)
  for e in state.log:
    assert all(c % NODES == 0 for c in e['clients'])
    assert e.get('failed_clients', []) == [
      c
      for c in federated.sample_clients(CONFIG, e['round'], range(6))
      if c % NODES == 1
    ]
  assert any('failed (no reply)' in line for line in lines)
  assert state.finished
  with pytest.raises(federated.NoParticipantError, match='none of'):
    _run(pool, _deployed(pool, dead={0, 1}), energy=False)


def _arrays(record):
  """A reply record's arrays by their dict keys (`['0']` → '0')."""
  return {k[2:-2]: v.numpy() for k, v in record.items()}


def _nan_scores(part):
  scores = _arrays(part['scores'])
  first = sorted(scores)[0]
  scores[first] = np.full_like(scores[first], np.nan)
  part['scores'] = codec.encode(scores)


def _choices_out_of_range(part):
  choices = _arrays(part['choices'])
  part['choices'] = codec.encode(
    {k: np.full_like(v, 99) for k, v in choices.items()}
  )


def _wider_scores(part):
  scores = _arrays(part['scores'])
  part['scores'] = codec.encode(
    {k: np.concatenate([v, v]) for k, v in scores.items()}
  )


def _energy_of_another_client(part):
  work = dict(part['work'])
  work['energy'] = json.dumps({'client': -1})
  part['work'] = ConfigRecord(work)


def _no_scores(part):
  del part['scores']


def _round(pool, change, lines):
  """One round, the first sampled client's score reply passed through
  `change` (returns None: no reply); its log entry (times left out)."""

  def first_only(p, part):
    return change(part) if p == 0 else part

  state = federated.run_round(
    pool,
    federated.state_lib.init_state(pool, NUM_CLIENTS),
    _deployed(pool, lines, change=first_only),
    CONFIG,
    population=range(NUM_CLIENTS),
    energy=_fleet(),
  )
  return _log(state), np.asarray(state.weights)


def _changed(change):
  def apply(part):
    change(part)
    return part

  return apply


@pytest.mark.parametrize(
  'change, said',
  [
    (_nan_scores, 'non-finite'),
    (_choices_out_of_range, 'not positions'),
    (_wider_scores, 'expected float64'),
    (_energy_of_another_client, 'not of client'),
    (_no_scores, 'malformed'),
  ],
)
def test_a_malformed_reply_is_refused_before_it_is_read(
  simulated, change, said
):
  pool, _ = simulated
  lines = []
  (entry,), _ = _round(pool, _changed(change), lines)
  first = federated.sample_clients(CONFIG, 0, range(NUM_CLIENTS))[0]
  assert entry['failed_clients'] == [first]
  assert first not in entry['clients'] and len(entry['clients']) == 2
  assert len(entry['energy']['clients']) == 2
  assert any(f'client {first} refused' in x and said in x for x in lines), lines


def test_a_node_refuses_what_is_not_its_own(simulated):
  pool, _ = simulated
  held = Nodes(pool).held[0]
  net = federated.state_lib.init_state(pool, NUM_CLIENTS).live[0].net
  request = stitch_node.statistics_request(1, 0, net, [1])
  with pytest.raises(node_lib.RequestError, match='not served by node 0'):
    stitch_node.answer(held, request, 0, NODES)
  request = stitch_node.statistics_request(2, 0, net, [len(pool.blocks)])
  with pytest.raises(node_lib.RequestError, match='pool does not hold'):
    stitch_node.answer(held, request, 0, NODES)
  request['paths'] = ConfigRecord({'paths': json.dumps([[['zz', 0]]])})
  with pytest.raises(node_lib.RequestError, match='pool does not hold'):
    stitch_node.answer(held, request, 0, NODES)


def _with_energy(**figures):
  """A change of a score reply: its coordinator's figures replaced."""

  def change(part):
    work = dict(part['work'])
    work['energy'] = json.dumps({**json.loads(work['energy']), **figures})
    part['work'] = ConfigRecord(work)

  return change


def _half_energy(part):
  entry = json.loads(part['work']['energy'])
  _with_energy(energy_j=entry['energy_j'] / 2)(part)


def _no_time(part):
  part['work'] = ConfigRecord({**dict(part['work']), 'time_s': 0.0})


def _scores_of(value):
  def change(part):
    scores = _arrays(part['scores'])
    first = sorted(scores)[0]
    scores[first] = np.full_like(scores[first], value)
    part['scores'] = codec.encode(scores)

  return change


def _duplicate_choices(part):
  choices = _arrays(part['choices'])
  part['choices'] = codec.encode(
    {k: np.zeros_like(v) for k, v in choices.items()}
  )


def _one_past_the_last(part):
  scores, choices = _arrays(part['scores']), _arrays(part['choices'])
  first = sorted(choices)[0]
  choices[first] = choices[first].copy()
  choices[first][0] = len(scores[first])
  part['choices'] = codec.encode(choices)


@pytest.mark.parametrize(
  'change, said',
  [
    (_with_energy(time_s=0.0, energy_j=0.0), 'energy time_s is 0.0'),
    (_with_energy(energy_j=0.0), 'energy energy_j is 0.0'),
    (_half_energy, 'energy_j (tx2_chained'),
    (_with_energy(time_s=1e-3), 'time_s (tx2_chained'),
    (_with_energy(device='agx'), 'device (tx2_chained'),
    (_with_energy(units=10**9), 'energy units'),
    (_no_time, 'time_s is 0.0'),
    (_scores_of(1e300), 'leave [0, 1]'),
    (_scores_of(-1e300), 'leave [0, 1]'),
    (_scores_of(1.001), 'leave [0, 1]'),
    (_duplicate_choices, 'not positions'),
    (_one_past_the_last, 'not positions'),
  ],
)
def test_a_score_reply_that_lies_is_a_failed_clients(simulated, change, said):
  pool, _ = simulated
  lines, failed_lines = [], []
  got = _round(pool, _changed(change), lines)
  want = _round(pool, lambda part: None, failed_lines)
  first = federated.sample_clients(CONFIG, 0, range(NUM_CLIENTS))[0]
  assert len(lines) == 1 and f'client {first} refused: ' in lines[0], lines
  assert said in lines[0], lines
  assert failed_lines == [f'round 1: client {first} failed (no reply)']
  # The rest of the round: the round where that client failed.
  assert got[0] == want[0]
  np.testing.assert_array_equal(got[1], want[1])


def _stats_of(rows=None, g=None):
  """A change of a statistics reply: every block's rows or XᵀX (a
  function of the true one) replaced."""

  def change(part):
    record = part['stats']
    stats = {}
    for k, v in record.items():
      block, name = k[2:-2].split("']['")
      stats.setdefault(block, {})[name] = v.numpy()
    for s in stats.values():
      if rows is not None:
        s['rows'] = np.int64(rows)
      if g is not None:
        s['g'] = g(s['g'])
    part['stats'] = codec.encode(stats)

  return change


def _statistics_run(pool, change, lines):
  """The whole run, the first statistics reply of each selection passed
  through `change` (returns None: no reply)."""

  def first_stats(p, part):
    return change(part) if p == 0 and 'stats' in part else part

  state = _run(pool, _deployed(pool, lines, change=first_stats))
  return _log(state), np.asarray(state.weights), _nets(state)


def _negative_definite(g):
  return -g - np.eye(len(g))


def _indefinite(g):
  # Symmetric, a non-negative diagonal, an eigenvalue of -trace.
  d = float(np.trace(g)) + 1
  out = np.zeros_like(g)
  out[:2, :2] = [[d, 2 * d], [2 * d, d]]
  return out


def _asymmetric(g):
  out = g.copy()
  out[0, 1] += float(np.trace(g))
  return out


@pytest.mark.parametrize(
  'change, said',
  [
    (_stats_of(rows=10**18), f'over {10**18} rows'),
    (_stats_of(rows=0), 'over 0 rows'),
    (_stats_of(10**18, _negative_definite), f'over {10**18} rows'),
    (_stats_of(g=_negative_definite), 'not symmetric PSD'),
    (_stats_of(g=_asymmetric), 'not symmetric PSD'),
    (_stats_of(g=_indefinite), 'not positive semi-definite'),
  ],
)
def test_statistics_that_lie_are_a_failed_clients(simulated, change, said):
  pool, _ = simulated
  lines, failed_lines = [], []
  got = _statistics_run(pool, _changed(change), lines)
  want = _statistics_run(pool, lambda part: None, failed_lines)
  assert lines and all(
    'refused: statistics' in x or 'refused: XᵀX' in x for x in lines
  ), lines
  assert all(said in x for x in lines), lines
  assert [x.replace(' failed (no reply)', '') for x in failed_lines] == [
    x.split(' refused: ')[0] for x in lines
  ]
  assert got[0] == want[0]
  np.testing.assert_array_equal(got[1], want[1])
  for (pa, sa), (pb, sb) in zip(got[2], want[2], strict=True):
    assert pa == pb
    for x, y in zip(sa, sb, strict=True):
      assert (x is None) == (y is None)
      if x is not None:
        np.testing.assert_array_equal(x[0], y[0])


def test_the_rows_of_a_stitch_are_the_batchs_positions(simulated):
  # By hand: a block's input of H × W × C takes batch · H · W rows, a
  # dense one batch rows.
  pool, _ = simulated
  for b, block in enumerate(pool.blocks):
    spatial = block.in_spec[:-1]
    want = 8 * (spatial[0] * spatial[1] if len(spatial) == 2 else 1)
    assert stitch_server.batch_rows(pool, b, 8) == want


def test_the_energy_model_is_the_nodes_devices():
  energy = types.SimpleNamespace(
    backend='simulated', mix=MIX, profile=None, ms_per_score=1.0
  )
  config = types.SimpleNamespace(
    energy=energy,
    partition=types.SimpleNamespace(num_clients=NUM_CLIENTS),
    run=types.SimpleNamespace(seed=0),
  )
  model = stitch_server.energy_model(config)
  assert model == ENERGY
  sysfs = types.SimpleNamespace(
    **{**vars(energy), 'backend': 'sysfs', 'profile': 'tx2_literal'}
  )
  model = stitch_server.energy_model(
    types.SimpleNamespace(**{**vars(config), 'energy': sysfs})
  )
  assert model.measured and model.seconds_per_unit == 0.001
  assert {d.profile.name for d in model.devices} == {'tx2_literal'}
  assert len(model.devices) == NUM_CLIENTS
