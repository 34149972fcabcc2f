"""The secure round (SecAgg+) deployed against the simulated encoding, in
one process: the nodes' stages through `secure_node.serve`, dropouts at
every stage, and the messages a node refuses (no Flower here;
tests/deploy/test_deploy_program.py runs it)."""

import jax
import numpy as np
import pytest
from flwr.app import ConfigRecord

from fedjax_mr.deploy import credentials
from fedjax_mr.deploy import node
from fedjax_mr.deploy import secure_node
from fedjax_mr.deploy import secure_round
from fedjax_mr.deploy import server
from fedjax_mr.privacy import distributed_dp
from fedjax_mr.privacy import secagg
from tests.deploy import test_server

NODES = 2

# Whole rounds through the engine and the deployed round.
pytestmark = pytest.mark.slow


def _experiment(algorithm='fedavg', clients=7, k=5, chunk=2, devices=2, **f):
  """test_server's small synthetic experiment, aggregated securely."""
  flags = dict(secure_aggregation=True, secagg_range=100.0)
  flags.update(f)
  return test_server._experiment(algorithm, clients, k, chunk, devices, **flags)


class SecureLocal:
  """The nodes in this process, each stage's requests packed per node
  (`node.pack`) and served by `secure_node.serve`, the replies arriving
  in reverse order; `lose(stage, client)` True drops that reply, and
  `change(stage, client, reply)` may alter one."""

  def __init__(
    self, experiment, folder, lose=None, change=None, identities=None
  ):
    self.experiment = experiment
    self.folder = folder
    self.identities = identities or [secure_node.NO_IDENTITY] * NODES
    self.lose = lose or (lambda stage, client: False)
    self.change = change or (lambda stage, client, reply: reply)
    self.stages = []

  def exchange(self, requests, timeout):
    by_node = {}
    for r in requests:
      by_node.setdefault(r.node, {})[r.position] = r.content
    replies = {}
    for n, parts in by_node.items():
      packed = node.pack(parts)
      served = secure_node.serve(
        secure_node.Run.of(self.experiment),
        packed,
        n,
        NODES,
        f'{self.folder}/node{n}',
        self.identities[n],
      )
      replies.update(node.unpack(served))
    stage = str(requests[0].content[secure_node.SECAGG]['stage'])
    self.stages.append(stage)
    for r in reversed(requests):
      if self.lose(stage, r.client):
        yield r.position, None
      else:
        yield r.position, self.change(stage, r.client, replies[r.position])


def _rounds(experiment, transport, rounds=2, log=print):
  """`(differences, last metrics)` of `rounds` deployed secure rounds
  against the ones `experiments.run` compiles
  (`test_server.compare_rounds`)."""
  collect = secure_round.make_collect(experiment, transport, log=log)
  chunk = experiment.config.devices.client_chunk
  deployed = server.make_round(
    experiment, chunk, transport, NODES, collect=collect, log=log
  )
  return test_server.compare_rounds(experiment, deployed, chunk, rounds)


@pytest.mark.parametrize(
  'algorithm, devices, chunk, neighbours',
  [
    ('fedavg', 2, 2, 0),
    ('fedprox', 1, 1, 2),
    ('fedmut', 2, 3, 0),
    ('scaffold', 1, 2, 2),
  ],
)
def test_secure_rounds_deployed_equal_the_simulated_bit_for_bit(
  algorithm, devices, chunk, neighbours, tmp_path
):
  experiment = _experiment(
    algorithm, chunk=chunk, devices=devices, secagg_neighbours=neighbours
  )
  transport = SecureLocal(experiment, str(tmp_path))
  differ, metrics = _rounds(experiment, transport)
  assert differ == []
  assert transport.stages == ['keys', 'share', 'mask', 'unmask'] * 2
  assert 'failed_clients' not in metrics and np.isfinite(metrics['train_loss'])
  assert np.isnan(metrics['client_loss']).all()
  # Each client's secrets are gone once it revealed its shares.
  assert not list(tmp_path.glob('node*/secagg/*.json'))


def _upload_sum(experiment, requests_seen, clients, folder):
  """The integer sum of `clients`' encoded uploads of round 1, each
  computed alone (`node.client_output` on a fresh state folder)."""
  total = None
  for content in requests_seen:
    c = int(content['meta']['client'])
    if c not in clients:
      continue
    out = node.client_output(experiment, content, c % NODES, NODES, folder)
    leaves = [np.asarray(x, np.uint32) for x in jax.tree.leaves(out.extra)]
    total = leaves if total is None else [a + b for a, b in zip(total, leaves)]
  return total


class Recording(SecureLocal):
  """`SecureLocal` that keeps each `mask` request's training content."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.training = []

  def exchange(self, requests, timeout):
    for r in requests:
      if str(r.content[secure_node.SECAGG]['stage']) == 'mask':
        self.training.append(r.content)
    yield from super().exchange(requests, timeout)


@pytest.mark.parametrize(
  'stage, lost, summed, threshold',
  [
    # Before its keys, before its shares, before its masked input: out
    # of the sum; after its masked input (no shares revealed): in it.
    # K = 5 clients, each shares with 4 and itself: t = 4 at 2/3 (one
    # may drop), 3 at 0.51 (two may).
    ('keys', {1}, False, 2 / 3),
    ('share', {1}, False, 2 / 3),
    ('mask', {1, 4}, False, 0.51),
    ('unmask', {1}, True, 2 / 3),
  ],
)
def test_a_round_completes_with_a_client_lost_at_any_stage(
  stage, lost, summed, threshold, tmp_path
):
  experiment = _experiment(clients=7, k=5, secagg_threshold=threshold)
  ids = None
  lines = []

  def lose(s, client):
    return s == stage and client in lost_ids

  # The round's clients are drawn by the engine: lose the clients at
  # these positions of the sampled order.
  transport = Recording(experiment, str(tmp_path / 'nodes'), lose=lose)
  collect = secure_round.make_collect(experiment, transport, log=lines.append)
  captured = []

  def capturing(requests, r, template, weights):
    nonlocal ids
    ids = [q.client for q in requests]
    lost_ids.update(ids[p] for p in lost)
    sums, failed = collect(requests, r, template, weights)
    captured.append(sums)
    return sums, failed

  lost_ids = set()
  step = server.make_round(
    experiment, 2, transport, NODES, collect=capturing, log=lines.append
  )
  _, metrics = step(experiment.state, experiment.data, experiment.key)
  out = set(lost_ids)
  assert sorted(metrics.get('failed_clients', [])) == (
    [] if summed else sorted(out)
  )
  kept = set(ids) - (set() if summed else out)
  want = _upload_sum(
    experiment, transport.training, kept, str(tmp_path / 'alone')
  )
  got = [np.asarray(x) for x in jax.tree.leaves(captured[0].total)]
  bits = experiment.config.privacy.secure.bits
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a, b & np.uint32(2**bits - 1))
  assert np.isfinite(metrics['train_loss'])
  assert any(f'secure stage {stage}' in line for line in lines)


def _lose_masked_inputs(experiment, folder, count):
  """`(the round's error, the transport)`: a round whose first `count`
  clients lose their masked input."""
  lost = set()

  def lose(stage, client):
    if stage == 'mask' and len(lost) < count:
      lost.add(client)
    return stage == 'mask' and client in lost

  transport = SecureLocal(experiment, folder, lose=lose)
  collect = secure_round.make_collect(experiment, transport, log=print)
  step = server.make_round(experiment, 2, transport, NODES, collect=collect)
  with pytest.raises(server.NoClientError) as e:
    step(experiment.state, experiment.data, experiment.key)
  return str(e.value), transport


def test_below_the_threshold_the_round_fails_in_one_line(tmp_path):
  experiment = _experiment(clients=7, k=5)  # t = 4 of 5 holders
  error, _ = _lose_masked_inputs(experiment, str(tmp_path), 2)
  assert error == (
    'round 1: secure aggregation needs 4 clients, 3 sent their masked input'
  )


def test_too_few_shares_to_unmask_fail_the_round(tmp_path):
  experiment = _experiment(clients=7, k=5)
  # After the masked inputs, three of five reveal nothing: each survivor's
  # self mask has 2 shares of the 4 it needs.
  transport = SecureLocal(experiment, str(tmp_path))
  seen = []

  def lose(stage, client):
    if stage == 'unmask':
      seen.append(client)
      return len(seen) <= 3
    return False

  transport.lose = lose
  collect = secure_round.make_collect(experiment, transport, log=print)
  step = server.make_round(experiment, 2, transport, NODES, collect=collect)
  with pytest.raises(secure_round.SecureRoundError, match='shares of its self'):
    step(experiment.state, experiment.data, experiment.key)


def _identities(folder):
  made = credentials.make(str(folder), NODES)
  return [
    secure_node.identity(
      {'signing-key': made.node_keys[i], 'roster': made.roster}
    )
    for i in range(NODES)
  ]


def test_signed_keys_a_round_equals_the_simulated_one(tmp_path):
  experiment = _experiment()
  who = _identities(tmp_path / 'credentials')
  transport = SecureLocal(experiment, str(tmp_path / 'nodes'), identities=who)
  differ, _ = _rounds(experiment, transport, rounds=1)
  assert differ == []


def test_keys_a_server_slips_in_are_refused_by_every_neighbour(tmp_path):
  """The server replaces the first client's keys by its own (so that it
  could open the shares sent to it): the nodes
  holding the roster find them unsigned by that client's node, and the
  round cannot go on."""
  experiment = _experiment()
  who = _identities(tmp_path / 'credentials')
  swapped = []
  mine = secagg.public_keys(secagg.new_seed())

  def change(stage, client, reply):
    if stage == 'keys' and not swapped:
      swapped.append(client)
      sig = reply['keys']['sig']
      reply['keys'] = ConfigRecord({'c': mine[0], 's': mine[1], 'sig': sig})
    return reply

  transport = SecureLocal(
    experiment, str(tmp_path / 'nodes'), change=change, identities=who
  )
  lines = []
  collect = secure_round.make_collect(experiment, transport, log=lines.append)
  step = server.make_round(experiment, 2, transport, NODES, collect=collect)
  with pytest.raises(secure_round.SecureRoundError, match='shared their'):
    step(experiment.state, experiment.data, experiment.key)
  refused = [line for line in lines if 'not signed by its node' in line]
  assert len(refused) == 4  # each of the other four clients
  assert all(f'client {swapped[0]} are not signed' in x for x in refused)


# Distributed DP: each node noises its clients' integers with its secret.

NOISED = dict(dp_clip=0.5, dp_noise_multiplier=0.8, weighting='uniform')


def _node_secrets(folder):
  """Each node's noise secret, written where the node keeps it."""
  made = []
  for n in range(NODES):
    here = folder / f'node{n}' / 'secagg'
    here.mkdir(parents=True, mode=0o700)
    secret = bytes([n + 1]) * 32
    (here / secure_node.NOISE_SECRET).write_bytes(secret)
    (here / secure_node.NOISE_SECRET).chmod(0o600)
    made.append(secret)
  return made


@pytest.mark.parametrize('algorithm', ['fedavg', 'scaffold'])
def test_noised_rounds_deployed_equal_the_simulated_given_the_secrets(
  algorithm, tmp_path
):
  """The simulation holding the nodes' secrets gives the deployed rounds'
  bits; without them (as the server) it cannot: the noise differs."""
  experiment = _experiment(algorithm, devices=1, chunk=2, **NOISED)
  held = _node_secrets(tmp_path)
  transport = SecureLocal(experiment, str(tmp_path))
  with distributed_dp.node_secret(lambda c: held[c % NODES]):
    differ, metrics = _rounds(experiment, transport)
  assert differ == []
  assert int(metrics['dp_clients']) == 5 and np.isnan(metrics['train_loss'])
  blind, _ = _rounds(experiment, SecureLocal(experiment, str(tmp_path)), 1)
  assert blind  # the server's own simulation is not the deployed round


def test_a_node_makes_its_secret_once_and_keeps_it_private(tmp_path):
  first = secure_node.noise_secret(str(tmp_path))
  assert len(first) == 32 and secure_node.noise_secret(str(tmp_path)) == first
  path = tmp_path / 'secagg' / secure_node.NOISE_SECRET
  assert path.stat().st_mode & 0o777 == 0o600
  path.chmod(0o644)
  with pytest.raises(node.RequestError, match='open to others'):
    secure_node.noise_secret(str(tmp_path))
  assert secure_node.noise_secret(str(tmp_path / 'other')) != first


def test_fewer_noised_inputs_than_accounted_fail_the_round(tmp_path):
  """SecAgg+ with 2 neighbours at 0.51 unmasks with 2 of 3 holders, but
  the accountant counts on the noise of 3 of the 5 clients: a round with
  2 masked inputs fails in one line before anything is unmasked."""
  experiment = _experiment(
    devices=1, secagg_neighbours=2, secagg_threshold=0.51, **NOISED
  )
  error, transport = _lose_masked_inputs(experiment, str(tmp_path), 3)
  assert error == (
    'round 1: secure aggregation needs 3 clients, 2 sent their noised input'
  )
  assert 'unmask' not in transport.stages


def test_with_secagg_the_nodes_count_is_the_noises():
  """A SecAgg node refuses to reveal shares below t of its K - 1 peers
  and itself: that t is the m the accountant counts on, so the noise
  floor does not rest on the server's count."""
  for k in (2, 3, 5, 10, 100):
    for fraction in (0.51, 2 / 3, 0.9, 1.0):
      assert secagg.threshold(k - 1, fraction) == (
        distributed_dp.min_clients(k, fraction)
      )


def test_a_plain_secure_round_makes_no_noise_secret(tmp_path):
  experiment = _experiment(devices=1)
  _rounds(experiment, SecureLocal(experiment, str(tmp_path)), rounds=1)
  assert not list(tmp_path.glob(f'node*/secagg/{secure_node.NOISE_SECRET}'))
