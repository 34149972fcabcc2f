"""Downloads the papers' datasets and writes them where `datasets.load` reads.

For a machine with internet access; `experiments/prepare.py` is the
program. Each dataset goes to the place `datasets.load` (and the bundled
configs) look for it, so a run needs no more than the `--data_dir` printed
at the end:

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
working folder (the bundled configs' `--data_dir=data/leaf/...`). Archives
are downloaded to `<root>/downloads` (tfds keeps its own in
`<tfds data dir>/downloads`); an archive already there is used as it is, so
a machine without internet access can be given them by hand.

Every download goes through `download`: all or nothing (the bytes go to a
`.part` file, renamed when complete), resumed by the next run after an
interruption, and checked against a checksum where the source publishes
one (none of our four sources does; tfds checks its own). The LEAF and
CINIC-10 folders are written as `<folder>.partial` and renamed when
complete (tfds does the same with its own), so a failed run leaves nothing
that looks prepared, and a prepared dataset is detected and skipped.

LEAF (FEMNIST, Shakespeare) is converted as LEAF's own scripts do
(`data/femnist/preprocess`, `data/shakespeare/preprocess`,
`data/utils/split_data.py` of github.com/TalwalkarLab/leaf), as if run with
`./preprocess.sh -s niid --sf 1.0 -k 0 -t sample --tf 0.9`: every user is
kept (the papers' filter, e.g. FEMNIST writers with more than 100 samples,
is the loader's `leaf_min_samples`, which counts as LEAF's `-k` does), and
each user's samples are split into training and test at random (LEAF's
`random.Random(seed).sample`, so a given `seed` gives the split LEAF's
`split_data.py --seed` would give on the same users in the same order).
Where we differ from LEAF, for determinism or correctness:
  * Users are in sorted (FEMNIST) or text (Shakespeare) order, not in the
    file system's order, and not shuffled by `sample.py` (`--sf 1.0` keeps
    every user, only their order changes).
  * LEAF's `group_by_writer.py` lists the first image of every writer but
    the first one twice; we list it once.
  * FEMNIST images are shrunk by a Lanczos resize of the 128×128 image to
    28×28, which is what LEAF's `thumbnail((28, 28), ANTIALIAS)` did with
    the Pillow of its time (Pillow ≥ 7 first box-reduces, `reducing_gap`).

References:
  Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018.
  Darlow et al., "CINIC-10 is not ImageNet or CIFAR-10", arXiv:1810.03505,
  2018.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import http.client
import importlib.util
import io
import itertools
import json
import os
import random
import re
import shutil
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
import zlib
from typing import Callable
from typing import Iterator
from typing import NamedTuple
from typing import TextIO

import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.data import cinic
from fedjax_mr.data import datasets
from fedjax_mr.data import leaf

# Every dataset the loader reads through tensorflow-datasets.
TFDS = tuple(n for n in datasets.NAMES if datasets.tfds_name(n))
NAMES = (*TFDS, 'cinic10', 'femnist', 'shakespeare')
# The papers' datasets (what the program prepares by default).
PAPERS = ('cifar10', 'cifar100', 'emnist', 'femnist', 'shakespeare', 'cinic10')
DEFAULT_ROOT = 'data'
DOWNLOADS = 'downloads'
# LEAF's defaults (`split_data.py`): 90 % of each user's samples train.
TRAIN_FRACTION = 0.9
# Writers per FEMNIST json file, as LEAF's `data_to_json.py` writes them.
WRITERS_PER_FILE = 100
# What preparing a tfds dataset needs beyond reading it: TensorFlow, and
# importlib_resources, which tensorflow-datasets 4.9 imports to build a
# dataset but declares only for Python < 3.9.
TFDS_NEEDS = {
  'tensorflow': 'TensorFlow',
  'importlib_resources': 'importlib_resources',
}
EXTRA_HINT = "pip install 'fedjax_mr[prepare]'"


class Source(NamedTuple):
  """A file to download: its URLs (tried in order), the name it is saved
  under and the checksums its publisher gives (None: none published)."""

  urls: tuple[str, ...]
  filename: str
  md5: str | None = None
  sha256: str | None = None


# NIST Special Database 19, as LEAF's femnist/preprocess/get_data.sh gets it.
NIST_BY_CLASS = Source(
  ('https://s3.amazonaws.com/nist-srd/SD19/by_class.zip',), 'by_class.zip'
)
NIST_BY_WRITE = Source(
  ('https://s3.amazonaws.com/nist-srd/SD19/by_write.zip',), 'by_write.zip'
)
# Project Gutenberg's etext 100 of January 1994 (its file 100.txt), which
# LEAF's shakespeare/preprocess/get_data.sh gets and whose layout its parser
# expects; Gutenberg has since moved it from old/ to old/old/.
GUTENBERG_1994 = Source(
  (
    'https://www.gutenberg.org/files/100/old/old/1994-01-100.zip',
    'http://www.gutenberg.org/files/100/old/1994-01-100.zip',
  ),
  '1994-01-100.zip',
)
# The URL the CINIC-10 README (github.com/BayesWatch/cinic-10) gives.
CINIC10 = Source(
  (
    'https://datashare.is.ed.ac.uk/bitstream/handle/10283/3192/CINIC-10.tar.gz',
  ),
  'CINIC-10.tar.gz',
)
SOURCES = {
  'femnist': (NIST_BY_CLASS, NIST_BY_WRITE),
  'shakespeare': (GUTENBERG_1994,),
  'cinic10': (CINIC10,),
}


# `download`'s signature, (url, path, *, md5, sha256) -> None; tests give
# `prepare` one that copies their fixtures.
Fetch = Callable[..., None]


class Prepared(NamedTuple):
  """What `prepare` did for one dataset.

  Attributes:
    name: the dataset.
    path: the folder holding its files.
    data_dir: the `--data_dir` of a run that reads it ('' for the default).
    skipped: it was already prepared.
    size: bytes on disk under `path`.
  """

  name: str
  path: str
  data_dir: str
  skipped: bool
  size: int


# ----------------------------------------------------------------- download --

_TIMEOUT_S = 60  # seconds without a byte before a download gives up
_CHUNK = 1 << 20


def download(
  url: str,
  path: str,
  *,
  md5: str | None = None,
  sha256: str | None = None,
  progress: TextIO | None = None,
) -> None:
  """Downloads `url` to `path`, all or nothing, resuming an earlier try.

  The bytes go to `path + '.part'`, which is renamed to `path` once whole
  and matching the checksums given. A `.part` left by an interrupted
  download is continued with an HTTP range request (started again when the
  server ignores it). A progress line goes to `progress` (stderr).

  Raises:
    DataError: the server cannot be reached or refuses; the download
      stopped early (the `.part` file stays, for the next try to resume);
      a checksum does not match (the `.part` file is deleted).
  """
  out = progress or sys.stderr
  part = path + '.part'
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  have = os.path.getsize(part) if os.path.exists(part) else 0
  headers = {'User-Agent': 'fedjax_mr-prepare'}
  if have:
    headers['Range'] = f'bytes={have}-'
  request = urllib.request.Request(url, headers=headers)
  response = None
  try:
    response = urllib.request.urlopen(request, timeout=_TIMEOUT_S)
  except urllib.error.HTTPError as e:
    if not (e.code == 416 and have):  # 416: the .part file is already whole
      raise errors.DataError(f'{url}: HTTP error {e.code} {e.reason}') from None
  except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
    raise errors.DataError(f'{url}: cannot download ({_reason(e)})') from None
  if response is not None:
    with response:
      if have and getattr(response, 'status', None) != 206:
        have = 0  # the server sends the whole file
      length = response.headers.get('Content-Length', '')
      total = have + int(length) if length.isdigit() else None
      done = have
      shown = -1.0
      with open(part, 'ab' if have else 'wb') as f:
        while True:
          try:
            chunk = response.read(_CHUNK)
          except (OSError, http.client.HTTPException) as e:
            chunk, error = b'', e
          else:
            error = None
          if not chunk:
            break
          f.write(chunk)
          done += len(chunk)
          now = time.monotonic()
          if now - shown >= 0.5:
            shown = now
            _show_progress(out, os.path.basename(path), done, total)
      _show_progress(out, os.path.basename(path), done, total, end='\n')
    if error is not None or (total is not None and done < total):
      reason = f' ({_reason(error)})' if error is not None else ''
      raise errors.DataError(
        f'{url}: the download stopped after {_human(done)}{reason}; run '
        f'again to resume it ({part})'
      )
  for algorithm, want in (('md5', md5), ('sha256', sha256)):
    if want:
      got = _file_digest(part, algorithm)
      if got != want.lower():
        os.remove(part)
        raise errors.DataError(
          f'{url}: {algorithm} {got} is not the published {want}; the '
          'download was deleted, run again to download it anew'
        )
  os.replace(part, path)


def _show_progress(
  out: TextIO, name: str, done: int, total: int | None, end: str = ''
) -> None:
  if total:
    text = f'{name}: {100 * done / total:3.0f}% of {_human(total)}'
  else:
    text = f'{name}: {_human(done)}'
  out.write(f'\r{text}{end}')
  out.flush()


def _reason(error: BaseException) -> str:
  reason = getattr(error, 'reason', None) or error
  return str(reason) or type(error).__name__


def _file_digest(path: str, algorithm: str) -> str:
  digest = hashlib.new(algorithm)
  with open(path, 'rb') as f:
    for chunk in iter(lambda: f.read(_CHUNK), b''):
      digest.update(chunk)
  return digest.hexdigest()


def _human(size: int) -> str:
  """`size` bytes in words: '512 B', '3.4 MB', '1.2 GB' (powers of 1000)."""
  value = float(size)
  for unit in ('B', 'KB', 'MB', 'GB'):
    if value < 1000 or unit == 'GB':
      return f'{size} B' if unit == 'B' else f'{value:.1f} {unit}'
    value /= 1000
  raise AssertionError('unreachable')


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
  """The folder a non-tfds dataset is written to (its run's `--data_dir`)."""
  if name in ('femnist', 'shakespeare'):
    return os.path.join(root_dir(data_dir), 'leaf', name, 'data')
  if name == 'cinic10':
    return os.path.join(root_dir(data_dir), 'cinic10')
  raise errors.ConfigError(f'{name!r} is a tfds dataset: see `tfds_builder`')


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
      f'prepare extra): {EXTRA_HINT}, or leave them out of --datasets'
    )


def check_data_dir(data_dir: str) -> None:
  """Raises DataError when `data_dir` exists but is not a folder."""
  path = os.path.expanduser(data_dir)
  if data_dir and os.path.exists(path) and not os.path.isdir(path):
    raise errors.DataError(f'--data_dir={data_dir}: not a folder')


# ------------------------------------------------------------------ prepare --


def prepare(
  name: str,
  data_dir: str = '',
  *,
  fetch: Fetch = download,
  train_fraction: float = TRAIN_FRACTION,
  seed: int = 0,
  keep_downloads: bool = True,
  log: Callable[[str], None] = print,
) -> Prepared:
  """Prepares one dataset, or says that it already is.

  Args:
    name: one of `NAMES`.
    data_dir: see the module docstring ('' for the loaders' defaults).
    fetch: downloads one URL to a path (`download`).
    train_fraction: LEAF datasets: the fraction of each user's samples in
      the training split (LEAF's `--tf`), in (0, 1).
    seed: LEAF datasets: seed of the training/test split.
    keep_downloads: keep the downloaded archives (else deleted once the
      dataset is prepared).
    log: prints one line of progress.

  Returns:
    Where the dataset is, and whether it was already there.

  Raises:
    ConfigError: an unknown name or a bad option.
    DataError: a download or a conversion failed (nothing half-written is
      left where the loader reads), or TensorFlow is missing for a tfds
      dataset.
  """
  if name not in NAMES:
    raise errors.ConfigError(
      f'--datasets: unknown dataset {name!r}; choose from {", ".join(NAMES)}'
    )
  if not 0 < train_fraction < 1:
    raise errors.ConfigError(
      f'--leaf_train_fraction must lie in (0, 1), got {train_fraction}'
    )
  if seed < 0:
    raise errors.ConfigError(f'--leaf_seed must be ≥ 0, got {seed}')
  if name in TFDS:
    return _prepare_tfds(name, data_dir, log)
  dest = destination(name, data_dir)
  if _is_prepared(name, dest):
    log(f'{name}: already prepared in {dest}, skipping')
    return Prepared(name, dest, dest, True, disk_size(dest))
  if os.path.isdir(dest) and os.listdir(dest):
    raise errors.DataError(
      f'{dest} exists but holds no prepared {name}: move it away, or pass '
      'another --data_dir'
    )
  log(f'{name}: preparing {dest}')
  downloads = os.path.join(root_dir(data_dir), DOWNLOADS)
  paths = [_fetch(s, downloads, fetch, log) for s in SOURCES[name]]
  log('  converting')
  with _building(dest) as tmp:
    if name == 'femnist':
      _femnist(*paths, tmp, train_fraction, seed, log)
    elif name == 'shakespeare':
      _shakespeare(paths[0], tmp, train_fraction, seed)
    else:
      _cinic10(paths[0], tmp)
  if not keep_downloads:
    for path in paths:
      os.remove(path)
  size = disk_size(dest)
  log(f'{name}: prepared in {dest} ({_human(size)})')
  return Prepared(name, dest, dest, False, size)


def summary(results: list[Prepared]) -> str:
  """One line per dataset: its size, where it is, whether it was already
  there and the flags of a run that reads it."""
  width = max(len(r.name) for r in results)
  lines = []
  for r in results:
    flag = f' --data_dir={r.data_dir}' if r.data_dir else ' (no --data_dir)'
    state = 'already there' if r.skipped else 'prepared'
    lines.append(
      f'{r.name:<{width}}  {_human(r.size):>8}  {r.path}  ({state}; run '
      f'with --dataset={r.name}{flag})'
    )
  return '\n'.join(lines)


def _prepare_tfds(name: str, data_dir: str, log) -> Prepared:
  builder = tfds_builder(name, data_dir)
  path = str(builder.data_dir)
  run_dir = os.path.expanduser(data_dir) if data_dir else ''
  if builder.is_prepared():
    file_format = str(getattr(builder.info.file_format, 'value', ''))
    if file_format and file_format != 'array_record':
      raise errors.DataError(
        f'{path} holds {name} as {file_format} files, but the loader reads '
        'array_record: convert them (`tfds convert_format '
        f'--dataset_version_dir={path} --out_file_format=array_record`) or '
        'delete the folder and run again'
      )
    log(f'{name}: already prepared in {path}, skipping')
    return Prepared(name, path, run_dir, True, disk_size(path))
  check_requirements([name], data_dir)
  log(f'{name}: preparing {path} (tfds build {datasets.tfds_name(name)})')
  try:
    builder.download_and_prepare(file_format='array_record')
  except Exception as e:  # noqa: BLE001 - tfds raises many types (network, IO)
    reason = ' '.join(str(e).split())[:300]
    raise errors.DataError(
      f'{name}: tensorflow-datasets could not prepare it ({type(e).__name__}: '
      f'{reason}); run again once that is fixed'
    ) from None
  size = disk_size(path)
  log(f'{name}: prepared in {path} ({_human(size)})')
  return Prepared(name, path, run_dir, False, size)


def _is_prepared(name: str, dest: str) -> bool:
  if name == 'cinic10':
    return all(os.path.isdir(os.path.join(dest, s)) for s in ('train', 'test'))
  return all(leaf.split_dir(dest, s) for s in ('train', 'test'))


def _fetch(source: Source, folder: str, fetch: Fetch, log) -> str:
  """`source` downloaded into `folder` (kept from an earlier run if there),
  trying its URLs in order."""
  path = os.path.join(folder, source.filename)
  if os.path.isfile(path):
    log(f'  using {path} (downloaded before)')
    return path
  problems = []
  for url in source.urls:
    log(f'  downloading {url}')
    try:
      fetch(url, path, md5=source.md5, sha256=source.sha256)
    except errors.DataError as e:
      problems.append(str(e))
      continue
    return path
  raise errors.DataError(
    f'{"; ".join(problems)} (or put {source.filename} in {folder} by hand)'
  )


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


# --------------------------------------------------------------------- LEAF --


def leaf_train_mask(
  n: int, fraction: float, rng: random.Random
) -> np.ndarray | None:
  """LEAF's `split_data.py --by_sample` for one user of `n` samples.

  Returns:
    `[n]` bool, True for the training samples: `max(1, int(fraction · n))`
    of them (1 of 2), drawn with `rng.sample` as LEAF draws them; None for
    a user with fewer than 2 samples, which LEAF drops.
  """
  if n < 2:
    return None
  k = 1 if n == 2 else max(1, int(fraction * n))
  mask = np.zeros(n, bool)
  mask[rng.sample(range(n), k)] = True
  return mask


def _write_leaf_json(
  path: str,
  users: list[str],
  num_samples: list[int],
  user_data: Iterator[tuple[str, str, str]],
) -> None:
  """Writes a LEAF json file, `users` and `num_samples` first (as LEAF
  does, so the loader sizes its arrays from the head). `user_data` yields
  (user, x as json text, y as json text) in the order of `users`."""
  with open(path, 'w', encoding='utf-8') as f:
    f.write(f'{{"users": {json.dumps(users)}, ')
    f.write(f'"num_samples": {json.dumps(num_samples)}, "user_data": {{')
    for i, (user, x, y) in enumerate(user_data):
      if user != users[i]:
        raise AssertionError(f'user {user!r} out of order')
      f.write(f'{", " if i else ""}{json.dumps(user)}: ')
      f.write(f'{{"x": {x}, "y": {y}}}')
    f.write('}}')


# FEMNIST ---------------------------------------------------------------------

# LEAF's pixel values, x = v / 255 as json writes the float.
_PIXEL_TEXT = np.array([json.dumps(v / 255) for v in range(256)], object)


def femnist_label(class_dir: str) -> int:
  """LEAF's `relabel_class`: NIST's hex ASCII code of a class folder
  ('30'..'39', '41'..'5a', '61'..'7a') → 0-9 digits, 10-35 upper case,
  36-61 lower case."""
  try:
    char = chr(int(class_dir, 16))
  except (ValueError, OverflowError):
    char = ''
  if not (char.isascii() and char.isalnum()):
    raise errors.DataError(
      f'by_class.zip: {class_dir!r} is not a NIST class folder (hex ASCII '
      'code of a digit or letter)'
    )
  if class_dir.isdigit() and int(class_dir) < 40:
    return int(class_dir) - 30
  code = int(class_dir, 16)
  return code - 55 if code <= 90 else code - 61


def _shrink(png: bytes, where: str) -> np.ndarray:
  """A NIST 128×128 PNG as LEAF's 28×28 grey uint8 image."""
  from PIL import Image

  try:
    with Image.open(io.BytesIO(png)) as image:
      grey = image.convert('L')
  except (OSError, ValueError) as e:
    raise errors.DataError(f'{where}: not a readable image ({e})') from None
  small = grey.resize((28, 28), Image.Resampling.LANCZOS)
  return np.asarray(small, np.uint8)


def _nist_classes(by_class: str) -> dict[bytes, int]:
  """MD5 of every image of `by_class/<class>/hsf_*/` → its label (LEAF's
  `get_file_dirs.py`, `get_hashes.py`; the first image wins a tie)."""
  classes: dict[bytes, int] = {}
  with _open_zip(by_class) as z:
    for info in sorted(z.infolist(), key=lambda i: i.filename):
      parts = info.filename.split('/')
      if info.is_dir() or len(parts) != 4:
        continue
      if 'hsf' not in parts[2] or 'mit' in parts[2]:
        continue
      label = femnist_label(parts[1])
      classes.setdefault(hashlib.md5(z.read(info)).digest(), label)
  if not classes:
    raise errors.DataError(
      f'{by_class}: no images in by_class/<class>/hsf_*/ (not NIST SD19?)'
    )
  return classes


def _nist_writers(
  by_write: str, classes: dict[bytes, int]
) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
  """(writer, `[n, 28, 28]` uint8 images, `[n]` labels) of every writer of
  `by_write/<part>/<writer>/<type>/`, in writer order; each image labelled
  by its identical twin in `by_class` (LEAF's `match_hashes.py`)."""
  with _open_zip(by_write) as z:
    infos = [
      i
      for i in z.infolist()
      if not i.is_dir() and len(i.filename.split('/')) == 5
    ]
    infos.sort(key=lambda i: (i.filename.split('/')[2], i.filename))
    if not infos:
      raise errors.DataError(
        f'{by_write}: no images in by_write/<part>/<writer>/<type>/ (not '
        'NIST SD19?)'
      )
    for writer, group in itertools.groupby(
      infos, key=lambda i: i.filename.split('/')[2]
    ):
      images, labels = [], []
      for info in group:
        png = z.read(info)
        label = classes.get(hashlib.md5(png).digest())
        if label is None:
          raise errors.DataError(
            f'{by_write}: {info.filename} has no identical image in '
            'by_class.zip/*/hsf_*/, which gives its label'
          )
        images.append(_shrink(png, f'{by_write}: {info.filename}'))
        labels.append(label)
      yield writer, np.stack(images), np.asarray(labels, np.int32)


def _femnist(
  by_class: str,
  by_write: str,
  out: str,
  train_fraction: float,
  seed: int,
  log,
) -> None:
  """Writes LEAF's FEMNIST json into `out`/train and `out`/test: files of
  `WRITERS_PER_FILE` writers, each writer's samples split by
  `leaf_train_mask`."""
  log('  hashing the images of by_class.zip')
  classes = _nist_classes(by_class)
  rng = random.Random(seed)
  writers = _nist_writers(by_write, classes)
  for split in ('train', 'test'):
    os.makedirs(os.path.join(out, split))
  done = 0
  for index in itertools.count():
    chunk = list(itertools.islice(writers, WRITERS_PER_FILE))
    if not chunk:
      break
    splits: dict[str, list] = {'train': [], 'test': []}
    for writer, x, y in chunk:
      mask = leaf_train_mask(len(y), train_fraction, rng)
      if mask is None:
        continue
      splits['train'].append((writer, x[mask], y[mask]))
      splits['test'].append((writer, x[~mask], y[~mask]))
    for split, rows in splits.items():
      path = os.path.join(out, split, f'all_data_{index:03d}_{split}.json')
      _write_leaf_json(
        path,
        [w for w, _, _ in rows],
        [len(y) for _, _, y in rows],
        ((w, _femnist_x(x), json.dumps(y.tolist())) for w, x, y in rows),
      )
    done += len(chunk)
    log(f'  {done} writers written')


def _femnist_x(x: np.ndarray) -> str:
  rows = (', '.join(_PIXEL_TEXT[image.reshape(-1)]) for image in x)
  return '[' + ', '.join(f'[{r}]' for r in rows) + ']'


# Shakespeare -----------------------------------------------------------------

# LEAF's preprocess_shakespeare.py (from Google's, for the 1994 text).
_CHARACTER_RE = re.compile(r'^  ([a-zA-Z][a-zA-Z ]*)\. (.*)')
_CONT_RE = re.compile(r'^    (.*)')
# "The Comedy of Errors" is indented differently.
_COE_CHARACTER_RE = re.compile(r'^([a-zA-Z][a-zA-Z ]*)\. (.*)')
_COE_CONT_RE = re.compile(r'^(.*)')
_AUTHOR = 'by William Shakespeare'
_LAST_LINE = 124195  # where the plays end in the 1994 text
_SPACES = re.compile(r'  +')


def shakespeare_plays(text: str) -> list[tuple[str, dict[str, list[str]]]]:
  """LEAF's `_split_into_plays`: (title, {character: lines}) of each play
  of Gutenberg's 1994 complete works (sonnets and poems are skipped), in
  text order; plays with fewer than two characters are dropped."""
  lines = text.splitlines(True)[1:]
  count, start = 0, 0
  for i, line in enumerate(lines):
    count += _AUTHOR in line
    if count == 2:  # the first play
      start = i - 5
      break
  lines = lines[start:]
  plays = []
  characters: dict[str, list[str]] | None = None
  current = None
  comedy_of_errors = False
  for i, line in enumerate(lines):
    if i > _LAST_LINE - start:
      break
    if _AUTHOR in line:
      current = None
      characters = collections.defaultdict(list)
      title = next(
        (lines[i - k] for k in range(2, 7) if lines[i - k].strip()),
        lines[i - 7],
      ).strip()
      if not title:
        raise errors.DataError(
          f'line {start + i + 2}: no play title above "{_AUTHOR}" (not '
          "Gutenberg's 1994 text of Shakespeare?)"
        )
      comedy_of_errors = title == 'THE COMEDY OF ERRORS'
      plays.append((title, characters))
      continue
    if characters is None:
      continue
    match = (_COE_CHARACTER_RE if comedy_of_errors else _CHARACTER_RE).match(
      line
    )
    if match:
      character, snippet = match.group(1).upper(), match.group(2)
      if comedy_of_errors and character.startswith('ACT '):
        current = None
      else:
        characters[character].append(snippet)
        current = character
      continue
    if current:
      match = (_COE_CONT_RE if comedy_of_errors else _CONT_RE).match(line)
      if match:
        if comedy_of_errors and match.group(1).startswith('<'):
          current = None
        else:
          characters[current].append(match.group(1))
  return [play for play in plays if len(play[1]) > 1]


def shakespeare_users(
  plays: list[tuple[str, dict[str, list[str]]]],
) -> dict[str, list[str]]:
  """User (`<PLAY>_<CHARACTER>`, non-word runs as '_') → the lines the
  character speaks, for characters with more than two lines (LEAF's
  `_get_train_test_by_character` with no test fraction)."""
  users: dict[str, list[str]] = collections.defaultdict(list)
  for title, characters in plays:
    for character, lines in characters.items():
      if len(lines) > 2:
        name = re.sub(r'\W+', '_', f'{title}_{character}'.replace(' ', '_'))
        users[name].extend(lines)
  return users


def shakespeare_lines(spoken: list[str]) -> list[str]:
  """LEAF's lines of one user (`shake_utils.py`): each line with its
  newline, runs of two or more spaces as one."""
  return [_SPACES.sub(' ', line + '\n') for line in spoken]


def shakespeare_windows(lines: list[str]) -> tuple[list[str], list[str]]:
  """LEAF's samples of one user: for each line, padded on the left with 80
  spaces, every window of 80 characters and the character after it."""
  xs, ys = [], []
  pad = ' ' * leaf.SEQ_LEN
  for line in lines:
    padded = pad + line
    xs += [padded[i : i + leaf.SEQ_LEN] for i in range(len(line))]
    ys += list(line)
  return xs, ys


def _read_gutenberg(path: str) -> str:
  """The text of 100.txt (or of the one .txt file) in the Gutenberg zip,
  newlines as '\\n' (as LEAF's reading it in text mode gives them)."""
  with _open_zip(path) as z:
    names = [n for n in z.namelist() if n.lower().endswith('.txt')]
    names = [n for n in names if os.path.basename(n) == '100.txt'] or names
    if len(names) != 1:
      raise errors.DataError(
        f'{path}: expected 100.txt (or one .txt file), found '
        f'{", ".join(names) or "none"}'
      )
    raw = z.read(names[0])
  text = raw.decode('latin-1')
  return text.replace('\r\n', '\n').replace('\r', '\n')


def _shakespeare(path: str, out: str, train_fraction: float, seed: int) -> None:
  """Writes LEAF's Shakespeare json into `out`/train and `out`/test, one
  file each."""
  users = shakespeare_users(shakespeare_plays(_read_gutenberg(path)))
  if not users:
    raise errors.DataError(
      f"{path}: no play found (not Gutenberg's 1994 text of Shakespeare?)"
    )
  lines = {u: shakespeare_lines(spoken) for u, spoken in users.items()}
  outside = set(''.join(''.join(v) for v in lines.values())) - set(
    leaf.ALL_LETTERS
  )
  if outside:
    raise errors.DataError(
      f"{path}: characters outside LEAF's 80-letter vocabulary: "
      f'{sorted(outside)!r}'
    )
  rng = random.Random(seed)
  masks = {}
  for user, text in lines.items():
    mask = leaf_train_mask(sum(map(len, text)), train_fraction, rng)
    if mask is not None:
      masks[user] = mask
  names = list(masks)
  for split, keep in (('train', True), ('test', False)):
    os.makedirs(os.path.join(out, split))

    def rows(keep=keep):
      for user in names:
        xs, ys = shakespeare_windows(lines[user])
        take = np.flatnonzero(masks[user] == keep)
        yield (
          user,
          json.dumps([xs[j] for j in take]),
          json.dumps([ys[j] for j in take]),
        )

    _write_leaf_json(
      os.path.join(out, split, f'all_data_{split}.json'),
      names,
      [int((masks[u] == keep).sum()) for u in names],
      rows(),
    )


# ----------------------------------------------------------------- CINIC-10 --


def _cinic10(path: str, out: str) -> None:
  """Unpacks the CINIC-10 tarball into `out` (train/, valid/, test/; a
  single top folder in the archive is taken away)."""
  try:
    with tarfile.open(path) as tar:
      tar.extractall(out, filter='data')
  except (tarfile.TarError, EOFError, zlib.error) as e:
    raise errors.DataError(
      f'{path}: not a readable CINIC-10 archive ({e}); delete it to '
      'download it anew'
    ) from None
  entries = os.listdir(out)
  if 'train' not in entries and len(entries) == 1:
    top = os.path.join(out, entries[0])
    for entry in os.listdir(top):
      os.replace(os.path.join(top, entry), os.path.join(out, entry))
    os.rmdir(top)
  for split in ('train', 'valid', 'test'):
    folder = os.path.join(out, split)
    found = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if tuple(found) != cinic.CLASSES:
      raise errors.DataError(
        f'{path}: {split}/ does not hold the class folders '
        f'{", ".join(cinic.CLASSES)} (found {", ".join(found) or "nothing"})'
      )


@contextlib.contextmanager
def _open_zip(path: str) -> Iterator[zipfile.ZipFile]:
  try:
    z = zipfile.ZipFile(path)
  except (zipfile.BadZipFile, OSError) as e:
    raise errors.DataError(
      f'{path}: not a readable zip archive ({e}); delete it to download it anew'
    ) from None
  with z:
    try:
      yield z
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
      raise errors.DataError(
        f'{path}: damaged zip archive ({e}); delete it to download it anew'
      ) from None
