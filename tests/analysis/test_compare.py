"""experiments.compare's library side: variants' flags, the table of a
folder, the matrix's ETA and the title of a setting."""

import json
import os

import pytest

from fedjax_mr.analysis import compare
from fedjax_mr.core import errors
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import records
from fedjax_mr.runtime import metrics_io
from tests import helpers


def _config(**changes):
  return helpers.small_config('/data', **changes)


def _values(**changes):
  return helpers.small_values('/data', **changes)


def test_an_algorithms_flag_applies_to_its_variants_only(tmp_path):
  base = _values(fedprox_mu=0.1, fedmut_alpha=2.0)
  variants = [compare.parse_variant(v) for v in ('fedavg', 'fedprox', 'fedmut')]
  runs = compare.configs(base, variants, [0], str(tmp_path))
  got = {n: c.algorithm.options() for n, _, c in runs}
  assert got['fedavg'] == {}  # FedAvg has no hyper-parameter of its own
  assert got['fedprox'] == {'fedprox_mu': 0.1}
  defaults = config_lib.ExperimentConfig.from_flat(algorithm='fedmut')
  assert got['fedmut'] == {**defaults.algorithm.options(), 'fedmut_alpha': 2.0}
  # A variant's own value wins; a flag no variant reads is refused.
  runs = compare.configs(
    _values(fedprox_mu=0.1),
    [('p', {'algorithm': 'fedprox', 'fedprox_mu': 0.5})],
    [0],
    '/x',
  )
  assert runs[0][2].algorithm.hparams.mu == 0.5
  with pytest.raises(
    errors.ConfigError, match=r'^`fedmut_alpha` applies to .*fedmut` only'
  ):
    compare.configs(base, variants[:2], [0], str(tmp_path))


def test_a_seed_out_of_range_is_refused_before_anything_runs(tmp_path):
  variants = [compare.parse_variant('fedavg')]
  for seed in (-1, 2**32):
    with pytest.raises(
      errors.ConfigError,
      match=rf'^`seeds` must be in \[0, 2\*\*32\), got {seed}$',
    ):
      compare.configs(_values(), variants, [0, seed], str(tmp_path))
  assert not os.listdir(tmp_path)


def test_a_seed_given_twice_is_refused(tmp_path):
  variants = [compare.parse_variant('fedavg')]
  with pytest.raises(errors.ConfigError) as e:
    compare.configs(_values(), variants, [0, 3, 0], str(tmp_path))
  assert str(e.value) == '`seeds`: seed 0 appears twice; each seed is one run'
  assert not os.listdir(tmp_path)


def _write(out, variant, seed, accs, rounds=None):
  folder = compare.run_dir(out, variant, seed)
  os.makedirs(folder)
  for i, a in enumerate(accs):
    row = {'round': i + 1, 'train_loss': 0.5}
    if a is not None:
      row['test_accuracy'] = a
    metrics_io.append(os.path.join(folder, 'metrics.jsonl'), row)


def test_the_table_covers_every_run_of_the_folder(tmp_path):
  out = str(tmp_path)
  _write(out, 'b', 0, [0.1, 0.2, 0.4])
  _write(out, 'b', 3, [0.1, 0.2, 0.6])
  _write(out, 'a', 1, [0.5, None, 0.7])  # two evaluations only
  os.makedirs(tmp_path / 'c' / 's0')  # no metrics: not a run
  (tmp_path / 'results.md').write_text('')  # a file, not a variant
  assert compare.runs_in(out) == {'a': [1], 'b': [0, 3]}
  summary = compare.summarize(out, last=3, first=['b'])
  assert list(summary['variants']) == ['b', 'a']
  b, a = summary['variants']['b'], summary['variants']['a']
  assert b['per_seed'] == {'0': pytest.approx(0.7 / 3), '3': pytest.approx(0.3)}
  assert b['evals'] == {'0': 3, '3': 3} and a['evals'] == {'1': 2}
  text = (tmp_path / compare.TABLE_FILE).read_text()
  assert 'mean of the last 2-3 evaluations' in text
  assert '| a | 60.00 | 1 | 3 |' in text
  # Only the runs named, as before.
  summary = compare.summarize(out, ['b'], [3], last=2)
  assert list(summary['variants']) == ['b'] and summary['variants']['b'][
    'per_seed'
  ] == {'3': pytest.approx(0.4)}
  assert 'mean of the last 2 evaluations' in compare.table(summary)


def test_table_and_figure_name_the_variants_alike(tmp_path, monkeypatch):
  out = str(tmp_path)
  for name in ('fedavg', 'fedmr_2stage20', 'my_fedavg'):
    _write(out, name, 0, [0.1, 0.2])
  drawn = {}
  monkeypatch.setattr(
    compare.plots, 'plot_curves', lambda runs, *_, **__: drawn.update(runs)
  )
  started = {'start_time': '2026-11-26T01:00:00+00:00'}
  compare.summarize(out, ['fedavg', 'fedmr_2stage20'], last=2, started=started)
  assert list(drawn) == ['FedAvg', 'FedMR (first_stage=20)']
  lines = (tmp_path / compare.TABLE_FILE).read_text().splitlines()
  assert lines[0].startswith('| method | final accuracy')
  assert lines[2:] == [
    '| FedAvg | 15.00 | 1 | 2 |',
    '| FedMR (first_stage=20) | 15.00 | 1 | 2 |',
  ]
  # results.json keeps the variants' names, and the command's start.
  with open(os.path.join(out, compare.RESULTS_FILE)) as f:
    written = json.load(f)
  assert list(written['variants']) == ['fedavg', 'fedmr_2stage20']
  assert written['provenance'] == started
  # A custom variant keeps its own name; one named like a display name
  # that an earlier variant has is told apart by its variant name.
  assert compare.display_names(['fedavg', 'my_fedavg', 'FedAvg']) == {
    'fedavg': 'FedAvg',
    'my_fedavg': 'my_fedavg',
    'FedAvg': 'FedAvg (FedAvg)',
  }


def test_the_matrix_says_how_long_it_has_left(tmp_path):
  base = _values(rounds=4)
  runs = compare.configs(
    base, [compare.parse_variant('fedavg')], [0, 1, 2], str(tmp_path)
  )
  _write(str(tmp_path), 'fedavg', 2, [None, 0.5])  # half done before

  def train(config):
    have = len(
      metrics_io.read(os.path.join(config.run.workdir, 'metrics.jsonl'))
    )
    for r in range(have + 1, config.run.rounds + 1):
      os.makedirs(config.run.workdir, exist_ok=True)
      metrics_io.append(
        os.path.join(config.run.workdir, 'metrics.jsonl'),
        {'round': r, 'train_loss': 0.5},
      )

  lines = []
  compare.run_matrix(runs, train, log=lines.append)
  assert lines[0].endswith('; 10 rounds left in the matrix')
  assert '; 6 rounds left in the matrix, ETA ' in lines[1]
  assert 's/round so far)' in lines[1]
  assert '; 2 rounds left in the matrix, ETA ' in lines[2]


def test_the_title_states_the_setting_and_what_differs(tmp_path):
  c = _config(lr=0.05, momentum=0.5, rounds=100)
  # In the names the figures give the dataset, model and partition.
  assert records.setting_title(c) == (
    'Fashion-MNIST, CNN (MNIST), Dir(α = 0.5), K = 4 of 10, E = 1, B = 50, '
    'lr = 0.05, momentum = 0.5, 100 rounds'
  )
  c = _config(partition='iid', weighting='uniform', min_client_size=3, rounds=1)
  title = records.setting_title(c)
  assert title.startswith('Fashion-MNIST, CNN (MNIST), IID, K = 4 of 10')
  assert ', 1 round, min_client_size=3, weighting=uniform' in title
  c = _config(dataset='synthetic', model='logistic', synthetic_beta=0.5)
  assert records.setting_title(c).startswith(
    'Synthetic(α = 1, β = 0.5), logistic regression, K = 4 of 10, E = 1'
  )


def test_every_dataset_and_model_has_a_display_name():
  from fedjax_mr.data import datasets
  from fedjax_mr.models import model

  assert set(datasets.DISPLAY_NAMES) == set(datasets.NAMES)
  assert set(records.MODEL_NAMES) == set(model.NAMES)


@pytest.mark.parametrize(
  'spec,names',
  [('x:seed=5', '`seeds`'), ('x:lr=0.1,workdir=/tmp/w', '`workdir`')],
)
def test_a_variant_cannot_set_what_each_run_gets(spec, names):
  # These used to reach dataclasses.replace twice ("got multiple values").
  with pytest.raises(errors.ConfigError, match=f'^`variants`: .*{names}'):
    compare.parse_variant(spec)


def test_many_variants_are_drawn_in_rows_by_family():
  # After the reference (drawn in every row), those that keep K models
  # apart from the others, in rows of at most `size`; a variant the
  # registry does not name aggregates.
  rows = compare.families(
    ['fedavg', 'fedprox', 'scaffold', 'fedmr', 'indep', 'fedexp', 'custom'],
    size=2,
  )
  assert rows == {
    'methods that aggregate (1 of 2)': ['fedprox', 'scaffold'],
    'methods that aggregate (2 of 2)': ['fedexp', 'custom'],
    'methods that keep K models': ['fedmr', 'indep'],
  }
