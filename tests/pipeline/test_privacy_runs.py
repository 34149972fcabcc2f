"""Runs with user-level DP (`dp_*` flags): ε in every row as the
accountant computes it, the stop before the target ε, a resumed run's ε
and model as an uninterrupted run's, and the algorithms refused."""

import json

import pytest

from fedjax_mr import privacy
from fedjax_mr.core import errors
from fedjax_mr.pipeline import experiment
from tests import helpers


def _rows(workdir):
  with open(f'{workdir}/metrics.jsonl') as f:
    return [json.loads(x) for x in f]


def _dp(data_dir, **changes):
  values = dict(
    partition='iid',
    alpha=0.1,
    rounds=3,
    dp_clip=0.5,
    dp_noise_multiplier=0.8,
  )
  return helpers.small_config(data_dir, **{**values, **changes})


@pytest.fixture(scope='module')
def whole(small_fmnist_dir, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('dp'))
  lines = []
  result = experiment.train_and_evaluate(
    _dp(small_fmnist_dir), workdir, log=lines.append
  )
  return workdir, result, lines


def test_every_row_has_the_accountants_epsilon(whole):
  workdir, _, lines = whole
  # N = 10, K = 4 a round without replacement, z = 0.8, δ = 1 / 10^1.1.
  acct = privacy.Accountant(0.8, 10, 4, 10**-1.1)
  rows = _rows(workdir)
  assert [r['dp_epsilon'] for r in rows] == [acct.epsilon(r) for r in (1, 2, 3)]
  assert rows[0]['dp_epsilon'] < rows[1]['dp_epsilon'] < rows[2]['dp_epsilon']
  assert any(
    x.startswith('privacy: DP-FedAvg, each update clipped to 0.5')
    for x in lines
  )
  assert sum(' | ε ' in x for x in lines) == 3


def test_the_run_stops_before_the_target_and_resumes_to_the_same(
  whole, small_fmnist_dir, tmp_path
):
  workdir, result, _ = whole
  rows = _rows(workdir)
  target = (rows[1]['dp_epsilon'] + rows[2]['dp_epsilon']) / 2
  lines = []
  cut = _dp(small_fmnist_dir, dp_target_epsilon=target)
  experiment.train_and_evaluate(cut, str(tmp_path), log=lines.append)
  assert [r['round'] for r in _rows(tmp_path)] == [1, 2]
  assert any('the run stops after round 2' in x for x in lines)
  # The last round it reaches is evaluated.
  assert 'test_accuracy' in _rows(tmp_path)[-1]
  # Without the target it resumes to round 3: the same rows and model as
  # the uninterrupted run (the noise comes from the round's key).
  again = experiment.train_and_evaluate(
    _dp(small_fmnist_dir), str(tmp_path), log=lambda x: None
  )
  strip = lambda rs: [  # noqa: E731
    {k: v for k, v in r.items() if not k.endswith('_s')} for r in rs
  ]
  assert strip(_rows(tmp_path)) == strip(rows)
  helpers.tree_equal(again.state.server.params, result.state.server.params)


def test_what_dp_does_not_apply_to_is_refused_in_one_line(small_fmnist_dir):
  for changes, says in [
    ({'algorithm': 'fedmr'}, 'central user-level DP does not apply'),
    ({'algorithm': 'depthfl'}, 'DP-FedAvg protects a sum'),
    ({'algorithm': 'fedexp'}, 'sq_norms'),
    ({'algorithm': 'clusamp'}, 'samples its clients itself'),
    ({'weighting': 'examples'}, 'DP weighs every client 1'),
    ({'dp_clip': 0.0}, '`dp_noise_multiplier` needs `dp_clip` > 0'),
    ({'dp_delta': 1.5}, r'`dp_delta` must be in \[0, 1\)'),
  ]:
    with pytest.raises(errors.ConfigError, match=says):
      experiment.setup(_dp(small_fmnist_dir, **changes))


def test_an_adaptive_clip_norm_is_in_the_rows_and_resumes(
  small_fmnist_dir, tmp_path
):
  config = _dp(
    small_fmnist_dir,
    dp_adaptive_quantile=0.5,
    dp_noise_multiplier=0.3,
    rounds=2,
  )
  whole = experiment.train_and_evaluate(config, str(tmp_path / 'a'), log=print)
  rows = _rows(tmp_path / 'a')
  # Round 1 clips to dp_clip; round 2 to the norm the first step made.
  assert rows[0]['dp_clip_norm'] == pytest.approx(0.5)
  assert rows[1]['dp_clip_norm'] != rows[0]['dp_clip_norm']
  assert float(whole.state.server.clip_norm) not in (
    rows[0]['dp_clip_norm'],
    rows[1]['dp_clip_norm'],
  )
  experiment.train_and_evaluate(
    config.replace(rounds=1), str(tmp_path / 'b'), log=print
  )
  again = experiment.train_and_evaluate(config, str(tmp_path / 'b'), log=print)
  helpers.tree_equal(again.state.server, whole.state.server)


# The privacy page's table of algorithms, as the builds find it (FedGen
# and HeteroFL need stored examples: their refusal is tested above for
# their kind, a server that reads every model, by DepthFL's).
WRAPPED = {
  'fedavg',
  'fedprox',
  'moon',
  'fedasam',
  'fedsam',
  'fedmut',
  'scaffold',
}
REFUSED = {'fedexp', 'clusamp', 'fedmr', 'fedmr_p', 'indep', 'depthfl'}
REFUSED |= {'fedepth', 'ft_full'}


def test_the_algorithms_dp_wraps_are_the_pages():
  from fedjax_mr.pipeline import registry

  assert WRAPPED | REFUSED | {'fedgen', 'heterofl', 'ft_part'} == set(
    registry.names()
  )
  for name in sorted(WRAPPED | REFUSED):
    config = _dp(
      '',
      algorithm=name,
      dataset='synthetic',
      model='logistic',
      partition='dirichlet',
      num_clients=10,
      clients_per_round=4,
      dp_noise_multiplier=0.3,
    )
    if name in WRAPPED:
      experiment.setup(config)
    else:
      with pytest.raises(errors.ConfigError, match='cannot run with `dp_clip`'):
        experiment.setup(config)
