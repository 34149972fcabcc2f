r"""Cost of every model and dataset of the zoo on this machine.

  python -m experiments.zoo_report                      # both tables
  python -m experiments.zoo_report --datasets=          # models only
  python -m experiments.zoo_report --models=cnn_mnist,resnet20 --datasets=

Models: parameter count, compile time and the median time of one local
epoch of 600 samples (12 steps of batch 50, plain SGD with momentum, the
papers' client update) for each model at the input shape of the papers'
dataset for it. Datasets: peak host memory of loading the dataset and
putting its training and test examples on the device, each measured in a
fresh subprocess (the process's peak resident memory minus its resident
memory after the imports). Datasets that cannot be downloaded here are measured
with `tfds.testing.mock_data` at their real number of training examples
(the mock gives the test split as many examples too, so those rows
slightly overstate); LEAF and CINIC-10 rows are the size of the arrays the
loaders build, computed, not measured.
"""

from __future__ import annotations

# First: Ctrl-C while the modules below import ends in one line (cli).
from . import cli  # isort: split

import os
import subprocess
import sys

import jax
from absl import flags

from fedjax_mr.bench import zoo

_MODELS = flags.DEFINE_list('models', list(zoo.MODELS), 'Models to time.')
_DATASETS = flags.DEFINE_list(
  'datasets', list(zoo.TFDS_TRAIN) + list(zoo.COMPUTED), 'Datasets to measure.'
)
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed epochs per model.')
_MEMORY_OF = flags.DEFINE_string(
  'memory_of', '', 'Internal: measure one dataset in this process.'
)


def _check(models: list[str], names: list[str], repeats: int) -> None:
  """Refuses unknown models or datasets and no repeats."""
  for name in models:
    if name not in zoo.MODELS:
      cli.fail(f'--models: unknown {name!r}; one of {list(zoo.MODELS)}')
  for name in names:
    if name not in zoo.TFDS_TRAIN and name not in zoo.COMPUTED:
      cli.fail(
        f'--datasets: unknown {name!r}; one of '
        f'{list(zoo.TFDS_TRAIN) + list(zoo.COMPUTED)}'
      )
  if repeats < 1:
    cli.fail('--repeats must be >= 1')


def _models_table(models: list[str], repeats: int) -> None:
  """Each model's row, timed in this process."""
  print(
    f'one local epoch of 600 samples (B=50, 12 steps) on '
    f'{jax.devices()[0].device_kind}, median of {repeats}'
  )
  print('| model | input | parameters | compile (s) | epoch (s) |')
  print('|---|---|---|---|---|')
  for name in models:
    print(zoo.model_row(name, zoo.time_model(name, repeats)), flush=True)


def _datasets_table(names: list[str]) -> None:
  """Each dataset's row; a tfds one measured in a fresh process."""
  print()
  print('| dataset | examples (train) | arrays (MiB) | peak host (MiB) | how |')
  print('|---|---|---|---|---|')
  for name in names:
    if name in zoo.COMPUTED:
      print(zoo.computed_row(name))
      continue
    proc = subprocess.run(
      [sys.executable, '-m', __spec__.name, f'--memory_of={name}'],
      capture_output=True,
      text=True,
      env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'},
    )
    if proc.returncode:
      print(f'| {name} | failed: {proc.stderr.strip().splitlines()[-1]} |')
      continue
    peak, arrays, how = proc.stdout.split()[:3]
    print(
      f'| {name} | {zoo.TFDS_TRAIN[name]:,} | {arrays} | {peak} | {how} |',
      flush=True,
    )


def main(argv) -> None:
  cli.no_arguments(argv)
  if _MEMORY_OF.value:
    peak, arrays, how = zoo.dataset_memory(_MEMORY_OF.value)
    print(f'{peak:.0f} {arrays:.0f} {how}')
    return
  _check(_MODELS.value, _DATASETS.value, _REPEATS.value)
  if _MODELS.value:
    _models_table(_MODELS.value, _REPEATS.value)
  if _DATASETS.value:
    _datasets_table(_DATASETS.value)


def entry() -> None:
  """The console script `fedjax-mr-zoo-report`."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  cli.run(main)


if __name__ == '__main__':
  entry()
