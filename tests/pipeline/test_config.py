"""`ExperimentConfig`: its tree of parts, its flat flags, the partition
flags' validation and run identity."""

import dataclasses
import hashlib
import json
import shutil

import pytest

from fedjax_mr.core import errors
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib


def _values(**changes):
  values = dict(num_clients=3, clients_per_round=2, alpha=0.1)
  values.update(changes)
  return values


def _config(**changes):
  """The config of flags `changes`, with the partition file's digest read
  as the programs read it (`with_file_digest`)."""
  config = config_lib.ExperimentConfig.from_flat(**_values(**changes))
  return config_lib.with_file_digest(config)


@pytest.fixture
def part_file(tmp_path):
  path = tmp_path / 'split.json'
  path.write_text(json.dumps({'clients': [[0, 1], [2], [5, 4]]}))
  return path


def test_shards_flags_and_workdir():
  cfg = _config(partition='shards', shards_per_client=3)
  checks.validate(cfg)
  assert (
    cfg.default_workdir() == 'runs/fedavg-fashion_mnist-cnn_mnist-shards3-s0'
  )
  assert cfg.identity()['shards_per_client'] == 3
  with pytest.raises(errors.ConfigError, match=r'^`shards_per_client` must'):
    checks.validate(_config(partition='shards', shards_per_client=0))
  with pytest.raises(
    errors.ConfigError,
    match=r'^`shards_per_client=3` applies to `partition=shards` only, not '
    r'`partition=iid`$',
  ):
    checks.validate(_config(partition='iid', shards_per_client=3))


def test_dirichlet_equal_flags_and_workdir():
  cfg = _config(partition='dirichlet_equal', alpha=0.5)
  checks.validate(cfg)
  assert cfg.default_workdir() == (
    'runs/fedavg-fashion_mnist-cnn_mnist-dirichlet_equal0.5-s0'
  )
  assert cfg.identity()['alpha'] == 0.5
  with pytest.raises(
    errors.ConfigError,
    match=r'^`alpha` must be finite and > 0, got 0.0 \(`partition=dirichlet_eq',
  ):
    checks.validate(_config(partition='dirichlet_equal', alpha=0.0))
  with pytest.raises(
    errors.ConfigError,
    match=r'^`min_client_size=5` applies to `partition=dirichlet` only, not '
    r'`partition=dirichlet_equal`$',
  ):
    checks.validate(_config(partition='dirichlet_equal', min_client_size=5))
  with pytest.raises(
    errors.ConfigError,
    match=r'^`alpha=0.5` applies to `partition=dirichlet or dirichlet_equal` '
    r'only, not `partition=iid`$',
  ):
    checks.validate(_config(partition='iid', alpha=0.5))


def test_file_config_holds_the_content_hash(part_file, tmp_path):
  sha = hashlib.sha256(part_file.read_bytes()).hexdigest()
  cfg = _config(partition='file', partition_file=str(part_file))
  checks.validate(cfg)
  assert cfg.partition.sha256 == sha
  assert cfg.to_dict()['partition_sha256'] == sha
  assert cfg.default_workdir().endswith(f'-file-{sha[:8]}-s0')
  # The content defines the run; the path does not (run_only).
  assert cfg.identity()['partition_sha256'] == sha
  assert 'partition_file' not in cfg.identity()
  moved = tmp_path / 'moved.json'
  shutil.copy(part_file, moved)
  same = _config(partition='file', partition_file=str(moved))
  assert checks.config_diffs(same, cfg.to_dict()) == []
  # A changed file is another run, from the flags as from a saved config.
  part_file.write_text(json.dumps([[0], [2], [5, 4]]))
  changed = _config(partition='file', partition_file=str(part_file))
  new_sha = hashlib.sha256(part_file.read_bytes()).hexdigest()
  assert checks.config_diffs(changed, cfg.to_dict()) == [
    f"`partition_sha256='{sha}'` there, '{new_sha}' here"
  ]
  with pytest.raises(
    errors.ConfigError,
    match=rf'^`partition_file={part_file}`: its sha256 is {new_sha}, not '
    rf'`partition_sha256={sha}` ',
  ):
    checks.validate(cfg.replace(rounds=3))


@pytest.mark.parametrize(
  'changes,message',
  [
    (
      {'partition': 'file'},
      '`partition=file` needs `partition_file=<a JSON file of client index '
      'lists>`',
    ),
    (
      {'partition_file': '{f}'},
      '`partition_file={f}` applies to `partition=file` only, not '
      '`partition=dirichlet`',
    ),
    (
      {'partition': 'iid', 'partition_sha256': 'ab'},
      '`partition_sha256=ab` applies to `partition=file` only, not '
      '`partition=iid`',
    ),
    (
      {'partition': 'file', 'partition_file': '{f}', 'num_clients': 4},
      '`partition_file={f}`: 3 clients, but `num_clients=4`; pass '
      '`num_clients=3`',
    ),
    (
      {'partition': 'file', 'partition_file': '{f}.missing'},
      '`partition_file={f}.missing`: cannot read it: No such file or '
      'directory (a partition file is a regular JSON file of at most 128 '
      'MiB: it lists each training example at most once)',
    ),
  ],
)
def test_file_flag_errors(part_file, changes, message):
  changes = {
    k: v.replace('{f}', str(part_file)) if isinstance(v, str) else v
    for k, v in changes.items()
  }
  with pytest.raises(errors.ConfigError) as e:
    checks.validate(_config(**changes))
  assert str(e.value) == message.replace('{f}', str(part_file))


def test_compare_variants_pass_the_new_partitions(part_file, tmp_path):
  from fedjax_mr.analysis import compare

  other = tmp_path / 'other.json'
  other.write_text(json.dumps([[3], [2], [0, 1]]))
  specs = [
    'fedavg',
    'sharded:partition=shards,shards_per_client=1',
    f'split:partition=file,partition_file={part_file}',
  ]
  runs = compare.configs(
    _values(), [compare.parse_variant(v) for v in specs], [0, 1], '/out'
  )
  got = {
    (n, seed): (
      c.partition.kind,
      c.partition.shards_per_client,
      c.partition.sha256,
    )
    for n, seed, c in runs
  }
  sha = hashlib.sha256(part_file.read_bytes()).hexdigest()
  for seed in (0, 1):
    assert got['fedavg', seed] == ('dirichlet', 2, '')
    assert got['sharded', seed] == ('shards', 1, '')
    assert got['split', seed] == ('file', 2, sha)
  # On a base that reads a file, a variant reading another one gets that
  # file's hash, not the base's; one that pins a hash is checked against it.
  base = _values(partition='file', partition_file=str(part_file))
  ((_, _, c),) = compare.configs(
    base, [compare.parse_variant(f'b:partition_file={other}')], [0], '/o'
  )
  assert c.partition.sha256 == hashlib.sha256(other.read_bytes()).hexdigest()
  with pytest.raises(errors.ConfigError, match=r'^variant b: .*sha256'):
    compare.configs(
      base,
      [
        compare.parse_variant(
          f'b:partition_file={other},partition_sha256={sha}'
        )
      ],
      [0],
      '/o',
    )


def _synthetic(**changes):
  values = dict(dataset='synthetic', model='logistic', num_clients=1000)
  values.update(changes)
  return config_lib.ExperimentConfig.from_flat(**values)


def test_synthetic_fields_define_the_run_and_its_workdir():
  cfg = _synthetic(num_clients=10**6, clients_per_round=10**4)
  checks.validate(cfg)
  assert cfg.data.synthetic_alpha == cfg.data.synthetic_beta == 1.0
  assert cfg.default_workdir() == (
    'runs/fedavg-synthetic-logistic-alpha1_beta1-s0'
  )
  half = cfg.replace(synthetic_alpha=0.5, synthetic_beta=0.0)
  checks.validate(half)
  assert half.default_workdir().endswith('-alpha0.5_beta0-s0')
  assert half.identity()['synthetic_alpha'] == 0.5
  # Resuming with other rates is another run; a saved config from before
  # these fields had their defaults.
  assert checks.config_diffs(half, cfg.to_dict()) == [
    '`synthetic_alpha=1.0` there, 0.5 here',
    '`synthetic_beta=1.0` there, 0.0 here',
  ]
  older = {
    k: v for k, v in cfg.to_dict().items() if not k.startswith('synthetic_')
  }
  assert checks.config_diffs(cfg, older) == []


@pytest.mark.parametrize(
  'changes,message',
  [
    (
      {'dataset': 'fashion_mnist', 'model': 'cnn_mnist', 'synthetic_beta': 0},
      '`synthetic_beta=0` applies to `dataset=synthetic` only, not '
      '`dataset=fashion_mnist`',
    ),
    (
      {'model': 'cnn_mnist'},
      '`model=cnn_mnist` takes images; `dataset=synthetic` gives vectors '
      '(models that take vectors: logistic)',
    ),
    ({'synthetic_alpha': -1.0}, '`synthetic_alpha` must be finite and ≥ 0'),
    (
      {'synthetic_beta': float('inf')},
      '`synthetic_beta` must be finite and ≥ 0',
    ),
    (
      {'partition': 'iid'},
      '`partition=iid` does not apply to `dataset=synthetic`, whose clients '
      'are generated (leave `partition` at its default)',
    ),
    (
      {'alpha': 0.5},
      '`alpha=0.5` does not apply to `dataset=synthetic`, whose clients are '
      'generated',
    ),
    (
      {'classes': '0-4'},
      '`classes=0-4` does not apply to `dataset=synthetic`, whose clients '
      'are generated',
    ),
    (
      {'algorithm': 'heterofl'},
      "`algorithm=heterofl` reads the clients' stored examples; "
      '`dataset=synthetic` generates them on demand',
    ),
    (
      {'num_clients': 2 * 10**7},
      '`num_clients=20000000`: at most 10737418 synthetic clients',
    ),
  ],
)
def test_synthetic_refusals_name_the_field(changes, message):
  with pytest.raises(errors.ConfigError) as e:
    checks.validate(_synthetic(**changes))
  assert str(e.value).startswith(message)


def test_logistic_takes_no_images():
  with pytest.raises(errors.ConfigError) as e:
    checks.validate(_config(model='logistic'))
  assert str(e.value).startswith(
    '`model=logistic` takes vectors; `dataset=fashion_mnist` gives images '
    '(models that take images: cnn_cifar,'
  )


@pytest.mark.parametrize(
  'content,reason',
  [
    ('{"rounds": ', 'not JSON (Expecting value'),
    ('[1]', 'holds a list, not an object'),
    (None, 'is a folder'),
  ],
)
def test_an_unreadable_saved_config_is_one_line(tmp_path, content, reason):
  path = tmp_path / 'config.json'
  if content is None:
    path.mkdir()
  else:
    path.write_text(content)
  with pytest.raises(errors.ConfigError) as e:
    checks.check_resumable(config_lib.ExperimentConfig.from_flat(), str(path))
  assert str(e.value).startswith(f'`workdir`: cannot read {path}: {reason}')


def test_a_saved_config_value_is_quoted_clipped(tmp_path):
  path = tmp_path / 'config.json'
  path.write_text(json.dumps({'seed': 'x' * 1000}))
  with pytest.raises(errors.ConfigError) as e:
    checks.check_resumable(config_lib.ExperimentConfig.from_flat(), str(path))
  assert f"`seed='{'x' * 79}…` there" in str(e.value)
  assert len(str(e.value)) < 400


def _parts(kind, path=()):
  """(path, dataclass) of the config tree's every node."""
  yield path, kind
  for f in dataclasses.fields(kind):
    if f.metadata.get('part') and f.default_factory is not dataclasses.MISSING:
      yield from _parts(f.default_factory, (*path, f.name))


def test_the_config_is_a_tree_of_small_frozen_parts():
  nodes = list(_parts(config_lib.ExperimentConfig))
  # The config, its eleven parts (privacy the newest), devices' processes
  # and privacy's secure aggregation.
  assert len(nodes) == 14
  for path, kind in nodes:
    assert dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen
    # A part holds few fields; the root one part per concern (the issue
    # that added privacy asked for a part of its own).
    assert len(dataclasses.fields(kind)) <= (10 if path else 11), path
    assert '__getattr__' not in vars(kind), path
  cfg = config_lib.ExperimentConfig()
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.local.lr = 1.0
  # Every flag reaches one field, and the flat form goes both ways.
  paths = [f.path for f in config_lib.base_fields()]
  assert len(set(paths)) == len(paths) == len(config_lib.base_fields())
  odd = _config(
    algorithm='fedmut', fedmut_alpha=2.0, lr=0.05, partition='iid', seed=3
  )
  assert config_lib.ExperimentConfig.from_flat(**odd.flat()) == odd
  assert odd.local.lr == 0.05 and odd.partition.kind == 'iid'
  assert odd.algorithm.hparams.alpha == 2.0 and odd.run.seed == 3
  assert odd.replace(rounds=7).run.rounds == 7
  assert odd.replace(rounds=7).algorithm == odd.algorithm


def test_building_a_config_reads_no_file(tmp_path):
  missing = str(tmp_path / 'nowhere.json')
  cfg = config_lib.ExperimentConfig.from_flat(
    partition='file',
    partition_file=missing,
    num_clients=3,
    clients_per_round=2,
  )
  assert cfg.partition.sha256 == ''  # read where a run starts, not here
  assert config_lib.with_file_digest(cfg) == cfg  # unreadable: left empty
  with pytest.raises(errors.ConfigError, match='nowhere.json'):
    checks.validate(cfg)


def test_another_algorithms_flag_is_refused_where_the_config_is_built():
  with pytest.raises(
    errors.ConfigError,
    match=r'^`fedprox_mu=0.5` applies to `algorithm=fedprox` only, not '
    r'`algorithm=fedavg`$',
  ):
    config_lib.ExperimentConfig.from_flat(fedprox_mu=0.5)
  with pytest.raises(errors.ConfigError, match=r'^`algorithm`: unknown value'):
    config_lib.ExperimentConfig.from_flat(algorithm='nope')
  with pytest.raises(TypeError, match='hparams'):
    config_lib.AlgorithmChoice('fedprox', config_lib.AlgorithmChoice().hparams)


def test_a_config_json_of_an_earlier_version_reads_back(tmp_path):
  from fedjax_mr.pipeline import experiment

  # Earlier versions wrote every algorithm's flags, at their defaults of
  # the time; those of other algorithms are left out, the run's own kept.
  saved = _config(algorithm='fedprox', fedprox_mu=0.3).flat()
  saved.update(fedmut_alpha=9.0, scaffold_control_steps='taken')
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  cfg = experiment.read_config(str(tmp_path))
  assert cfg.algorithm.options() == {'fedprox_mu': 0.3}
  assert cfg == _config(algorithm='fedprox', fedprox_mu=0.3)
