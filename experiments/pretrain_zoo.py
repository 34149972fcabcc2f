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

import json
import math
import os
import time

from absl import flags
from absl import logging

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
flags.DEFINE_alias('learning_rate', 'lr')


_LOCKS = []


def _check_flags() -> None:
  """Refuses bad flag values before anything is loaded."""
  from fedjax_mr import models
  from fedjax_mr.core import errors

  for flag in (_EPOCHS, _BATCH_SIZE, _PUBLIC_SIZE):
    if flag.value < 1:
      raise errors.ConfigError(f'--{flag.name} must be ≥ 1, got {flag.value}')
  if not (_LEARNING_RATE.value > 0 and math.isfinite(_LEARNING_RATE.value)):
    raise errors.ConfigError(
      f'--lr must be finite and > 0, got {_LEARNING_RATE.value}'
    )
  if not 0 <= _SEED.value < 2**32:
    raise errors.ConfigError(f'--seed must be in [0, 2**32), got {_SEED.value}')
  unknown = [m for m in _MODELS.value if m not in models.NAMES]
  if unknown:
    raise errors.ConfigError(
      f'--models: unknown {", ".join(unknown)}; choose from '
      f'{", ".join(models.NAMES)}'
    )


def _load_dataset():
  """The dataset, of the --classes only when given (relabelled), and those
  classes (None: all)."""
  from fedjax_mr.data import datasets

  return datasets.load_task(_DATASET.value, _DATA_DIR.value, _CLASSES.value)


def _public_split(ds, classes):
  """Takes the pool folder (held until the process ends: one writer per
  pool) and writes its public split, `public.json`; refuses a folder whose
  pool was trained on another split.

  Returns:
    The public examples' indices into `ds.x_train`, and the split as
    written: {'dataset', 'seed', 'public_size', 'indices', 'classes'}.
  """
  from fedjax_mr.core import errors
  from fedjax_mr.core import files
  from fedjax_mr.core import jsonfile
  from fedjax_mr.core import workdir as workdir_lib
  from fedjax_mr.stitch import pool

  public, _ = pool.split_public(
    len(ds.y_train), _PUBLIC_SIZE.value, _SEED.value
  )
  _LOCKS.append(workdir_lib.acquire(_OUT.value))
  split_path = os.path.join(_OUT.value, 'public.json')
  split = {
    'dataset': ds.name,
    'seed': _SEED.value,
    'public_size': _PUBLIC_SIZE.value,
    'indices': public.tolist(),
    'classes': None if classes is None else list(classes),
  }
  if os.path.lexists(split_path):
    try:
      old = jsonfile.load(split_path, pool.MAX_PUBLIC_BYTES)
    except jsonfile.JsonFileError as e:
      raise errors.ConfigError(
        f'--workdir={_OUT.value}: its public split {e} (the split of '
        'the pool trained there): use a new --workdir'
      ) from None
    if (
      old.get('indices') != split['indices']
      or old.get('classes') != (split['classes'])
    ):
      raise errors.ConfigError(
        f'--workdir={_OUT.value} holds a pool trained on another public '
        'split (--dataset, --public_size, --seed or --classes differ): '
        'use a new --workdir'
      )
  files.write_atomic(split_path, lambda f: json.dump(split, f))
  return public, split


def _model(name: str, ds):
  """The zoo model `name` for the dataset `ds`; one that cannot take its
  examples is refused naming --models (before anything is written)."""
  from fedjax_mr import models
  from fedjax_mr.core import errors

  try:
    return models.get(name, ds.num_classes, ds.input_shape, dataset=ds.name)
  except errors.ConfigError as e:
    # This program's flag is --models (several), not run's --model.
    raise errors.ConfigError(
      str(e).replace(f'`model={name}`', f'--models: {name}')
    ) from None


def _pretrain(name: str, model, ds, x, y, classes) -> None:
  """Trains `model` (the zoo model `name`) on the public examples (`x`,
  `y`), saves it in the pool folder and prints its test accuracy."""
  from fedjax_mr.stitch import pool

  t0 = time.perf_counter()
  variables, losses = pool.pretrain(
    model,
    x,
    y,
    scale=ds.scale,
    shift=ds.shift,
    epochs=_EPOCHS.value,
    batch_size=_BATCH_SIZE.value,
    learning_rate=_LEARNING_RATE.value,
    seed=_SEED.value,
  )
  seconds = time.perf_counter() - t0
  acc = pool.accuracy(
    model, variables, ds.x_test, ds.y_test, scale=ds.scale, shift=ds.shift
  )
  pool.save_model(
    _OUT.value,
    name,
    model,
    variables,
    dataset=ds.name,
    public_size=_PUBLIC_SIZE.value,
    classes=classes,
    epochs=_EPOCHS.value,
    train_loss=losses,
    test_accuracy=acc,
    train_seconds=seconds,
  )
  print(
    f'{name}: test accuracy {100 * acc:.2f} % '
    f'(loss {losses[-1]:.3f}, {seconds:.0f} s)'
  )


def main(argv) -> None:
  cli.no_arguments(argv)
  logging.set_verbosity(logging.WARNING)  # orbax logs every save
  from fedjax_mr.core import errors
  from fedjax_mr.core import workdir as workdir_lib

  try:
    _check_flags()
    workdir_lib.check_free(_OUT.value)
    ds, classes = _load_dataset()
    zoo = {name: _model(name, ds) for name in _MODELS.value}
    public, split = _public_split(ds, classes)
    public = public[ds.y_train[public] >= 0]  # --classes
    x, y = ds.x_train[public], ds.y_train[public]
    for name in _MODELS.value:
      if os.path.exists(os.path.join(_OUT.value, name, 'meta.json')):
        print(f'{name}: already saved, skipped')
        continue
      _pretrain(name, zoo[name], ds, x, y, split['classes'])
  except (errors.ConfigError, errors.DataError) as e:
    cli.fail(str(e))


def entry() -> None:
  """The console script `fedjax-mr-pretrain-zoo`."""
  cli.run(main)


if __name__ == '__main__':
  entry()
