"""The configuration of one FedStitch experiment, with its validation.

`StitchConfig` is a tree of frozen parts, one per concern, as
`ExperimentConfig` is (`fedjax_mr.core.config_tree`): `pool`, `data`,
`partition`, `selection` (what the clients vote and how the votes count),
`search` (how networks grow), `cka`, `stitching`, `run`, `evaluation` and
`energy`. A consumer takes the part it reads.

Every field is an absl flag of `experiments/stitch.py` under its flat name
(`flag`, else its own: `top_k`; `partition` for `Partition.kind`,
`energy_mix` for `Energy.mix`): `StitchConfig.from_flat(top_k=5)`,
`config.flat()`, `config.replace(seed=1)`. The fields not marked
`run_only` define a run's state: they are saved with it (`identity`) and a
resume with other values is refused; the others only change what is
evaluated or reported, or where. The FedStitch hyper-parameters among them
make the library's `fedjax_mr.stitch.config.Config` (`library_config`;
`stitch_solver` is its `solver`). Nothing here reads a file; `validate`
runs once where a run starts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from typing import Sequence

from fedjax_mr.core import config_tree
from fedjax_mr.core import errors
from fedjax_mr.data import partition
from fedjax_mr.energy import fleet
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.stitch import cka
from fedjax_mr.stitch import config as stitch_config
from fedjax_mr.stitch import network
from fedjax_mr.stitch import projection
from fedjax_mr.stitch import units

# The training runs' partitions of a dataset's examples (the clients here
# hold those outside the pool's public split: no file, no natural users).
PARTITIONS = tuple(
  p for p in config_lib.PARTITIONS if p not in ('file', 'natural')
)
KNN_AT = ('output', 'trunk')
# The library's names of the fields that it calls otherwise.
LIBRARY_NAMES = {'solver': 'stitch_solver'}

_field = config_tree.field
_part = config_tree.part


@dataclasses.dataclass(frozen=True)
class Pool:
  """The pre-trained models and where they are cut into blocks."""

  pool: str = _field('runs/pool', 'Pool folder.', run_only=True)
  pool_models: tuple[str, ...] = _field(
    (), 'Pool model ids to use (default: all in pool).', run_only=True
  )
  imagenet_pool: str | None = _field(
    None,
    "FedStitch's ImageNet pool instead of pool: a folder of torchvision "
    'state dicts as .safetensors (alexnet, resnet50, vgg16, densenet121, '
    'mobilenet_v3_large); label_map defaults to the bundled map of '
    'dataset where there is one (cifar10, cinic10).',
    run_only=True,
  )
  imagenet_resolution: int = _field(
    224, 'Side images are resized to (imagenet_pool).'
  )
  cuts: str = _field(
    'default', 'Where models are cut into blocks.', choices=units.CUT_STYLES
  )

  def __post_init__(self):
    # A list of ids (as a flag gives it) is kept as a tuple.
    object.__setattr__(self, 'pool_models', tuple(self.pool_models))


# The dataset and the clients' classes of it: the part every program
# shares.
Data = config_lib.Data


@dataclasses.dataclass(frozen=True)
class Partition(config_lib.Partition):
  """The clients and how the examples are split among them: the shared
  part, with FedStitch's partitions and alpha."""

  kind: str = config_tree.shared(
    config_lib.Partition,
    'kind',
    choices=PARTITIONS,
    why="FedStitch's clients hold the examples outside the pool's public "
    'split, drawn by one of these.',
  )
  alpha: float = config_tree.shared(
    config_lib.Partition,
    'alpha',
    default=1.0,
    why="FedStitch's non-IID setting, Dir(1) per client (its Table I).",
  )


@dataclasses.dataclass(frozen=True)
class Selection:
  """A round: who takes part, what each uploads, how the votes count."""

  clients_per_round: int = _field(10, 'Participants per round.')
  batch_size: int = _field(64, 'Scoring batch size.')
  top_k: int = _field(3, 'Blocks each client uploads.')
  epsilon: float = _field(0.1, 'Exploration probability.')
  epsilon_decay: float = _field(1.0, 'ε is multiplied by this per depth.')
  reward: float = _field(0.2, 'Weight reward factor.')
  penalty: float = _field(0.2, 'Weight penalty factor.')
  threshold: float = _field(0.75, 'Rank threshold.')
  aggregation: str = _field(
    'rl',
    'Vote aggregation: rl (reinforcement-learned client weights) or uniform '
    '(every client alike).',
    choices=stitch_config.AGGREGATIONS,
  )


@dataclasses.dataclass(frozen=True)
class Search:
  """How the networks grow: selections, their rounds, depth, pruning."""

  num_selections: int = _field(3, 'Blocks chosen per network; networks kept.')
  rounds_per_selection: int = _field(5, 'Rounds per block selection.')
  max_depth: int = _field(8, 'Most blocks per network.')
  prune: bool = _field(True, 'Search-space optimiser.')


@dataclasses.dataclass(frozen=True)
class Cka:
  """How blocks' representations are compared."""

  view: str = _field('positions', 'CKA view.', choices=cka.VIEWS)
  debiased: bool = _field(False, 'Debiased CKA.')


@dataclasses.dataclass(frozen=True)
class Stitching:
  """The stitches between blocks."""

  spatial: str = _field(
    'match',
    'Stitching across spatial sizes.',
    choices=projection.SPATIAL_POLICIES,
  )
  bias: bool = _field(False, 'Affine stitches.', flag='stitch_bias')
  solver: str = _field(
    'pinv', 'Stitch fit.', choices=projection.SOLVERS, flag='stitch_solver'
  )


@dataclasses.dataclass(frozen=True)
class Run(config_lib.Run):
  """The seed, the output folder and what it keeps: the shared part."""

  workdir: str = config_tree.shared(
    config_lib.Run,
    'workdir',
    default='runs/stitch',
    why='a FedStitch run has no algorithm or model to name its folder by.',
  )


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """How the networks are evaluated, and the "Local" baseline."""

  mode: str = _field(
    'head',
    'How networks are evaluated.',
    choices=network.EVAL_MODES,
    run_only=True,
    flag='eval',
  )
  knn_reference: int = _field(
    2000, 'Public examples the kNN probe is fitted on.', run_only=True
  )
  knn_at: str = _field(
    'output',
    "What the kNN probe reads: the network's output (a finished network: "
    'its logits), or for a finished network the input of its end block '
    "(trunk): the features, when the pool's heads learnt other classes "
    '(classes); its last block is still chosen by the search.',
    choices=KNN_AT,
    run_only=True,
  )
  eval_examples: int = _field(
    0, 'Test examples to evaluate on (0: all).', run_only=True
  )
  label_map: str | None = _field(
    None,
    'Per dataset class, the pool classes that count as it: a JSON file (a '
    'list of lists of class ids) or a bundled map by name (cifar10, '
    'cinic10: ImageNet-1K to the CIFAR-10 classes; '
    'fedjax_mr.stitch.label_maps).',
    run_only=True,
  )
  local_clients: int = _field(
    0, '"Local" baseline: this many clients stitch alone.', run_only=True
  )


@dataclasses.dataclass(frozen=True)
class Energy:
  """The clients' local energy coordinators."""

  backend: str = _field(
    'simulated',
    "Where the clients' local energy coordinators run: simulated devices "
    '(energy_mix), or this Jetson through sysfs (energy_profile; clocks '
    'are set per client, restored at the end), or a dry run of that '
    '(writes planned and recorded, none made).',
    choices=fleet.BACKENDS,
    flag='energy_backend',
  )
  mix: str = _field(
    'tx2_chained@1:0.3,tx2_chained@0.7:0.4,tx2_chained@0.4:0.3',
    'The simulated devices, profile[@speed]:weight,... (profiles: '
    'tx2_literal, tx2_chained or a JSON file; energy_backend=simulated).',
    flag='energy_mix',
  )
  profile: str | None = _field(
    None,
    "This device's profile (tx2_literal, tx2_chained or a JSON file of "
    'experiments.profile_device) for energy_backend=sysfs or dry_run.',
    flag='energy_profile',
  )
  ms_per_score: float = _field(
    1.0,
    "The coordinators' time model: ms to score one candidate block on one "
    "example at the profile's first configuration (feedback corrects it; "
    'on simulated devices it is the time).',
    flag='energy_ms_per_score',
  )
  sysfs_root: str = _field(
    '/',
    'Root of the sysfs tree (energy_backend=sysfs or dry_run).',
    run_only=True,
    flag='energy_sysfs_root',
  )


@dataclasses.dataclass(frozen=True)
class StitchConfig:
  """One FedStitch experiment: a part per concern (see the module
  docstring and each field's help)."""

  pool: Pool = _part(Pool)
  data: Data = _part(Data)
  partition: Partition = _part(Partition)
  selection: Selection = _part(Selection)
  search: Search = _part(Search)
  cka: Cka = _part(Cka)
  stitching: Stitching = _part(Stitching)
  run: Run = _part(Run)
  evaluation: Evaluation = _part(Evaluation)
  energy: Energy = _part(Energy)

  @classmethod
  def from_flat(cls, **values: Any) -> StitchConfig:
    """The config of flat flag values (missing ones take their defaults).

    Raises:
      TypeError: a name that is no flag.
    """
    config_tree.check_names(cls, values, _FLAGS)
    return config_tree.replaced(cls(), _FLAGS, values)

  def flat(self) -> dict[str, Any]:
    """Every field by its flag."""
    return config_tree.flat(self, _FIELDS)

  def replace(self, **values: Any) -> StitchConfig:
    """This config with the flags `values` changed."""
    return StitchConfig.from_flat(**{**self.flat(), **values})


_FIELDS = config_tree.fields(StitchConfig)
_FLAGS = {f.name: f for f in _FIELDS}


def fields() -> tuple[config_tree.FlagField, ...]:
  """The fields of `StitchConfig` by flag, part by part (each one a
  flag)."""
  return _FIELDS


def choices(field: Any) -> tuple[str, ...] | None:
  """The values `field` allows, or None (any)."""
  return config_lib.choices(field)


def library_config(config: StitchConfig) -> stitch_config.Config:
  """The FedStitch hyper-parameters of `config` (the library's `Config`)."""
  flat = config.flat()
  return stitch_config.Config(
    **{
      name: flat[LIBRARY_NAMES.get(name, name)]
      for name in stitch_config.Config._fields
    }
  )


def _where_they_apply(config: StitchConfig) -> dict[str, bool]:
  """The fields that define the run only where they apply, and whether
  they do: saved only then (as before they existed), so that the
  workdirs of earlier versions keep resuming."""
  return {
    'shards_per_client': config.partition.kind == 'shards',
    'classes': bool(config.data.classes),
    'imagenet_resolution': bool(config.pool.imagenet_pool),
  }


def identity(config: StitchConfig, pool_models: Sequence[str]) -> dict:
  """What defines the run (saved with its state, checked on resume): the
  fields that are not `run_only`, by flag, and the pool's models by id."""
  flat, applies = config.flat(), _where_they_apply(config)
  names = [
    f.name
    for f in _FIELDS
    if not f.metadata['run_only'] and f.name not in applies
  ]
  # In the order earlier versions saved them (a state's document keeps its
  # bytes): `num_clients` before `partition`, as FedStitch's own partition
  # part had them before it composed the shared one.
  names.remove('num_clients')
  names.insert(names.index('partition'), 'num_clients')
  out = {name: flat[name] for name in names}
  # Stored under the field's earlier name: workdirs keep resuming.
  out['dirichlet_alpha'] = out.pop('alpha')
  out['pool_models'] = list(pool_models)
  out.update({name: flat[name] for name, yes in applies.items() if yes})
  return out


def validate(config: StitchConfig) -> None:
  """Raises `ConfigError` naming the first bad field, before anything is
  loaded (the files it names are checked where they are read)."""
  for f in _FIELDS:
    checks.check_choice(f.name, config_tree.get(config, f.path), choices(f))
  stitch_config.check_config(
    library_config(config), config.partition.num_clients, names=LIBRARY_NAMES
  )
  _check_run(config)
  _check_partition(config.partition)
  _check_energy(config.energy)
  _check_owned(config)


def _check_run(config: StitchConfig) -> None:
  """K against N, the seed, the evaluation's sizes."""
  n = config.partition.num_clients
  k = config.selection.clients_per_round
  e = config.evaluation
  checks.check_clients_per_round(k, n)
  checks.check_seed('seed', config.run.seed)
  rules = [
    (
      config.run.keep_checkpoints >= 1,
      f'`keep_checkpoints` must be ≥ 1, got {config.run.keep_checkpoints}',
    ),
    (
      e.eval_examples >= 0,
      f'`eval_examples` must be ≥ 0 (0: all), got {e.eval_examples}',
    ),
    (
      e.knn_reference >= 1,
      f'`knn_reference` must be ≥ 1, got {e.knn_reference}',
    ),
    (
      0 <= e.local_clients <= n,
      f'`local_clients` must be in [0, `num_clients={n}`], got '
      f'{e.local_clients}',
    ),
  ]
  for ok, message in rules:
    if not ok:
      raise errors.ConfigError(message)


# The fields that some energy backends alone read, and those backends.
ENERGY_BACKEND_FIELDS = {
  'energy_mix': ('simulated',),
  'energy_profile': ('sysfs', 'dry_run'),
}


def _check_owned(config: StitchConfig) -> None:
  """The fields that some partitions or energy backends alone read, left
  at their defaults where they are not read (the training runs' rule)."""
  values = config.flat()
  defaults = StitchConfig().flat()
  partition_fields = {
    k: v for k, v in checks.PARTITION_FIELDS.items() if k in values
  }
  checks.check_owned(values, defaults, 'partition', partition_fields)
  checks.check_owned(values, defaults, 'energy_backend', ENERGY_BACKEND_FIELDS)


def _check_partition(part: Partition) -> None:
  """`alpha` and `shards_per_client` where their partition reads them."""
  try:
    if part.kind in ('dirichlet', 'dirichlet_equal'):
      partition.check_alpha(part.alpha)
    if part.kind == 'shards':
      errors.check_count('shards_per_client', part.shards_per_client)
  except errors.ArgumentError as e:
    raise checks.field_error(e.argument, e) from None


def _check_energy(energy: Energy) -> None:
  """The coordinators' time model; a device profile where the clocks are
  this device's."""
  ms = energy.ms_per_score
  if not (ms > 0 and math.isfinite(ms)):
    raise errors.ConfigError(
      f'`energy_ms_per_score` must be finite and > 0, got {ms}'
    )
  if energy.backend != 'simulated' and energy.profile is None:
    raise errors.ConfigError(
      f'`energy_backend={energy.backend}` needs `energy_profile`: '
      'tx2_literal, tx2_chained or a JSON file of experiments.profile_device'
    )
