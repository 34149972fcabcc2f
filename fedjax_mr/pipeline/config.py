"""The configuration of one experiment: a tree of frozen parts, one per
concern.

`ExperimentConfig` holds eleven parts: `data`, `partition`, `model`,
`local` (how a client trains), `server` (K, weights, server optimizer),
`algorithm` (the name and the algorithm's own `Hparams`), `privacy`
(defined in `protection`, with its secure-aggregation part), `run`,
`evaluation`, `energy` and `devices` (with its `processes`). A consumer
takes the part it reads. The parts every program shares are defined here
once: `Data`, `Partition` and `Run` (extended for training by
`TrainingData`, `TrainingPartition`, `TrainingRun`; FedStitch's config
composes them, `stitch_config`) and `Devices` (whose fields the
benchmark's flat `Setting` takes, `config_tree.shared`).

Every field is an absl flag of `experiments/run.py` under the flat name
its metadata gives (`flag`, else its own: `lr`; `partition` for
`Partition.kind`, `server_lr` for `Server.lr`); the flags, config.json and
`experiments.compare`'s variants use those names:
`ExperimentConfig.from_flat(algorithm='fedprox', fedprox_mu=0.1)`,
`config.flat()`, `config.replace(rounds=5)`. The algorithms' flags come
from the registry. Fields marked `run_only` may change when a run resumes,
and so may the flags of a privacy feature that is off
(`protection.inactive_flags`); the others define the run. Nothing here
reads a file: `checks.check` fills `partition_sha256` where a run starts
(`with_file_digest` alone, for a config that is not checked yet). The
checks are in `fedjax_mr.pipeline.checks`; their errors name flags in
backticks, which the programs render as their flags
(`experiments.cli.render`).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Mapping

from fedjax_mr.core import config_tree
from fedjax_mr.core import errors
from fedjax_mr.pipeline import protection
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


_field = config_tree.field


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


@dataclasses.dataclass(frozen=True)
class Data:
  """The dataset: which one, where it is read from, which of its classes.
  Shared: every program's config composes it (`TrainingData` adds what
  training reads of some datasets)."""

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
  classes: str = _field(
    '',
    'These classes only, e.g. 5-9 or 0,2,4 (relabelled 0..n-1 in this '
    'order): the clients hold, and the test set has, examples of these '
    'classes alone. With a FedStitch pool trained on other classes '
    '(pretrain_zoo classes), a transfer setting, evaluated by eval=knn. '
    'Empty: every class.',
  )


@dataclasses.dataclass(frozen=True)
class TrainingData(Data):
  """`Data`, and what the training programs read of some datasets."""

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


@dataclasses.dataclass(frozen=True)
class Partition:
  """How the training set is split among the clients. Shared: every
  program's config composes it (`TrainingPartition` adds the partitions
  of a file; FedStitch's allows fewer and another alpha, saying why)."""

  kind: str = _field(
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
    flag='partition',
  )
  num_clients: int = _field(100, 'Number of clients N.')
  alpha: float = _field(
    0.1, 'Dirichlet concentration (partition=dirichlet, dirichlet_equal).'
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


@dataclasses.dataclass(frozen=True)
class TrainingPartition(Partition):
  """`Partition`, and what the training programs add: a smallest client
  and the partition of a file."""

  min_client_size: int = _field(
    10, 'Minimum examples per client (partition=dirichlet).'
  )
  file: str = _field(
    '',
    'partition=file: a JSON file of client index lists, [[i, ...], ...] '
    'or {"clients": [[i, ...], ...]}: exactly num_clients non-empty lists '
    "of indices into the dataset's training set (from 0), no index in two "
    'lists or twice; examples in no list are not used.',
    run_only=True,
    flag='partition_file',
  )
  sha256: str = _field(
    '',
    'partition=file: the sha256 (hex) of partition_file. Empty: computed '
    'from the file; it is saved in config.json, so resuming with a changed '
    'file is refused. Set: the file must have it.',
    flag='partition_sha256',
  )


@dataclasses.dataclass(frozen=True)
class ModelChoice:
  """The network the clients train, and where it starts."""

  name: str = _field('cnn_mnist', 'Model name.', choices='models', flag='model')
  init_from: str = _field(
    '',
    'Start from a pre-trained model: <pool folder>/<model id> as '
    'experiments.pretrain_zoo writes it (meta.json + variables), of this '
    'model, input shape and number of classes. A model trained on other '
    "classes (its meta's classes differ from these classes) keeps all but "
    'its classifier, the last module, which starts from the fresh init. '
    'Empty: the fresh init.',
  )


@dataclasses.dataclass(frozen=True)
class Local:
  """How a client trains: epochs, batches, its optimizer."""

  local_epochs: int = _field(5, 'Local epochs E per round.')
  batch_size: int = _field(50, 'Local batch size B.')
  optimizer: str = _field(
    'sgd',
    "The clients' optimizer: sgd (with momentum) or adam (with "
    'client_beta1, client_beta2, client_epsilon); both at rate lr.',
    choices=optimizers.CLIENT_OPTIMIZERS,
    flag='client_optimizer',
  )
  lr: float = _field(0.01, "The clients' learning rate.")
  momentum: float = _field(
    0.9, 'Client SGD heavy-ball momentum (0 for plain SGD).'
  )
  beta1: float = _field(0.9, 'Client Adam beta1.', flag='client_beta1')
  beta2: float = _field(0.999, 'Client Adam beta2.', flag='client_beta2')
  epsilon: float = _field(1e-8, 'Client Adam epsilon.', flag='client_epsilon')


@dataclasses.dataclass(frozen=True)
class Server:
  """What the server samples and how it steps: K, the weights of the
  average, the server optimizer."""

  clients_per_round: int = _field(10, 'Clients sampled per round K.')
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
  optimizer: str = _field(
    'sgd',
    'The server optimizer on the pseudo-gradient (global model minus the '
    "clients' aggregate), for the algorithms that aggregate: sgd (at "
    'server_lr 1, the plain aggregate: FedAvg), momentum (FedAvgM, '
    'server_momentum), adam, yogi, adagrad (FedAdam, FedYogi, FedAdagrad '
    'of Reddi et al., with server_beta1, server_beta2, server_epsilon).',
    choices=optimizers.SERVER_OPTIMIZERS,
    flag='server_optimizer',
  )
  lr: float = _field(
    1.0,
    'Server learning rate (SCAFFOLD: its global step eta_g).',
    flag='server_lr',
  )
  momentum: float = _field(
    0.9,
    'Server momentum of the momentum server optimizer (FedAvgM).',
    flag='server_momentum',
  )
  beta1: float = _field(
    0.9,
    'First-moment decay of the adam, yogi and adagrad server optimizers.',
    flag='server_beta1',
  )
  beta2: float = _field(
    0.99,
    'Second-moment decay of the adam and yogi server optimizers.',
    flag='server_beta2',
  )
  epsilon: float = _field(
    1e-3,
    'Adaptivity tau of the adam, yogi and adagrad server optimizers (added '
    'to the root of the second moment, which starts at tau^2).',
    flag='server_epsilon',
  )


@dataclasses.dataclass(frozen=True)
class Run:
  """The run's seed, its folder and what it keeps there. Shared: every
  program that writes a workdir composes it (`TrainingRun` adds how long
  a training run is and how often it checkpoints)."""

  seed: int = _field(0, 'Seed of the partition, the init and every round.')
  workdir: str = _field(
    '',
    'Output folder (records, checkpoints, plots); a run there resumes. '
    'Empty, for experiments.run: '
    'runs/<algorithm>-<dataset>-<model>-<partition>-s<seed> '
    '(<partition>: e.g. dirichlet0.1, shards2, file-<sha256[:8]>; for '
    'dataset=synthetic alpha<a>_beta<b>).',
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


@dataclasses.dataclass(frozen=True)
class TrainingRun(Run):
  """`Run`, and how long a training run is and how often it
  checkpoints."""

  rounds: int = _field(20, 'Total number of rounds.', run_only=True)
  checkpoint_every: int = _field(
    5,
    'Save a checkpoint every this many rounds (0: only at the end).',
    run_only=True,
  )


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """When and in what batches the run evaluates."""

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


@dataclasses.dataclass(frozen=True)
class Energy:
  """The simulated client devices of energy.json."""

  mix: str = _field(
    '',
    'Simulated client devices, profile[@speed]:weight,... (several mixes '
    "separated by ';'; empty: none). At the end, each mix is simulated on "
    "the run's sampled clients and their local work with the energy "
    'coordinator vs the highest frequency; figures go to energy.json. '
    'Profiles: tx2_literal, tx2_chained or a JSON profile file.',
    run_only=True,
    flag='energy_mix',
  )
  ms_per_sample: float = _field(
    2.0,
    "Energy simulation: local training time per example at a profile's "
    'first configuration, in ms (scales the reported times, not the '
    'saving).',
    run_only=True,
    flag='energy_ms_per_sample',
  )


@dataclasses.dataclass(frozen=True)
class Processes:
  """A run over several processes (jax.distributed)."""

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


@dataclasses.dataclass(frozen=True)
class Devices:
  """Where and how the clients train: devices, chunks, data placement
  (results do not depend on them)."""

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
  processes: Processes = dataclasses.field(
    default_factory=Processes, metadata={'part': True}
  )


@dataclasses.dataclass(frozen=True)
class AlgorithmChoice:
  """The federated algorithm and its own hyper-parameters.

  Attributes:
    name: a registry name (flag `algorithm`).
    hparams: an instance of the entry's `hparams` dataclass (None: its
      defaults); its fields are the flags `<prefix>_<field>`.
  """

  name: str = _field(
    'fedavg', 'Federated algorithm.', choices='algorithms', flag='algorithm'
  )
  hparams: Any = dataclasses.field(default=None, metadata={'part': True})

  def __post_init__(self):
    if self.name not in registry.REGISTRY:
      raise errors.ConfigError(
        f'`algorithm`: unknown value {self.name!r}; choose one of '
        f'{", ".join(registry.names())}'
      )
    kind = registry.get(self.name).hparams
    if self.hparams is None:
      object.__setattr__(self, 'hparams', kind())
    elif not isinstance(self.hparams, kind):
      raise TypeError(
        f'AlgorithmChoice: hparams of {self.name!r} must be a '
        f'{kind.__qualname__}, got {type(self.hparams).__qualname__}'
      )

  def options(self) -> dict[str, Any]:
    """{flag: value} of the hyper-parameters."""
    return {
      flag: getattr(self.hparams, f.field.name)
      for flag, f in registry.flags_of(self.name).items()
    }


_part = config_tree.part


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """One federated training experiment: a part per concern (see the module
  docstring and each field's help)."""

  data: TrainingData = _part(TrainingData)
  partition: TrainingPartition = _part(TrainingPartition)
  model: ModelChoice = _part(ModelChoice)
  local: Local = _part(Local)
  server: Server = _part(Server)
  algorithm: AlgorithmChoice = _part(AlgorithmChoice)
  privacy: protection.Privacy = _part(protection.Privacy)
  run: TrainingRun = _part(TrainingRun)
  evaluation: Evaluation = _part(Evaluation)
  energy: Energy = _part(Energy)
  devices: Devices = _part(Devices)

  @classmethod
  def from_flat(cls, **values: Any) -> ExperimentConfig:
    """The config of flat flag values (missing ones take their defaults):
    the fields' flags and the algorithms' (`fedprox_mu`, ...).

    Raises:
      TypeError: a name that is no flag.
      ConfigError: an unknown `algorithm`, or another algorithm's flag set
        away from its default.
    """
    return _build(cls(), values)

  def flat(self) -> dict[str, Any]:
    """Every field by its flag, the algorithm's own too (config.json)."""
    out = {f.name: _get(self, f.path) for f in base_fields()}
    out.update(self.algorithm.options())
    return out

  to_dict = flat

  def replace(self, **values: Any) -> ExperimentConfig:
    """This config with the flags `values` changed (a changed `algorithm`
    starts from its defaults, as from the command line)."""
    flat = self.flat()
    if values.get('algorithm', self.algorithm.name) != self.algorithm.name:
      flat = {k: v for k, v in flat.items() if k in _FLAGS}
    return _build(ExperimentConfig(), {**flat, **values})

  def identity(self) -> dict[str, Any]:
    """What defines the run: all but the `run_only` fields and the flags
    of a privacy feature that is off (`protection.inactive_flags`), by
    flag."""
    inactive = set(protection.inactive_flags(self.privacy))
    out = {
      f.name: _get(self, f.path)
      for f in base_fields()
      if not f.metadata['run_only'] and f.name not in inactive
    }
    out.update(self.algorithm.options())
    return out

  def default_workdir(self) -> str:
    d, p = self.data, self.partition
    part = p.kind
    if d.dataset == 'synthetic':
      part = f'alpha{d.synthetic_alpha:g}_beta{d.synthetic_beta:g}'
    elif part in ('dirichlet', 'dirichlet_equal'):
      part += f'{p.alpha:g}'
    elif part == 'shards':
      part += f'{p.shards_per_client}'
    elif part == 'file' and p.sha256:
      part += f'-{p.sha256[:8]}'
    return (
      f'runs/{self.algorithm.name}-{d.dataset}-{self.model.name}-{part}'
      f'-s{self.run.seed}'
    )


FlagField = config_tree.FlagField
_FIELDS = config_tree.fields(ExperimentConfig)
_FLAGS = {f.name: f for f in _FIELDS}


def base_fields() -> tuple[FlagField, ...]:
  """Every field of the tree but the algorithms' own, by flag, part by
  part."""
  return _FIELDS


def path_of(flag: str) -> tuple[str, ...]:
  """The attributes that reach the field of `flag` ('lr' -> ('local',
  'lr'))."""
  return _FLAGS[flag].path


_get = config_tree.get


def _build(base: ExperimentConfig, values: Mapping[str, Any]):
  algorithm_flags = registry.all_flags()
  config_tree.check_names(ExperimentConfig, values, [*_FLAGS, *algorithm_flags])
  name = values.get('algorithm', base.algorithm.name)
  choice = AlgorithmChoice(name=name)  # checks the name
  for flag, (f, users) in algorithm_flags.items():
    value = values.get(flag, f.default)
    if name not in users and value != f.default:
      raise errors.ConfigError(
        f'`{flag}={value}` applies to `algorithm={" or ".join(users)}` '
        f'only, not `algorithm={name}`'
      )
  choice = AlgorithmChoice(name, registry.hparams(name, values))
  ours = {k: v for k, v in values.items() if k in _FLAGS and k != 'algorithm'}
  config = config_tree.replaced(base, _FLAGS, ours)
  return dataclasses.replace(config, algorithm=choice)


def with_file_digest(config: ExperimentConfig) -> ExperimentConfig:
  """`config` with `partition_sha256` read from `partition_file` when it is
  empty (`partition=file`): what the file holds defines the run, not its
  path. An unreadable file leaves it empty (`checks.validate` says why)."""
  p = config.partition
  if p.kind != 'file' or not p.file or p.sha256:
    return config
  from fedjax_mr.data import partition

  try:
    digest = partition.file_sha256(p.file)
  except OSError:
    return config
  return dataclasses.replace(
    config, partition=dataclasses.replace(p, sha256=digest)
  )


def choices(field: Any) -> tuple[str, ...] | None:
  c = field.metadata.get('choices')
  if c == 'algorithms':
    return registry.names()
  if c == 'datasets':
    return _dataset_names()
  if c == 'models':
    return _model_names()
  return c


def energy_mixes(energy: Energy) -> list[str]:
  """The device mixes of `energy_mix` (';'-separated), in order."""
  return [m.strip() for m in energy.mix.split(';') if m.strip()]


def multi_model(config: ExperimentConfig) -> bool:
  """Whether the algorithm keeps K different models (evaluated too)."""
  return registry.get(config.algorithm.name).multi_model


def uniform_weights(config: ExperimentConfig) -> bool:
  """Whether the server takes the plain mean of the K trained models."""
  if config.server.weighting == 'auto':
    return registry.get(config.algorithm.name).weighting == 'uniform'
  return config.server.weighting == 'uniform'
