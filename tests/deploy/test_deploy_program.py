"""A deployed run on a real local federation (a SuperLink and 3
SuperNodes as processes, TLS, node authentication) ends with
`experiments.run`'s own rows, bit for bit, for FedAvg, for FedMR (which
needs every client's model) and for SCAFFOLD (whose client state lives on
the nodes). One federation serves the three runs, as a real fleet serves
many (`launch.run(..., federation=)`); the program's own start of a
federation is tested in test_deploy_faults.py."""

import json
import os

import jax
import numpy as np
import pytest

from fedjax_mr.deploy import federation
from fedjax_mr.deploy import launch
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import experiment

# A tiny run: 9 generated clients, 3 a round, 2 rounds, a 610-parameter
# model; one device and one client at a time, the order of the
# deployment's sums (see fedjax_mr/deploy/server.py).
SETTING = dict(
  dataset='synthetic',
  model='logistic',
  num_clients=9,
  clients_per_round=3,
  rounds=2,
  local_epochs=1,
  client_chunk=1,
  num_devices=1,
  eval_every=1,
  checkpoint_every=1,
  seed=3,
)
FLAGS = [f'--{k}={v}' for k, v in SETTING.items()]
NODES = 3
TIMES = {'round_time_s', 'eval_time_s', 'elapsed_s'}


def _rows(workdir, name):
  with open(os.path.join(workdir, name)) as f:
    return [
      {k: v for k, v in json.loads(line).items() if k not in TIMES}
      for line in f
    ]


def config(workdir, **values):
  return config_lib.ExperimentConfig.from_flat(
    **{**SETTING, **values}, workdir=str(workdir)
  )


@pytest.fixture(scope='module')
def fed(tmp_path_factory):
  folder = str(tmp_path_factory.mktemp('federation'))
  with federation.Federation(
    folder, NODES, launch.node_config(folder, NODES)
  ) as f:
    yield f


def assert_same_run(simulated, deployed, rounds=2):
  for name in ('metrics.jsonl', 'clients.jsonl'):
    assert _rows(deployed, name) == _rows(simulated, name)
  assert len(_rows(deployed, 'metrics.jsonl')) == rounds
  a, b = experiment.load_run(simulated), experiment.load_run(deployed)
  assert a.round == b.round == rounds
  for x, y in zip(
    jax.tree.leaves(a.state.server), jax.tree.leaves(b.state.server)
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize('algorithm', ['fedavg', 'fedmr', 'scaffold'])
def test_deployed_run_equals_the_simulation(tmp_path, fed, algorithm):
  simulated, deployed = tmp_path / 'sim', tmp_path / 'dep'
  experiment.train_and_evaluate(
    config(simulated, algorithm=algorithm), str(simulated), log=lambda s: None
  )
  lines = []
  launch.run(
    config(deployed, algorithm=algorithm),
    NODES,
    federation=fed,
    log=lines.append,
  )
  assert any(f'SuperLink on {fed.address}' in line for line in lines)
  assert_same_run(str(simulated), str(deployed))
  with open(deployed / 'flower' / 'result.json') as f:
    assert json.load(f) == {'ok': True}
