"""FEMNIST from NIST Special Database 19, converted as LEAF converts it.

`convert` writes LEAF's FEMNIST json (`leaf`) from NIST's `by_class.zip`
and `by_write.zip`, as LEAF's `data/femnist/preprocess` scripts do: every
image of `by_write` is labelled by its identical twin in `by_class`
(`get_hashes.py`, `match_hashes.py`), each writer is a user, and each
writer's samples are split by `leaf.train_mask`. Where we differ from
LEAF, for determinism or correctness:
  * Writers are in sorted order, not in the file system's order.
  * LEAF's `group_by_writer.py` lists the first image of every writer but
    the first one twice; we list it once.
  * Images are shrunk by a Lanczos resize of the 128×128 image to 28×28,
    which is what LEAF's `thumbnail((28, 28), ANTIALIAS)` did with the
    Pillow of its time (Pillow ≥ 7 first box-reduces, `reducing_gap`).

References:
  Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018.
  Grother, "NIST Special Database 19: Handprinted Forms and Characters
  Database", 1995.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import random
from typing import Callable
from typing import Iterator

import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.data import download
from fedjax_mr.data import leaf

# NIST Special Database 19, as LEAF's femnist/preprocess/get_data.sh gets it.
BY_CLASS = download.Source(
  ('https://s3.amazonaws.com/nist-srd/SD19/by_class.zip',), 'by_class.zip'
)
BY_WRITE = download.Source(
  ('https://s3.amazonaws.com/nist-srd/SD19/by_write.zip',), 'by_write.zip'
)
SOURCES = (BY_CLASS, BY_WRITE)
# Writers per json file, as LEAF's `data_to_json.py` writes them.
WRITERS_PER_FILE = 100

# LEAF's pixel values, x = v / 255 as json writes the float.
_PIXEL_TEXT = np.array([json.dumps(v / 255) for v in range(256)], object)


def label(class_dir: str) -> int:
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


def _classes(by_class: str) -> dict[bytes, int]:
  """MD5 of every image of `by_class/<class>/hsf_*/` → its label (LEAF's
  `get_file_dirs.py`, `get_hashes.py`; the first image wins a tie)."""
  classes: dict[bytes, int] = {}
  with download.open_zip(by_class) as z:
    for info in sorted(z.infolist(), key=lambda i: i.filename):
      parts = info.filename.split('/')
      if info.is_dir() or len(parts) != 4:
        continue
      if 'hsf' not in parts[2] or 'mit' in parts[2]:
        continue
      found = label(parts[1])
      classes.setdefault(hashlib.md5(z.read(info)).digest(), found)
  if not classes:
    raise errors.DataError(
      f'{by_class}: no images in by_class/<class>/hsf_*/ (not NIST SD19?)'
    )
  return classes


def _writers(
  by_write: str, classes: dict[bytes, int]
) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
  """(writer, `[n, 28, 28]` uint8 images, `[n]` labels) of every writer of
  `by_write/<part>/<writer>/<type>/`, in writer order; each image labelled
  by its identical twin in `by_class` (LEAF's `match_hashes.py`)."""
  with download.open_zip(by_write) as z:
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
        found = classes.get(hashlib.md5(png).digest())
        if found is None:
          raise errors.DataError(
            f'{by_write}: {info.filename} has no identical image in '
            'by_class.zip/*/hsf_*/, which gives its label'
          )
        images.append(_shrink(png, f'{by_write}: {info.filename}'))
        labels.append(found)
      yield writer, np.stack(images), np.asarray(labels, np.int32)


def convert(
  by_class: str,
  by_write: str,
  out: str,
  train_fraction: float,
  seed: int,
  log: Callable[[str], None],
) -> None:
  """Writes LEAF's FEMNIST json into `out`/train and `out`/test: files of
  `WRITERS_PER_FILE` writers, each writer's samples split by
  `leaf.train_mask`."""
  log('  hashing the images of by_class.zip')
  classes = _classes(by_class)
  rng = random.Random(seed)
  writers = _writers(by_write, classes)
  for split in ('train', 'test'):
    os.makedirs(os.path.join(out, split))
  done = 0
  for index in itertools.count():
    chunk = list(itertools.islice(writers, WRITERS_PER_FILE))
    if not chunk:
      break
    splits: dict[str, list] = {'train': [], 'test': []}
    for writer, x, y in chunk:
      mask = leaf.train_mask(len(y), train_fraction, rng)
      if mask is None:
        continue
      splits['train'].append((writer, x[mask], y[mask]))
      splits['test'].append((writer, x[~mask], y[~mask]))
    for split, rows in splits.items():
      path = os.path.join(out, split, f'all_data_{index:03d}_{split}.json')
      leaf.write_json(
        path,
        [w for w, _, _ in rows],
        [len(y) for _, _, y in rows],
        ((w, _x_text(x), json.dumps(y.tolist())) for w, x, y in rows),
      )
    done += len(chunk)
    log(f'  {done} writers written')


def _x_text(x: np.ndarray) -> str:
  """`[n, 28, 28]` uint8 images as LEAF's json text of n lists of 784
  floats."""
  rows = (', '.join(_PIXEL_TEXT[image.reshape(-1)]) for image in x)
  return '[' + ', '.join(f'[{r}]' for r in rows) + ']'
