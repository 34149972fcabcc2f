"""FedMR, FedMut and their variants through the experiment loop."""

import json
import os

import jax
import numpy as np
import pytest

import fedjax_mr
from fedjax_mr.analysis import compare
from fedjax_mr.core import errors
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import experiment
from fedjax_mr.pipeline import registry
from fedjax_mr.runtime import metrics_io
from fedjax_mr.training import evaluation
from tests import helpers


def _small_config(data_dir):
  return helpers.small_config(
    data_dir, partition='dirichlet', local_eval_every=2
  )


@pytest.fixture
def small_config(small_fmnist_dir):
  return _small_config(small_fmnist_dir)


@pytest.fixture(scope='module')
def reference(small_fmnist_dir, tmp_path_factory):
  """`reference(**changes)`: the uninterrupted run of `small_config` with
  `changes`, run once for every test of this module that needs it."""
  done = {}

  def run(**changes):
    key = tuple(sorted(changes.items()))
    if key not in done:
      cfg = _small_config(small_fmnist_dir).replace(**changes)
      done[key] = experiment.train_and_evaluate(
        cfg, str(tmp_path_factory.mktemp('reference')), log=_quiet
      )
    return done[key]

  return run


@pytest.fixture(scope='module')
def uniform_fedavg(small_fmnist_dir, tmp_path_factory):
  cfg = helpers.small_config(small_fmnist_dir, weighting='uniform')
  return experiment.train_and_evaluate(
    cfg, str(tmp_path_factory.mktemp('fedavg')), log=_quiet
  )


def _quiet(line):
  del line


def _no_times(rows):
  return [{k: v for k, v in r.items() if not k.endswith('_s')} for r in rows]


def _crash_at(r_stop):
  def hook(r, row):
    del row
    if r == r_stop:
      raise RuntimeError('crash')

  return hook


@pytest.mark.parametrize(
  'changes',
  [
    {'algorithm': 'fedmr_p', 'fedmr_segments': 3, 'fedmr_secure_repeats': 2},
    {'algorithm': 'fedmut'},
  ],
)
def test_crash_and_resume_equals_uninterrupted(
  small_config, reference, tmp_path, changes
):
  cfg = small_config.replace(**changes)
  ref = reference(**changes)
  work = str(tmp_path / 'crashed')
  with pytest.raises(RuntimeError, match='^crash$'):
    experiment.train_and_evaluate(cfg, work, log=_quiet, on_round=_crash_at(2))
  lines = []
  res = experiment.train_and_evaluate(cfg, work, log=lines.append)
  assert lines[0] == f'resuming {work} after round 2'
  helpers.tree_equal(jax.device_get(res.state), jax.device_get(ref.state))
  assert _no_times(res.history) == _no_times(ref.history)
  # The K models really differ (recombined or mutated), and the global
  # model learned something.
  rows = ref.history
  assert 0.1 < rows[-1]['test_accuracy']
  assert rows[1]['local_accuracy_std'] > 0
  assert (
    'local_accuracy_mean' in rows[1] and 'local_accuracy_mean' not in rows[0]
  )
  # clients.jsonl lists the K models' accuracies on the rounds that
  # evaluate them.
  per_client = metrics_io.read(os.path.join(ref.workdir, 'clients.jsonl'))
  assert ['local_accuracy' in c for c in per_client] == [
    'local_accuracy_mean' in r for r in rows
  ]
  local = per_client[1]['local_accuracy']
  assert len(local) == cfg.server.clients_per_round
  assert np.mean(local) == pytest.approx(rows[1]['local_accuracy_mean'])
  assert np.std(local) == pytest.approx(rows[1]['local_accuracy_std'])
  # cnn_mnist: 66,130 float32 parameters, 4 models down and 4 up; the secure
  # protocol adds the client-to-client layer transfers.
  plain = 2 * 4 * 66_130 * 4
  sent = [r['bytes_communicated'] for r in rows]
  if cfg.algorithm.options().get('fedmr_secure_repeats'):
    assert all(b > plain for b in sent)
    assert all(-1 <= r['pairwise_cosine'] <= 1 for r in rows)
  else:
    assert sent == [plain] * cfg.run.rounds


@pytest.mark.parametrize(
  'algorithm', ['scaffold', 'fedexp', 'clusamp', 'moon', 'fedgen']
)
def test_single_model_algorithms_resume_exactly(
  small_config, tmp_path, algorithm
):
  # Per-client state (SCAFFOLD's controls, MOON's previous models on a
  # network with a projection head), server state beyond the model
  # (FedExP's previous iterate, clustered sampling's N client updates that
  # drive its sampler, FedGen's generator and its Adam state) survive a
  # crash bit for bit. (FedASAM's state is
  # FedAvg's.)
  cfg = small_config.replace(algorithm=algorithm)
  ref = experiment.train_and_evaluate(cfg, str(tmp_path / 'ref'), log=_quiet)
  work = str(tmp_path / 'crashed')
  with pytest.raises(RuntimeError, match='^crash$'):
    experiment.train_and_evaluate(cfg, work, log=_quiet, on_round=_crash_at(2))
  lines = []
  res = experiment.train_and_evaluate(cfg, work, log=lines.append)
  assert lines[0] == f'resuming {work} after round 2'
  helpers.tree_equal(jax.device_get(res.state), jax.device_get(ref.state))
  assert _no_times(res.history) == _no_times(ref.history)
  assert ref.history[-1]['test_accuracy'] > 0.1
  if algorithm == 'fedexp':
    # The reported global model is the average of the last two iterates.
    server = res.state.server
    averaged = jax.tree.map(
      lambda a, b: (a + b) / 2, server.params, server.previous
    )
    setup = experiment.setup(cfg)
    ev = evaluation.make_evaluate(setup.model)(averaged, setup.test)
    helpers.assert_close(
      res.history[-1]['test_accuracy'], float(ev['accuracy']), atol=1e-6
    )
    assert all(r['global_lr'] >= 1 for r in res.history)


def test_fedavg_metrics(uniform_fedavg):
  rows = uniform_fedavg.history
  assert [r['bytes_communicated'] for r in rows] == [2 * 4 * 66_130 * 4] * 3
  assert 'pairwise_cosine' not in rows[0]
  assert 'local_accuracy_mean' not in rows[-1]


@pytest.mark.parametrize(
  'changes',
  [
    # Two-stage training that never leaves the first stage is FedAvg.
    {'algorithm': 'fedmr_p', 'fedmr_first_stage': 3},
    # No mutation is FedAvg.
    {'algorithm': 'fedmut', 'fedmut_alpha': 0.0},
  ],
)
def test_degenerate_settings_are_unweighted_fedavg(
  small_config, uniform_fedavg, tmp_path, changes
):
  ref = uniform_fedavg
  res = experiment.train_and_evaluate(
    small_config.replace(**changes),
    str(tmp_path / 'other'),
    log=_quiet,
  )
  helpers.assert_close(
    jax.device_get(res.state.server.params),
    jax.device_get(ref.state.server.params),
    atol=1e-6,
  )
  accs = [r.get('test_accuracy') for r in res.history]
  ref_accs = [r.get('test_accuracy') for r in ref.history]
  helpers.assert_close(
    [a for a in accs if a is not None],
    [a for a in ref_accs if a is not None],
    atol=1e-4,
  )


def test_weighting_auto_follows_the_papers(small_config):
  assert not config_lib.uniform_weights(small_config)
  multi = [n for n, e in registry.REGISTRY.items() if e.multi_model]
  assert multi == ['fedmr', 'fedmr_p', 'indep', 'fedmut']
  for algorithm in multi:
    cfg = small_config.replace(algorithm=algorithm)
    assert config_lib.uniform_weights(cfg)
  cfg = small_config.replace(weighting='uniform')
  assert config_lib.uniform_weights(cfg)
  cfg = small_config.replace(algorithm='fedmut', weighting='examples')
  assert not config_lib.uniform_weights(cfg)


@pytest.mark.parametrize(
  'changes,message',
  [
    ({'fedmut_alpha': 2.0}, '`fedmut_alpha=2.0` applies to `algorithm=fedmut`'),
    ({'fedmr_first_stage': 3}, '`fedmr_first_stage=3` applies to'),
    ({'algorithm': 'fedmr', 'fedmr_segments': 4}, '`fedmr_segments=4`'),
    ({'algorithm': 'fedmr_p', 'fedmr_segments': 1}, '`algorithm=indep`'),
    (
      {
        'algorithm': 'fedmr',
        'fedmr_secure_repeats': 1,
        'weighting': 'examples',
      },
      '`weighting` by examples is not available',
    ),
    (
      {
        'algorithm': 'fedmr',
        'fedmr_secure_repeats': 1,
        'fedmr_secure_min_sent': 3,
        'fedmr_secure_max_sent': 2,
      },
      '`fedmr_secure_min_sent` must not exceed secure_max_sent=2, got 3',
    ),
    (
      {
        'algorithm': 'fedmr',
        'fedmr_secure_repeats': 1,
        'fedmr_secure_max_sent': 99,
      },
      '`fedmr_secure_max_sent` (n_u = 99) and secure_min_sent (n_l = 1) '
      'must satisfy n_l <= n_u <= 8, the number of layers',
    ),
    ({'algorithm': 'fedmut', 'fedmut_beta0': 2.0}, '`fedmut_beta0`'),
    ({'algorithm': 'fedmut', 'fedmut_alpha': -1.0}, '`fedmut_alpha`'),
    ({'algorithm': 'fedmr', 'fedmr_grouping': 'block'}, '`fedmr_grouping`'),
    ({'weighting': 'size'}, '`weighting`'),
    ({'local_eval_every': -1}, '`local_eval_every`'),
  ],
)
def test_bad_algorithm_flags(small_config, tmp_path, changes, message):
  with pytest.raises(errors.ConfigError) as e:  # building, or starting
    cfg = small_config.replace(**changes)
    experiment.train_and_evaluate(cfg, str(tmp_path), log=_quiet)
  assert message in str(e.value)


def test_resume_accepts_a_workdir_from_before_new_flags(
  small_config, reference, tmp_path
):
  # The config.json that FedMut's reference run (the one
  # test_crash_and_resume_equals_uninterrupted resumes against) wrote.
  cfg = small_config.replace(algorithm='fedmut')
  written = os.path.join(reference(algorithm='fedmut').workdir, 'config.json')
  with open(written) as f:
    saved = json.load(f)
  path = tmp_path / 'config.json'
  del saved['fedmut_alpha']  # as written by an older version
  path.write_text(json.dumps(saved))
  checks.check_resumable(cfg, str(path))
  with pytest.raises(errors.ConfigError, match='`fedmut_alpha=4.0` there'):
    checks.check_resumable(cfg.replace(fedmut_alpha=1.0), str(path))


# --- compare ----------------------------------------------------------------


def test_parse_variant():
  assert compare.parse_variant('fedmr_p2') == (
    'fedmr_p2',
    {'algorithm': 'fedmr_p', 'fedmr_segments': 2},
  )
  name, over = compare.parse_variant(
    'mine:algorithm=fedmut,fedmut_alpha=2,fedmut_bound=10,weighting=uniform'
  )
  assert name == 'mine'
  assert over == {
    'algorithm': 'fedmut',
    'fedmut_alpha': 2.0,
    'fedmut_bound': 10,
    'weighting': 'uniform',
  }
  with pytest.raises(errors.ConfigError, match="unknown variant 'fedmx'"):
    compare.parse_variant('fedmx')
  with pytest.raises(errors.ConfigError, match='not field=value'):
    compare.parse_variant('x:nosuchflag=1')
  with pytest.raises(errors.ConfigError, match='fedmut_bound=.*not a int'):
    compare.parse_variant('x:fedmut_bound=1.5')


def test_configs_validate_each_variant(small_config, tmp_path):
  variants = [compare.parse_variant('fedmr'), ('bad', {'fedmut_alpha': 1.0})]
  with pytest.raises(
    errors.ConfigError, match='variant bad: `fedmut_alpha=1.0` applies'
  ):
    compare.configs(small_config.flat(), variants, [0], str(tmp_path))
  runs = compare.configs(
    small_config.flat(), variants[:1], [0, 5], str(tmp_path)
  )
  assert [(n, s, c.run.seed, c.algorithm.name) for n, s, c in runs] == [
    ('fedmr', 0, 0, 'fedmr'),
    ('fedmr', 5, 5, 'fedmr'),
  ]
  assert runs[1][2].run.workdir == os.path.join(str(tmp_path), 'fedmr', 's5')


def test_summarize_exact_values(tmp_path):
  def write(variant, seed, accs):
    d = compare.run_dir(str(tmp_path), variant, seed)
    os.makedirs(d)
    for i, a in enumerate(accs):
      row = {'round': i + 1, 'train_loss': 1.0 / (i + 1)}
      if a is not None:
        row['test_accuracy'] = a
      metrics_io.append(os.path.join(d, 'metrics.jsonl'), row)

  write('a', 0, [0.1, None, 0.5, 0.7])  # last 2 evals: 0.5, 0.7 -> 0.6
  write('a', 1, [0.2, None, 0.7, 0.9])  # -> 0.8
  write('b', 0, [0.3, 0.4, 0.5])  # -> 0.45
  write('b', 1, [0.3, 0.4, 0.5, 0.1])
  metrics_io.append(  # b seed 1 diverged in round 5
    os.path.join(compare.run_dir(str(tmp_path), 'b', 1), 'metrics.jsonl'),
    {'round': 5, 'train_loss': float('nan')},
  )
  write('d', 0, [0.3])
  metrics_io.append(
    os.path.join(compare.run_dir(str(tmp_path), 'd', 0), 'metrics.jsonl'),
    {'round': 2, 'train_loss': float('inf')},
  )
  summary = compare.summarize(
    str(tmp_path), ['a', 'b', 'c', 'd'], [0, 1], last=2
  )
  a, b = summary['variants']['a'], summary['variants']['b']
  assert set(summary['variants']) == {'a', 'b', 'd'}
  assert b['diverged'] == {'1': 5} and summary['variants']['d']['n'] == 0
  helpers.assert_close([a['mean'], a['std']], [0.7, 0.1])
  assert a['n'] == 2 and a['rounds'] == 4
  helpers.assert_close([b['mean'], b['std']], [0.45, 0.0])
  table = (tmp_path / compare.TABLE_FILE).read_text()
  assert '| a | 70.00 ± 10.00 | 2 | 4 |' in table
  assert '| b | 45.00 (diverged: seed 1 at round 5) | 1 | 3 |' in table
  assert '| d | diverged: seed 0 at round 2 | 0 | 0 |' in table
  assert (tmp_path / compare.CURVES_FILE).stat().st_size > 1000
  written = json.load(open(tmp_path / compare.RESULTS_FILE))
  assert written['variants']['a'] == summary['variants']['a']
  assert written['provenance']['packages']['fedjax_mr'] == fedjax_mr.__version__
  # Nothing to summarize: a clear error, and the table above stays.
  with pytest.raises(errors.ConfigError, match=r'`workdir=.*`: no runs of .*c'):
    compare.summarize(str(tmp_path), ['c'], [0, 1])
  assert (tmp_path / compare.TABLE_FILE).read_text() == table
  with pytest.raises(errors.ConfigError, match='nothing to summarize'):
    compare.summarize(str(tmp_path / 'missing'), ['a'], [0])


def test_run_matrix_goes_on_past_a_diverged_run(small_config, tmp_path):
  runs = compare.configs(
    small_config.flat(),
    [compare.parse_variant(v) for v in ('fedavg', 'fedmut')],
    [0],
    str(tmp_path),
  )
  trained = []

  def train(cfg):
    trained.append(cfg.algorithm.name)
    os.makedirs(cfg.run.workdir, exist_ok=True)
    path = os.path.join(cfg.run.workdir, 'metrics.jsonl')
    if cfg.algorithm.name == 'fedavg':
      metrics_io.append(path, {'round': 1, 'train_loss': float('nan')})
      raise errors.NonFiniteError('non-finite train loss')
    metrics_io.append(path, {'round': 1, 'train_loss': 0.5})

  lines = []
  assert compare.run_matrix(runs, train, log=lines.append) == {('fedavg', 0): 1}
  assert trained == ['fedavg', 'fedmut']
  # Re-running skips the diverged run instead of diverging again.
  assert compare.run_matrix(runs, train, log=lines.append) == {('fedavg', 0): 1}
  assert trained == ['fedavg', 'fedmut', 'fedmut']
  assert any('diverged at round 1 before; skipped' in x for x in lines)
