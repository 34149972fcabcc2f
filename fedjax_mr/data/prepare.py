"""Prepares the papers' datasets where `datasets.load` reads them.

For a machine with internet access; `experiments/prepare.py` is the
program. Each dataset goes to the place `datasets.load` (and the bundled
configs) look for it, so a run needs no more than the `data_dir` that
`Prepared` gives:

| dataset          | source                         | written to            |
|------------------|--------------------------------|-----------------------|
| cifar10,         | tensorflow-datasets' builder   | the tfds data dir     |
| cifar100, emnist | (array_record files); also     |                       |
| (mnist, ...)     | the loader's other tfds ones   |                       |
| femnist          | NIST SD19 by_class.zip and     | <root>/leaf/femnist/  |
|                  | by_write.zip, LEAF's pipeline  | data                  |
| shakespeare      | Gutenberg's 1994 Shakespeare,  | <root>/leaf/          |
|                  | LEAF's pipeline                | shakespeare/data      |
| cinic10          | the CINIC-10 tarball           | <root>/cinic10        |

With `data_dir` given, the tfds data dir and <root> are both `data_dir`;
without, the tfds data dir is tensorflow-datasets' default
(`~/tensorflow_datasets`, or `$TFDS_DATA_DIR`) and <root> is `data` in the
working folder (the bundled configs' `data_dir=data/leaf/...`). Archives
are downloaded to `<root>/downloads` (`download`; tfds keeps its own in
`<root>/downloads/tfds`); an archive already in `<root>/downloads` under
its published name (tfds's `cifar-10-binary.tar.gz`, ...: a failure names
them) is used as it is, so a machine without internet access can be given
them by hand. A failed tfds preparation removes the folders it created
(no `~/tensorflow_datasets` is left behind), and draws no progress bars
unless stderr is a terminal.

The LEAF and CINIC-10 folders are written as `<folder>.partial` and renamed
when complete (tfds does the same with its own), so a failed run leaves
nothing that looks prepared, and a prepared dataset is detected and
skipped. What each conversion does, and where it differs from LEAF's:
`femnist`, `shakespeare` (both in LEAF's json format, `leaf`) and `cinic`.

References:
  Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018.
  Darlow et al., "CINIC-10 is not ImageNet or CIFAR-10", arXiv:1810.03505,
  2018.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import sys
import urllib.parse
import urllib.request
from typing import Callable
from typing import Iterator
from typing import NamedTuple

from fedjax_mr.core import errors
from fedjax_mr.data import cinic
from fedjax_mr.data import datasets
from fedjax_mr.data import download
from fedjax_mr.data import femnist
from fedjax_mr.data import leaf
from fedjax_mr.data import shakespeare

# Every dataset the loader reads through tensorflow-datasets.
TFDS = tuple(n for n in datasets.NAMES if datasets.tfds_name(n))
NAMES = (*TFDS, 'cinic10', 'femnist', 'shakespeare')
# The papers' datasets (what the program prepares by default).
PAPERS = ('cifar10', 'cifar100', 'emnist', 'femnist', 'shakespeare', 'cinic10')
DEFAULT_ROOT = 'data'
# What preparing a tfds dataset needs beyond reading it: TensorFlow, and
# importlib_resources, which tensorflow-datasets 4.9 imports to build a
# dataset but declares only for Python < 3.9.
TFDS_NEEDS = {
  'tensorflow': 'TensorFlow',
  'importlib_resources': 'importlib_resources',
}
EXTRA_HINT = "pip install 'fedjax_mr[prepare]'"
# The folder below the downloads where tensorflow-datasets keeps its own
# (files named by tfds, and what it extracts).
TFDS_DOWNLOADS = 'tfds'

# The archives of each dataset that is not a tfds one.
SOURCES = {
  'femnist': femnist.SOURCES,
  'shakespeare': shakespeare.SOURCES,
  'cinic10': cinic.SOURCES,
}


class Prepared(NamedTuple):
  """What `prepare` did for one dataset.

  Attributes:
    name: the dataset.
    path: the folder holding its files.
    data_dir: the `data_dir` of a run that reads it ('' for the default).
    skipped: it was already prepared.
    size: bytes on disk under `path`.
  """

  name: str
  path: str
  data_dir: str
  skipped: bool
  size: int


def disk_size(path: str) -> int:
  """Bytes of the files under `path` (a file or a folder)."""
  if os.path.isfile(path):
    return os.path.getsize(path)
  total = 0
  for folder, _, files in os.walk(path):
    for name in files:
      with contextlib.suppress(OSError):
        total += os.path.getsize(os.path.join(folder, name))
  return total


# ------------------------------------------------------------------- places --


def root_dir(data_dir: str = '') -> str:
  """Where the LEAF and CINIC-10 folders and the downloads go."""
  return os.path.expanduser(data_dir) if data_dir else DEFAULT_ROOT


def destination(name: str, data_dir: str = '') -> str:
  """The folder a non-tfds dataset is written to (its run's `data_dir`)."""
  if name in ('femnist', 'shakespeare'):
    return os.path.join(root_dir(data_dir), 'leaf', name, 'data')
  if name == 'cinic10':
    return os.path.join(root_dir(data_dir), 'cinic10')
  raise errors.ArgumentError(
    'name', f'{name!r} is a tfds dataset: see `tfds_builder`'
  )


def check_options(train_fraction: float, seed: int) -> None:
  """Raises `ArgumentError` naming `train_fraction` unless it lies in
  (0, 1), or `seed` unless it is ≥ 0 (`prepare`'s LEAF options)."""
  if not 0 < train_fraction < 1:  # nan too
    raise errors.ArgumentError(
      'train_fraction', f'must lie in (0, 1), got {train_fraction}'
    )
  if seed < 0:
    raise errors.ArgumentError('seed', f'must be ≥ 0, got {seed}')


def tfds_builder(name: str, data_dir: str = ''):
  """The tensorflow-datasets builder of `name` under `data_dir` (tfds's
  default data dir when empty), the one `datasets.load` reads."""
  import tensorflow_datasets as tfds

  data_dir = os.path.expanduser(data_dir) if data_dir else None
  return tfds.builder(datasets.tfds_name(name), data_dir=data_dir)


def _has_module(name: str) -> bool:
  return importlib.util.find_spec(name) is not None


def check_requirements(names: list[str], data_dir: str = '') -> None:
  """Raises DataError when a tfds dataset of `names` is still to prepare
  and a package that preparing needs (TensorFlow) is missing."""
  missing = [label for m, label in TFDS_NEEDS.items() if not _has_module(m)]
  if not missing:
    return
  todo = [n for n in names if n in TFDS]
  todo = [n for n in todo if not tfds_builder(n, data_dir).is_prepared()]
  if todo:
    raise errors.DataError(
      f'preparing {", ".join(todo)} needs {" and ".join(missing)} (the '
      f'prepare extra): {EXTRA_HINT}, or leave them out of `datasets`'
    )


def check_data_dir(data_dir: str) -> None:
  """Raises DataError when `data_dir` exists but is not a folder."""
  path = os.path.expanduser(data_dir)
  if data_dir and os.path.exists(path) and not os.path.isdir(path):
    raise errors.DataError(f'`data_dir={data_dir}`: not a folder')


# ------------------------------------------------------------------ prepare --


def prepare(
  name: str,
  data_dir: str = '',
  *,
  fetch: download.Fetch = download.download,
  train_fraction: float = leaf.TRAIN_FRACTION,
  seed: int = 0,
  keep_downloads: bool = True,
  log: Callable[[str], None] = print,
) -> Prepared:
  """Prepares one dataset, or says that it already is.

  Args:
    name: one of `NAMES`.
    data_dir: see the module docstring ('' for the loaders' defaults).
    fetch: downloads one URL to a path (`download.download`).
    train_fraction: LEAF datasets: the fraction of each user's samples in
      the training split (LEAF's `tf`), in (0, 1).
    seed: LEAF datasets: seed of the training/test split.
    keep_downloads: keep the downloaded archives (else deleted once the
      dataset is prepared).
    log: prints one line of progress.

  Returns:
    Where the dataset is, and whether it was already there.

  Raises:
    ArgumentError: naming an unknown `name` or a bad option.
    DataError: a download or a conversion failed (nothing half-written is
      left where the loader reads), or TensorFlow is missing for a tfds
      dataset.
  """
  if name not in NAMES:
    raise errors.ArgumentError(
      'name', f'{name!r} is unknown; choose from {", ".join(NAMES)}'
    )
  check_options(train_fraction, seed)
  if name in TFDS:
    return _prepare_tfds(name, data_dir, keep_downloads, log)
  dest = destination(name, data_dir)
  if _is_prepared(name, dest):
    log(f'{name}: already prepared in {dest}, skipping')
    return Prepared(name, dest, dest, True, disk_size(dest))
  if os.path.isdir(dest) and os.listdir(dest):
    raise errors.DataError(
      f'{dest} exists but holds no prepared {name}: move it away, or pass '
      'another `data_dir`'
    )
  log(f'{name}: preparing {dest}')
  downloads = os.path.join(root_dir(data_dir), download.DOWNLOADS)
  with _removed_on_failure(downloads, only_empty=True):
    paths = [download.fetch(s, downloads, fetch, log) for s in SOURCES[name]]
  log('  converting')
  with _building(dest) as tmp:
    if name == 'femnist':
      femnist.convert(*paths, tmp, train_fraction, seed, log)
    elif name == 'shakespeare':
      shakespeare.convert(paths[0], tmp, train_fraction, seed)
    else:
      cinic.unpack(paths[0], tmp)
  if not keep_downloads:
    for path in paths:
      os.remove(path)
  size = disk_size(dest)
  log(f'{name}: prepared in {dest} ({download.human_size(size)})')
  return Prepared(name, dest, dest, False, size)


def _prepare_tfds(
  name: str, data_dir: str, keep_downloads: bool, log
) -> Prepared:
  builder = tfds_builder(name, data_dir)
  path = str(builder.data_dir)
  run_dir = os.path.expanduser(data_dir) if data_dir else ''
  if builder.is_prepared():
    file_format = str(getattr(builder.info.file_format, 'value', ''))
    if file_format and file_format != 'array_record':
      raise errors.DataError(
        f'{path} holds {name} as {file_format} files, but the loader reads '
        "array_record: convert them with tfds's `convert_format` "
        f'(`dataset_version_dir={path}`, `out_file_format=array_record`) or '
        'delete the folder and run again'
      )
    log(f'{name}: already prepared in {path}, skipping')
    return Prepared(name, path, run_dir, True, disk_size(path))
  check_requirements([name], data_dir)
  log(f'{name}: preparing {path} (tfds build {datasets.tfds_name(name)})')
  downloads = os.path.join(root_dir(data_dir), download.DOWNLOADS)
  unknown = _unresolved_hosts(builder, downloads)
  if unknown:
    # Offline, tfds would retry each archive for minutes before failing.
    raise errors.DataError(
      f'{name}: cannot look up {", ".join(unknown)} (no internet access?); '
      f'run again once it can, or put {_archives(builder)} in {downloads} '
      'by hand'
    )
  try:
    with _removed_on_failure(path, os.path.join(downloads, TFDS_DOWNLOADS)):
      _tfds_build(builder, downloads)
  except Exception as e:  # noqa: BLE001 - tfds raises many types (network, IO)
    reason = ' '.join(str(e).split())
    reason = reason if len(reason) <= 160 else reason[:157] + '...'
    raise errors.DataError(
      f'{name}: tensorflow-datasets could not prepare it ({type(e).__name__}: '
      f'{reason}); run again once that is fixed, or, without internet '
      f'access, put {_archives(builder)} in {downloads} by hand'
    ) from None
  if not keep_downloads:
    shutil.rmtree(os.path.join(downloads, TFDS_DOWNLOADS), ignore_errors=True)
  size = disk_size(path)
  log(f'{name}: prepared in {path} ({download.human_size(size)})')
  return Prepared(name, path, run_dir, False, size)


def _tfds_build(builder, downloads: str) -> None:
  """`tfds build` as array_record: tfds's own downloads in
  `<downloads>/tfds`, an archive put in `downloads` by hand (under its
  own name, `_archives`) used as it is; no progress bars unless stderr is
  a terminal (captured, they are lines of escape codes)."""
  import tensorflow_datasets as tfds

  if not sys.stderr.isatty():
    tfds.disable_progress_bar()
  builder.download_and_prepare(
    download_dir=os.path.join(downloads, TFDS_DOWNLOADS),
    download_config=tfds.download.DownloadConfig(manual_dir=downloads),
    file_format='array_record',
  )


def _archives(builder) -> str:
  """The archives a tfds builder downloads, as 'name (from url)', or 'its
  archives' when tfds cannot say (its checksums need the prepare extra)."""
  try:
    infos = builder.url_infos or {}
  except Exception:  # noqa: BLE001 - a missing package, an unreadable file
    infos = {}
  named = [
    f'{i.filename} (from {url})' for url, i in infos.items() if i.filename
  ]
  return ' and '.join(named) or 'its archives (under the names tfds gives them)'


def _resolves(host: str) -> bool:
  """Whether `host`'s name resolves (a failed lookup is immediate
  offline)."""
  try:
    socket.getaddrinfo(host, None)
  except OSError:
    return False
  return True


def _unresolved_hosts(builder, downloads: str) -> list[str]:
  """The hosts of the archives a tfds build would download (those not
  put in `downloads` by hand) whose names do not resolve; none behind a
  proxy (which resolves them itself) or when tfds cannot list them."""
  if urllib.request.getproxies():
    return []
  try:
    infos = builder.url_infos or {}
  except Exception:  # noqa: BLE001 - a missing package, an unreadable file
    return []
  hosts = {
    urllib.parse.urlsplit(url).hostname
    for url, info in infos.items()
    if not (
      info.filename and os.path.isfile(os.path.join(downloads, info.filename))
    )
  }
  return sorted(h for h in hosts if h and not _resolves(h))


@contextlib.contextmanager
def _removed_on_failure(
  *paths: str, only_empty: bool = False
) -> Iterator[None]:
  """Removes, when the block fails, the folders of `paths` (and the
  missing folders above them) that the block created: a failed
  preparation leaves no `~/tensorflow_datasets` or empty downloads
  folder behind. `only_empty`: only those left empty (a partial download
  stays, to be resumed)."""
  created = []
  for target in map(os.path.abspath, paths):
    path, top = target, None
    while not os.path.exists(path):
      top, path = path, os.path.dirname(path)
    if top is not None:
      created.append((top, target))
  try:
    yield
  except BaseException:
    for top, target in created:
      if not only_empty:
        shutil.rmtree(top, ignore_errors=True)
        continue
      # From the deepest created folder up to `top`, while empty.
      folder = target
      while True:
        if os.path.isdir(folder):
          try:
            os.rmdir(folder)
          except OSError:  # not empty
            break
        if folder == top:
          break
        folder = os.path.dirname(folder)
    raise


def _is_prepared(name: str, dest: str) -> bool:
  if name == 'cinic10':
    return all(os.path.isdir(os.path.join(dest, s)) for s in ('train', 'test'))
  return all(leaf.split_dir(dest, s) for s in ('train', 'test'))


@contextlib.contextmanager
def _building(dest: str) -> Iterator[str]:
  """A fresh folder `dest + '.partial'`, renamed to `dest` when the block
  succeeds and deleted when it fails."""
  tmp = dest + '.partial'
  shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run
  os.makedirs(tmp)
  try:
    yield tmp
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  if os.path.isdir(dest):
    os.rmdir(dest)  # empty: checked by the caller
  os.replace(tmp, dest)
