"""Distributed DP as configured (noise with `secure_aggregation`:
`build.distributed_algorithm`, `protection.accountant`): its rules in one
line, its accountant and calibration from the model and data, a simulated
run's records and its resume, and the algorithms it takes."""

import json

import jax
import pytest

from fedjax_mr import privacy
from fedjax_mr.core import errors
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import experiment
from fedjax_mr.pipeline import protection
from fedjax_mr.privacy import distributed_dp
from tests import helpers
from tests.pipeline import test_privacy_runs as privacy_runs

SMALL = dict(
  dataset='synthetic',
  model='logistic',
  num_clients=10,
  clients_per_round=4,
  local_epochs=1,
  rounds=2,
  eval_every=1,
  seed=5,
  secure_aggregation=True,
  dp_clip=0.5,
  dp_noise_multiplier=0.8,
  weighting='uniform',
)


def _config(**flags):
  return config_lib.ExperimentConfig.from_flat(**{**SMALL, **flags})


def _rows(workdir):
  with open(f'{workdir}/metrics.jsonl') as f:
    return [json.loads(x) for x in f]


def test_it_is_on_where_noise_goes_with_secure_aggregation():
  assert protection.distributed(_config().privacy)
  for off in (
    {'secure_aggregation': False},
    {'dp_noise_multiplier': 0.0},
    {'dp_clip': 0.0, 'dp_noise_multiplier': 0.0},
  ):
    assert not protection.distributed(_config(**off).privacy)


def test_too_few_bits_are_refused_before_anything_is_written(tmp_path):
  workdir = tmp_path / 'run'
  config = _config(secagg_bits=12, workdir=str(workdir))
  with pytest.raises(errors.ConfigError) as e:
    experiment.train_and_evaluate(config, str(workdir), log=print)
  says = str(e.value)
  assert says.startswith('`secagg_bits=12` is too few for distributed DP')
  assert '\n' not in says and not workdir.exists()


def test_the_accountant_and_the_wrapper_share_one_calibration():
  e = experiment.setup(_config())
  acct = e.accountant
  assert isinstance(acct, privacy.SkellamAccountant)
  # logistic on synthetic: the update is the model's every value.
  size = sum(x.size for x in jax.tree.leaves(e.state.server.params))
  assert acct.dim == size
  cal = distributed_dp.calibrate(size, 0.5, 0.8, 4, 3, 32, 10.0)
  assert acct.bound == cal.bound
  gauss = privacy.Accountant(0.8, 10, 4, acct.delta)
  assert gauss.epsilon(2) <= acct.epsilon(2) <= gauss.epsilon(2) * (1 + 1e-6)


def test_a_simulated_run_records_null_losses_and_resumes(tmp_path):
  """Two rounds, then a third on the same workdir: rows with a null train
  loss (not a divergence), every client counted, the accountant's ε; the
  resumed rows and model are an uninterrupted run's."""
  lines = []
  two = experiment.train_and_evaluate(
    _config(), str(tmp_path / 'a'), log=lines.append
  )
  assert any(
    x.startswith('privacy: distributed DP over secure aggregation')
    for x in lines
  )
  assert any('train loss n/a' in x for x in lines)
  rows = _rows(tmp_path / 'a')
  assert [r['train_loss'] for r in rows] == [None, None]
  assert [r['dp_clients'] for r in rows] == [4, 4]
  acct = experiment.setup(_config()).accountant
  assert [r['dp_epsilon'] for r in rows] == [acct.epsilon(1), acct.epsilon(2)]
  resumed = experiment.train_and_evaluate(
    _config(rounds=3), str(tmp_path / 'a'), log=lambda x: None
  )
  whole = experiment.train_and_evaluate(
    _config(rounds=3), str(tmp_path / 'b'), log=lambda x: None
  )
  assert two.history[-1]['round'] == 2
  helpers.tree_equal(resumed.state.server.params, whole.state.server.params)


@pytest.mark.parametrize('name', sorted(privacy_runs.WRAPPED))
def test_it_takes_what_dp_fedavg_wraps(name):
  experiment.setup(_config(algorithm=name, partition='dirichlet'))


@pytest.mark.parametrize(
  'name', ['fedexp', 'ft_full', 'fedmr', 'depthfl', 'clusamp']
)
def test_it_refuses_what_dp_fedavg_refuses(name):
  with pytest.raises(errors.ConfigError, match=f'`algorithm={name}` cannot'):
    experiment.setup(_config(algorithm=name, partition='dirichlet'))
