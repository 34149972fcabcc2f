"""The configuration of one FedStitch experiment, with its validation.

Every field is also an absl flag of `experiments/stitch.py` (same name,
the help text below). The fields marked `identity` define a run's state:
they are saved with it (`identity`) and a resume with other values is
refused; the others only change what is evaluated or reported, or where.
The FedStitch hyper-parameters among them make the library's
`fedjax_mr.stitch.config.Config` (`library_config`; `stitch_solver` is its
`solver`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from typing import Sequence

from fedjax_mr.core import errors
from fedjax_mr.energy import fleet
from fedjax_mr.stitch import cka
from fedjax_mr.stitch import config as stitch_config
from fedjax_mr.stitch import network
from fedjax_mr.stitch import projection
from fedjax_mr.stitch import units

PARTITIONS = ('iid', 'dirichlet', 'dirichlet_equal', 'shards')
KNN_AT = ('output', 'trunk')
# The library's names of the fields that it calls otherwise.
LIBRARY_NAMES = {'solver': 'stitch_solver'}


def _field(
  default: Any, help_text: str, *, choices=None, identity=False
) -> dataclasses.Field:
  return dataclasses.field(
    default=default,
    metadata={'help': help_text, 'choices': choices, 'identity': identity},
  )


@dataclasses.dataclass(frozen=True)
class StitchConfig:
  """One FedStitch experiment (see each field's help)."""

  pool: str = _field('runs/pool', 'Pool folder.')
  pool_models: tuple[str, ...] = _field(
    (), 'Pool model ids to use (default: all in pool).'
  )
  imagenet_pool: str | None = _field(
    None,
    "FedStitch's ImageNet pool instead of pool: a folder of torchvision "
    'state dicts as .safetensors (alexnet, resnet50, vgg16, densenet121, '
    'mobilenet_v3_large); label_map defaults to the bundled map of '
    'dataset where there is one (cifar10, cinic10).',
  )
  imagenet_resolution: int = _field(
    224, 'Side images are resized to (imagenet_pool).'
  )
  cuts: str = _field(
    'default',
    'Where models are cut into blocks.',
    choices=units.CUT_STYLES,
    identity=True,
  )
  dataset: str = _field('fashion_mnist', 'Dataset.', identity=True)
  data_dir: str | None = _field(None, 'Dataset folder.')
  num_clients: int = _field(100, 'Clients N.', identity=True)
  partition: str = _field(
    'dirichlet',
    'Client partition: iid; dirichlet (each class split over the clients by '
    'Dir(alpha), as experiments.run); dirichlet_equal (equal-size clients, '
    "each with class proportions from Dir(alpha): FedStitch's non-IID "
    'setting, and the one that stays non-empty with few classes); shards '
    '(the label-sorted shards of experiments.run, shards_per_client: a '
    "client holds few classes; FedStitch's Fig. 2).",
    choices=PARTITIONS,
    identity=True,
  )
  shards_per_client: int = _field(2, 'partition=shards: shards per client.')
  alpha: float = _field(
    1.0,
    'Dirichlet concentration (partition=dirichlet or dirichlet_equal).',
    identity=True,
  )
  clients_per_round: int = _field(10, 'Participants per round.', identity=True)
  batch_size: int = _field(64, 'Scoring batch size.', identity=True)
  top_k: int = _field(3, 'Blocks each client uploads.', identity=True)
  epsilon: float = _field(0.1, 'Exploration probability.', identity=True)
  epsilon_decay: float = _field(
    1.0, 'ε is multiplied by this per depth.', identity=True
  )
  reward: float = _field(0.2, 'Weight reward factor.', identity=True)
  penalty: float = _field(0.2, 'Weight penalty factor.', identity=True)
  threshold: float = _field(0.75, 'Rank threshold.', identity=True)
  aggregation: str = _field(
    'rl',
    'Vote aggregation: rl (reinforcement-learned client weights) or uniform '
    '(every client alike).',
    choices=stitch_config.AGGREGATIONS,
    identity=True,
  )
  num_selections: int = _field(
    3, 'Blocks chosen per network; networks kept.', identity=True
  )
  rounds_per_selection: int = _field(
    5, 'Rounds per block selection.', identity=True
  )
  max_depth: int = _field(8, 'Most blocks per network.', identity=True)
  prune: bool = _field(True, 'Search-space optimiser.', identity=True)
  view: str = _field('positions', 'CKA view.', choices=cka.VIEWS, identity=True)
  debiased: bool = _field(False, 'Debiased CKA.', identity=True)
  spatial: str = _field(
    'match',
    'Stitching across spatial sizes.',
    choices=projection.SPATIAL_POLICIES,
    identity=True,
  )
  stitch_bias: bool = _field(False, 'Affine stitches.', identity=True)
  stitch_solver: str = _field(
    'pinv', 'Stitch fit.', choices=projection.SOLVERS, identity=True
  )
  seed: int = _field(0, 'Seed.', identity=True)
  eval: str = _field(
    'head', 'How networks are evaluated.', choices=network.EVAL_MODES
  )
  knn_reference: int = _field(
    2000, 'Public examples the kNN probe is fitted on.'
  )
  knn_at: str = _field(
    'output',
    "What the kNN probe reads: the network's output (a finished network: "
    'its logits), or for a finished network the input of its end block '
    "(trunk): the features, when the pool's heads learnt other classes "
    '(classes); its last block is still chosen by the search.',
    choices=KNN_AT,
  )
  eval_examples: int = _field(0, 'Test examples to evaluate on (0: all).')
  label_map: str | None = _field(
    None,
    'Per dataset class, the pool classes that count as it: a JSON file (a '
    'list of lists of class ids) or a bundled map by name (cifar10, '
    'cinic10: ImageNet-1K to the CIFAR-10 classes; '
    'fedjax_mr.stitch.label_maps).',
  )
  classes: str = _field(
    '',
    "The clients' task: these classes only, e.g. 5-9 (relabelled 0..n-1); "
    'with a pool trained on other classes (pretrain_zoo classes) a '
    'transfer setting, evaluated by eval=knn. Empty: all.',
  )
  local_clients: int = _field(
    0, '"Local" baseline: this many clients stitch alone.'
  )
  energy_backend: str = _field(
    'simulated',
    "Where the clients' local energy coordinators run: simulated devices "
    '(energy_mix), or this Jetson through sysfs (energy_profile; clocks '
    'are set per client, restored at the end), or a dry run of that '
    '(writes planned and recorded, none made).',
    choices=fleet.BACKENDS,
    identity=True,
  )
  energy_mix: str = _field(
    'tx2_chained@1:0.3,tx2_chained@0.7:0.4,tx2_chained@0.4:0.3',
    'The simulated devices, profile[@speed]:weight,... (profiles: '
    'tx2_literal, tx2_chained or a JSON file; energy_backend=simulated).',
    identity=True,
  )
  energy_profile: str | None = _field(
    None,
    "This device's profile (tx2_literal, tx2_chained or a JSON file of "
    'experiments.profile_device) for energy_backend=sysfs or dry_run.',
    identity=True,
  )
  energy_sysfs_root: str = _field(
    '/', 'Root of the sysfs tree (energy_backend=sysfs or dry_run).'
  )
  energy_ms_per_score: float = _field(
    1.0,
    "The coordinators' time model: ms to score one candidate block on one "
    "example at the profile's first configuration (feedback corrects it; "
    'on simulated devices it is the time).',
    identity=True,
  )
  workdir: str = _field('runs/stitch', 'Output folder.')

  def __post_init__(self):
    # A list of ids (as a flag gives it) is kept as a tuple.
    object.__setattr__(self, 'pool_models', tuple(self.pool_models))


def fields() -> tuple[dataclasses.Field, ...]:
  """The fields of `StitchConfig`, in order (each one a flag)."""
  return dataclasses.fields(StitchConfig)


def choices(field: dataclasses.Field) -> tuple[str, ...] | None:
  """The values `field` allows, or None (any)."""
  return field.metadata['choices']


def library_config(config: StitchConfig) -> stitch_config.Config:
  """The FedStitch hyper-parameters of `config` (the library's `Config`)."""
  return stitch_config.Config(
    **{
      name: getattr(config, LIBRARY_NAMES.get(name, name))
      for name in stitch_config.Config._fields
    }
  )


def identity(config: StitchConfig, pool_models: Sequence[str]) -> dict:
  """What defines the run (saved with its state, checked on resume): the
  `identity` fields and the pool's models by id."""
  out = {
    f.name: getattr(config, f.name) for f in fields() if f.metadata['identity']
  }
  # Stored under the field's earlier name: workdirs keep resuming.
  out['dirichlet_alpha'] = out.pop('alpha')
  out['pool_models'] = list(pool_models)
  # The fields below are absent where they do not apply (and were before
  # they existed): old workdirs resume.
  if config.partition == 'shards':
    out['shards_per_client'] = config.shards_per_client
  if config.classes:
    out['classes'] = config.classes
  if config.imagenet_pool:
    out['imagenet_resolution'] = config.imagenet_resolution
  return out


def validate(config: StitchConfig) -> None:
  """Raises `ConfigError` naming the first bad field, before anything is
  loaded (the files it names are checked where they are read)."""
  _check_choices(config)
  stitch_config.check_config(
    library_config(config), config.num_clients, names=LIBRARY_NAMES
  )
  _check_run(config)
  _check_partition(config)
  _check_energy(config)


def _check_choices(config: StitchConfig) -> None:
  """The choices of the fields the library's `check_config` does not
  check."""
  library = {LIBRARY_NAMES.get(n, n) for n in stitch_config.Config._fields}
  for f in fields():
    allowed = choices(f)
    value = getattr(config, f.name)
    if allowed and f.name not in library and value not in allowed:
      raise errors.ConfigError(
        f'`{f.name}` must be one of {", ".join(allowed)}'
      )


def _check_run(config: StitchConfig) -> None:
  """K against N, the seed, the evaluation's sizes."""
  n = config.num_clients
  checks = [
    (
      config.clients_per_round <= n,
      f'`clients_per_round={config.clients_per_round}` exceeds '
      f'`num_clients={n}`; it must be between 1 and num_clients',
    ),
    (
      0 <= config.seed < 2**32,
      f'`seed` must be in [0, 2**32), got {config.seed}',
    ),
    (
      config.eval_examples >= 0,
      f'`eval_examples` must be ≥ 0 (0: all), got {config.eval_examples}',
    ),
    (
      config.knn_reference >= 1,
      f'`knn_reference` must be ≥ 1, got {config.knn_reference}',
    ),
    (
      0 <= config.local_clients <= n,
      f'`local_clients` must be in [0, `num_clients={n}`], got '
      f'{config.local_clients}',
    ),
  ]
  for ok, message in checks:
    if not ok:
      raise errors.ConfigError(message)


def _default(name: str) -> Any:
  return StitchConfig.__dataclass_fields__[name].default


def _check_partition(config: StitchConfig) -> None:
  """`alpha` and `shards_per_client`, each where its partition reads it."""
  alpha, part = config.alpha, config.partition
  if part in ('dirichlet', 'dirichlet_equal'):
    if not (alpha > 0 and math.isfinite(alpha)):
      raise errors.ConfigError(f'`alpha` must be finite and > 0, got {alpha}')
  elif alpha != _default('alpha'):
    raise errors.ConfigError(
      '`alpha` applies to `partition=dirichlet|dirichlet_equal` only, not '
      f'`partition={part}`'
    )
  if part == 'shards':
    if config.shards_per_client < 1:
      raise errors.ConfigError(
        f'`shards_per_client` must be >= 1, got {config.shards_per_client}'
      )
  elif config.shards_per_client != _default('shards_per_client'):
    raise errors.ConfigError(
      '`shards_per_client` applies to `partition=shards` only, not '
      f'`partition={part}`'
    )


def _check_energy(config: StitchConfig) -> None:
  """The coordinators' time model, and each backend's own fields."""
  ms = config.energy_ms_per_score
  if not (ms > 0 and math.isfinite(ms)):
    raise errors.ConfigError(
      f'`energy_ms_per_score` must be finite and > 0, got {ms}'
    )
  backend = config.energy_backend
  if backend == 'simulated':
    if config.energy_profile is not None:
      raise errors.ConfigError(
        '`energy_profile` applies to `energy_backend=sysfs` or dry_run, '
        'not simulated (which takes `energy_mix`)'
      )
    return
  if config.energy_mix != _default('energy_mix'):
    raise errors.ConfigError(
      f'`energy_mix` applies to `energy_backend=simulated`, not {backend} '
      '(which takes `energy_profile`)'
    )
  if config.energy_profile is None:
    raise errors.ConfigError(
      f'`energy_backend={backend}` needs `energy_profile`: tx2_literal, '
      'tx2_chained or a JSON file of experiments.profile_device'
    )
