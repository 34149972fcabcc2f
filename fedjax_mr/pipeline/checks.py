"""The checks of an `ExperimentConfig`, run once where a run starts.

`validate(config)` checks every field and returns the algorithm's
hyper-parameters (`check` returns them with what the checks read: the
partition file, read once, for the build); the optimizers are built here
from their parts (`client_optimizer`, `server_optimizer`), so that an
optimizer's `ArgumentError` names its flag. Errors are `ConfigError`s
naming the flag in backticks, which the programs render as their flags.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any
from typing import Mapping
from typing import NamedTuple

import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.core import jsonfile
from fedjax_mr.data import partition
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import registry
from fedjax_mr.runtime import distributed
from fedjax_mr.training import optimizers

# The fields that some partitions alone read, and those partitions.
PARTITION_FIELDS = {
  'alpha': ('dirichlet', 'dirichlet_equal'),
  'min_client_size': ('dirichlet',),
  'shards_per_client': ('shards',),
  'partition_file': ('file',),
  'partition_sha256': ('file',),
}
# The fields that some datasets alone read, and those datasets.
DATASET_FIELDS = {
  'synthetic_alpha': ('synthetic',),
  'synthetic_beta': ('synthetic',),
}
# The algorithms that read the clients' stored examples (`ClientData`'s
# index lists and arrays), which generated clients (`dataset=synthetic`)
# do not have: FedGen counts every client's labels, HeteroFL's static
# BatchNorm and label masks read its examples.
STORED_DATA_ALGORITHMS = ('fedgen', 'heterofl')
# The fields that some optimizers alone read, and those optimizers.
CLIENT_OPTIMIZER_FIELDS = {
  'momentum': ('sgd',),
  'client_beta1': ('adam',),
  'client_beta2': ('adam',),
  'client_epsilon': ('adam',),
}
SERVER_OPTIMIZER_FIELDS = {
  'server_momentum': ('momentum',),
  'server_beta1': ('adam', 'yogi', 'adagrad'),
  'server_beta2': ('adam', 'yogi'),
  'server_epsilon': ('adam', 'yogi', 'adagrad'),
}
# The field that sets each argument of the optimizers.
_CLIENT_ARGUMENTS = {
  'learning_rate': 'lr',
  'momentum': 'momentum',
  'b1': 'client_beta1',
  'b2': 'client_beta2',
  'eps': 'client_epsilon',
}
_SERVER_ARGUMENTS = {
  'name': 'server_optimizer',
  'learning_rate': 'server_lr',
  'momentum': 'server_momentum',
  'b1': 'server_beta1',
  'b2': 'server_beta2',
  'tau': 'server_epsilon',
}


def _natural_names():
  from fedjax_mr.data import datasets

  return datasets.NATURAL


def _models_taking(kind: str) -> list[str]:
  from fedjax_mr.models import model

  return [m for m in model.NAMES if model.input_kind(m) == kind]


def _synthetic():
  from fedjax_mr.data import synthetic

  return synthetic


def _input_kinds(dataset: str, model_name: str) -> tuple[str, str]:
  from fedjax_mr.data import datasets
  from fedjax_mr.models import model

  return datasets.input_kind(dataset), model.input_kind(model_name)


def _value(config: config_lib.ExperimentConfig, flag: str) -> Any:
  """The value of the field of `flag`."""
  node = config
  for name in config_lib.path_of(flag):
    node = getattr(node, name)
  return node


def _identity_defaults() -> dict[str, Any]:
  """The default of every flag that defines a run, the algorithms' too."""
  out = {
    f.name: f.default
    for f in config_lib.base_fields()
    if not f.metadata['run_only']
  }
  out.update({k: f.default for k, (f, _) in registry.all_flags().items()})
  return out


class Checked(NamedTuple):
  """A config checked once (`check`), with what its checks read.

  Attributes:
    config: the config, its `partition_sha256` that of the partition file
      read (`partition=file`).
    hparams: the algorithm's hyper-parameters, validated (what `hparams`
      returns).
    partition: the client index lists of the partition file
      (`partition=file`; the build checks them against the dataset's
      size), else None.
  """

  config: config_lib.ExperimentConfig
  hparams: Any
  partition: list[np.ndarray] | None = None


def check(config: config_lib.ExperimentConfig) -> Checked:
  """Checks every field of `config` once, reading the partition file
  (`partition=file`) once, so that a caller builds the run from what it
  returns without checking or reading again.

  Raises:
    ConfigError: naming the first bad field (in backticks) and what it
      allows.
  """
  _check_values(config)
  _check_run(config)
  client_optimizer(config)
  _check_optimizer_fields(config)
  server_optimizer(config)
  config, parts = _check_data(config)
  return Checked(config, _check_algorithm_fields(config), parts)


def validate(config: config_lib.ExperimentConfig) -> Any:
  """`check`'s hyper-parameters: the algorithm's, validated (what
  `hparams` returns).

  Raises:
    ConfigError: as `check`.
  """
  return check(config).hparams


# The fields that must be ≥ 1, and those that must be ≥ 0.
_POSITIVE = (
  'num_clients',
  'clients_per_round',
  'rounds',
  'local_epochs',
  'batch_size',
  'shards_per_client',
  'eval_batch_size',
  'keep_checkpoints',
  'num_processes',
)
_NON_NEGATIVE = (
  'eval_every',
  'local_eval_every',
  'checkpoint_every',
  'min_client_size',
  'leaf_min_samples',
  'client_chunk',
  'num_devices',
  'host_devices',
)


# Upper bounds checked before anything allocates: what each value would
# cost beyond them (XLA's host devices are threads with their own buffers;
# a batch is allocated whole), and why no real setting comes near.
# host_devices: distributed.MAX_HOST_DEVICES.
_AT_MOST = {
  'host_devices': (256, 'XLA host devices on one CPU host'),
  'num_devices': (65_536, 'devices in one mesh'),
  'batch_size': (2**20, 'examples in one batch'),
  'eval_batch_size': (2**20, 'examples in one batch'),
  'client_chunk': (2**20, 'clients vmapped at once'),
}


def _check_values(config: config_lib.ExperimentConfig) -> None:
  """Choices, and sizes and rates in their ranges."""
  for f in config_lib.base_fields():
    check_choice(f.name, _value(config, f.name), config_lib.choices(f))
  for name in _POSITIVE:
    try:
      errors.check_count(name, _value(config, name))
    except errors.ArgumentError as e:
      raise field_error(name, e) from None
  for name in _NON_NEGATIVE:
    if _value(config, name) < 0:
      raise errors.ConfigError(
        f'`{name}` must be ≥ 0, got {_value(config, name)}'
      )
  for name, (bound, what) in _AT_MOST.items():
    if _value(config, name) > bound:
      raise errors.ConfigError(
        f'`{name}` must be at most {bound:,} ({what}), got '
        f'{_value(config, name):,}'
      )
  check_seed('seed', config.run.seed)
  if not (
    config.energy.ms_per_sample > 0
    and math.isfinite(config.energy.ms_per_sample)
  ):
    raise errors.ConfigError(
      '`energy_ms_per_sample` must be finite and > 0, got '
      f'{config.energy.ms_per_sample}'
    )


def check_choice(name: str, value: Any, allowed: Any) -> None:
  """Refuses `value` of field `name` unless it is one of `allowed` (any
  value when `allowed` is empty)."""
  if allowed and value not in allowed:
    raise errors.ConfigError(
      f'`{name}`: unknown value {value!r}; choose one of {", ".join(allowed)}'
    )


def check_seed(name: str, seed: int) -> None:
  """Raises `ConfigError` naming `name` unless `seed` is in [0, 2**32)."""
  if not 0 <= seed < 2**32:
    raise errors.ConfigError(f'`{name}` must be in [0, 2**32), got {seed}')


def check_clients_per_round(k: int, n: int) -> None:
  """Raises `ConfigError` if `clients_per_round` `k` exceeds `num_clients`
  `n`."""
  if k > n:
    raise errors.ConfigError(
      f'`clients_per_round={k}` exceeds `num_clients={n}`; it must be '
      'between 1 and num_clients'
    )


def _check_run(config: config_lib.ExperimentConfig) -> None:
  """The energy mixes, K against N, the processes."""
  for mix in config_lib.energy_mixes(config.energy):
    from fedjax_mr.energy import simulation  # host-only, no jax

    try:
      simulation.assign_profiles(
        mix, config.partition.num_clients, config.run.seed
      )
    except (ValueError, OSError) as e:
      raise errors.ConfigError(f'`energy_mix`: {mix!r}: {e}') from None
  check_clients_per_round(
    config.server.clients_per_round, config.partition.num_clients
  )
  p = config.devices.processes
  try:
    distributed.check_processes(
      p.num_processes,
      p.process_id,
      p.coordinator_address,
      p.coordinator_timeout,
    )
  except errors.ArgumentError as e:
    raise field_error(e.argument, e) from None


def _check_data(
  config: config_lib.ExperimentConfig,
) -> tuple[config_lib.ExperimentConfig, list[np.ndarray] | None]:
  """The partition and its fields, the model against the dataset; returns
  `config` and the partition file's client lists as `_check_partition_file`
  does."""
  _check_owned(config, 'dataset', DATASET_FIELDS)
  if config.data.dataset == _synthetic().NAME:
    _check_synthetic(config)
  if config.partition.kind in PARTITION_FIELDS['alpha']:
    try:
      partition.check_alpha(config.partition.alpha)
    except errors.ArgumentError as e:
      raise errors.ConfigError(
        f'`alpha` {e.message} (`partition={config.partition.kind}`; IID is '
        '`partition=iid`)'
      ) from None
  _check_owned(config, 'partition', PARTITION_FIELDS)
  if config.model.init_from and not os.path.isfile(
    os.path.join(config.model.init_from, 'meta.json')
  ):
    raise errors.ConfigError(
      f'`init_from={config.model.init_from}`: no meta.json there (want a model '
      'folder as experiments.pretrain_zoo writes it: <pool>/<model id>)'
    )
  config, parts = _check_partition_file(config)
  gives, takes = _input_kinds(config.data.dataset, config.model.name)
  if gives != takes:
    fits = _models_taking(gives)
    raise errors.ConfigError(
      f'`model={config.model.name}` takes {takes}; '
      f'`dataset={config.data.dataset}` '
      f'gives {gives} (models that take {gives}: {", ".join(fits)})'
    )
  _check_dataset_fields(config)
  return config, parts


def _check_dataset_fields(config: config_lib.ExperimentConfig) -> None:
  """The fields that only some datasets read."""
  natural = _natural_names()
  if config.partition.kind == 'natural' and config.data.dataset not in natural:
    raise errors.ConfigError(
      f'`partition=natural` needs a dataset with its own clients '
      f'({", ".join(natural)}); `dataset={config.data.dataset}` has none: use '
      '`partition=iid` or dirichlet'
    )
  if config.data.leaf_min_samples and config.data.dataset not in natural:
    raise errors.ConfigError(
      f'`leaf_min_samples` applies to LEAF datasets ({", ".join(natural)}) '
      f'only, not `dataset={config.data.dataset}`'
    )
  if (
    config.data.cifar100_labels != 'fine' and config.data.dataset != 'cifar100'
  ):
    raise errors.ConfigError(
      f'`cifar100_labels={config.data.cifar100_labels}` applies to '
      f'`dataset=cifar100` only, not `dataset={config.data.dataset}`'
    )


def _check_synthetic(config: config_lib.ExperimentConfig) -> None:
  """`dataset=synthetic`: its rates, and none of the fields that only
  stored data reads (its clients are generated, `num_clients` of them)."""
  synthetic = _synthetic()
  for name in ('synthetic_alpha', 'synthetic_beta'):
    value = _value(config, name)
    if not (math.isfinite(value) and value >= 0):
      raise errors.ConfigError(f'`{name}` must be finite and ≥ 0, got {value}')
  limit = (2**31 - 1) // synthetic.MAX_SIZE
  if config.partition.num_clients > limit:
    raise errors.ConfigError(
      f'`num_clients={config.partition.num_clients}`: at most {limit} '
      'synthetic '
      'clients (their example counts must fit int32)'
    )
  where = 'does not apply to `dataset=synthetic`, whose clients are generated'
  defaults = {f.name: f.default for f in config_lib.base_fields()}
  if config.partition.kind != defaults['partition']:
    raise errors.ConfigError(
      f'`partition={config.partition.kind}` {where} (leave `partition` at its '
      'default)'
    )
  for name in (*PARTITION_FIELDS, 'classes'):
    if _value(config, name) != defaults[name]:
      raise errors.ConfigError(f'`{name}={_value(config, name)}` {where}')
  if config.algorithm.name in STORED_DATA_ALGORITHMS:
    raise errors.ConfigError(
      f"`algorithm={config.algorithm.name}` reads the clients' stored "
      'examples; '
      '`dataset=synthetic` generates them on demand'
    )


def _check_partition_file(
  config: config_lib.ExperimentConfig,
) -> tuple[config_lib.ExperimentConfig, list[np.ndarray] | None]:
  """`partition_file` with `partition=file`: given, and readable as
  `num_clients` index lists (of the given sha256, if any). Returns
  `read_partition_file`'s config and lists, or `config` and None for the
  other partitions."""
  if config.partition.kind != 'file':
    return config, None
  if not config.partition.file:
    raise errors.ConfigError(
      '`partition=file` needs `partition_file=<a JSON file of client '
      'index lists>`'
    )
  return read_partition_file(config)


def read_partition_file(
  config: config_lib.ExperimentConfig,
) -> tuple[config_lib.ExperimentConfig, list[np.ndarray]]:
  """Reads `partition_file` once and checks it, all but the index range
  (the dataset is not loaded yet: `partition.check_range`).

  Returns:
    `config` with `partition_sha256` that of the bytes read, and the
    file's `num_clients` client index lists.

  Raises:
    ConfigError: naming `partition_file` and what is wrong with it, or
      the file's sha256 where it is not `partition_sha256` (when set).
  """
  p = config.partition
  where = f'`partition_file={errors.clip(p.file)}`'
  try:
    data = partition.read_file(p.file)
  except errors.ArgumentError as e:
    raise partition_error(e, config.flat()) from None
  digest = partition.digest(data)
  if p.sha256 and digest != p.sha256:
    raise errors.ConfigError(
      f'{where}: its sha256 is {digest}, not `partition_sha256={p.sha256}` '
      '(the file changed; an empty `partition_sha256` takes it as it is)'
    )
  try:
    parts = partition.parse_file(data, p.file, p.num_clients)
  except errors.ArgumentError as e:
    raise partition_error(e, config.flat()) from None
  digested = dataclasses.replace(p, sha256=digest)
  return dataclasses.replace(config, partition=digested), parts


# The field behind each argument of the partition functions whose name
# differs (`sizes_between`'s, in the benchmark's setting).
PARTITION_ARGUMENTS = {'low': 'min_client_size', 'high': 'max_client_size'}


def partition_error(
  error: errors.ArgumentError, values: Mapping[str, Any]
) -> errors.ConfigError:
  """A partition function's `error` naming the field of its argument with
  its value in `values` ({field: value}: a config's `flat()`, a FedStitch
  config's or the benchmark's setting)."""
  if isinstance(error, partition.FileError):
    where = f'`partition_file={errors.clip(values["partition_file"])}`'
    return errors.ConfigError(f'{where}: {error.reason}')
  if error.argument == 'alpha':
    # `dirichlet`'s search; a bad alpha is refused before (`check_alpha`).
    return errors.ConfigError(f'Dirichlet partition: {error.message}')
  field = PARTITION_ARGUMENTS.get(error.argument, error.argument)
  return errors.ConfigError(f'`{field}={values[field]}` {error.message}')


def _check_owned(
  config: config_lib.ExperimentConfig,
  owner: str,
  owned: Mapping[str, tuple[str, ...]],
  defaults: Mapping[str, Any] | None = None,
) -> None:
  """Refuses a field of `owned` ({field: the values of `owner` that read
  it}) set away from its default (`defaults`, else the field's own) while
  the field `owner` is none of the values that read it."""
  if defaults is None:
    defaults = {f.name: f.default for f in config_lib.base_fields()}
  check_owned(config.flat(), defaults, owner, owned)


def check_owned(
  values: Mapping[str, Any],
  defaults: Mapping[str, Any],
  owner: str,
  owned: Mapping[str, tuple[str, ...]],
) -> None:
  """`_check_owned` of any config's flat `values` and their `defaults`
  ({flag: value}; the FedStitch runs' too)."""
  value = values[owner]
  for name, owners in owned.items():
    if value not in owners and values[name] != defaults[name]:
      raise errors.ConfigError(
        f'`{name}={values[name]}` applies to `{owner}='
        f'{" or ".join(owners)}` only, not `{owner}={value}`'
      )


def _check_optimizer_fields(config: config_lib.ExperimentConfig) -> None:
  """The fields of the optimizers that `client_optimizer` and
  `server_optimizer` do not choose, and the server's fields of an
  algorithm that takes no server optimizer."""
  _check_owned(config, 'client_optimizer', CLIENT_OPTIMIZER_FIELDS)
  _check_owned(config, 'server_optimizer', SERVER_OPTIMIZER_FIELDS)
  if registry.get(config.algorithm.name).server_optimizer:
    return
  defaults = {f.name: f.default for f in config_lib.base_fields()}
  for name in ('server_optimizer', 'server_lr', *SERVER_OPTIMIZER_FIELDS):
    if _value(config, name) != defaults[name]:
      takers = [n for n, e in registry.REGISTRY.items() if e.server_optimizer]
      raise errors.ConfigError(
        f'`{name}={_value(config, name)}` applies to the algorithms that '
        f'step toward an aggregate ({", ".join(takers)}) only, not '
        f'`algorithm={config.algorithm.name}`'
      )


def field_error(field: str, error: errors.ArgumentError) -> errors.ConfigError:
  """`error` naming `field`, the field that holds its argument."""
  return errors.ConfigError(f'`{field}` {error.message}')


# The field behind each argument of the data functions (`datasets.load`'s
# `name`, `parse_classes`'s `text`) where the two names differ.
DATA_FIELDS = {'name': 'dataset', 'text': 'classes'}


def data_error(error: errors.ArgumentError) -> errors.ConfigError:
  """A data function's `error` naming the field of its argument."""
  return field_error(DATA_FIELDS.get(error.argument, error.argument), error)


def value_error(
  config: config_lib.ExperimentConfig, error: errors.ArgumentError
) -> errors.ConfigError:
  """`error` of a library function whose argument is the field of the same
  name, naming the field and its value in `config`."""
  value = _value(config, error.argument)
  return errors.ConfigError(f'`{error.argument}={value}` {error.message}')


def client_optimizer(
  config: config_lib.ExperimentConfig,
) -> optimizers.Optimizer:
  """The clients' optimizer (`client_optimizer` at rate `lr`).

  Raises:
    ConfigError: a bad value, named by its field.
  """
  try:
    if config.local.optimizer == 'adam':
      return optimizers.adam(
        config.local.lr,
        config.local.beta1,
        config.local.beta2,
        config.local.epsilon,
      )
    return optimizers.sgd(config.local.lr, config.local.momentum)
  except errors.ArgumentError as e:
    raise field_error(
      _CLIENT_ARGUMENTS.get(e.argument, e.argument), e
    ) from None


def server_optimizer(
  config: config_lib.ExperimentConfig,
) -> optimizers.Optimizer:
  """The server optimizer (`server_optimizer` at rate `server_lr`).

  Raises:
    ConfigError: a bad value, named by its field.
  """
  try:
    return optimizers.server_optimizer(
      config.server.optimizer,
      config.server.lr,
      momentum=config.server.momentum,
      b1=config.server.beta1,
      b2=config.server.beta2,
      tau=config.server.epsilon,
    )
  except errors.ArgumentError as e:
    raise field_error(
      _SERVER_ARGUMENTS.get(e.argument, e.argument), e
    ) from None


# Arguments of the algorithms' factories that are not their own
# hyper-parameters, by the field that sets them.
_SETTING_FIELDS = {
  'weighted': 'weighting',
  'clients_per_round': 'clients_per_round',
  'num_clients': 'num_clients',
  'optimizer': 'client_optimizer',
}


def field_of(algorithm: str, argument: str) -> str:
  """The field behind an `ArgumentError` of algorithm `algorithm`."""
  for name, f in registry.flags_of(algorithm).items():
    if f.field.name == argument:
      return name
  return _SETTING_FIELDS.get(argument, argument)


def as_config_error(
  algorithm: str, error: errors.ArgumentError
) -> errors.ConfigError:
  """An algorithm's `ArgumentError` as a one-line error naming the field
  (in backticks)."""
  return field_error(field_of(algorithm, error.argument), error)


def setting_of(config: config_lib.ExperimentConfig) -> dict[str, Any]:
  """The values the algorithms' checks may read beside their own."""
  return {
    'clients_per_round': config.server.clients_per_round,
    'num_clients': config.partition.num_clients,
    'weighted': not config_lib.uniform_weights(config),
  }


def hparams(config: config_lib.ExperimentConfig) -> Any:
  """The hyper-parameters of `config.algorithm.name`, validated.

  Raises:
    ConfigError: a bad value, named by its field.
  """
  hp = config.algorithm.hparams
  try:
    hp.validate(**setting_of(config))
  except errors.ArgumentError as e:
    raise as_config_error(config.algorithm.name, e) from None
  return hp


def _check_algorithm_fields(config: config_lib.ExperimentConfig) -> Any:
  """The algorithm's own fields, each one of its choices (another
  algorithm's flags are refused where the config is built from flags:
  `ExperimentConfig.from_flat`); then `hparams`' checks. Returns the
  hyper-parameters."""
  options = config.algorithm.options()
  for name, f in registry.flags_of(config.algorithm.name).items():
    check_choice(name, options[name], f.choices)
  return hparams(config)


# A config.json holds a few hundred short fields: a few KiB.
MAX_CONFIG_BYTES = 1 << 20


def check_resumable(
  config: config_lib.ExperimentConfig, saved_path: str
) -> None:
  """Raises `ConfigError` if `saved_path` (a config.json) defines another
  run than `config`."""
  try:
    saved = jsonfile.load(saved_path, MAX_CONFIG_BYTES)
  except jsonfile.JsonFileError as e:
    raise errors.ConfigError(
      f'`workdir`: cannot read {errors.clip(saved_path)}: {e.reason}'
    ) from None
  diffs = config_diffs(config, saved)
  if diffs:
    raise errors.ConfigError(
      f'`workdir` holds a run of a different config ({"; ".join(diffs)}); '
      'pass another `workdir` or the same values'
    )


def config_diffs(config: config_lib.ExperimentConfig, saved: Mapping[str, Any]):
  """'`field=<saved>` there, <value> here' for each field that defines the
  run and differs between `config` and a saved config dict (a field the
  saved run predates had its default there)."""
  defaults = _identity_defaults()
  return [
    f'`{k}={errors.clip(repr(saved.get(k, defaults[k])), 80)}` there, '
    f'{v!r} here'
    for k, v in config.identity().items()
    if saved.get(k, defaults[k]) != v
  ]
