"""`experiments.deploy` on a real local federation (a SuperLink and 3
SuperNodes as processes) ends with `experiments.run`'s own rows, bit for
bit, for FedAvg and for FedMR (which needs every client's model)."""

import json
import os

import jax
import numpy as np
import pytest

from fedjax_mr.pipeline import experiment
from tests import helpers

# A tiny run: 9 generated clients, 3 a round, 2 rounds, a 610-parameter
# model; one device and one client at a time, the order of the
# deployment's sums (see fedjax_mr/deploy/server.py).
FLAGS = [
  '--dataset=synthetic',
  '--model=logistic',
  '--num_clients=9',
  '--clients_per_round=3',
  '--rounds=2',
  '--local_epochs=1',
  '--client_chunk=1',
  '--num_devices=1',
  '--eval_every=1',
  '--checkpoint_every=1',
  '--seed=3',
]
TIMES = {'round_time_s', 'eval_time_s', 'elapsed_s'}


def _rows(workdir, name):
  with open(os.path.join(workdir, name)) as f:
    return [
      {k: v for k, v in json.loads(line).items() if k not in TIMES}
      for line in f
    ]


def _check(proc):
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.parametrize('algorithm', ['fedavg', 'fedmr', 'scaffold'])
def test_deployed_run_equals_the_simulation(tmp_path, algorithm):
  flags = [*FLAGS, f'--algorithm={algorithm}']
  simulated, deployed = str(tmp_path / 'sim'), str(tmp_path / 'dep')
  _check(
    helpers.run_module('experiments.run', *flags, f'--workdir={simulated}')
  )
  proc = helpers.run_module(
    'experiments.deploy', '--nodes=3', *flags, f'--workdir={deployed}'
  )
  _check(proc)
  assert 'SuperLink on 127.0.0.1:' in proc.stdout
  for name in ('metrics.jsonl', 'clients.jsonl'):
    assert _rows(deployed, name) == _rows(simulated, name)
  assert len(_rows(deployed, 'metrics.jsonl')) == 2
  a, b = experiment.load_run(simulated), experiment.load_run(deployed)
  assert a.round == b.round == 2
  for x, y in zip(
    jax.tree.leaves(a.state.server), jax.tree.leaves(b.state.server)
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # Flower's files (its home, certificates, logs) stayed in the workdir.
  assert os.path.exists(os.path.join(deployed, 'flower', 'home', 'config.toml'))
