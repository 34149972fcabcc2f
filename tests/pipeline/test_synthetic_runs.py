"""Runs on Synthetic(α, β) (`dataset=synthetic`, `model=logistic`): what
setup builds, a short run that learns, and every algorithm that reads its
clients only through the client data protocol."""

import json
import os

import numpy as np
import pytest

from fedjax_mr.data import synthetic
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import experiment
from fedjax_mr.pipeline import registry


def _config(**changes):
  values = dict(
    dataset='synthetic',
    model='logistic',
    num_clients=200,
    clients_per_round=20,
    rounds=20,
    eval_every=10,
    checkpoint_every=0,
    tensorboard=False,
  )
  values.update(changes)
  return config_lib.ExperimentConfig.from_flat(**values)


def test_setup_generates_the_clients_and_holds_out_a_test_set():
  exp = experiment.setup(_config(num_clients=3000, synthetic_alpha=0.5))
  sizes = synthetic.client_sizes(3000, seed=0)
  np.testing.assert_array_equal(exp.client_sizes, sizes)
  assert isinstance(exp.data, synthetic.SyntheticData)
  assert exp.data.num_clients == 3000 and exp.data.max_size == sizes.max()
  assert float(exp.data.alpha) == 0.5
  # 1,000 clients' held-out examples, at most 10,000.
  assert 1000 < int(exp.test.mask.sum()) <= synthetic.TEST_EXAMPLES
  assert exp.partition['num_examples'] == sizes.sum()
  assert exp.model.input_shape == (60,) and exp.model.num_classes == 10


def test_a_short_run_learns_and_says_what_it_runs(tmp_path):
  lines = []
  res = experiment.train_and_evaluate(
    _config(), str(tmp_path), log=lines.append
  )
  assert lines[0].startswith(
    'fedavg on synthetic(α=1, β=1): 200 clients generated on demand, '
    '19.88 examples each on average (10..136; 3,975 train / 1,071 test), '
    'logistic (610 parameters), 20 per round, 20 rounds'
  )
  first, last = res.history[9], res.history[-1]
  # Above chance (10 classes) and above the test set's commonest label
  # (16 %), and better than at round 10.
  assert last['test_accuracy'] > 0.2
  assert last['test_accuracy'] > first['test_accuracy']
  with open(os.path.join(tmp_path, 'partition.json')) as f:
    summary = json.load(f)
  assert summary['num_clients'] == 200 and summary['size_min'] == 10
  assert 'sizes' not in summary  # they follow from the seed


@pytest.mark.slow
@pytest.mark.parametrize(
  'name',
  [n for n in registry.names() if n not in checks.STORED_DATA_ALGORITHMS],
)
def test_every_algorithm_of_the_protocol_trains_on_generated_clients(
  name, tmp_path
):
  changes = {'ft_layers': 1} if name == 'ft_part' else {}
  cfg = _config(
    algorithm=name,
    num_clients=30,
    clients_per_round=6,
    rounds=2,
    local_epochs=1,
    local_eval_every=0,
    **changes,
  )
  res = experiment.train_and_evaluate(cfg, str(tmp_path), log=lambda s: None)
  assert len(res.history) == 2
  assert np.isfinite(res.history[-1]['train_loss'])
  # The sampled generated clients' examples were trained on (their sizes
  # follow from the seed, as setup's are; the first test checks that).
  sizes = synthetic.client_sizes(cfg.partition.num_clients, seed=cfg.run.seed)
  for row in res.history:
    assert row['num_examples'] == sum(int(sizes[i]) for i in row['client_ids'])
    assert row['num_steps'] >= len(row['client_ids'])
