"""The secure round (SecAgg+) deployed against the simulated encoding, in
one process: the nodes' stages through `secure_node.serve`, dropouts at
every stage, and the messages a node refuses (no Flower here;
tests/deploy/test_deploy_program.py runs it)."""

import jax
import numpy as np
import pytest
from flwr.app import ConfigRecord
from flwr.app import RecordDict

from fedjax_mr.deploy import adapter
from fedjax_mr.deploy import node
from fedjax_mr.deploy import secure_node
from fedjax_mr.deploy import secure_round
from fedjax_mr.deploy import server
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import experiment as experiment_lib

NODES = 2

# Whole rounds through the engine and the deployed round.
pytestmark = pytest.mark.slow


def _experiment(algorithm='fedavg', clients=7, k=5, chunk=2, devices=2, **f):
  flags = dict(secure_aggregation=True, secagg_range=100.0)
  flags.update(f)
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


class SecureLocal:
  """The nodes in this process, each stage's requests packed per node
  (`node.pack`) and served by `secure_node.serve`, the replies arriving
  in reverse order; `lose(stage, client)` True drops that reply, and
  `change(stage, client, reply)` may alter one."""

  def __init__(self, experiment, folder, lose=None, change=None):
    self.experiment = experiment
    self.folder = folder
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
        self.experiment, packed, n, NODES, f'{self.folder}/node{n}'
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
  """`(differences, last metrics)`: what differs between `rounds`
  deployed secure rounds and the ones `experiments.run` compiles (the
  server state's leaves and the metrics, by name)."""
  collect = secure_round.make_collect(experiment, transport, log=log)
  chunk = experiment.config.devices.client_chunk
  deployed = server.make_round(
    experiment, chunk, transport, NODES, collect=collect, log=log
  )
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
    for name in sorted(set(metrics) | set(want_metrics)):
      if name not in metrics or name not in want_metrics:
        differ.append(f'round {r + 1} {name} in one only')
      elif not np.array_equal(
        metrics[name], want_metrics[name], equal_nan=True
      ):
        differ.append(f'round {r + 1} {name}')
  return differ, metrics


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
