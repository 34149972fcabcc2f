"""The configuration of one experiment, with its validation.

Every field is also an absl flag of `experiments/run.py` (same name, the
help text below). Fields marked `run_only` may change when a run resumes
(how long to run, how often to log or save, how to execute); all the others
define the run, and resuming a workdir with different values is an error.

The algorithms' own hyper-parameters are fields too (`fedprox_mu`,
`fedmr_first_stage`, ...), generated from the algorithm registry
(`fedjax_mr.pipeline.registry`): `ExperimentConfig(algorithm='fedprox',
fedprox_mu=0.1)` and `config.fedprox_mu` work like ordinary fields; they
are held in `config.options` (every registered one, defaults filled in).

Errors name the field in backticks (`rounds`, `partition=natural`), the
library's word for it; the programs render those as their flags
(`experiments.cli.render`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any
from typing import Mapping

from fedjax_mr.core import errors
from fedjax_mr.core import jsonfile
from fedjax_mr.pipeline import registry
from fedjax_mr.training import optimizers

WEIGHTINGS = ('auto', 'examples', 'uniform')
DATA_PLACEMENTS = ('auto', 'device', 'host', 'memmap')
PARTITIONS = (
  'iid',
  'dirichlet',
  'dirichlet_equal',
  'shards',
  'file',
  'natural',
)
CIFAR100_LABELS = ('fine', 'coarse')
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


def _field(default: Any, help_text: str, *, choices=None, run_only=False):
  return dataclasses.field(
    default=default,
    metadata={'help': help_text, 'choices': choices, 'run_only': run_only},
  )


def _dataset_names():
  from fedjax_mr.data import datasets

  return datasets.NAMES


def _natural_names():
  from fedjax_mr.data import datasets

  return datasets.NATURAL


def _models_taking(kind: str) -> list[str]:
  from fedjax_mr.models import model

  return [m for m in model.NAMES if model.input_kind(m) == kind]


def _synthetic():
  from fedjax_mr.data import synthetic

  return synthetic


def _model_names():
  from fedjax_mr.models import model

  return model.NAMES


def _input_kinds(dataset: str, model_name: str) -> tuple[str, str]:
  from fedjax_mr.data import datasets
  from fedjax_mr.models import model

  return datasets.input_kind(dataset), model.input_kind(model_name)


@dataclasses.dataclass(frozen=True, init=False)
class ExperimentConfig:
  """One federated training experiment (see each field's help).

  Keyword arguments are the fields below and the registered algorithms'
  fields (see the module docstring); an unknown name is a TypeError.
  """

  algorithm: str = _field(
    'fedavg', 'Federated algorithm.', choices='algorithms'
  )
  dataset: str = _field('fashion_mnist', 'Dataset name.', choices='datasets')
  data_dir: str = _field(
    '',
    'Folder with the dataset: IDX files for (fashion_)mnist (default '
    "/usr/share/datasets/fashion-mnist for fashion_mnist); LEAF's folder "
    'holding train/ and test/ json for femnist, shakespeare; the folder '
    'holding train/, valid/, test/ for cinic10; else a tensorflow-datasets '
    'data dir.',
    run_only=True,
  )
  cifar100_labels: str = _field(
    'fine',
    'cifar100 only: fine (100 classes, as the papers) or coarse (the 20 '
    'superclasses the reference code uses).',
    choices=CIFAR100_LABELS,
  )
  leaf_min_samples: int = _field(
    0,
    'LEAF datasets (femnist, shakespeare) only: keep the users with more '
    "than this many samples (train + test); 0 keeps all. The FedMR paper's "
    'FEMNIST setting: 100.',
  )
  synthetic_alpha: float = _field(
    1.0,
    'dataset=synthetic only: alpha, how much the clients label alike '
    "inputs differently: client k's weights W_k and bias b_k have entries "
    '~ N(u_k, 1), u_k ~ N(0, alpha^2). Li et al.: 0, 0.5 or 1.',
  )
  synthetic_beta: float = _field(
    1.0,
    "dataset=synthetic only: beta, how much the clients' inputs differ: "
    "client k's inputs have mean v_k, whose entries are ~ N(B_k, 1), "
    'B_k ~ N(0, beta^2). Li et al.: 0, 0.5 or 1.',
  )
  classes: str = _field(
    '',
    'Learn these classes only, e.g. 5-9 or 0,2,4 (relabelled 0..n-1 in '
    'this order): the clients hold, and the test set has, examples of '
    'these classes alone (a transfer setting beside the classes of '
    'experiments.stitch). Empty: every class.',
  )
  model: str = _field('cnn_mnist', 'Model name.', choices='models')
  init_from: str = _field(
    '',
    'Start from a pre-trained model: <pool folder>/<model id> as '
    'experiments.pretrain_zoo writes it (meta.json + variables), of this '
    'model, input shape and number of classes. A model trained on other '
    "classes (its meta's classes differ from these classes) keeps all but "
    'its classifier, the last module, which starts from the fresh init. '
    'Empty: the fresh init.',
  )
  num_clients: int = _field(100, 'Number of clients N.')
  clients_per_round: int = _field(10, 'Clients sampled per round K.')
  partition: str = _field(
    'dirichlet',
    'How to split data among clients: iid (equal random shares); '
    'dirichlet (label skew, alpha: each class split over the clients by '
    'Dir(alpha), so client sizes vary); dirichlet_equal (equal-size '
    "clients, each client's class mix drawn from Dir(alpha), FedStitch's "
    "non-IID setting); shards (the FedAvg paper's "
    'label-sorted shards, shards_per_client); file (the index lists of '
    "partition_file); natural: the dataset's own users (femnist, "
    'shakespeare), num_clients of them chosen by the seed.',
    choices=PARTITIONS,
  )
  alpha: float = _field(
    0.1, 'Dirichlet concentration (partition=dirichlet, dirichlet_equal).'
  )
  min_client_size: int = _field(
    10, 'Minimum examples per client (partition=dirichlet).'
  )
  shards_per_client: int = _field(
    2,
    'partition=shards: shards per client s. The training set, sorted by '
    'label (stably), is cut into num_clients*s shards of consecutive '
    'examples (sizes differ by at most one; every example used), dealt at '
    'random. A shard holds one class unless a class boundary falls inside '
    'it: a client holds at most s classes when every class size is a '
    'multiple of the shard size, else at most 2s (when every class fills a '
    'shard); fewer when it draws two shards of one class. The FedAvg paper: '
    's=2.',
  )
  partition_file: str = _field(
    '',
    'partition=file: a JSON file of client index lists, [[i, ...], ...] '
    'or {"clients": [[i, ...], ...]}: exactly num_clients non-empty lists '
    "of indices into the dataset's training set (from 0), no index in two "
    'lists or twice; examples in no list are not used.',
    run_only=True,
  )
  partition_sha256: str = _field(
    '',
    'partition=file: the sha256 (hex) of partition_file. Empty: computed '
    'from the file; it is saved in config.json, so resuming with a changed '
    'file is refused. Set: the file must have it.',
  )
  rounds: int = _field(20, 'Total number of rounds.', run_only=True)
  local_epochs: int = _field(5, 'Local epochs E per round.')
  batch_size: int = _field(50, 'Local batch size B.')
  client_optimizer: str = _field(
    'sgd',
    "The clients' optimizer: sgd (with momentum) or adam (with "
    'client_beta1, client_beta2, client_epsilon); both at rate lr.',
    choices=optimizers.CLIENT_OPTIMIZERS,
  )
  lr: float = _field(0.01, "The clients' learning rate.")
  momentum: float = _field(
    0.9, 'Client SGD heavy-ball momentum (0 for plain SGD).'
  )
  client_beta1: float = _field(0.9, 'Client Adam beta1.')
  client_beta2: float = _field(0.999, 'Client Adam beta2.')
  client_epsilon: float = _field(1e-8, 'Client Adam epsilon.')
  server_optimizer: str = _field(
    'sgd',
    'The server optimizer on the pseudo-gradient (global model minus the '
    "clients' aggregate), for the algorithms that aggregate: sgd (at "
    'server_lr 1, the plain aggregate: FedAvg), momentum (FedAvgM, '
    'server_momentum), adam, yogi, adagrad (FedAdam, FedYogi, FedAdagrad '
    'of Reddi et al., with server_beta1, server_beta2, server_epsilon).',
    choices=optimizers.SERVER_OPTIMIZERS,
  )
  server_lr: float = _field(
    1.0, 'Server learning rate (SCAFFOLD: its global step eta_g).'
  )
  server_momentum: float = _field(
    0.9, 'Server momentum of the momentum server optimizer (FedAvgM).'
  )
  server_beta1: float = _field(
    0.9, 'First-moment decay of the adam, yogi and adagrad server optimizers.'
  )
  server_beta2: float = _field(
    0.99, 'Second-moment decay of the adam and yogi server optimizers.'
  )
  server_epsilon: float = _field(
    1e-3,
    'Adaptivity tau of the adam, yogi and adagrad server optimizers (added '
    'to the root of the second moment, which starts at tau^2).',
  )
  weighting: str = _field(
    'auto',
    'How the server averages the K trained models: examples (by their '
    'numbers of examples) or uniform (plain mean); auto: what the '
    "algorithm's paper does (uniform for "
    + ', '.join(
      n for n, e in registry.REGISTRY.items() if e.weighting == 'uniform'
    )
    + '; examples for the others).',
    choices=WEIGHTINGS,
  )
  eval_every: int = _field(
    1,
    'Evaluate on the test set every this many rounds (0: only at the '
    'end); always at the end.',
    run_only=True,
  )
  local_eval_every: int = _field(
    10,
    'Multi-model algorithms (fedmr, fedmr_p, indep, fedmut): also '
    'evaluate the K models the next round dispatches (mean and std of '
    'their test accuracy) every this many rounds (0: only at the end); '
    'costs K evaluations.',
    run_only=True,
  )
  eval_batch_size: int = _field(
    500,
    'Batch size for evaluation (on CPU 500 evaluates cnn_mnist 1.4x faster '
    'than 1000, whose activations leave the cache).',
    run_only=True,
  )
  seed: int = _field(0, 'Seed of the partition, the init and every round.')
  workdir: str = _field(
    '',
    'Output folder (metrics, checkpoints, plots); a run there resumes. '
    'Default: runs/<algorithm>-<dataset>-<model>-<partition>-s<seed> '
    '(<partition>: e.g. dirichlet0.1, shards2, file-<sha256[:8]>; for '
    'dataset=synthetic alpha<a>_beta<b>).',
    run_only=True,
  )
  checkpoint_every: int = _field(
    5,
    'Save a checkpoint every this many rounds (0: only at the end).',
    run_only=True,
  )
  keep_checkpoints: int = _field(
    2, 'How many checkpoints to keep.', run_only=True
  )
  tensorboard: bool = _field(
    True,
    'Also write the metrics rows as TensorBoard event files to '
    '<workdir>/tensorboard (for TensorBoard, whose logdir is <workdir>).',
    run_only=True,
  )
  energy_mix: str = _field(
    '',
    'Simulated client devices, profile[@speed]:weight,... (several mixes '
    "separated by ';'; empty: none). At the end, each mix is simulated on "
    "the run's sampled clients and their local work with the energy "
    'coordinator vs the highest frequency; figures go to energy.json. '
    'Profiles: tx2_literal, tx2_chained or a JSON profile file.',
    run_only=True,
  )
  energy_ms_per_sample: float = _field(
    2.0,
    "Energy simulation: local training time per example at a profile's "
    'first configuration, in ms (scales the reported times, not the '
    'saving).',
    run_only=True,
  )
  client_chunk: int = _field(
    0,
    'Clients trained together on each device: 1 = one after another '
    '(fastest on CPU), K/devices = all vmapped (for accelerators), in '
    'between = vmapped chunks; 0 = 1 on CPU (8 for models of at most '
    '1,000 parameters), all on GPU/TPU up to 1,000 a device.',
    run_only=True,
  )
  data_placement: str = _field(
    'auto',
    'Where the training set lives: device = whole on every device; host = '
    "in host memory, each round sending the devices only its clients' "
    'examples; memmap = as host, memory-mapped from an unnamed file in the '
    'workdir (written when the run starts, gone when it ends), so it need '
    'not stay in memory; auto = device while the set (times the devices) '
    'takes at most a quarter of the memory, else memmap where it takes '
    "more than half the machine's memory, else host. Results are the same. "
    'Generated clients (synthetic) have no stored set.',
    choices=DATA_PLACEMENTS,
    run_only=True,
  )
  prefetch: bool = _field(
    True,
    "With the training set on the host: gather the next round's examples "
    'and start sending them to the devices while a round trains, when the '
    "algorithm's sampler does not depend on the round's result (the "
    "uniform one; CluSamp's and the fine-tuning baselines' own samplers "
    'are drawn after it). Results are the same.',
    run_only=True,
  )
  num_devices: int = _field(
    0,
    'Devices the client axis is sharded over (0: all; at most K). '
    'Clients are balanced by local steps.',
    run_only=True,
  )
  host_devices: int = _field(
    0,
    'CPU only: XLA host devices per process (0: num_devices if set, '
    'else one per core, at most K). One CPU device keeps ~1.3 cores busy.',
    run_only=True,
  )
  coordinator_address: str = _field(
    '',
    'Multi-process runs: host:port of process 0 (jax.distributed).',
    run_only=True,
  )
  num_processes: int = _field(
    1, 'Multi-process runs: number of processes.', run_only=True
  )
  process_id: int = _field(
    0, 'Multi-process runs: index of this process.', run_only=True
  )
  coordinator_timeout: float = _field(
    300.0,
    'Multi-process runs: seconds to wait for every process to join (then '
    'give up, exit code 2).',
    run_only=True,
  )
  options: Mapping[str, Any] = dataclasses.field(
    default_factory=dict,
    metadata={'help': '', 'choices': None, 'run_only': False, 'flag': False},
  )

  def __init__(self, **kwargs: Any):
    flags = registry.all_flags()
    options = {flag: f.default for flag, (f, _) in flags.items()}
    options.update(kwargs.pop('options', None) or {})
    for f in base_fields():
      value = kwargs.pop(f.name, f.default)
      object.__setattr__(self, f.name, value)
    for name, value in kwargs.items():
      if name not in flags:
        raise TypeError(
          f'ExperimentConfig got an unexpected keyword argument {name!r}'
        )
      options[name] = value
    unknown = set(options) - set(flags)
    if unknown:
      raise TypeError(f'ExperimentConfig: unknown options {sorted(unknown)}')
    object.__setattr__(self, 'options', options)
    if self.partition == 'file' and self.partition_file:
      if not self.partition_sha256:
        # What the file holds defines the run, not its path.
        object.__setattr__(
          self, 'partition_sha256', _sha256_or_empty(self.partition_file)
        )

  def __getattr__(self, name: str) -> Any:
    # Only for names that are not fields: the algorithms' own.
    options = self.__dict__.get('options')
    if options is not None and name in options:
      return options[name]
    raise AttributeError(f'ExperimentConfig has no attribute {name!r}')

  def __hash__(self) -> int:
    return hash(json.dumps(self.to_dict(), sort_keys=True))

  def default_workdir(self) -> str:
    part = self.partition
    if self.dataset == 'synthetic':
      part = f'alpha{self.synthetic_alpha:g}_beta{self.synthetic_beta:g}'
    elif part in ('dirichlet', 'dirichlet_equal'):
      part += f'{self.alpha:g}'
    elif part == 'shards':
      part += f'{self.shards_per_client}'
    elif part == 'file' and self.partition_sha256:
      part += f'-{self.partition_sha256[:8]}'
    return (
      f'runs/{self.algorithm}-{self.dataset}-{self.model}-{part}-s{self.seed}'
    )

  def to_dict(self) -> dict[str, Any]:
    """Every field, the algorithms' too, flat (what config.json holds)."""
    out = {f.name: getattr(self, f.name) for f in base_fields()}
    out.update(self.options)
    return out

  def identity(self) -> dict[str, Any]:
    """What defines the run: all but the `run_only` fields."""
    out = {
      f.name: getattr(self, f.name)
      for f in base_fields()
      if not f.metadata['run_only']
    }
    out.update(self.options)
    return out


def _sha256_or_empty(path: str) -> str:
  """The file's sha256, or '' if it cannot be read (`validate` says why)."""
  from fedjax_mr.data import partition

  try:
    return partition.file_sha256(path)
  except OSError:
    return ''


def base_fields() -> tuple[dataclasses.Field, ...]:
  """The fields of `ExperimentConfig` itself (all but `options`, which
  holds the algorithms' fields)."""
  return tuple(
    f
    for f in dataclasses.fields(ExperimentConfig)
    if f.metadata.get('flag', True)
  )


def choices(field: dataclasses.Field) -> tuple[str, ...] | None:
  c = field.metadata.get('choices')
  if c == 'algorithms':
    return registry.names()
  if c == 'datasets':
    return _dataset_names()
  if c == 'models':
    return _model_names()
  return c


def energy_mixes(config: ExperimentConfig) -> list[str]:
  """The device mixes of `energy_mix` (';'-separated), in order."""
  return [m.strip() for m in config.energy_mix.split(';') if m.strip()]


def validate(config: ExperimentConfig) -> Any:
  """Checks every field of `config` once.

  Returns:
    The algorithm's hyper-parameters, validated (what `hparams` returns),
    so that a caller builds the run from them without checking again.

  Raises:
    ConfigError: naming the first bad field (in backticks) and what it
      allows.
  """
  _check_values(config)
  _check_run(config)
  client_optimizer(config)
  _check_optimizer_fields(config)
  server_optimizer(config)
  _check_data(config)
  return _check_algorithm_fields(config)


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


def _check_values(config: ExperimentConfig) -> None:
  """Choices, and sizes and rates in their ranges."""
  for f in base_fields():
    _check_choice(f.name, getattr(config, f.name), choices(f))
  for name in _POSITIVE:
    if getattr(config, name) < 1:
      raise errors.ConfigError(
        f'`{name}` must be a positive integer, got {getattr(config, name)}'
      )
  for name in _NON_NEGATIVE:
    if getattr(config, name) < 0:
      raise errors.ConfigError(
        f'`{name}` must be ≥ 0, got {getattr(config, name)}'
      )
  for name, (bound, what) in _AT_MOST.items():
    if getattr(config, name) > bound:
      raise errors.ConfigError(
        f'`{name}` must be at most {bound:,} ({what}), got '
        f'{getattr(config, name):,}'
      )
  check_seed('seed', config.seed)
  if not (
    config.energy_ms_per_sample > 0
    and math.isfinite(config.energy_ms_per_sample)
  ):
    raise errors.ConfigError(
      '`energy_ms_per_sample` must be finite and > 0, got '
      f'{config.energy_ms_per_sample}'
    )


def _check_choice(name: str, value: Any, allowed: Any) -> None:
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


def _check_run(config: ExperimentConfig) -> None:
  """The energy mixes, K against N, the processes."""
  for mix in energy_mixes(config):
    from fedjax_mr.energy import simulation  # host-only, no jax

    try:
      simulation.assign_profiles(mix, config.num_clients, config.seed)
    except (ValueError, OSError) as e:
      raise errors.ConfigError(f'`energy_mix`: {mix!r}: {e}') from None
  if config.clients_per_round > config.num_clients:
    raise errors.ConfigError(
      f'`clients_per_round={config.clients_per_round}` exceeds '
      f'`num_clients={config.num_clients}`; it must be between 1 and '
      'num_clients'
    )
  if not 0 <= config.process_id < config.num_processes:
    raise errors.ConfigError(
      f'`process_id` must be in [0, `num_processes={config.num_processes}`),'
      f' got {config.process_id}'
    )
  timeout = config.coordinator_timeout
  if not (0 < timeout <= 86_400):  # nan too
    raise errors.ConfigError(
      f'`coordinator_timeout` must be in (0, 86400] seconds, got {timeout}'
    )
  if config.num_processes > 1:
    host, sep, port = config.coordinator_address.rpartition(':')
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
      raise errors.ConfigError(
        '`coordinator_address` must be host:port (e.g. 10.0.0.1:1234) with '
        f'`num_processes={config.num_processes}`, got '
        f'{config.coordinator_address!r}'
      )


def _check_data(config: ExperimentConfig) -> None:
  """The partition and its fields, the model against the dataset."""
  _check_owned(config, 'dataset', DATASET_FIELDS)
  if config.dataset == _synthetic().NAME:
    _check_synthetic(config)
  if config.partition in PARTITION_FIELDS['alpha'] and not (
    config.alpha > 0 and math.isfinite(config.alpha)
  ):
    raise errors.ConfigError(
      f'`alpha` must be finite and > 0 for `partition={config.partition}` '
      f'(IID is `partition=iid`), got {config.alpha}'
    )
  _check_owned(config, 'partition', PARTITION_FIELDS)
  if config.init_from and not os.path.isfile(
    os.path.join(config.init_from, 'meta.json')
  ):
    raise errors.ConfigError(
      f'`init_from={config.init_from}`: no meta.json there (want a model '
      'folder as experiments.pretrain_zoo writes it: <pool>/<model id>)'
    )
  _check_partition_file(config)
  gives, takes = _input_kinds(config.dataset, config.model)
  if gives != takes:
    fits = _models_taking(gives)
    raise errors.ConfigError(
      f'`model={config.model}` takes {takes}; `dataset={config.dataset}` '
      f'gives {gives} (models that take {gives}: {", ".join(fits)})'
    )
  _check_dataset_fields(config)


def _check_dataset_fields(config: ExperimentConfig) -> None:
  """The fields that only some datasets read."""
  natural = _natural_names()
  if config.partition == 'natural' and config.dataset not in natural:
    raise errors.ConfigError(
      f'`partition=natural` needs a dataset with its own clients '
      f'({", ".join(natural)}); `dataset={config.dataset}` has none: use '
      '`partition=iid` or dirichlet'
    )
  if config.leaf_min_samples and config.dataset not in natural:
    raise errors.ConfigError(
      f'`leaf_min_samples` applies to LEAF datasets ({", ".join(natural)}) '
      f'only, not `dataset={config.dataset}`'
    )
  if config.cifar100_labels != 'fine' and config.dataset != 'cifar100':
    raise errors.ConfigError(
      f'`cifar100_labels={config.cifar100_labels}` applies to '
      f'`dataset=cifar100` only, not `dataset={config.dataset}`'
    )


def _check_synthetic(config: ExperimentConfig) -> None:
  """`dataset=synthetic`: its rates, and none of the fields that only
  stored data reads (its clients are generated, `num_clients` of them)."""
  synthetic = _synthetic()
  for name in ('synthetic_alpha', 'synthetic_beta'):
    value = getattr(config, name)
    if not (math.isfinite(value) and value >= 0):
      raise errors.ConfigError(f'`{name}` must be finite and ≥ 0, got {value}')
  limit = (2**31 - 1) // synthetic.MAX_SIZE
  if config.num_clients > limit:
    raise errors.ConfigError(
      f'`num_clients={config.num_clients}`: at most {limit} synthetic '
      'clients (their example counts must fit int32)'
    )
  where = 'does not apply to `dataset=synthetic`, whose clients are generated'
  defaults = {f.name: f.default for f in base_fields()}
  if config.partition != defaults['partition']:
    raise errors.ConfigError(
      f'`partition={config.partition}` {where} (leave `partition` at its '
      'default)'
    )
  for name in (*PARTITION_FIELDS, 'classes'):
    if getattr(config, name) != defaults[name]:
      raise errors.ConfigError(f'`{name}={getattr(config, name)}` {where}')
  if config.algorithm in STORED_DATA_ALGORITHMS:
    raise errors.ConfigError(
      f"`algorithm={config.algorithm}` reads the clients' stored examples; "
      '`dataset=synthetic` generates them on demand'
    )


def _check_partition_file(config: ExperimentConfig) -> None:
  """`partition_file` with `partition=file`: given, and readable as
  `num_clients` index lists (of the given sha256, if any)."""
  if config.partition != 'file':
    return
  if not config.partition_file:
    raise errors.ConfigError(
      '`partition=file` needs `partition_file=<a JSON file of client '
      'index lists>`'
    )
  from fedjax_mr.data import partition  # host-only, no jax

  # Everything but the index range (the dataset is not loaded yet).
  partition.load_file(
    config.partition_file,
    config.num_clients,
    sha256=config.partition_sha256,
  )


def _check_owned(
  config: ExperimentConfig,
  owner: str,
  owned: Mapping[str, tuple[str, ...]],
  defaults: Mapping[str, Any] | None = None,
) -> None:
  """Refuses a field of `owned` ({field: the values of `owner` that read
  it}) set away from its default (`defaults`, else the field's own) while
  the field `owner` is none of the values that read it."""
  if defaults is None:
    defaults = {f.name: f.default for f in base_fields()}
  value = getattr(config, owner)
  for name, owners in owned.items():
    if value not in owners and getattr(config, name) != defaults[name]:
      raise errors.ConfigError(
        f'`{name}={getattr(config, name)}` applies to `{owner}='
        f'{" or ".join(owners)}` only, not `{owner}={value}`'
      )


def _check_optimizer_fields(config: ExperimentConfig) -> None:
  """The fields of the optimizers that `client_optimizer` and
  `server_optimizer` do not choose, and the server's fields of an
  algorithm that takes no server optimizer."""
  _check_owned(config, 'client_optimizer', CLIENT_OPTIMIZER_FIELDS)
  _check_owned(config, 'server_optimizer', SERVER_OPTIMIZER_FIELDS)
  if registry.get(config.algorithm).server_optimizer:
    return
  defaults = {f.name: f.default for f in base_fields()}
  for name in ('server_optimizer', 'server_lr', *SERVER_OPTIMIZER_FIELDS):
    if getattr(config, name) != defaults[name]:
      takers = [n for n, e in registry.REGISTRY.items() if e.server_optimizer]
      raise errors.ConfigError(
        f'`{name}={getattr(config, name)}` applies to the algorithms that '
        f'step toward an aggregate ({", ".join(takers)}) only, not '
        f'`algorithm={config.algorithm}`'
      )


def _field_error(field: str, error: errors.ArgumentError) -> errors.ConfigError:
  """`error` naming `field`, the field that holds its argument."""
  return errors.ConfigError(f'`{field}` {error.message}')


def client_optimizer(config: ExperimentConfig) -> optimizers.Optimizer:
  """The clients' optimizer (`client_optimizer` at rate `lr`).

  Raises:
    ConfigError: a bad value, named by its field.
  """
  try:
    if config.client_optimizer == 'adam':
      return optimizers.adam(
        config.lr,
        config.client_beta1,
        config.client_beta2,
        config.client_epsilon,
      )
    return optimizers.sgd(config.lr, config.momentum)
  except errors.ArgumentError as e:
    raise _field_error(
      _CLIENT_ARGUMENTS.get(e.argument, e.argument), e
    ) from None


def server_optimizer(config: ExperimentConfig) -> optimizers.Optimizer:
  """The server optimizer (`server_optimizer` at rate `server_lr`).

  Raises:
    ConfigError: a bad value, named by its field.
  """
  try:
    return optimizers.server_optimizer(
      config.server_optimizer,
      config.server_lr,
      momentum=config.server_momentum,
      b1=config.server_beta1,
      b2=config.server_beta2,
      tau=config.server_epsilon,
    )
  except errors.ArgumentError as e:
    raise _field_error(
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
    if f.name == argument:
      return name
  return _SETTING_FIELDS.get(argument, argument)


def as_config_error(
  algorithm: str, error: errors.ArgumentError
) -> errors.ConfigError:
  """An algorithm's `ArgumentError` as a one-line error naming the field
  (in backticks)."""
  return _field_error(field_of(algorithm, error.argument), error)


def setting_of(config: ExperimentConfig) -> dict[str, Any]:
  """The values the algorithms' checks may read beside their own."""
  return {
    'clients_per_round': config.clients_per_round,
    'num_clients': config.num_clients,
    'weighted': not uniform_weights(config),
  }


def hparams(config: ExperimentConfig) -> Any:
  """The hyper-parameters of `config.algorithm`, validated.

  Raises:
    ConfigError: a bad value, named by its field.
  """
  hp = registry.hparams(config.algorithm, config.options)
  try:
    hp.validate(**setting_of(config))
  except errors.ArgumentError as e:
    raise as_config_error(config.algorithm, e) from None
  return hp


def _check_algorithm_fields(config: ExperimentConfig) -> Any:
  """The algorithms' own fields: each one of its choices and, away from
  its default, read by `algorithm`; then `hparams`' checks. Returns the
  hyper-parameters."""
  fields = registry.all_flags()
  defaults = {name: f.default for name, (f, _) in fields.items()}
  for name, (f, users) in fields.items():
    _check_choice(name, config.options[name], f.metadata.get('choices'))
    _check_owned(config, 'algorithm', {name: users}, defaults)
  return hparams(config)


def multi_model(config: ExperimentConfig) -> bool:
  """Whether the algorithm keeps K different models (evaluated too)."""
  return registry.get(config.algorithm).multi_model


def uniform_weights(config: ExperimentConfig) -> bool:
  """Whether the server takes the plain mean of the K trained models."""
  if config.weighting == 'auto':
    return registry.get(config.algorithm).weighting == 'uniform'
  return config.weighting == 'uniform'


# A config.json holds a few hundred short fields: a few KiB.
MAX_CONFIG_BYTES = 1 << 20


def check_resumable(config: ExperimentConfig, saved_path: str) -> None:
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


def config_diffs(config: ExperimentConfig, saved: Mapping[str, Any]):
  """'`field=<saved>` there, <value> here' for each field that defines the
  run and differs between `config` and a saved config dict (a field the
  saved run predates had its default there)."""
  defaults = ExperimentConfig().identity()
  return [
    f'`{k}={errors.clip(repr(saved.get(k, defaults[k])), 80)}` there, '
    f'{v!r} here'
    for k, v in config.identity().items()
    if saved.get(k, defaults[k]) != v
  ]
