r"""Downloads and prepares the papers' datasets, where the runs read them.

  python -m experiments.prepare                       # all six, default places
  python -m experiments.prepare --datasets=femnist,cinic10 --data_dir=/data
  fedjax-mr-prepare --datasets=cifar10                # installed

On a machine with internet access. Without --data_dir, each dataset goes
where the bundled configs look: the tfds datasets (cifar10, cifar100,
emnist) to tensorflow-datasets' data dir (~/tensorflow_datasets), where
the loader looks by default, FEMNIST and Shakespeare to
data/leaf/<name>/data (the configs' --data_dir), and CINIC-10, which no
bundled config uses, to data/cinic10 (runs pass --data_dir=data/cinic10;
all in the working folder); with --data_dir=D,
all under D (tfds's in D itself). A dataset already prepared is skipped;
the end lists where each one is, its size and the --data_dir its runs
take. Preparing a tfds dataset needs TensorFlow (`pip install
'fedjax_mr[prepare]'`); the others need nothing more. FEMNIST and
Shakespeare keep every user: the papers' filter (FEMNIST writers with more
than 100 samples) is the runs' --leaf_min_samples=100, as in the bundled
configs. Archives go to <data_dir>/downloads (data/downloads; tfds's own
to <data_dir>/downloads/tfds), where an archive put by hand under its
published name (cifar-10-binary.tar.gz, ...; a failure names it) is used
as it is. A failed dataset leaves no folder it created behind. What each
dataset's preparation does is described in `fedjax_mr/data/prepare.py`
and the modules it names (`download`, `femnist`, `shakespeare`, `leaf`,
`cinic`).
"""

from __future__ import annotations

# First: Ctrl-C while the modules below import ends in one line (cli).
from . import cli  # isort: split

import sys

from absl import flags
from absl import logging

from fedjax_mr.core import errors
from fedjax_mr.data import download
from fedjax_mr.data import leaf
from fedjax_mr.data import prepare

_DATASETS = flags.DEFINE_list(
  'datasets',
  list(prepare.PAPERS),
  f'Datasets to prepare, from: {", ".join(prepare.NAMES)}.',
)
_DATA_DIR = flags.DEFINE_string(
  'data_dir',
  '',
  'Where the datasets go (tfds datasets in it, the others in '
  '<data_dir>/leaf/<name>/data and <data_dir>/cinic10, downloads in '
  "<data_dir>/downloads). Empty: tensorflow-datasets' default data dir "
  'for the tfds datasets, data/ of the working folder for the others.',
)
_TRAIN_FRACTION = flags.DEFINE_float(
  'leaf_train_fraction',
  leaf.TRAIN_FRACTION,
  "FEMNIST, Shakespeare: fraction of each user's samples in the training "
  "split (LEAF's --tf; its default).",
)
_SEED = flags.DEFINE_integer(
  'leaf_seed', 0, 'FEMNIST, Shakespeare: seed of the training/test split.'
)
_KEEP_DOWNLOADS = flags.DEFINE_bool(
  'keep_downloads',
  True,
  'Keep the downloaded archives (in <data_dir>/downloads) once a dataset '
  'is prepared.',
)


# The flag of each option of `prepare.check_options`.
_FLAGS = {'train_fraction': 'leaf_train_fraction', 'seed': 'leaf_seed'}


def _names() -> list[str]:
  names = _DATASETS.value
  if not names:
    cli.fail(f'--datasets is empty; choose from {", ".join(prepare.NAMES)}')
  for name in names:
    if name not in prepare.NAMES:
      cli.fail(
        f'--datasets: unknown dataset {name!r}; choose from '
        f'{", ".join(prepare.NAMES)}'
      )
    if names.count(name) > 1:
      cli.fail(f'--datasets: {name} is named twice')
  return names


def summary(results: list[prepare.Prepared]) -> str:
  """One line per dataset: its size, where it is, whether it was already
  there and the flags of a run that reads it."""
  width = max(len(r.name) for r in results)
  lines = []
  for r in results:
    flag = f' --data_dir={r.data_dir}' if r.data_dir else ' (no --data_dir)'
    state = 'already there' if r.skipped else 'prepared'
    lines.append(
      f'{r.name:<{width}}  {download.human_size(r.size):>8}  {r.path}  '
      f'({state}; run with --dataset={r.name}{flag})'
    )
  return '\n'.join(lines)


def main(argv) -> None:
  cli.no_arguments(argv)
  # tensorflow-datasets warns of every folder it looks into; our own lines
  # say what happens.
  logging.set_verbosity(logging.ERROR)
  names = _names()
  fraction = _TRAIN_FRACTION.value
  try:
    prepare.check_options(fraction, _SEED.value)
  except errors.ArgumentError as e:
    cli.fail(f'--{_FLAGS[e.argument]} {e.message}')
  data_dir = _DATA_DIR.value
  prepare.check_data_dir(data_dir)
  # Before anything is downloaded: a missing TensorFlow stops the run now,
  # not after the other datasets.
  prepare.check_requirements(names, data_dir)
  results, failed = [], []
  try:
    for name in names:
      try:
        results.append(
          prepare.prepare(
            name,
            data_dir,
            train_fraction=fraction,
            seed=_SEED.value,
            keep_downloads=_KEEP_DOWNLOADS.value,
          )
        )
      except errors.DataError as e:  # the others may still succeed
        # The reason once, in the error line at the end.
        cli.log(f'{name}: failed (why: see the error at the end)')
        failed.append(
          str(e) if str(e).startswith(f'{name}: ') else f'{name}: {e}'
        )
  except KeyboardInterrupt:
    print(
      '\ninterrupted; run again to go on (downloads resume where they stopped)',
      file=sys.stderr,
    )
    sys.exit(130)
  if results:
    print('\nDatasets:')
    print(summary(results))
  if failed:
    cli.fail(f'not prepared: {"; ".join(failed)}')


def entry() -> None:
  """The console script `fedjax-mr-prepare`."""
  cli.run(main)


if __name__ == '__main__':
  entry()
