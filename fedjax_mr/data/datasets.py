"""Datasets as host numpy arrays.

Images stay in their storage dtype (uint8) on the host and on the device;
the model input is `x * scale + shift` in float32, applied per batch (see
`fedjax_mr.data.client_data.normalize`). This keeps device memory at one byte
per pixel and the host never holds a float copy.

Sources:
  * IDX files (the format of (Fashion-)MNIST, as Debian's
    `dataset-fashion-mnist` installs them in /usr/share/datasets/fashion-mnist).
  * tensorflow-datasets through its TF-free random-access `tfds.data_source`
    API (array_record files). Preparing such a dataset once needs TensorFlow
    (the `prepare` extra); reading it does not.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from fedjax_mr.core import errors

DEFAULT_FASHION_MNIST_DIR = '/usr/share/datasets/fashion-mnist'

_IDX_STEMS = {
  'x_train': 'train-images-idx3-ubyte',
  'y_train': 'train-labels-idx1-ubyte',
  'x_test': 't10k-images-idx3-ubyte',
  'y_test': 't10k-labels-idx1-ubyte',
}


class Dataset(NamedTuple):
  """A classification dataset held on the host.

  Attributes:
    name: registry name.
    x_train: `[M, H, W, C]` examples in storage dtype.
    y_train: `[M]` int32 labels.
    x_test: `[M_test, H, W, C]`.
    y_test: `[M_test]` int32.
    num_classes: number of labels.
    scale: model input is `x * scale + shift`.
    shift: see `scale`.
  """

  name: str
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int
  scale: float
  shift: float

  @property
  def input_shape(self) -> tuple[int, ...]:
    return tuple(self.x_train.shape[1:])


class _Spec(NamedTuple):
  tfds_name: str
  num_classes: int
  scale: float
  shift: float
  has_idx: bool  # may be read from IDX files
  default_dir: str | None


# Normalisation as in the reference code: (Fashion-)MNIST pixels / 255;
# CIFAR mean 0.5, std 0.5 per channel, i.e. x / 127.5 - 1.
_SPECS = {
  'fashion_mnist': _Spec(
    'fashion_mnist', 10, 1 / 255, 0.0, True, DEFAULT_FASHION_MNIST_DIR
  ),
  'mnist': _Spec('mnist', 10, 1 / 255, 0.0, True, None),
  'cifar10': _Spec('cifar10', 10, 1 / 127.5, -1.0, False, None),
  'cifar100': _Spec('cifar100', 100, 1 / 127.5, -1.0, False, None),
  'emnist': _Spec('emnist/byclass', 62, 1 / 255, 0.0, False, None),
}

NAMES = tuple(sorted(_SPECS))


def load(name: str, data_dir: str | None = None) -> Dataset:
  """Loads a dataset by name.

  Args:
    name: one of `NAMES`.
    data_dir: for `fashion_mnist`/`mnist`, a folder with the four IDX files
      (default for Fashion-MNIST: Debian's folder); otherwise, or when no IDX
      files are there, a tensorflow-datasets data dir (default: tfds's).

  Raises:
    ConfigError: unknown name.
    DataError: the data is missing or unreadable; the message says how to
      get it.
  """
  if name not in _SPECS:
    raise errors.ConfigError(
      f'--dataset: unknown dataset {name!r}; choose one of {", ".join(NAMES)}'
    )
  spec = _SPECS[name]
  if data_dir and not os.path.isdir(data_dir):
    raise errors.DataError(f'--data_dir: {data_dir!r} is not a readable folder')
  if data_dir and not os.access(data_dir, os.R_OK | os.X_OK):
    raise errors.DataError(f'--data_dir: {data_dir!r} is not readable')
  idx_dir = data_dir or spec.default_dir
  if spec.has_idx and idx_dir and _has_idx_files(idx_dir):
    return _load_idx(name, spec, idx_dir)
  return _load_tfds(name, spec, data_dir)


def _has_idx_files(folder: str) -> bool:
  from fedjax_mr.data import idx

  return all(idx.find_idx_file(folder, s) for s in _IDX_STEMS.values())


def _load_idx(name: str, spec: _Spec, folder: str) -> Dataset:
  from fedjax_mr.data import idx

  arrays = {
    k: idx.read_idx(idx.find_idx_file(folder, stem))
    for k, stem in _IDX_STEMS.items()
  }
  for split in ('train', 'test'):
    x, y = arrays[f'x_{split}'], arrays[f'y_{split}']
    if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
      raise errors.DataError(
        f'{folder}: {split} images {x.shape} and labels {y.shape} do not match'
      )
  return Dataset(
    name=name,
    x_train=arrays['x_train'][..., None],
    y_train=arrays['y_train'].astype(np.int32),
    x_test=arrays['x_test'][..., None],
    y_test=arrays['y_test'].astype(np.int32),
    num_classes=spec.num_classes,
    scale=spec.scale,
    shift=spec.shift,
  )


def _missing_message(name: str, spec: _Spec, data_dir: str | None) -> str:
  where = data_dir or '~/tensorflow_datasets'
  hint = ''
  if name == 'fashion_mnist':
    hint = (
      f"install Debian's IDX files with `apt-get install -y "
      f'dataset-fashion-mnist` (they go to {DEFAULT_FASHION_MNIST_DIR}), or '
    )
  elif spec.has_idx:
    hint = 'pass --data_dir to a folder holding the four IDX files, or '
  return (
    f'dataset {name!r} not found in {where}: {hint}prepare it once with '
    f'tensorflow-datasets (needs TensorFlow: `pip install -e ".[prepare]"` '
    f'then `tfds build {spec.tfds_name} --data_dir {where} '
    f'--file_format array_record`) and pass --data_dir'
  )


def _load_tfds(name: str, spec: _Spec, data_dir: str | None) -> Dataset:
  import tensorflow_datasets as tfds

  splits = {}
  for split in ('train', 'test'):
    try:
      source = tfds.data_source(
        spec.tfds_name, split=split, data_dir=data_dir, download=False
      )
    except Exception:  # noqa: BLE001 - tfds raises many types for "missing".
      raise errors.DataError(_missing_message(name, spec, data_dir)) from None
    splits[split] = _read_source(source)
  (x_train, y_train), (x_test, y_test) = splits['train'], splits['test']
  return Dataset(
    name=name,
    x_train=x_train,
    y_train=y_train,
    x_test=x_test,
    y_test=y_test,
    num_classes=spec.num_classes,
    scale=spec.scale,
    shift=spec.shift,
  )


def _read_source(source) -> tuple[np.ndarray, np.ndarray]:
  """Reads a random-access tfds source into preallocated arrays."""
  n = len(source)
  if n == 0:
    raise errors.DataError('tfds split is empty')
  first = source[0]
  image = np.asarray(first['image'])
  x = np.empty((n, *image.shape), image.dtype)
  y = np.empty((n,), np.int32)
  for i in range(n):
    record = first if i == 0 else source[i]
    x[i] = record['image']
    y[i] = record['label']
  return x, y
