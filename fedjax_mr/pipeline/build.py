"""What a run is made of (`Experiment`) and the pieces `experiment.setup`
builds it from, out of an `ExperimentConfig`.

The dataset (`load_dataset`), the clients' partition (`make_partition`),
both as the clients' data and the test set (`load_clients`; generated for
`dataset=synthetic`), the fingerprint of the data loaded
(`data_fingerprint`: part of a run's identity), the algorithm from the
registry (`build_algorithm`, wrapped as the privacy part says:
`protected`; its accountant is `protection.accountant`) and pretrained
starting variables (`pretrained_variables`, the config's `init_from`).
Each raises `ConfigError` naming the config field at fault.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any
from typing import NamedTuple
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr import privacy
from fedjax_mr.core import errors
from fedjax_mr.core import types
from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.data import datasets
from fedjax_mr.data import partition as partition_lib
from fedjax_mr.data import synthetic
from fedjax_mr.models import model as model_lib
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import protection
from fedjax_mr.pipeline import registry
from fedjax_mr.privacy import distributed_dp
from fedjax_mr.privacy import private
from fedjax_mr.privacy import secure
from fedjax_mr.training import client
from fedjax_mr.training import engine
from fedjax_mr.training import host_round


class Experiment(NamedTuple):
  """Everything a run needs, built by `experiment.setup` (or by hand, from
  a notebook).

  Attributes:
    config: the experiment (its loop settings: rounds, evaluation,
      checkpoints, devices).
    model: the model.
    algorithm: the federated algorithm.
    data: the clients' training data: `ClientData` on the devices,
      `host_round.HostData` (in host memory, memory-mapped by `run` under
      `data_placement=memmap`), or `SyntheticData` for
      `dataset=synthetic`.
    test: the test set (`EvalData`, on the devices).
    state: the initial `RoundState` (on the devices).
    key: the run key; round r uses `fold_in(key, r)`.
    mesh: the devices the client axis is sharded over.
    client_sizes: every client's number of training examples.
    partition: the partition summary written to partition.json, or None.
    data_fingerprint: `data_fingerprint` of the data loaded (kept in
      config.json and each checkpoint; a resume on other data is
      refused), or None (not checked).
    accountant: the run's privacy accountant (`protection.accountant`), or
      None.
  """

  config: config_lib.ExperimentConfig
  model: model_lib.Model
  algorithm: types.Algorithm
  data: client_data_lib.ClientData | synthetic.SyntheticData
  test: client_data_lib.EvalData
  state: engine.RoundState
  key: jax.Array
  mesh: jax.sharding.Mesh
  client_sizes: list[int]
  partition: dict[str, Any] | None = None
  data_fingerprint: dict[str, Any] | None = None
  accountant: privacy.Accountant | None = None


class Clients(NamedTuple):
  """The clients' training data and the test set of a run (`load_clients`).

  Attributes:
    data: `ClientData` on the host's default device, or `SyntheticData`.
    x_test: `[M, ...]` test examples (host, storage dtype).
    y_test: `[M]` int32 test labels.
    num_classes: C.
    input_shape: one example's shape.
    scale: model input is `x * scale + shift`.
    shift: see `scale`.
    sizes: `[N]` every client's number of training examples (host).
    partition: the partition's summary (partition.json).
    fingerprint: `data_fingerprint` of the stored data loaded; None for
      generated clients (the config's seed defines them).
  """

  data: client_data_lib.ClientData | synthetic.SyntheticData
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int
  input_shape: tuple[int, ...]
  scale: float
  shift: float
  sizes: np.ndarray
  partition: dict[str, Any]
  fingerprint: dict[str, Any] | None = None


def data_fingerprint(dataset: datasets.Dataset) -> dict[str, Any]:
  """What identifies the data a run loaded: the sizes of the training and
  test sets and a sha256 of all their examples and labels, each with its
  dtype and shape (on Fashion-MNIST, 55 MB: 0.07 s, a tenth of loading
  it; BUILD.md "Output folders").

  Returns:
    `{'train': M, 'test': M_test, 'sha256': hex}` (JSON-able).
  """
  h = hashlib.sha256()
  for a in (dataset.x_train, dataset.y_train, dataset.x_test, dataset.y_test):
    a = np.ascontiguousarray(a)
    h.update(f'{a.dtype.str}|{a.shape}'.encode())
    h.update(a.reshape(-1).view(np.uint8))
  return {
    'train': int(len(dataset.y_train)),
    'test': int(len(dataset.y_test)),
    'sha256': h.hexdigest(),
  }


def load_clients(
  config: config_lib.ExperimentConfig,
  file_parts: Sequence[np.ndarray] | None = None,
) -> Clients:
  """The dataset and partition of `config` as the clients' data and the
  test set; for `dataset=synthetic`, `num_clients` generated clients and
  their held-out test set (`fedjax_mr.data.synthetic`). `file_parts`: the
  partition file's client lists as `checks.check` read them (None: read
  here)."""
  if config.data.dataset == datasets.SYNTHETIC:
    data = synthetic.from_seed(
      config.partition.num_clients,
      config.data.synthetic_alpha,
      config.data.synthetic_beta,
      config.run.seed,
    )
    x_test, y_test = synthetic.held_out(data, config.run.seed)
    return Clients(
      data=data,
      x_test=x_test,
      y_test=y_test,
      num_classes=synthetic.NUM_CLASSES,
      input_shape=(synthetic.NUM_FEATURES,),
      scale=1.0,
      shift=0.0,
      sizes=np.asarray(data.sizes),
      partition=synthetic.summary(
        data, config.data.synthetic_alpha, config.data.synthetic_beta
      ),
    )
  dataset = load_dataset(config)
  parts = make_partition(
    config, dataset.y_train, dataset.clients, file_parts=file_parts
  )
  data = client_data_lib.from_partition(
    dataset.x_train, dataset.y_train, parts, dataset.scale, dataset.shift
  )
  return Clients(
    data=data,
    x_test=dataset.x_test,
    y_test=dataset.y_test,
    num_classes=dataset.num_classes,
    input_shape=dataset.input_shape,
    scale=dataset.scale,
    shift=dataset.shift,
    sizes=np.array([len(p) for p in parts], np.int64),
    partition=partition_lib.summary(
      parts, dataset.y_train, dataset.num_classes
    ),
    fingerprint=data_fingerprint(dataset),
  )


def load_dataset(config: config_lib.ExperimentConfig) -> datasets.Dataset:
  """The dataset of a run, as `setup` loads it (its folder, CIFAR-100
  labels, LEAF filter, and the natural clients kept)."""
  try:
    return _load_dataset(config)
  except errors.ArgumentError as e:
    error = checks.data_error(e)
    if e.argument == 'num_clients':
      error = checks.value_error(config, e)
    if config.partition.kind == 'natural':
      error = errors.ConfigError(
        f'{error} (`partition=natural`, after `leaf_min_samples`)'
      )
    raise error from None


def _load_dataset(config: config_lib.ExperimentConfig) -> datasets.Dataset:
  dataset = datasets.load(
    config.data.dataset,
    config.data.data_dir or None,
    cifar100_labels=config.data.cifar100_labels,
    leaf_min_samples=config.data.leaf_min_samples,
  )
  if config.partition.kind == 'natural':
    dataset = datasets.natural_clients(
      dataset, config.partition.num_clients, config.run.seed
    )
  if config.data.classes:
    classes = datasets.parse_classes(config.data.classes, dataset.num_classes)
    # Training indices stay valid (other classes get label −1), so a
    # natural partition is kept and filtered by `make_partition`.
    dataset = datasets.select_classes(dataset, classes)._replace(
      clients=dataset.clients
    )
  return dataset


def make_partition(
  config: config_lib.ExperimentConfig,
  labels: np.ndarray,
  clients: Sequence[np.ndarray] | None = None,
  file_parts: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
  """Client index lists; `clients`: the dataset's own (`partition=natural`);
  `file_parts`: the partition file's as `checks.check` read them
  (`partition=file`; None: read here).

  Examples labelled −1 (not among `classes`) are in no client.

  Raises:
    ConfigError: naming the field at fault.
  """
  try:
    return _kept(config, labels, clients, file_parts)
  except errors.ArgumentError as e:
    raise checks.partition_error(e, config.flat()) from None


def _kept(
  config: config_lib.ExperimentConfig,
  labels: np.ndarray,
  clients: Sequence[np.ndarray] | None,
  file_parts: Sequence[np.ndarray] | None,
) -> list[np.ndarray]:
  """`make_partition`'s lists, of the examples of the kept classes."""
  if config.data.classes and config.partition.kind in (
    'iid',
    'dirichlet',
    'dirichlet_equal',
    'shards',
  ):
    # Partition the examples of the kept classes only.
    keep = np.flatnonzero(labels >= 0)
    return [keep[p] for p in _partition(config, labels[keep], clients)]
  parts = _partition(config, labels, clients, file_parts)
  if not config.data.classes:
    return parts
  kept = [p[labels[p] >= 0] for p in parts]
  if config.partition.kind == 'file':
    for k, (p, q) in enumerate(zip(parts, kept)):
      if len(q) < len(p):
        bad = int(p[labels[p] < 0][0])
        raise errors.ConfigError(
          f'`partition_file={config.partition.file}`: client {k} holds '
          f'example {bad}, of a class outside `classes={config.data.classes}`'
        )
  empty = [k for k, q in enumerate(kept) if not len(q)]
  if empty:
    raise errors.ConfigError(
      f'`classes={config.data.classes}`: client {empty[0]} has no examples of '
      'these classes'
    )
  return kept


def _partition(
  config: config_lib.ExperimentConfig,
  labels: np.ndarray,
  clients: Sequence[np.ndarray] | None,
  file_parts: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
  if config.partition.kind == 'natural':
    if clients is None:
      raise errors.ConfigError(
        f'`partition=natural`: `dataset={config.data.dataset}` has no natural '
        'clients'
      )
    return list(clients)
  if config.partition.kind == 'file':
    if file_parts is None:
      _, file_parts = checks.read_partition_file(config)
    partition_lib.check_range(file_parts, len(labels), config.partition.file)
    return list(file_parts)
  p = config.partition
  return partition_lib.drawn(
    p.kind,
    labels,
    p.num_clients,
    config.run.seed,
    alpha=p.alpha,
    shards_per_client=p.shards_per_client,
    min_size=p.min_client_size,
  )


def build_algorithm(
  config: config_lib.ExperimentConfig,
  model: model_lib.Model,
  variables: types.Variables,
  hparams: Any = None,
  max_examples: int | None = None,
  data: Any = None,
) -> types.Algorithm:
  """The algorithm named by `config.algorithm.name`, from the registry
  (`registry_algorithm`), wrapped as the privacy part says
  (`protected`).

  Args:
    config: the experiment (validated).
    model: the model the clients train.
    variables: the initial model variables as `model.init` returns them
      (their key order is the model's layer order, which FedMR-p's segments
      follow).
    hparams: the algorithm's hyper-parameters as `checks.validate`
      returned them; None: read from `config` (and checked).
    max_examples: the largest client's number of examples (secure
      aggregation needs it).
    data: the clients' training data (distributed DP needs its shapes).

  Raises:
    ConfigError: a hyper-parameter that does not fit the model, named by
      its config field.
  """
  algorithm = registry_algorithm(config, model, variables, hparams)
  return protected(config, algorithm, variables, max_examples, data)


def registry_algorithm(
  config: config_lib.ExperimentConfig,
  model: model_lib.Model,
  variables: types.Variables,
  hparams: Any = None,
) -> types.Algorithm:
  """The algorithm named by `config.algorithm.name`, from the registry, as
  its factory builds it (`build_algorithm`'s arguments)."""
  local = client.LocalTraining(
    model,
    checks.client_optimizer(config),
    config.local.local_epochs,
    config.local.batch_size,
  )
  entry = registry.get(config.algorithm.name)
  setting = registry.Setting(
    local=local,
    clients_per_round=config.server.clients_per_round,
    num_clients=config.partition.num_clients,
    weighted=not config_lib.uniform_weights(config),
    variables=variables,
    server_optimizer=(
      checks.server_optimizer(config) if entry.server_optimizer else None
    ),
  )
  try:
    hp = checks.hparams(config) if hparams is None else hparams
    algorithm = entry.factory(setting, hp)
  except errors.ArgumentError as e:
    raise checks.as_config_error(config.algorithm.name, e) from None
  return algorithm


def protected(
  config: config_lib.ExperimentConfig,
  algorithm: types.Algorithm,
  variables: types.Variables,
  max_examples: int | None,
  data: Any = None,
) -> types.Algorithm:
  """`algorithm` wrapped as the privacy part says: DP-FedAvg
  (`private_algorithm`), secure aggregation's encoding
  (`secure_algorithm`), or both with the noise drawn by the clients
  (`distributed_algorithm`, where noise goes with secure aggregation)."""
  protection.check_privacy(config)
  if protection.distributed(config.privacy):
    return distributed_algorithm(config, algorithm, variables, data)
  algorithm = private_algorithm(config, algorithm, variables)
  return secure_algorithm(config, algorithm, variables, max_examples)


def private_algorithm(
  config: config_lib.ExperimentConfig,
  algorithm: types.Algorithm,
  variables: types.Variables,
) -> types.Algorithm:
  """`algorithm` with DP-FedAvg (`privacy.private`) where `dp_clip` is
  set; refused in one line naming `algorithm` where it does not apply."""
  protection.check_privacy(config)
  p = config.privacy
  if p.clip == 0:
    return algorithm
  if config_lib.multi_model(config) and algorithm.contribution is None:
    raise errors.ConfigError(
      f'`algorithm={config.algorithm.name}` cannot run with `dp_clip`: it '
      "sends models made of the clients' own back to the clients, so no "
      'noise on a sum protects them: central user-level DP does not apply '
      '(nor is local DP offered)'
    )
  _check_wraps(private.check, algorithm, variables, config, 'dp_clip')
  if p.adaptive_quantile:
    return private.adaptive(
      algorithm, p.clip, p.noise_multiplier, p.adaptive_quantile, p.per_layer
    )
  return private.private(algorithm, p.clip, p.noise_multiplier, p.per_layer)


def _check_wraps(check, algorithm, variables, config, flag: str) -> None:
  """`check(algorithm, variables)`'s refusal as one line naming
  `algorithm` and `flag`."""
  try:
    check(algorithm, variables)
  except ValueError as e:
    reason = str(e).removeprefix('algorithm: ')
    raise errors.ConfigError(
      f'`algorithm={config.algorithm.name}` cannot run with `{flag}`: {reason}'
    ) from None


def secure_algorithm(
  config: config_lib.ExperimentConfig,
  algorithm: types.Algorithm,
  variables: types.Variables,
  max_examples: int | None,
) -> types.Algorithm:
  """`algorithm` with secure aggregation's encoding (`privacy.secure`)
  where `secure_aggregation` is set, each value within ±`secagg_range`
  (times the largest client's examples, weighted by examples); refused
  in one line naming `algorithm` where it does not apply."""
  p = config.privacy
  if not p.secure.enabled:
    return algorithm
  if max_examples is None:
    raise ValueError('max_examples: secure aggregation needs it')
  name = config.algorithm.name
  if config_lib.multi_model(config) and algorithm.contribution is None:
    raise errors.ConfigError(
      f'`algorithm={name}` cannot run with `secure_aggregation`: its '
      "server builds each client's next model from the clients' own "
      'models (FedMR recombines them layer by layer), so it reads every '
      'model, not their sum'
    )
  _check_wraps(secure.check, algorithm, variables, config, 'secure_aggregation')
  # A weight by examples scales every value by up to the largest client's.
  weighted = not config_lib.uniform_weights(config) and p.clip == 0
  bound = p.secure.range * (max_examples if weighted else 1)
  return secure.secure(algorithm, p.secure.bits, bound, max_examples)


def distributed_algorithm(
  config: config_lib.ExperimentConfig,
  algorithm: types.Algorithm,
  variables: types.Variables,
  data: Any,
) -> types.Algorithm:
  """`algorithm` with distributed DP over secure aggregation
  (`distributed_dp.distributed`); refused in one line naming `algorithm`
  where DP-FedAvg or secure aggregation does not apply to it."""
  _check_wraps(private.check, algorithm, variables, config, 'dp_clip')
  _check_wraps(secure.check, algorithm, variables, config, 'secure_aggregation')
  if data is None:
    raise ValueError("data: distributed DP needs the clients' data")
  cal = protection.calibration(config, algorithm, variables, data)
  return distributed_dp.distributed(algorithm, cal, config.privacy.per_layer)


def pretrained_variables(
  config: config_lib.ExperimentConfig,
  model: model_lib.Model,
  fresh: types.Variables,
) -> types.Variables:
  """The variables of `init_from` (a pool model folder) in place of the
  fresh init `fresh`; a model trained on other classes than `classes`
  keeps the fresh classifier (the last module of `params`, and its
  statistics if any).

  Raises:
    ConfigError: the folder cannot be read, or holds another model, input
      shape, dataset or number of classes (one line naming `init_from`).
  """
  from fedjax_mr.stitch import pool as pool_lib  # orbax, on demand

  where = f'`init_from={config.model.init_from}`'
  folder, model_id = os.path.split(os.path.normpath(config.model.init_from))
  try:
    pretrained = pool_lib.load_model(folder, model_id)
  except errors.UserError as e:
    raise errors.ConfigError(f'{where}: {e}') from None
  except Exception as e:  # an unreadable or mismatched orbax checkpoint
    raise errors.ConfigError(
      f'{where}: cannot restore its variables ({type(e).__name__}: '
      f'{str(e).splitlines()[0] if str(e) else ""})'
    ) from None
  _check_pretrained(config, model, fresh, pretrained, where)
  loaded = jax.tree.map(
    lambda a, b: jnp.asarray(a, b.dtype),
    dict(pretrained.variables),
    dict(fresh),
  )
  pool_classes = pretrained.meta.get('classes')
  # (`load_dataset` checked the ids against the dataset's classes.)
  run_classes = (
    list(datasets.parse_classes(config.data.classes, 2**31))
    if config.data.classes
    else None
  )
  if pool_classes != run_classes:
    head = list(fresh['params'])[-1]
    for collection in loaded:
      if head in loaded[collection]:
        loaded[collection] = {
          **loaded[collection],
          head: fresh[collection][head],
        }
  return loaded


def _check_pretrained(
  config: config_lib.ExperimentConfig,
  model: model_lib.Model,
  fresh: types.Variables,
  pretrained,
  where: str,
) -> None:
  """Refuses a pool model (`pool.load_model`'s) that is not this run's:
  another model, dataset, input shape, number of classes or variables."""
  meta = pretrained.meta
  if meta.get('model') != config.model.name:
    raise errors.ConfigError(
      f'{where}: a {meta.get("model")} model, not `model={config.model.name}`'
    )
  if meta.get('dataset', config.data.dataset) != config.data.dataset:
    raise errors.ConfigError(
      f'{where}: trained on {meta.get("dataset")}, not '
      f'`dataset={config.data.dataset}`'
    )
  if tuple(pretrained.model.input_shape) != tuple(model.input_shape) or (
    pretrained.model.num_classes != model.num_classes
  ):
    raise errors.ConfigError(
      f'{where}: takes {tuple(pretrained.model.input_shape)} and answers '
      f'{pretrained.model.num_classes} classes; this run needs '
      f'{tuple(model.input_shape)} and {model.num_classes}'
    )
  loaded = pretrained.variables
  same = jax.tree.structure(loaded) == jax.tree.structure(fresh) and all(
    a.shape == b.shape
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(fresh))
  )
  if not same:
    raise errors.ConfigError(
      f'{where}: its variables do not have the shapes of '
      f'`model={config.model.name}` under `algorithm={config.algorithm.name}`'
    )


# The share of the memory the training set may take on the devices under
# `data_placement=auto` (all CPU host devices share the machine's memory).
DEVICE_DATA_SHARE = 0.25
# Under `data_placement=auto`, a set kept on the host that takes more than
# this share of the machine's memory is memory-mapped from a file in the
# workdir (`client_data.memory_mapped`) instead of held in memory.
HOST_DATA_SHARE = 0.5


def _machine_bytes() -> int:
  """The machine's memory (0 when unknown)."""
  try:
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError, AttributeError):
    return 0


def _memory_bytes(device: jax.Device) -> int:
  """What one device can hold: an accelerator's own memory, or for the CPU
  the machine's (0 when unknown)."""
  stats = (device.memory_stats() or {}) if device.platform != 'cpu' else {}
  if 'bytes_limit' in stats:
    return int(stats['bytes_limit'])
  return _machine_bytes()


def data_bytes(data: client_data_lib.ClientData) -> int:
  """Bytes of a stored training set with its index lists."""
  return sum(int(a.nbytes) for a in (data.x, data.y, data.flat))


def data_placement(
  config: config_lib.ExperimentConfig,
  data: Any,
  mesh: jax.sharding.Mesh,
) -> str:
  """Where a run keeps its training data: 'device' (whole, on every device
  of `mesh`), 'host' (in host memory; each round sends its clients'
  examples), 'memmap' (as 'host', memory-mapped from a file in the
  workdir, which `experiment.run` writes) or 'generated' (synthetic
  clients, nothing stored). `data_placement=auto` picks 'device' while
  the set takes at most `DEVICE_DATA_SHARE` of the memory (on the CPU,
  of the machine's, times the devices that each hold a copy), else
  'memmap' where it takes more than `HOST_DATA_SHARE` of the machine's
  memory, else 'host'."""
  if not isinstance(data, client_data_lib.ClientData):
    return 'generated'
  if config.devices.data_placement != 'auto':
    return config.devices.data_placement
  device = mesh.devices.flat[0]
  copies = mesh.devices.size if device.platform == 'cpu' else 1
  memory = _memory_bytes(device)
  size = data_bytes(data)
  if not memory or size * copies <= DEVICE_DATA_SHARE * memory:
    return 'device'
  machine = _machine_bytes()
  if machine and size > HOST_DATA_SHARE * machine:
    return 'memmap'
  return 'host'


def prefetches(experiment: Experiment) -> bool:
  """Whether a run gathers the next round's examples while a round runs:
  its training data are on the host, `prefetch` is on and its sampler
  reads nothing of the round before (`host_round.draws_ahead`)."""
  return (
    experiment.config.devices.prefetch
    and isinstance(experiment.data, host_round.HostData)
    and host_round.draws_ahead(experiment.algorithm)
  )


# What a client of an algorithm that stacks its K uploads holds at least,
# in models: its trained model, the model dispatched to it, the optimizer's
# momentum and the gradient. FedMR at K = 1,000 (cnn_mnist, 265 KB a
# model) peaked at 1.35 MB a client, about 5 models.
STACKED_MODELS_PER_CLIENT = 4


def check_round_memory(
  config: config_lib.ExperimentConfig,
  algorithm: types.Algorithm,
  variables: Any,
  mesh: jax.sharding.Mesh,
) -> None:
  """Refuses a round that cannot fit before anything allocates it: an
  algorithm that stacks its K uploads (no `contribution`) holds at least
  `STACKED_MODELS_PER_CLIENT` models per client of a device (all K on
  the CPU's host devices, which share the machine's memory).

  Raises:
    ConfigError: naming `clients_per_round`, with the estimate and the
      memory.
  """
  if algorithm.contribution is not None:
    return
  device = mesh.devices.flat[0]
  memory = _memory_bytes(device)
  if not memory:
    return
  k = config.server.clients_per_round
  per_device = k if device.platform == 'cpu' else -(-k // mesh.devices.size)
  model = sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(variables))
  need = per_device * model * STACKED_MODELS_PER_CLIENT
  if need > memory:
    raise errors.ConfigError(
      f'`clients_per_round={k}`: `algorithm={config.algorithm.name}` keeps '
      'every '
      f"client's model of a round, at least {need / 2**30:,.1f} GiB "
      f'({STACKED_MODELS_PER_CLIENT} models of {model / 2**20:,.2f} MiB a '
      f'client), more than the {memory / 2**30:,.1f} GiB '
      f'{"of this machine" if device.platform == "cpu" else "of a device"}'
    )
