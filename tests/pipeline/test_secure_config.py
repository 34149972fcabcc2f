"""Secure aggregation as configured (`pipeline.protection`,
`build.secure_algorithm`): each rule refused in one line naming its flag,
the algorithms that read every model refused with their reason, and a
simulated secure run's records."""

import json
import os

import pytest

from fedjax_mr.core import errors
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import experiment
from fedjax_mr.pipeline import protection

SMALL = dict(
  dataset='synthetic',
  model='logistic',
  num_clients=7,
  clients_per_round=5,
  local_epochs=1,
  rounds=2,
  eval_every=1,
  seed=5,
)


def _config(**flags):
  return config_lib.ExperimentConfig.from_flat(
    **{**SMALL, 'secure_aggregation': True, **flags}
  )


@pytest.mark.parametrize(
  'flags, says',
  [
    ({'secagg_bits': 33}, '`secagg_bits` must be in [2, 32], got 33'),
    (
      {'secagg_bits': 3},
      '`secagg_bits=3` cannot hold the sum of `clients_per_round=5` clients',
    ),
    ({'secagg_range': 0.5}, '`secagg_range` must be finite and at least 1'),
    ({'secagg_range': float('inf')}, '`secagg_range` must be finite'),
    (
      {'clients_per_round': 1},
      '`secure_aggregation` needs `clients_per_round` >= 2',
    ),
    ({'secagg_neighbours': 3}, '`secagg_neighbours` must be 0'),
    ({'secagg_neighbours': 5}, '`secagg_neighbours` must be 0'),
    ({'secagg_threshold': 0.5}, '`secagg_threshold` must be over 1/2'),
    ({'secagg_threshold': 1.2}, '`secagg_threshold` must be over 1/2'),
    (
      {
        'dp_clip': 1.0,
        'dp_noise_multiplier': 0.3,
        'dp_adaptive_quantile': 0.5,
        'weighting': 'uniform',
      },
      '`dp_adaptive_quantile` cannot go with `secure_aggregation` and '
      '`dp_noise_multiplier` > 0',
    ),
  ],
)
def test_each_rule_is_one_line_naming_its_flag(flags, says):
  with pytest.raises(errors.ConfigError) as e:
    protection.check_privacy(_config(**flags))
  assert says in str(e.value) and '\n' not in str(e.value)


def test_a_valid_config_passes():
  protection.check_privacy(_config(secagg_neighbours=2, secagg_bits=16))
  protection.check_privacy(_config(dp_clip=1.0, weighting='uniform'))
  protection.check_privacy(config_lib.ExperimentConfig.from_flat(**SMALL))


@pytest.mark.parametrize(
  'algorithm, says',
  [
    ('fedmr', 'reads every model, not their sum'),
    ('indep', 'reads every model, not their sum'),
  ],
)
def test_algorithms_that_read_every_model_are_refused(algorithm, says):
  with pytest.raises(errors.ConfigError) as e:
    experiment.setup(_config(algorithm=algorithm))
  message = str(e.value)
  assert message.startswith(f'`algorithm={algorithm}` cannot run with')
  assert says in message


def test_the_range_bounds_a_models_values_times_its_weight():
  """Weighted by examples, the encoding's bound is the range times the
  largest client's examples (each value is n_k times a model's): at range
  1 no client is clipped, where a bound of 1 itself clips every client
  (its weight n_k > 1); weighing every client 1, the range itself."""
  weighted = experiment.setup(_config(secagg_range=1.0, weighting='examples'))
  assert min(weighted.client_sizes) > 1
  _, metrics = _one_round(weighted)
  assert int(metrics['secagg_clipped']) == 0
  _, metrics = _one_round(weighted._replace(algorithm=_rebound(weighted, 1.0)))
  assert int(metrics['secagg_clipped']) == 5
  uniform = experiment.setup(_config(secagg_range=1.0, weighting='uniform'))
  _, metrics = _one_round(uniform)
  assert int(metrics['secagg_clipped']) == 0


def _one_round(e):
  import jax

  from fedjax_mr.training import engine

  step = jax.jit(engine.make_round_fn(e.algorithm, clients_per_round=5))
  return step(e.state, e.data, e.key)


def _rebound(e, bound):
  """`e`'s algorithm encoded within `bound`."""
  from fedjax_mr.pipeline import build
  from fedjax_mr.privacy import secure

  plain = build.build_algorithm(
    e.config.replace(secure_aggregation=False), e.model, e.state.server.params
  )
  return secure.secure(plain, 32, bound, max(e.client_sizes))


def test_a_simulated_secure_run_records_no_client_loss(tmp_path):
  config = _config(secagg_range=1000.0, workdir=str(tmp_path))
  result = experiment.train_and_evaluate(config, str(tmp_path), log=print)
  rows = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  assert [r['secagg_clipped'] for r in rows] == [0, 0]
  assert all(r['train_loss'] > 0 for r in rows)
  with open(os.path.join(tmp_path, 'clients.jsonl')) as f:
    clients = [json.loads(line) for line in f]
  assert all(c['loss'] is None for row in clients for c in row['clients'])
  assert result.history[-1]['round'] == 2


# The privacy page's table of algorithms, secure aggregation's column, as
# the builds find it (FedGen and HeteroFL need other data or models here:
# their kind, a server that reads every model, is DepthFL's).
SECURED = {
  'fedavg',
  'fedprox',
  'moon',
  'fedasam',
  'fedsam',
  'fedmut',
  'scaffold',
  'fedexp',
  'ft_full',
}
REFUSED = {'fedmr', 'fedmr_p', 'indep', 'depthfl', 'fedepth', 'clusamp'}
REFUSED |= {'ft_part'}


def test_the_algorithms_secure_aggregation_takes_are_the_pages():
  from fedjax_mr.pipeline import registry

  assert SECURED | REFUSED | {'fedgen', 'heterofl'} == set(registry.names())
  for name in sorted(SECURED | REFUSED):
    config = _config(
      algorithm=name,
      partition='dirichlet',
      num_clients=10,
      clients_per_round=4,
      secagg_range=1000.0,
      **({'ft_layers': 1} if name == 'ft_part' else {}),
    )
    if name in SECURED:
      experiment.setup(config)
    else:
      with pytest.raises(errors.ConfigError, match='cannot run with `secure'):
        experiment.setup(config)


def test_a_deployed_run_is_refused_before_anything_is_written(tmp_path):
  """`experiments.deploy` checks the algorithm as the server will build
  it, before a federation starts (`adapter.check`)."""
  from fedjax_mr.deploy import adapter

  workdir = tmp_path / 'run'
  for flags in ({'secure_aggregation': True}, {'dp_clip': 1.0}):
    config = config_lib.ExperimentConfig.from_flat(
      **{**SMALL, 'algorithm': 'fedmr', 'workdir': str(workdir), **flags}
    )
    with pytest.raises(errors.ConfigError, match='`algorithm=fedmr` cannot'):
      adapter.check(config)
    assert not workdir.exists()
  fine = _config(secagg_range=1000.0, workdir=str(workdir))
  assert adapter.check(fine) == str(workdir)


def test_the_pages_flag_table_holds_the_defaults():
  from tests import docs_text
  from tests import test_readme_records as readme_records

  table = readme_records._table(
    docs_text.read('docs/howto/secure-aggregation.md'), '| flag | default |'
  )
  fields = {f.name: f for f in config_lib.base_fields()}
  shown = {row[0].strip('`').lstrip('-'): row[1] for row in table[1:]}
  assert set(shown) == {n for n in fields if n.startswith(('secagg', 'secure'))}
  for name, default in shown.items():
    value = fields[name].default
    if isinstance(value, bool):
      assert default == str(value).lower(), name
    elif name == 'secagg_threshold':
      assert default == '2/3' and value == 2 / 3
    else:
      assert float(default) == value, name


def test_a_features_flags_define_a_run_only_where_it_is_on():
  """A run without secure aggregation (or without DP) resumes whatever
  secure aggregation's (DP's) other flags hold; with it, they define the
  run."""
  from fedjax_mr.pipeline import checks

  plain = config_lib.ExperimentConfig.from_flat(**SMALL)
  saved = plain.replace(secagg_range=1e4, dp_delta=1e-3, dp_per_layer=True)
  assert checks.config_diffs(plain, saved.to_dict()) == []
  secure = _config(secagg_range=10.0)
  diffs = checks.config_diffs(secure, _config(secagg_range=1e4).to_dict())
  assert diffs == ['`secagg_range=10000.0` there, 10.0 here']
  diffs = checks.config_diffs(secure, saved.to_dict())
  assert diffs == [
    '`secure_aggregation=False` there, True here',
    '`secagg_range=10000.0` there, 10.0 here',
  ]
  private = plain.replace(dp_clip=1.0, weighting='uniform')
  diffs = checks.config_diffs(private, private.replace(dp_delta=1e-3).to_dict())
  assert diffs == ['`dp_delta=0.001` there, 0.0 here']
