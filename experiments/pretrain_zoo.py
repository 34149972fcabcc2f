r"""Trains a heterogeneous pool of zoo models for FedStitch on public data.

  python -m experiments.pretrain_zoo --workdir=runs/pool

ImageNet weights cannot be downloaded here, so the pool is "pre-trained"
centrally on a held-out public part of the dataset's training split
(`--public_size` examples, a seeded split saved as `<out>/public.json`);
`experiments.stitch` gives the clients only the rest. Each model is saved
as `<out>/<model>/` (meta.json + an orbax checkpoint) and its test accuracy
printed. Re-running skips models already saved.

`--classes=0-4` trains the pool on those classes only (relabelled 0..n-1;
the public examples of other classes are left out), for a transfer
setting in which `experiments.stitch --classes=5-9 --eval=knn` stitches
for a task the pool never learnt.
"""

from __future__ import annotations

# First: Ctrl-C while the modules below import ends in one line (cli).
from . import cli  # isort: split

import math
import os

from absl import flags
from absl import logging

from fedjax_mr import models
from fedjax_mr.core import errors
from fedjax_mr.core import workdir as workdir_lib
from fedjax_mr.data import datasets
from fedjax_mr.stitch import pool

_DATASET = flags.DEFINE_string('dataset', 'fashion_mnist', 'Dataset.')
_DATA_DIR = flags.DEFINE_string('data_dir', None, 'Dataset folder.')
_MODELS = flags.DEFINE_list(
  'models',
  ['cnn_mnist', 'cnn_femnist', 'cnn_cifar', 'cnn_fedavg', 'resnet20'],
  'Zoo models of the pool (different architectures).',
)
_PUBLIC_SIZE = flags.DEFINE_integer(
  'public_size', 10000, 'Training examples held out as public data.'
)
_EPOCHS = flags.DEFINE_integer('epochs', 2, 'Epochs over the public data.')
_BATCH_SIZE = flags.DEFINE_integer('batch_size', 64, 'Batch size.')
_LEARNING_RATE = flags.DEFINE_float('lr', 1e-3, 'Adam step size.')
_SEED = flags.DEFINE_integer('seed', 0, 'Split, initialisation, shuffling.')
_OUT = flags.DEFINE_string(
  'workdir', 'runs/pool', 'Pool folder (experiments.stitch --pool).'
)
# The flags' names before they were unified with experiments.run's.
_CLASSES = flags.DEFINE_string(
  'classes',
  '',
  'Train the pool on these classes only, e.g. 0-4 (relabelled 0..n-1 in '
  'this order; a transfer setting with experiments.stitch --classes); '
  'empty: all.',
)
flags.DEFINE_alias('out', 'workdir')
# The flag of each argument of `datasets.load_task` whose name differs.
_FLAGS = {'name': 'dataset'}
flags.DEFINE_alias('learning_rate', 'lr')


def _check(names, public_size, epochs, batch_size, learning_rate, seed):
  """Refuses bad flag values before anything is loaded."""
  for name, value in (
    ('epochs', epochs),
    ('batch_size', batch_size),
    ('public_size', public_size),
  ):
    if value < 1:
      raise errors.ConfigError(f'--{name} must be ≥ 1, got {value}')
  if not (learning_rate > 0 and math.isfinite(learning_rate)):
    raise errors.ConfigError(
      f'--lr must be finite and > 0, got {learning_rate}'
    )
  if not 0 <= seed < 2**32:
    raise errors.ConfigError(f'--seed must be in [0, 2**32), got {seed}')
  unknown = [m for m in names if m not in models.NAMES]
  if unknown:
    raise errors.ConfigError(
      f'--models: unknown {", ".join(unknown)}; choose from '
      f'{", ".join(models.NAMES)}'
    )


def _model(name: str, ds):
  """The zoo model `name` for the dataset `ds`; one that cannot take its
  examples is refused naming --models (before anything is written)."""
  try:
    return models.get(name, ds.num_classes, ds.input_shape, dataset=ds.name)
  except errors.ConfigError as e:
    # This program's flag is --models (several), not run's --model.
    raise errors.ConfigError(
      str(e).replace(f'`model={name}`', f'--models: {name}')
    ) from None


def _pretrain_all(out, names, zoo, ds, public, classes, public_size, train):
  """Trains and saves each model `names` of `zoo` not yet in the pool folder
  `out` on the `public` examples of `ds` (of `classes`, None: all), and
  prints its test accuracy."""
  public = public[ds.y_train[public] >= 0]  # --classes
  x, y = ds.x_train[public], ds.y_train[public]
  for name in names:
    if os.path.exists(os.path.join(out, name, 'meta.json')):
      print(f'{name}: already saved, skipped')
      continue
    meta = pool.pretrain_and_save(
      out,
      name,
      zoo[name],
      ds,
      x,
      y,
      public_size=public_size,
      classes=classes,
      **train,
    )
    print(
      f'{name}: test accuracy {100 * meta["test_accuracy"]:.2f} % '
      f'(loss {meta["train_loss"][-1]:.3f}, {meta["train_seconds"]:.0f} s)'
    )


def main(argv) -> None:
  cli.no_arguments(argv)
  logging.set_verbosity(logging.WARNING)  # orbax logs every save
  out, size, seed = _OUT.value, _PUBLIC_SIZE.value, _SEED.value
  train = dict(
    epochs=_EPOCHS.value,
    batch_size=_BATCH_SIZE.value,
    learning_rate=_LEARNING_RATE.value,
    seed=seed,
  )
  try:
    _check(_MODELS.value, size, **train)
    workdir_lib.check_free(out)
    ds, classes = datasets.load_task(
      _DATASET.value, _DATA_DIR.value, _CLASSES.value
    )
    zoo = {name: _model(name, ds) for name in _MODELS.value}
    public, _ = pool.split_public(len(ds.y_train), size, seed)
    with workdir_lib.acquire(out):  # one writer per pool
      split = pool.write_public_split(out, ds.name, public, size, seed, classes)
      _pretrain_all(
        out, _MODELS.value, zoo, ds, public, split['classes'], size, train
      )
  except errors.ArgumentError as e:  # of `load_task`
    cli.fail(f'`{_FLAGS.get(e.argument, e.argument)}` {e.message}')
  except (errors.ConfigError, errors.DataError) as e:
    cli.fail(str(e))


def entry() -> None:
  """The console script `fedjax-mr-pretrain-zoo`."""
  cli.run(main)


if __name__ == '__main__':
  entry()
