"""Datasets as host numpy arrays.

Images stay in their storage dtype (uint8) on the host and on the device;
the model input is `x * scale + shift` in float32, applied per batch (see
`fedjax_mr.data.client_data.normalize`). This keeps device memory at one byte
per pixel and the host never holds a float copy. Token datasets (Shakespeare)
store character ids as uint8 with scale 1 and shift 0, which `normalize`
passes through unchanged.

Sources:
  * IDX files (the format of (Fashion-)MNIST, as Debian's
    `dataset-fashion-mnist` installs them in /usr/share/datasets/fashion-mnist).
  * tensorflow-datasets through its TF-free random-access `tfds.data_source`
    API (array_record files). Preparing such a dataset once needs TensorFlow
    (the `prepare` extra); reading it does not.
  * LEAF json folders (FEMNIST, Shakespeare; `fedjax_mr.data.leaf`), which
    also give each user's examples: `Dataset.clients`, the natural partition.
  * The CINIC-10 image folders (`fedjax_mr.data.cinic`).

`synthetic` is a name here too, but nothing is loaded: its clients and
examples are generated on demand (`fedjax_mr.data.synthetic`), and `load`
refuses it.

Peak host memory while loading. Every array is allocated once at its final
size and filled in place (N × H × W × C bytes, plus 4 bytes per label; full
datasets):

| dataset           | train + test examples   | arrays | peak     |
|-------------------|-------------------------|--------|----------|
| mnist, fashion_m. | 60,000 + 10,000 28×28×1 | 55 MB  | 55 MB    |
| emnist (byclass)  | 697,932 + 116,323 28×28 | 642 MB | 642 MB   |
| cifar10, cifar100 | 50,000 + 10,000 32×32×3 | 185 MB | 185 MB   |
| svhn_cropped      | 73,257 + 26,032 32×32×3 | 305 MB | 305 MB   |
| cinic10           | 90,000 + 90,000 32×32×3 | 554 MB | 554 MB   |
| femnist (LEAF)    | 805,263 28×28×1 in all  | 635 MB | ≈ 1.5 GB |
| shakespeare (LEAF)| 4,226,158 × 80 ids      | 355 MB | ≈ 1.7 GB |

tfds and CINIC-10 read one record or image at a time ('extra' of SVHN and
'valid' of CINIC-10 are not read). LEAF json is parsed one file at a time;
Python's json holds ≈ 45 KB per FEMNIST sample (784 float objects; LEAF's
files hold 100 writers, ≈ 20,000 training samples: ≈ 0.9 GB) and ≈ 0.35 KB
per Shakespeare sample (LEAF writes one file per split, ≈ 3.8 M training
samples: ≈ 1.3 GB), measured on synthetic files of that format.
`partition=natural` with fewer clients than users copies only the kept
users' examples. On the CPU backend, the device arrays of `ClientData` and
`EvalData` are one more copy of the training and test sets.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator
from typing import NamedTuple
from typing import Sequence

import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.data import cinic
from fedjax_mr.data import host
from fedjax_mr.data import leaf
from fedjax_mr.data import synthetic

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
    clients: the natural partition (LEAF datasets): one index array into
      `x_train` per user; None for datasets without one.
    test_clients: per entry of `clients`, that user's indices into `x_test`,
      when the test split holds the same users; else None.
  """

  name: str
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int
  scale: float
  shift: float
  clients: tuple[np.ndarray, ...] | None = None
  test_clients: tuple[np.ndarray, ...] | None = None

  @property
  def input_shape(self) -> tuple[int, ...]:
    return tuple(self.x_train.shape[1:])


class _Spec(NamedTuple):
  source: str  # 'tfds', 'leaf' or 'cinic'
  tfds_name: str
  num_classes: int
  scale: float
  shift: float
  has_idx: bool = False  # may be read from IDX files
  default_dir: str | None = None


# Normalisation as in the reference code: (Fashion-)MNIST pixels / 255;
# CIFAR mean 0.5, std 0.5 per channel, i.e. x / 127.5 - 1 (also used for
# SVHN and CINIC-10, our choice); FEMNIST (0.5 - x) / 0.5 for LEAF's x in
# [0, 1], stored as u = 255 x: 1 - 2u / 255.
_SPECS = {
  'fashion_mnist': _Spec(
    'tfds', 'fashion_mnist', 10, 1 / 255, 0.0, True, DEFAULT_FASHION_MNIST_DIR
  ),
  'mnist': _Spec('tfds', 'mnist', 10, 1 / 255, 0.0, True),
  'cifar10': _Spec('tfds', 'cifar10', 10, 1 / 127.5, -1.0),
  'cifar100': _Spec('tfds', 'cifar100', 100, 1 / 127.5, -1.0),
  'emnist': _Spec('tfds', 'emnist/byclass', 62, 1 / 255, 0.0),
  'svhn_cropped': _Spec('tfds', 'svhn_cropped', 10, 1 / 127.5, -1.0),
  'cinic10': _Spec('cinic', '', 10, 1 / 127.5, -1.0),
  'femnist': _Spec('leaf', '', 62, -2 / 255, 1.0),
  'shakespeare': _Spec('leaf', '', len(leaf.ALL_LETTERS), 1.0, 0.0),
}

# Generated on demand, never loaded (`fedjax_mr.data.synthetic`).
SYNTHETIC = synthetic.NAME
NAMES = tuple(sorted((*_SPECS, SYNTHETIC)))
# Datasets with their own users (`partition=natural`).
NATURAL = tuple(n for n in NAMES if n in _SPECS and _SPECS[n].source == 'leaf')
CIFAR100_LABELS = ('fine', 'coarse')
# The names figures and tables give the datasets.
DISPLAY_NAMES = {
  'cifar10': 'CIFAR-10',
  'cifar100': 'CIFAR-100',
  'cinic10': 'CINIC-10',
  'emnist': 'EMNIST (byclass)',
  'fashion_mnist': 'Fashion-MNIST',
  'femnist': 'FEMNIST',
  'mnist': 'MNIST',
  'shakespeare': 'Shakespeare',
  'svhn_cropped': 'SVHN',
  SYNTHETIC: 'Synthetic',
}


def _dataset(name: str, spec: _Spec, train, test, **natural) -> Dataset:
  """A `Dataset` of (x, y) train and test pairs with `spec`'s classes and
  normalisation; `natural` passes `clients` and `test_clients`."""
  return Dataset(
    name=name,
    x_train=train[0],
    y_train=train[1],
    x_test=test[0],
    y_test=test[1],
    num_classes=spec.num_classes,
    scale=spec.scale,
    shift=spec.shift,
    **natural,
  )


# One example's shape, the images each dataset holds (`random_images`).
IMAGE_SHAPES = {
  'fashion_mnist': (28, 28, 1),
  'mnist': (28, 28, 1),
  'emnist': (28, 28, 1),
  'femnist': (28, 28, 1),
  'cifar10': (32, 32, 3),
  'cifar100': (32, 32, 3),
  'svhn_cropped': (32, 32, 3),
  'cinic10': (32, 32, 3),
}


def random_images(
  name: str, num_train: int, num_test: int, seed: int = 0
) -> Dataset:
  """A stand-in for image dataset `name`: its shape, classes and
  normalisation, uniform random uint8 pixels and labels (for timing where
  the data cannot be read, as on a machine without the dataset).

  Args:
    name: a key of `IMAGE_SHAPES`.
    num_train, num_test: examples in each split (≥ 1).
    seed: of the pixels and labels.

  Raises:
    ArgumentError: naming `name` (unknown) or a count below 1.
  """
  if name not in IMAGE_SHAPES:
    raise errors.ArgumentError(
      'name',
      f'{name!r} has no random stand-in; choose one of '
      f'{", ".join(sorted(IMAGE_SHAPES))}',
    )
  errors.check_count('num_train', num_train)
  errors.check_count('num_test', num_test)
  spec = _SPECS[name]
  rng = np.random.default_rng(seed)

  def split(n):
    x = rng.integers(0, 256, (n, *IMAGE_SHAPES[name]), np.uint8)
    return x, rng.integers(0, spec.num_classes, n).astype(np.int32)

  return _dataset(name, spec, split(num_train), split(num_test))


def tfds_name(name: str) -> str:
  """The tensorflow-datasets name `name` is read under ('' for the LEAF
  and CINIC-10 datasets)."""
  spec = _SPECS.get(name)
  return spec.tfds_name if spec and spec.source == 'tfds' else ''


def input_kind(name: str) -> str:
  """'tokens' for `[T]` integer sequences (shakespeare), 'vectors' for
  `[D]` features (synthetic), else 'images'."""
  if name == SYNTHETIC:
    return 'vectors'
  return 'tokens' if name == 'shakespeare' else 'images'


def load(
  name: str,
  data_dir: str | None = None,
  *,
  cifar100_labels: str = 'fine',
  leaf_min_samples: int = 0,
) -> Dataset:
  """Loads a dataset by name.

  Args:
    name: one of `NAMES`.
    data_dir: for `fashion_mnist`/`mnist`, a folder with the four IDX files
      (default for Fashion-MNIST: Debian's folder); for `femnist` and
      `shakespeare`, LEAF's folder holding `train/` and `test/` json files;
      for `cinic10`, the folder holding `train/`, `valid/`, `test/`;
      otherwise, or when no IDX files are there, a tensorflow-datasets data
      dir (default: tfds's).
    cifar100_labels: `cifar100` only: 'fine' (100 classes) or 'coarse' (the
      20 superclasses the reference code uses).
    leaf_min_samples: LEAF datasets only: keep the users with more than this
      many samples (training plus test); 0 keeps all.

  Raises:
    ArgumentError: naming the unknown `name` or bad option.
    DataError: the data is missing or unreadable; the message says how to
      get it.
  """
  if name == SYNTHETIC:
    raise errors.ArgumentError(
      'name',
      f'{name!r} is generated on demand, not loaded '
      '(fedjax_mr.data.synthetic); it has no stored training set',
    )
  if name not in _SPECS:
    raise errors.ArgumentError(
      'name', f'{name!r} is unknown; choose one of {", ".join(NAMES)}'
    )
  if cifar100_labels not in CIFAR100_LABELS:
    raise errors.ArgumentError(
      'cifar100_labels',
      f'{cifar100_labels!r} is unknown; choose one of '
      f'{", ".join(CIFAR100_LABELS)}',
    )
  if leaf_min_samples < 0:
    raise errors.ArgumentError(
      'leaf_min_samples', f'must be ≥ 0, got {leaf_min_samples}'
    )
  spec = _SPECS[name]
  if data_dir and not os.path.isdir(data_dir):
    raise errors.DataError(f'`data_dir`: {data_dir!r} is not a readable folder')
  if data_dir and not os.access(data_dir, os.R_OK | os.X_OK):
    raise errors.DataError(f'`data_dir`: {data_dir!r} is not readable')
  if spec.source == 'leaf':
    return _load_leaf(name, spec, data_dir, leaf_min_samples)
  if spec.source == 'cinic':
    return _load_cinic(name, spec, data_dir)
  idx_dir = data_dir or spec.default_dir
  if spec.has_idx and idx_dir and _has_idx_files(idx_dir):
    return _load_idx(name, spec, idx_dir)
  if name == 'cifar100' and cifar100_labels == 'coarse':
    spec = spec._replace(num_classes=20)
    return _load_tfds(name, spec, data_dir, label_key='coarse_label')
  return _load_tfds(name, spec, data_dir)


def natural_clients(dataset: Dataset, num_clients: int, seed: int) -> Dataset:
  """Keeps `num_clients` of a dataset's own users (`partition=natural`).

  With fewer clients than users, a seeded uniform subset of users is kept
  (in their original order) and only their examples: the training arrays
  are compacted, and the test set becomes the pooled test data of the kept
  users when the test split holds the same users (LEAF's `-t sample`);
  otherwise the whole test set is kept.

  Args:
    dataset: a dataset with `clients`.
    num_clients: N ≤ number of users.
    seed: numpy seed of the subset.

  Returns:
    The dataset whose `clients` are the N kept users.

  Raises:
    ArgumentError: naming `dataset` (no natural clients) or `num_clients`
      (more than its users).
  """
  if dataset.clients is None:
    raise errors.ArgumentError(
      'dataset',
      f'{dataset.name} has no natural clients (those that do: '
      f'{", ".join(NATURAL)})',
    )
  users = len(dataset.clients)
  if num_clients > users:
    raise errors.ArgumentError(
      'num_clients',
      f'exceeds the {users} users of {dataset.name}; use at most {users}',
    )
  if num_clients == users:
    return dataset
  keep = np.sort(
    np.random.default_rng(seed).choice(users, num_clients, replace=False)
  )
  rows = [dataset.clients[k] for k in keep]
  sizes = [len(r) for r in rows]
  take = np.concatenate(rows)
  bounds = np.cumsum([0, *sizes])
  clients = tuple(np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:]))
  x_test, y_test, test_clients = dataset.x_test, dataset.y_test, None
  if dataset.test_clients is not None:
    test_rows = [dataset.test_clients[k] for k in keep]
    test_take = np.concatenate(test_rows).astype(np.int64)
    if not len(test_take):
      raise errors.DataError(
        f'`partition=natural`: the {num_clients} users kept (`seed`) have no '
        'test examples; change `seed` or `num_clients`'
      )
    x_test, y_test = x_test[test_take], y_test[test_take]
    bounds = np.cumsum([0, *(len(r) for r in test_rows)])
    test_clients = tuple(
      np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])
    )
  return dataset._replace(
    x_train=dataset.x_train[take],
    y_train=dataset.y_train[take],
    x_test=x_test,
    y_test=y_test,
    clients=clients,
    test_clients=test_clients,
  )


def parse_classes(
  text: str | Sequence[str], num_classes: int
) -> tuple[int, ...]:
  """Class ids from `text`: `'0,1,2'`, `'5-9'` or a mix (`'0-2,7'`), in
  the order given.

  Raises:
    ArgumentError: naming `text`: an unparsable item, an id outside
      `[0, num_classes)`, a repeated id, or fewer than 2 classes.
  """
  items = text.split(',') if isinstance(text, str) else list(text)
  out: list[int] = []
  for item in (i.strip() for i in items):
    try:
      if '-' in item[1:]:
        a, b = item.split('-', 1)
        out.extend(range(int(a), int(b) + 1))
      else:
        out.append(int(item))
    except ValueError:
      raise errors.ArgumentError(
        'text', f'holds {item!r}, not a class id or a range a-b'
      ) from None
  bad = [c for c in out if not 0 <= c < num_classes]
  if bad:
    raise errors.ArgumentError(
      'text', f'holds class {bad[0]}, not in [0, {num_classes})'
    )
  if len(set(out)) != len(out):
    raise errors.ArgumentError('text', f'names a class twice: {out}')
  if len(out) < 2:
    raise errors.ArgumentError(
      'text', f'must name ≥ 2 classes (a task), got {out}'
    )
  return tuple(out)


def load_task(
  name: str, data_dir: str | None, classes: str | Sequence[str] = ''
) -> tuple[Dataset, tuple[int, ...] | None]:
  """`(dataset, class ids)`: dataset `name` (from `data_dir`), reduced to
  the `classes` (a `parse_classes` value) when given, else whole (None).

  Raises:
    ArgumentError: naming `name` (as `load`) or `classes` (as
      `parse_classes`).
    DataError: as `load`.
  """
  dataset = load(name, data_dir)
  if not classes:
    return dataset, None
  try:
    ids = parse_classes(classes, dataset.num_classes)
  except errors.ArgumentError as e:
    raise errors.ArgumentError('classes', e.message) from None
  return select_classes(dataset, ids), ids


def select_classes(dataset: Dataset, classes: Sequence[int]) -> Dataset:
  """The task of `classes` only, relabelled `0..len(classes) − 1` in the
  given order (a transfer setting: the pool learns one part of the
  classes, the clients need another).

  The training arrays keep every example, so indices into `x_train` (a
  pool's public split) stay valid: examples of other classes get label −1
  and the caller keeps `y_train >= 0`. The test set holds only the kept
  classes.
  """
  remap = np.full(dataset.num_classes, -1, np.int32)
  remap[np.asarray(classes, np.int64)] = np.arange(len(classes))
  keep = remap[dataset.y_test] >= 0
  return dataset._replace(
    y_train=remap[dataset.y_train],
    x_test=dataset.x_test[keep],
    y_test=remap[dataset.y_test[keep]],
    num_classes=len(classes),
    clients=None,
    test_clients=None,
  )


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
    if x.dtype != np.uint8:
      raise errors.DataError(
        f'{idx.find_idx_file(folder, _IDX_STEMS["x_" + split])}: images must '
        f'be unsigned bytes (IDX type 0x08), not {x.dtype}'
      )
    labels = idx.find_idx_file(folder, _IDX_STEMS['y_' + split])
    if not np.issubdtype(y.dtype, np.integer):
      raise errors.DataError(
        f'{labels}: labels must be integers, not {y.dtype}'
      )
    if len(y) and (y.min() < 0 or y.max() >= spec.num_classes):
      raise errors.DataError(
        f'{labels}: labels must lie in 0..{spec.num_classes - 1}, found '
        f'{int(y.min())}..{int(y.max())}'
      )
  if arrays['x_train'].shape[1:] != arrays['x_test'].shape[1:]:
    raise errors.DataError(
      f'{folder}: test images are {arrays["x_test"].shape[1:]}, training '
      f'images {arrays["x_train"].shape[1:]}'
    )
  return _dataset(
    name,
    spec,
    (arrays['x_train'][..., None], arrays['y_train'].astype(np.int32)),
    (arrays['x_test'][..., None], arrays['y_test'].astype(np.int32)),
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
    hint = 'pass `data_dir` to a folder holding the four IDX files, or '
  place = f', `data_dir={data_dir}`' if data_dir else ''
  return (
    f'dataset {name!r} not found in {where}: {hint}prepare it once with '
    f'experiments.prepare (`datasets={name}`{place}; needs TensorFlow: '
    f'`pip install -e ".[prepare]"`; it runs tensorflow-datasets\' '
    f'`tfds build {spec.tfds_name}` with the array_record file format)'
  )


def _load_tfds(
  name: str, spec: _Spec, data_dir: str | None, label_key: str = 'label'
) -> Dataset:
  import tensorflow_datasets as tfds

  splits = {}
  for split in ('train', 'test'):
    try:
      with _tfds_warnings_off():
        source = tfds.data_source(
          spec.tfds_name, split=split, data_dir=data_dir, download=False
        )
    except Exception:  # noqa: BLE001 - tfds raises many types for "missing".
      raise errors.DataError(_missing_message(name, spec, data_dir)) from None
    splits[split] = _read_source(source, label_key)
  return _dataset(name, spec, splits['train'], splits['test'])


@contextlib.contextmanager
def _tfds_warnings_off() -> Iterator[None]:
  """absl's log at ERROR and above only: tensorflow-datasets warns of each
  folder it looks into ('Variant folder ... has no dataset_info.json')
  before the loader says in one line what is missing."""
  from absl import logging as absl_logging

  level = absl_logging.get_verbosity()
  absl_logging.set_verbosity(min(level, absl_logging.ERROR))
  try:
    yield
  finally:
    absl_logging.set_verbosity(level)


def _read_source(
  source, label_key: str = 'label'
) -> tuple[np.ndarray, np.ndarray]:
  """Reads a random-access tfds source into preallocated arrays."""
  n = len(source)
  if n == 0:
    raise errors.DataError('tfds split is empty')
  first = source[0]
  image = np.asarray(first['image'])
  x = host.empty((n, *image.shape), image.dtype)
  y = np.empty((n,), np.int32)
  for i in range(n):
    record = first if i == 0 else source[i]
    x[i] = record['image']
    y[i] = record[label_key]
  return x, y


def _load_leaf(
  name: str, spec: _Spec, data_dir: str | None, min_samples: int
) -> Dataset:
  if not data_dir:
    raise errors.DataError(
      f'dataset {name!r} is read from LEAF json files: prepare them with '
      f'experiments.prepare (`datasets={name}`) and pass '
      f"`data_dir=data/leaf/{name}/data`, or run LEAF's `preprocess.sh` in "
      f'leaf/data/{name} (e.g. `./preprocess.sh -s niid -k 0 -t sample` '
      'with a sampling fraction `sf` of 1.0) and pass '
      f'`data_dir=leaf/data/{name}/data` (the folder holding train/ and '
      'test/)'
    )
  reader = leaf.load_femnist if name == 'femnist' else leaf.load_shakespeare
  data = reader(data_dir, min_samples)
  if not len(data.y_test):
    raise errors.DataError(
      f'{data_dir}: no test examples (of users with more than {min_samples} '
      'samples)'
    )
  for split, y in (('train', data.y_train), ('test', data.y_test)):
    if y.size and not (y.min() >= 0 and y.max() < spec.num_classes):
      raise errors.DataError(
        f'{data_dir}: {split} labels must lie in [0, {spec.num_classes})'
      )
  return _dataset(
    name,
    spec,
    (data.x_train, data.y_train),
    (data.x_test, data.y_test),
    clients=data.clients,
    test_clients=data.test_clients,
  )


def _load_cinic(name: str, spec: _Spec, data_dir: str | None) -> Dataset:
  if not data_dir:
    raise errors.DataError(
      'dataset cinic10 is read from its image folders: prepare them with '
      'experiments.prepare (`datasets=cinic10`) and pass '
      '`data_dir=data/cinic10`, or download and unpack CINIC-10 '
      '(https://github.com/BayesWatch/cinic-10) and pass '
      '`data_dir=<folder holding train/, valid/, test/>`'
    )
  return _dataset(
    name,
    spec,
    cinic.load_split(data_dir, ('train',)),
    cinic.load_split(data_dir, ('test',)),
  )
