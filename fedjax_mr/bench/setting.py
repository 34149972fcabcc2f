"""What a benchmark times: one frozen `Setting`, checked once by `check`.

Its flags are flat. Those that mean what the training program's mean
(the dataset, the model, N, K, E, B, the devices, the algorithm, the test
batch) are the training config's fields, defined there once
(`config_tree.shared`); `choices` gives each field's values.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Mapping

from fedjax_mr.core import config_tree
from fedjax_mr.core import errors
from fedjax_mr.data import datasets
from fedjax_mr.data import partition
from fedjax_mr.pipeline import config as config_lib

SIZES = ('equal', 'dirichlet', 'range')


_shared = config_tree.shared


def _field(default: Any, help_text: str, choices=None):
  return dataclasses.field(
    default=default, metadata={'help': help_text, 'choices': choices}
  )


@dataclasses.dataclass(frozen=True)
class Setting:
  """A benchmark setting (see each field's help)."""

  dataset: str = _shared(config_lib.Data, 'dataset')
  data_dir: str = _shared(config_lib.Data, 'data_dir')
  model: str = _shared(config_lib.ModelChoice, 'name')
  num_clients: int = _shared(config_lib.Partition, 'num_clients')
  clients_per_round: int = _shared(config_lib.Server, 'clients_per_round')
  local_epochs: int = _shared(config_lib.Local, 'local_epochs')
  batch_size: int = _shared(config_lib.Local, 'batch_size')
  sizes: str = _field(
    'equal',
    'Client sizes: equal shares, Dirichlet(alpha) label skew, or sizes '
    'drawn uniformly from min_client_size..max_client_size.',
    SIZES,
  )
  min_client_size: int = _field(10, 'Smallest client (sizes=range).')
  max_client_size: int = _field(50, 'Largest client (sizes=range).')
  random_data: bool = _field(
    False,
    "Random uint8 images and labels of the dataset's shape and classes "
    'instead of the stored set (timing where the data cannot be read).',
  )
  random_train_size: int = _field(
    0,
    'Training examples of random_data (0: 50,000, or N × max_client_size '
    'for sizes=range); the test set holds at most 10,000.',
  )
  compute_dtype: str = _field(
    'float32',
    'The model computes in this dtype; bfloat16 keeps float32 master '
    'weights (fedjax_mr.models.model.get). The PyTorch loop autocasts alike.',
    ('float32', 'bfloat16'),
  )
  matmul_precision: str = _field(
    'default',
    "float32 products: JAX's default precision (TF32 on NVIDIA GPUs; the "
    'PyTorch loop then allows TF32 too) or highest (full float32 on both '
    'sides).',
    ('default', 'highest'),
  )
  limit_batch: int = _field(
    0,
    "The limit's batch (0: B, the round's steps). Else the limit trains the "
    "round's samples in ceil(samples / this) steps of this batch (K × B: "
    'the same samples trained centrally by one model).',
  )
  peak: bool = _field(
    True, "Measure the device's float32 and bfloat16 matmul peak at the end."
  )
  client_chunks: tuple[int, ...] = _field(
    (),
    'Several client_chunk settings (e.g. 1,5,10: sequential, chunks, all '
    'vmapped) timed round by round in one process, beside each device '
    'setting.',
  )
  alpha: float = _field(0.1, 'Dirichlet α for sizes=dirichlet.')
  num_devices: int = _shared(
    config_lib.Devices,
    'num_devices',
    default=1,
    why='the plain PyTorch loop it compares with runs on one device '
    '(matrix: both).',
  )
  client_chunk: int = _shared(config_lib.Devices, 'client_chunk')
  host_devices: int = _shared(config_lib.Devices, 'host_devices')
  rounds: int = _field(5, 'Timed rounds (after one warm-up).')
  matrix: bool = _field(False, '1 and all devices × equal and Dirichlet sizes.')
  pytorch: bool = _field(
    True,
    'Also time a plain PyTorch FedAvg loop on the same clients '
    '(experiments.torch_reference; needs the bench extra, skipped without it).',
  )
  limit: bool = _field(
    True,
    'Time the limit (centralised training of the same steps, one jitted '
    'loop); off for large K on accelerators, where it is sequential.',
  )
  threads: int = _field(
    0, 'PyTorch intra-op threads on the CPU (0: all cores; at most the cores).'
  )
  algorithm: str = _shared(config_lib.AlgorithmChoice, 'name')
  eval_every: int = _field(
    10,
    'Evaluation share: one evaluation (as a training run evaluates, for '
    'FedMR-type algorithms with its local evaluations too) per this many '
    'rounds.',
  )
  eval_batch_size: int = _shared(config_lib.Evaluation, 'eval_batch_size')
  # Fields of the experiment config: the dataset's (Synthetic's α and β)
  # and the timed algorithm's hyper-parameters (FedAvg beside it has none).
  dataset_options: Mapping[str, Any] = dataclasses.field(
    default_factory=dict, metadata={'flag': False}
  )
  algorithm_options: Mapping[str, Any] = dataclasses.field(
    default_factory=dict, metadata={'flag': False}
  )


def choices(field: dataclasses.Field) -> tuple[str, ...] | None:
  """The values `field` allows, or None (any)."""
  return config_lib.choices(field)


def flag_fields() -> tuple[dataclasses.Field, ...]:
  """The fields a program sets one flag each for (not the options)."""
  return tuple(
    f for f in dataclasses.fields(Setting) if f.metadata.get('flag', True)
  )


def synthetic(setting: Setting) -> bool:
  """Whether the clients are generated (`dataset=synthetic`)."""
  return setting.dataset == datasets.SYNTHETIC


def size_kinds(setting: Setting) -> tuple[str, ...]:
  """The client-size settings: equal, Dirichlet or ranged shares of a
  stored dataset, or the generated clients' own lognormal sizes."""
  return ('lognormal',) if synthetic(setting) else SIZES


def check(setting: Setting, cores: int) -> None:
  """Raises `errors.ConfigError` naming the first bad field (`cores`: the
  machine's, the most PyTorch threads)."""
  s = setting
  for name in (
    'num_clients',
    'clients_per_round',
    'local_epochs',
    'batch_size',
    'rounds',
    'eval_every',
    'eval_batch_size',
  ):
    _at_least(name, getattr(s, name), 1)
  for name in ('client_chunk', 'host_devices', 'threads'):
    _at_least(name, getattr(s, name), 0)
  # More intra-op threads than cores only time-slice them (1,000,000 made
  # PyTorch crash with a segmentation fault).
  if s.threads > cores:
    raise errors.ConfigError(
      f"`threads` must be at most {cores} (this machine's cores; 0: all), "
      f'got {s.threads}'
    )
  if not 1 <= s.min_client_size <= s.max_client_size:
    raise errors.ConfigError(
      '`min_client_size` and `max_client_size` need 1 ≤ min ≤ max, got '
      f'{s.min_client_size} and {s.max_client_size}'
    )
  for name in ('random_train_size', 'limit_batch'):
    _at_least(name, getattr(s, name), 0)
  for c in s.client_chunks:
    if c < 0:
      raise errors.ConfigError(f'`client_chunks` takes counts ≥ 0, got {c!r}')
  if s.random_data and synthetic(s):
    raise errors.ConfigError(
      '`random_data` stands in for a stored dataset, not synthetic'
    )
  if s.clients_per_round > s.num_clients:
    raise errors.ConfigError(
      f'`clients_per_round={s.clients_per_round}` exceeds '
      f'`num_clients={s.num_clients}`'
    )
  try:
    partition.check_alpha(s.alpha)
  except errors.ArgumentError as e:
    raise errors.ConfigError(f'`alpha` {e.message}') from None
  _at_least('num_devices', s.num_devices, 0)


# The field behind each argument of the data functions the benchmark calls
# (`datasets.random_images`, `datasets.load`; the partitions':
# `checks.partition_error`) whose name differs.
_DATA_FIELDS = {'name': 'dataset', 'num_train': 'random_train_size'}


def data_error(error: errors.ArgumentError) -> errors.ConfigError:
  """A data function's `error` as a one-line error naming the field of its
  argument."""
  field = _DATA_FIELDS.get(error.argument, error.argument)
  return errors.ConfigError(f'`{field}` {error.message}')


def _at_least(name: str, value: int, least: int) -> None:
  if value < least:
    raise errors.ConfigError(f'`{name}` must be ≥ {least}, got {value}')


def device_settings(setting: Setting, n_dev: int) -> list[tuple[str, str]]:
  """The (sizes, devices) pairs to time: with `matrix` each size kind on
  1 and all devices, else the setting's; refuses more devices than K or
  than the `n_dev` there are."""
  kinds = size_kinds(setting)
  if setting.matrix:
    runs = [
      (sizes, dev)
      for sizes in kinds
      if sizes != 'range'
      for dev in ('1', 'all')
    ]
  else:
    sizes = kinds[0] if synthetic(setting) else setting.sizes
    runs = [(sizes, str(setting.num_devices or 'all'))]
  k = setting.clients_per_round
  for _, dev in runs:
    d = n_dev if dev == 'all' else int(dev)
    if d > min(n_dev, k):
      raise errors.ConfigError(
        f'`num_devices={d}`: need at most K={k} and at most the {n_dev} devices'
      )
  return runs
