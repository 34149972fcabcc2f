"""The deployed round against the engine's, in one process: the nodes'
work through `node.train`, replies in any order, failures and malformed
replies (no Flower here; tests/deploy/test_deploy_program.py runs it)."""

import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flwr.app import Array
from flwr.app import ArrayRecord
from flwr.app import RecordDict

from fedjax_mr.core import types
from fedjax_mr.deploy import adapter
from fedjax_mr.deploy import codec
from fedjax_mr.deploy import node
from fedjax_mr.deploy import server
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import experiment as experiment_lib
from fedjax_mr.pipeline import records
from fedjax_mr.training import engine
from fedjax_mr.training import fold
from tests import helpers
from tests import xla_flags

NODES = 2

# Whole rounds through the engine and the deployed round (over 1.5 s).
pytestmark = pytest.mark.slow


def _experiment(algorithm, clients=6, k=3, chunk=1, devices=1, **flags):
  return adapter.setup(
    config_lib.ExperimentConfig.from_flat(
      algorithm=algorithm,
      dataset='synthetic',
      model='logistic',
      num_clients=clients,
      clients_per_round=k,
      local_epochs=1,
      client_chunk=chunk,
      num_devices=devices,
      seed=5,
      **flags,
    )
  )


class Local:
  """The nodes in this process; replies in reverse order, some changed
  by `tamper(position, reply) -> reply or None` (None: no reply)."""

  def __init__(self, experiment, tamper=None):
    self.experiment = experiment
    self.tamper = tamper or (lambda p, reply: reply)

  def exchange(self, requests, timeout):
    for r in reversed(requests):
      reply = node.train(self.experiment, r.content, r.node, NODES)
      yield r.position, self.tamper(r.position, reply)


def _simulated(experiment):
  step = jax.jit(
    engine.make_round_fn(
      experiment.algorithm, clients_per_round=3, client_chunk=1
    )
  )
  return step(experiment.state, experiment.data, experiment.key)


def _deployed(experiment, tamper=None, log=None):
  step = server.make_round(
    experiment, 1, Local(experiment, tamper), NODES, log=log or print
  )
  return step(experiment.state, experiment.data, experiment.key)


def _assert_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope='module', params=['fedavg', 'fedmr'])
def experiment(request):
  return _experiment(request.param)


@pytest.fixture(scope='module')
def simulated(experiment):
  return _simulated(experiment)


def test_a_round_equals_the_engines_bit_for_bit(experiment, simulated):
  state, metrics = _deployed(experiment)
  want_state, want_metrics = simulated
  assert int(state.round) == 1
  _assert_equal(state.server, want_state.server)
  assert sorted(metrics) == sorted(want_metrics)
  _assert_equal(
    [metrics[k] for k in sorted(metrics)],
    [want_metrics[k] for k in sorted(metrics)],
  )


# (algorithm, devices, client_chunk): 5 clients a round over 2 devices
# fill a sixth slot with an empty client; groups of 2 leave a group of
# one; each kind of contribution (weighted sums, SCAFFOLD's two sums,
# FedExP's norms, FedMut's, FedMR's stack of models).
PLACEMENTS = [
  ('fedavg', 1, 2),
  ('fedavg', 2, 1),
  ('fedavg', 2, 3),
  ('scaffold', 2, 2),
  ('fedexp', 2, 2),
  ('fedmut', 2, 2),
  ('fedmr', 2, 2),
]


def _differences(
  algorithm, devices, chunk, folder, rounds=2, arrival='reverse', **flags
) -> list[str]:
  """What differs between `rounds` deployed rounds (replies in `arrival`'s
  order, the nodes keeping client state in `folder`) and the rounds
  `experiments.run` compiles for the same config (its mesh, its chunk;
  other `flags`): `compare_rounds`'s."""
  experiment = _experiment(algorithm, 7, 5, chunk, devices, **flags)
  assert experiment.mesh.devices.size == devices
  local = LocalWithState(experiment, folder, arrival)
  deployed = server.make_round(experiment, chunk, local, NODES)
  return compare_rounds(experiment, deployed, chunk, rounds)[0]


def compare_rounds(experiment, deployed, chunk, rounds):
  """`(differences, last metrics)`: what differs between `rounds` of
  `deployed` and of the round `experiments.run` compiles for
  `experiment` and `chunk`: the server state's leaves and the metrics
  (NaN equal to NaN), by name."""
  simulated = experiment_lib._compile_round(experiment, chunk)
  state = experiment.state
  want = jax.tree.map(lambda x: np.array(x, copy=True), state)  # donated
  differ = []
  for r in range(rounds):
    state, metrics = deployed(state, experiment.data, experiment.key)
    want, want_metrics = simulated(want, experiment.data, experiment.key)
    leaves = jax.tree_util.tree_leaves_with_path(state.server)
    for (path, x), y in zip(leaves, jax.tree.leaves(want.server), strict=True):
      if not np.array_equal(np.asarray(x), np.asarray(y)):
        differ.append(f'round {r + 1} {jax.tree_util.keystr(path)}')
    assert sorted(metrics) == sorted(want_metrics)
    for name in sorted(metrics):
      a, b = metrics[name], want_metrics[name]
      if not np.array_equal(a, b, equal_nan=True):
        differ.append(f'round {r + 1} {name}')
  return differ, metrics


@pytest.mark.parametrize('algorithm, devices, chunk', PLACEMENTS)
def test_two_rounds_equal_the_suites_programs_at_every_placement(
  algorithm, devices, chunk, tmp_path
):
  # Each placement its own order of arrival (the sums depend on order).
  arrival = sorted(ARRIVALS)[PLACEMENTS.index((algorithm, devices, chunk)) % 3]
  assert (
    _differences(algorithm, devices, chunk, str(tmp_path), 2, arrival) == []
  )


@pytest.mark.parametrize(
  'algorithm, quantile',
  # SCAFFOLD's two sums and client state; FedMut's models made from the
  # dispatch, with the clip norm sent beside them (the engine's tests
  # cover the rest: tests/privacy).
  [('scaffold', 0.0), ('fedmut', 0.5)],
)
def test_a_private_round_deployed_equals_the_simulated_one(
  algorithm, quantile, tmp_path
):
  # DP-FedAvg: the nodes clip, the server noises the folded sum from the
  # round's key; a clip small enough to bind every client; with a quantile
  # the clip norm travels in the dispatch and adapts.
  dp = {
    'dp_clip': 0.05,
    'dp_noise_multiplier': 0.3,
    'dp_adaptive_quantile': quantile,
  }
  assert _differences(algorithm, 2, 2, str(tmp_path), 2, **dp) == []


def differing(cases, folder) -> dict[str, list[str]]:
  """`_differences` of each `(algorithm, devices, chunk, rounds)` of
  `cases`."""
  return {
    '-'.join(map(str, case)): _differences(*case[:3], f'{folder}/{i}', case[3])
    for i, case in enumerate(cases)
  }


def test_two_rounds_equal_the_programs_as_programs_compile(tmp_path):
  # At the suite's LLVM -O0 (tests/xla_flags.py) XLA:CPU makes no fused
  # multiply-add and a vmapped client rounds as one alone; at a program's
  # level it makes FedAvg's total + n_k * w_k one where its fusions allow
  # (so each contribution passes `types.unfused` before it is summed),
  # and a client of a vmapped group gets other bits than alone (so a
  # node trains it in its group's program, `node._update`). Without
  # either, FedAvg's and FedMR's leaves and the clients' losses differed
  # here (AMD EPYC) while the in-process tests passed.
  # Each kind of contribution, one round (the sums of round 1 are what
  # round 2 starts from); SCAFFOLD two (its controls). Chunk 2 over 2
  # devices: a vmapped group and a group of one each; FedMR at chunk 3
  # on one device: groups of 3 and 2 (chunk 3 over 2 devices is in
  # process above).
  cases = [
    ('fedavg', 1, 1, 1),
    ('fedavg', 2, 2, 1),
    ('scaffold', 2, 2, 2),
    ('fedexp', 2, 2, 1),
    ('fedmut', 2, 2, 1),
    ('fedmr', 1, 3, 1),
  ]
  env = dict(os.environ)
  env['XLA_FLAGS'] = xla_flags.program_flags(env.get('XLA_FLAGS', ''))
  code = (
    'import json, sys; from tests.deploy import test_server as t; '
    'print(json.dumps(t.differing(json.loads(sys.argv[1]), sys.argv[2])))'
  )
  repo = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  done = subprocess.run(
    [sys.executable, '-c', code, json.dumps(cases), str(tmp_path)],
    cwd=os.path.abspath(repo),
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  got = json.loads(done.stdout.splitlines()[-1])
  assert got == {'-'.join(map(str, c)): [] for c in cases}


def _summed(chunk, outputs, order, devices=1):
  """The engine's fold (`training/fold.py`) of `outputs` (None: failed)
  put in `order`, as a round over `devices` devices with `client_chunk`
  `chunk` sums them; the clients all of one size."""
  scalar = jax.ShapeDtypeStruct((), np.int32)
  template = types.ClientOutput(
    {'x': jax.ShapeDtypeStruct((1,), np.float32)},
    scalar,
    jax.ShapeDtypeStruct((), np.float32),
    scalar,
  )
  contribution = lambda o: {'x': o.loss * o.variables['x']}  # noqa: E731
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ('clients',))
  programs = fold.programs(contribution, mesh)
  sizes = np.full(len(outputs), 5, np.int32)
  sums = fold.Fold(programs, template, sizes, chunk)
  for p in order:
    x = outputs[p]
    if x is not None:
      x = types.ClientOutput(
        {'x': np.asarray([x], np.float32)},
        np.int32(5),
        np.float32(1),
        np.int32(1),
      )
    sums.put(p, x)
  assert not sums.waiting
  return float(np.asarray(sums.total()['x'])[0])


def test_sums_group_as_the_simulation_in_any_arrival_order():
  # float32 spacing at 1e8 is 8: 1e8 + 1 is 1e8 and 1 - 1e8 is -1e8, so
  # the grouping shows in the total.
  xs = [1e8, 1.0, -1e8, 1.0]
  for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]):
    # One at a time: ((1e8 + 1) - 1e8) + 1.
    assert _summed(1, xs, order) == 1.0
    # Groups of 2 (engine's client_chunk): (1e8 + 1) + (-1e8 + 1).
    assert _summed(2, xs, order) == 0.0
    # Groups of 3 and the rest: (1e8 + 1 - 1e8) + 1.
    assert _summed(3, xs, order) == 1.0
    # A failed client adds nothing, also within a group.
    assert _summed(1, [1e8, None, -1e8, 1.0], order) == 1.0
    assert _summed(2, [1e8, 1.0, None, 1.0], order) == 1e8
    # Two devices (`placement.slots`, equal sizes): device 0 runs clients
    # 0 and 3, device 1 clients 1 and 2, then one sum over the devices:
    # (1e8 + 1) + (1 - 1e8).
    assert _summed(1, xs, order, devices=2) == 0.0
    assert _summed(1, [1e8, 1.0, -1e8, None], order, devices=2) == 0.0
    assert _summed(1, [1e8, 1.0, 1.0, -1e8], order, devices=2) == 2.0
    # Five clients on two devices in groups of 2: device 0 runs clients
    # 0, 3 and 4, device 1 clients 1, 2 and an empty one (a sixth, which
    # adds zeros): ((1e8 - 1e8) + 1) + ((1 + 1) + 0).
    xs5 = [1e8, 1.0, 1.0, -1e8, 1.0]
    assert _summed(2, xs5, order + [4], devices=2) == 3.0


def _nan(reply):
  record = reply['output']
  out = ArrayRecord()
  for k in record:
    value = record[k].numpy()
    if 'kernel' in k:
      value = value.copy()
      value.flat[0] = np.nan
    out[k] = Array(value)
  return RecordDict({'output': out})


def _wrong_tree(reply):
  return RecordDict({'output': codec.encode({'w': np.zeros(3, np.float32)})})


@pytest.mark.parametrize(
  'change, says',
  [
    (lambda reply: None, 'failed (no reply)'),
    (_nan, 'non-finite'),
    (_wrong_tree, 'refused: record does not hold the expected tree'),
  ],
)
def test_a_failed_or_malformed_reply_is_left_out_and_named(
  experiment, simulated, change, says
):
  lines = []
  state, metrics = _deployed(
    experiment,
    lambda p, reply: change(reply) if p == 1 else reply,
    lines.append,
  )
  ids = [int(i) for i in metrics['client_ids']]
  assert [int(i) for i in metrics['failed_clients']] == [ids[1]]
  assert int(metrics['client_examples'][1]) == 0
  assert int(metrics['client_steps'][1]) == 0
  assert len(lines) == 1 and f'client {ids[1]}' in lines[0]
  # The records: the metrics row names it, the clients row marks it.
  row, clients_row = records.round_rows(1, jax.device_get(metrics))
  assert row['failed_clients'] == [ids[1]]
  assert [c.get('failed', False) for c in clients_row['clients']] == [
    False,
    True,
    False,
  ]
  assert says in lines[0]
  # What the round aggregated: the two replies that arrived, and for
  # algorithms that need every model, the model client 1 was sent.
  _, full = simulated
  assert int(metrics['num_examples']) == int(full['num_examples']) - int(
    full['client_examples'][1]
  )
  assert np.all(np.isfinite(np.asarray(jax.tree.leaves(state.server)[0])))


def _with_scalar(name, value):
  """A change of a reply: its `ClientOutput.<name>` made `value`."""

  def change(reply):
    record = reply['output']
    out = ArrayRecord()
    for k in record:
      got = record[k].numpy()
      out[k] = Array(np.asarray(value, got.dtype) if k == f'.{name}' else got)
    return RecordDict({'output': out})

  return change


def _steps_times(factor, plus=0):
  """A change: the reply's steps times `factor`, plus `plus`."""

  def change(reply):
    steps = int(reply['output']['.num_steps'].numpy())
    return _with_scalar('num_steps', steps * factor + plus)(reply)

  return change


@pytest.fixture(scope='module')
def second_failed(experiment):
  """The round in which the second sampled client sent no reply."""
  lines = []
  got = _deployed(
    experiment, lambda p, reply: None if p == 1 else reply, lines.append
  )
  return got, lines


# The weights a hostile node claimed (issue 71): each refused.
WEIGHT_ATTACKS = [
  (_with_scalar('num_examples', 10**9), 'num_examples is 1000000000'),
  (_with_scalar('num_examples', -7), 'num_examples is -7'),
  (_with_scalar('num_examples', 0), 'num_examples is 0'),
  (_steps_times(1, plus=1), 'num_steps is'),
  (_steps_times(0), 'num_steps is 0'),
  (_steps_times(-1), 'num_steps is -'),
  (_with_scalar('num_steps', 10**9), 'num_steps is 1000000000'),
  (_with_scalar('loss', -1.0), 'loss is -1.0'),
]


@pytest.mark.parametrize('change, says', WEIGHT_ATTACKS)
def test_a_reply_that_lies_about_its_weight_is_a_failed_clients(
  experiment, second_failed, change, says
):
  lines = []
  state, metrics = _deployed(
    experiment,
    lambda p, reply: change(reply) if p == 1 else reply,
    lines.append,
  )
  (want_state, want_metrics), failed_lines = second_failed
  client = int(metrics['client_ids'][1])
  assert len(lines) == 1, lines
  assert f'client {client} refused: ' in lines[0] and says in lines[0]
  assert failed_lines == [f'round 1: client {client} failed (no reply)']
  # The rest of the round: the round where that client failed, bit for
  # bit (state and every metric, its failure named).
  _assert_equal(state, want_state)
  assert sorted(metrics) == sorted(want_metrics)
  _assert_equal(
    [metrics[k] for k in sorted(metrics)],
    [want_metrics[k] for k in sorted(metrics)],
  )


def test_the_most_examples_from_every_client_are_all_refused(experiment):
  # Three of 2^31 - 1 wrap an int32 total; all zeros divide by zero.
  for value in (2**31 - 1, 0):
    lines = []
    with pytest.raises(server.NoClientError, match='no client replied'):
      _deployed(
        experiment,
        lambda p, reply: _with_scalar('num_examples', value)(reply),
        lines.append,
      )
    assert len(lines) == 3
    assert all(f'refused: num_examples is {value},' in x for x in lines)


def test_the_weights_of_every_client_are_what_the_server_knows(experiment):
  # What `check_weights` expects, by hand from the partition and flags
  # (6 clients, E = 1, B = 50): the steps the simulation reports.
  template = node.output_shape(
    experiment,
    engine.next_dispatch(
      experiment.algorithm,
      experiment.state,
      experiment.data,
      experiment.key,
      3,
    ),
    experiment.state,
  )
  weights = server.weights_of(experiment, template)
  assert list(weights.sizes) == list(experiment.client_sizes)
  assert (weights.epochs, weights.max_passes) == (1, 1)
  b = min(50, max(experiment.client_sizes))
  assert weights.batch == b
  _, metrics = _simulated(experiment)
  for c, n, steps in zip(
    metrics['client_ids'], metrics['client_examples'], metrics['client_steps']
  ):
    assert int(n) == experiment.client_sizes[int(c)]
    assert int(steps) == -(-int(n) // b)


def test_no_reply_at_all_is_an_error(experiment):
  with pytest.raises(server.NoClientError, match='no client replied'):
    _deployed(experiment, lambda p, reply: None, lambda line: None)


def test_node_refuses_a_client_it_does_not_serve(experiment):
  sent = engine.next_dispatch(
    experiment.algorithm,
    experiment.state,
    experiment.data,
    experiment.key,
    3,
  )
  content = node.request_content(sent, 0, 1, jax.random.key(0), 0)
  with pytest.raises(node.RequestError, match='not served by node 0'):
    node.train(experiment, content, 0, NODES)


@pytest.mark.parametrize('lane', [(4, 0), (2, 2), (-1, 0), (0, 1), (2, -1)])
def test_node_refuses_a_lane_outside_the_round(experiment, lane):
  # A round of 3 clients trains a client alone (0, 0) or in lane l < w of
  # a vmapped group of w <= 3: a wider group is work the round never
  # asks for.
  sent = engine.next_dispatch(
    experiment.algorithm,
    experiment.state,
    experiment.data,
    experiment.key,
    3,
  )
  content = node.request_content(sent, 0, 0, jax.random.key(0), 0, lane)
  with pytest.raises(node.RequestError, match='a request to train in lane'):
    node.train(experiment, content, 0, NODES)


def test_node_refuses_a_request_of_another_shape(experiment):
  sent = engine.next_dispatch(
    experiment.algorithm,
    experiment.state,
    experiment.data,
    experiment.key,
    3,
  )
  bad = types.Dispatch(
    jax.tree.map(lambda x: np.zeros((2,), np.float32), sent.shared),
    sent.per_client,
  )
  if not jax.tree.leaves(sent.shared):
    bad = types.Dispatch(
      sent.shared, jax.tree.map(lambda x: x[:, :1], sent.per_client)
    )
  content = node.request_content(bad, 0, 0, jax.random.key(0), 0)
  with pytest.raises(node.RequestError, match='request of round 1'):
    node.train(experiment, content, 0, NODES)


# Orders in which replies arrive, as positions of a round's K requests.
ARRIVALS = {
  'reverse': lambda k: list(range(k))[::-1],
  'forward': lambda k: list(range(k)),
  # The odd positions first, then the even ones from the last: no group of
  # 2 or 3 is complete until its last reply arrives out of turn.
  'interleaved': lambda k: list(range(1, k, 2)) + list(range(0, k, 2))[::-1],
}


class LocalWithState(Local):
  """`Local`, the nodes keeping their clients' state in `folder`, the
  replies arriving in `ARRIVALS[arrival]`'s order; the replies of the
  positions in `lost` never arrive (`None`: a failed client's)."""

  def __init__(self, experiment, folder, arrival='reverse', lost=()):
    super().__init__(experiment)
    self.folder = folder
    self.arrival = ARRIVALS[arrival]
    self.lost = set(lost)
    self.replies = {}  # position -> the latest round's reply

  def exchange(self, requests, timeout):
    for p in self.arrival(len(requests)):
      r = requests[p]
      folder = f'{self.folder}/node{r.node}'
      reply = node.train(self.experiment, r.content, r.node, NODES, folder)
      self.replies[p] = reply
      yield p, None if p in self.lost else reply


# A failed client at each place of its group, in round 2: with chunk 3
# the first, middle and last of the group of 3 and the last of the group
# of 2; with chunk 1 the first and the last client.
FAILURES = [
  ('fedavg', 1, (0, 4)),
  ('fedavg', 3, (0, 1, 2, 4)),
  ('fedmr', 1, (0, 4)),
  ('fedmr', 3, (0, 1, 2, 4)),
]


@pytest.mark.parametrize('algorithm, chunk, positions', FAILURES)
def test_a_failed_client_anywhere_is_left_out_of_its_round(
  algorithm, chunk, positions, tmp_path
):
  # FedAvg with the plain mean: a failed client's zeros, if summed, would
  # weigh as much as a trained model. FedMR needs K models: the failed
  # client's slot holds the model it was sent, no other.
  experiment = _experiment(algorithm, 7, 5, chunk, weighting='uniform')
  algo = experiment.algorithm
  local = LocalWithState(experiment, str(tmp_path), 'interleaved')
  step = server.make_round(experiment, chunk, local, NODES, log=lambda _: 0)
  first, _ = step(experiment.state, experiment.data, experiment.key)
  sent = engine.next_dispatch(algo, first, experiment.data, experiment.key, 5)
  template = node.output_shape(experiment, sent, first)
  k_aggregate = engine.round_keys(experiment.key, first.round)[3]
  aggregate = jax.jit(functools.partial(types.aggregate_stacked, algo))
  for p in positions:
    local.lost = {p}
    state, metrics = step(first, experiment.data, experiment.key)
    ids = np.asarray(metrics['client_ids'])
    assert [int(i) for i in metrics['failed_clients']] == [ids[p]], p
    outputs = [node.read_reply(local.replies[q], template) for q in range(5)]
    assert [int(n) for n in metrics['client_examples']] == [
      0 if q == p else int(o.num_examples) for q, o in enumerate(outputs)
    ]
    if algo.contribution is not None:
      # The plain mean of the other four models (float64, any order).
      for path, got in jax.tree_util.tree_leaves_with_path(state.server.params):
        others = [
          np.asarray(_at(o.variables, path), np.float64)
          for q, o in enumerate(outputs)
          if q != p
        ]
        helpers.assert_close(got, np.mean(others, axis=0), rtol=1e-5, atol=1e-7)
      continue
    # The model client p was sent, in its slot, zero examples and steps.
    row = jax.tree.map(lambda x: np.asarray(x[p]), sent.per_client)
    outputs[p] = jax.tree.map(
      lambda s: np.zeros(s.shape, s.dtype), template
    )._replace(variables=row)
    want, _ = aggregate(
      first.server, _stacked(outputs), ids, first.round, k_aggregate
    )
    _assert_equal(state.server, want)


def _at(tree, path):
  for entry in path:
    tree = tree[entry.key]
  return tree


def _stacked(outputs):
  return jax.tree.map(lambda *xs: np.stack(xs), *outputs)


def test_scaffold_control_variates_live_on_the_nodes(tmp_path):
  experiment = _experiment('scaffold')
  simulate = jax.jit(
    engine.make_round_fn(
      experiment.algorithm, clients_per_round=3, client_chunk=1
    )
  )
  step = server.make_round(
    experiment, 1, LocalWithState(experiment, str(tmp_path)), NODES
  )
  want, state = experiment.state, experiment.state
  deployed = []
  for _ in range(2):
    want, want_metrics = simulate(want, experiment.data, experiment.key)
    before = state
    state, metrics = step(state, experiment.data, experiment.key)
    deployed.append((before, state, metrics))
    _assert_equal(state.server, want.server)
    _assert_equal(
      [metrics[k] for k in sorted(want_metrics)],
      [want_metrics[k] for k in sorted(want_metrics)],
    )
  # The server restarted from round 1's checkpoint asks for round 2
  # again: the nodes use their state of round 1, not of round 2.
  before, after, metrics = deployed[1]
  again, again_metrics = step(before, experiment.data, experiment.key)
  _assert_equal(again.server, after.server)
  _assert_equal(again_metrics, metrics)
  saved = sorted(p.name for p in tmp_path.rglob('*.npz'))
  assert saved and all('.round' in name for name in saved)
  # The clients' states are the node's alone (issue 71).
  for folder in {p.parent for p in tmp_path.rglob('*.npz')}:
    assert folder.stat().st_mode & 0o777 == 0o700, folder
