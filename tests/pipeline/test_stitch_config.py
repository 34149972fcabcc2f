"""The FedStitch experiment's config: fields, validation, identity."""

import dataclasses

import pytest

from fedjax_mr.core import errors
from fedjax_mr.energy import fleet
from fedjax_mr.pipeline import config as training_config
from fedjax_mr.pipeline import stitch_config as config_lib
from fedjax_mr.stitch import cka
from fedjax_mr.stitch import config as stitch_config
from fedjax_mr.stitch import network
from fedjax_mr.stitch import projection
from fedjax_mr.stitch import units

Config = config_lib.StitchConfig.from_flat


def test_the_choices_are_the_librarys():
  choices = {
    f.name: config_lib.choices(f)
    for f in config_lib.fields()
    if config_lib.choices(f)
  }
  assert choices == {
    'cuts': units.CUT_STYLES,
    # The dataset's names, as the training program's (one definition).
    'dataset': training_config.choices(
      training_config.Data.__dataclass_fields__['dataset']
    ),
    'partition': config_lib.PARTITIONS,
    'aggregation': stitch_config.AGGREGATIONS,
    'view': cka.VIEWS,
    'spatial': projection.SPATIAL_POLICIES,
    'stitch_solver': projection.SOLVERS,
    'eval': network.EVAL_MODES,
    'knn_at': config_lib.KNN_AT,
    'energy_backend': fleet.BACKENDS,
  }


def test_library_config_has_the_same_defaults_and_values():
  assert config_lib.library_config(Config()) == stitch_config.Config()
  lib = config_lib.library_config(Config(stitch_solver='ridge', top_k=5))
  assert lib.solver == 'ridge' and lib.top_k == 5


def test_identity_is_what_earlier_versions_saved():
  # The keys (and their order) a state.npz of an earlier version holds:
  # those workdirs keep resuming.
  keys = (
    'cuts dataset num_clients partition clients_per_round batch_size top_k '
    'epsilon epsilon_decay reward penalty threshold aggregation '
    'num_selections rounds_per_selection max_depth prune view debiased '
    'spatial stitch_bias stitch_solver seed energy_backend energy_mix '
    'energy_profile energy_ms_per_score dirichlet_alpha pool_models'
  ).split()
  got = config_lib.identity(Config(), ['a', 'b'])
  assert list(got) == keys
  assert got['dirichlet_alpha'] == 1.0 and got['pool_models'] == ['a', 'b']
  more = config_lib.identity(
    Config(
      partition='shards', classes='5-9', imagenet_pool='p', pool_models=['x']
    ),
    [],
  )
  assert list(more)[-3:] == [
    'shards_per_client',
    'classes',
    'imagenet_resolution',
  ]


def test_pool_models_are_a_tuple():
  assert Config(pool_models=['a', 'b']).pool.pool_models == ('a', 'b')


_BAD = [
  ({'eval': 'bogus'}, "`eval`: unknown value 'bogus'; choose one of head"),
  ({'partition': 'natural'}, '`partition`: unknown value'),
  ({'aggregation': 'vote'}, '`aggregation`: unknown value'),
  ({'stitch_solver': 'lu'}, '`stitch_solver`: unknown value'),
  ({'num_clients': 0}, '`num_clients` must be a positive integer'),
  ({'num_clients': 2**20 + 1}, '`num_clients` must be at most 1,048,576'),
  ({'batch_size': 4097}, '`batch_size` must be at most 4,096'),
  (
    {'clients_per_round': 50, 'num_clients': 20},
    '`clients_per_round=50` exceeds `num_clients=20`',
  ),
  ({'seed': -1}, '`seed` must be in [0, 2**32)'),
  ({'epsilon': float('nan')}, '`epsilon` must be finite'),
  ({'reward': float('inf')}, '`reward` must be finite'),
  ({'eval_examples': -5}, '`eval_examples` must be ≥ 0'),
  ({'knn_reference': 0}, '`knn_reference` must be ≥ 1'),
  ({'local_clients': 200}, '`local_clients` must be in [0, `num_clients=100`]'),
  ({'alpha': 0.0}, '`alpha` must be finite and > 0'),
  (
    {'partition': 'iid', 'alpha': 0.5},
    '`alpha=0.5` applies to `partition=dirichlet or dirichlet_equal` only',
  ),
  ({'partition': 'shards', 'shards_per_client': 0}, '`shards_per_client`'),
  ({'shards_per_client': 3}, '`shards_per_client=3` applies to'),
  ({'energy_ms_per_score': 0.0}, '`energy_ms_per_score` must be finite'),
  (
    {'energy_profile': 'tx2_chained'},
    '`energy_profile=tx2_chained` applies to `energy_backend=sysfs or '
    'dry_run` only, not `energy_backend=simulated`',
  ),
  ({'energy_backend': 'sysfs'}, 'needs `energy_profile`'),
  (
    {
      'energy_backend': 'dry_run',
      'energy_profile': 'tx2_chained',
      'energy_mix': 'tx2_literal:1',
    },
    '`energy_mix=tx2_literal:1` applies to',
  ),
]


@pytest.mark.parametrize('fields,message', _BAD, ids=[str(f) for f, _ in _BAD])
def test_validate_names_the_field(fields, message):
  with pytest.raises(errors.ConfigError) as e:
    config_lib.validate(Config(**fields))
  assert message in str(e.value)


def test_validate_accepts_the_defaults_and_edges():
  config_lib.validate(Config())
  config_lib.validate(Config(partition='iid', local_clients=100))
  config_lib.validate(Config(num_clients=2**20, batch_size=4096))
  config_lib.validate(
    Config(energy_backend='sysfs', energy_profile='tx2_chained')
  )


def test_every_field_has_help():
  for f in config_lib.fields():
    assert f.metadata['help'], f.name


def test_no_part_holds_more_than_ten_fields():
  parts = [config_lib.StitchConfig]
  parts += [f.default_factory for f in dataclasses.fields(parts[0])]
  for part in parts:
    assert len(dataclasses.fields(part)) <= 10, part.__name__


def test_flat_names_round_trip_and_replace_one_field():
  config = Config(top_k=5, partition='iid', energy_mix='tx2_literal:1')
  assert config.selection.top_k == 5 and config.partition.kind == 'iid'
  assert config.energy.mix == 'tx2_literal:1'
  assert config_lib.StitchConfig.from_flat(**config.flat()) == config
  assert list(Config().flat()) == [f.name for f in config_lib.fields()]
  assert config.replace(seed=3).run.seed == 3
  assert config.replace(seed=3).selection.top_k == 5
  with pytest.raises(TypeError, match="argument 'bogus'"):
    Config(bogus=1)


def test_the_flat_names_are_those_of_earlier_versions():
  # The flags (and the names state.npz's identity holds) stay flat.
  assert {f.name for f in config_lib.fields()} == set(
    'pool pool_models imagenet_pool imagenet_resolution cuts dataset '
    'data_dir num_clients partition shards_per_client alpha '
    'clients_per_round batch_size top_k epsilon epsilon_decay reward '
    'penalty threshold aggregation num_selections rounds_per_selection '
    'max_depth prune view debiased spatial stitch_bias stitch_solver seed '
    'eval knn_reference knn_at eval_examples label_map classes '
    'local_clients energy_backend energy_mix energy_profile '
    'energy_sysfs_root energy_ms_per_score workdir'.split()
    # The shared run part's, which the host loop of every run honours.
    + ['keep_checkpoints', 'tensorboard']
  )


def test_the_shared_parts_are_the_training_configs_own():
  # Defined once: the same fields (help, choices, flat names), FedStitch's
  # other defaults and fewer partitions with their reasons in the help.
  train = {f.name: f for f in training_config.base_fields()}
  for f in config_lib.fields():
    if f.path[0] not in ('data', 'partition', 'run'):
      continue
    assert f.name in train, f.name
    if f.name in ('alpha', 'partition', 'workdir'):
      assert f.metadata['help'].startswith(train[f.name].metadata['help'])
      assert 'Here ' in f.metadata['help'], f.name
    else:
      assert f.metadata == train[f.name].metadata, f.name
      assert f.default == train[f.name].default, f.name
  assert Config().partition.alpha == 1.0
  assert (
    'Table I'
    in config_lib.Partition.__dataclass_fields__['alpha'].metadata['help']
  )


@pytest.mark.parametrize(
  'kind,fragment',
  [
    ('device', 'is not a regular file (a character device) (a label map'),
    ('folder', 'is a folder (a label map is a JSON list'),
    ('large', 'holds 13 bytes, more than the 8 allowed'),
    ('good', None),
  ],
)
def test_label_map_file_is_checked_before_it_is_read(
  tmp_path, monkeypatch, kind, fragment
):
  from fedjax_mr.pipeline import stitch_experiment

  path = {'device': '/dev/zero', 'folder': str(tmp_path)}.get(kind)
  if path is None:
    path = str(tmp_path / 'map.json')
    with open(path, 'w') as f:
      f.write('[[1], [2, 3]]')  # 13 bytes
  if kind == 'large':
    monkeypatch.setattr(stitch_experiment, 'MAX_LABEL_MAP_BYTES', 8)
  config = Config(label_map=path)
  if fragment is None:
    assert stitch_experiment.read_label_map(config) == [[1], [2, 3]]
    return
  with pytest.raises(errors.ConfigError) as e:
    stitch_experiment.read_label_map(config)
  assert str(e.value).startswith(f'`label_map={path}`: {fragment}')
