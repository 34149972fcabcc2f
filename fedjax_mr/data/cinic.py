"""CINIC-10: its archive unpacked, and read from its image-folder layout.

The CINIC-10 archive (`ARCHIVE`; `unpack`) unpacks to `train/`, `valid/`
and `test/`, each with one folder per class (the CIFAR-10 class names) of
32×32 PNG images (90,000 per split; a few are greyscale and are converted
to RGB). `load_split` decodes the images with Pillow into a uint8 array
allocated once, so peak host memory is the arrays themselves.

References:
  Darlow et al., "CINIC-10 is not ImageNet or CIFAR-10", arXiv:1810.03505,
  2018.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import zlib
from typing import Sequence

import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.data import download
from fedjax_mr.data import host

# Label = position, as in CIFAR-10.
CLASSES = (
  'airplane',
  'automobile',
  'bird',
  'cat',
  'deer',
  'dog',
  'frog',
  'horse',
  'ship',
  'truck',
)
IMAGE_SHAPE = (32, 32, 3)
SPLITS = ('train', 'valid', 'test')

# The URL the CINIC-10 README (github.com/BayesWatch/cinic-10) gives.
ARCHIVE = download.Source(
  (
    'https://datashare.is.ed.ac.uk/bitstream/handle/10283/3192/CINIC-10.tar.gz',
  ),
  'CINIC-10.tar.gz',
)
SOURCES = (ARCHIVE,)


def load_split(
  root: str, splits: Sequence[str] = ('train',)
) -> tuple[np.ndarray, np.ndarray]:
  """Reads one or more splits of a CINIC-10 folder.

  Args:
    root: the folder holding `train/`, `valid/`, `test/`.
    splits: which of them, concatenated in this order.

  Returns:
    `x` `[M, 32, 32, 3]` uint8 and `y` `[M]` int32 (labels by `CLASSES`);
    within a split, class after class, files in name order.

  Raises:
    DataError: a missing folder or class, or an image that is not a 32×32
      picture.
  """
  files, labels = [], []
  for split in splits:
    folder = os.path.join(root, split)
    if not os.path.isdir(folder):
      raise errors.DataError(
        f'`data_dir`: {root!r} has no {split}/ folder; CINIC-10 unpacks '
        'to train/, valid/ and test/'
      )
    found = sorted(
      d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d))
    )
    if tuple(found) != CLASSES:
      raise errors.DataError(
        f'{folder}: expected the class folders {", ".join(CLASSES)}; found '
        f'{", ".join(found) or "none"}'
      )
    for label, name in enumerate(CLASSES):
      class_dir = os.path.join(folder, name)
      names = sorted(f for f in os.listdir(class_dir) if f.endswith('.png'))
      files.extend(os.path.join(class_dir, f) for f in names)
      labels.extend([label] * len(names))
  if not files:
    raise errors.DataError(f'{root}: no PNG images in {", ".join(splits)}')
  x = host.empty((len(files), *IMAGE_SHAPE), np.uint8)
  for i, path in enumerate(files):
    x[i] = _decode(path)
  return x, np.asarray(labels, np.int32)


def _decode(path: str) -> np.ndarray:
  from PIL import Image

  try:
    with Image.open(path) as image:
      size = image.size
      pixels = np.asarray(image.convert('RGB'))
  except (OSError, ValueError) as e:  # PIL's UnidentifiedImageError: OSError
    raise errors.DataError(f'{path}: not a readable image ({e})') from None
  if pixels.shape != IMAGE_SHAPE:
    raise errors.DataError(
      f'{path}: a CINIC-10 image is 32×32, this one is {size[0]}×{size[1]}'
    )
  return pixels


def _extract(tar: tarfile.TarFile, out: str) -> None:
  """Extracts the folders and regular files of `tar` into `out`, in one
  pass over the archive, refusing any other member (a link, a device)
  and any name that would land outside `out`: what tarfile's 'data'
  filter does, which Python has only from 3.11.4 (and 3.10.12) on.

  Raises:
    TarError: a member refused (named).
  """
  root = os.path.realpath(out)
  for member in tar:
    target = os.path.realpath(os.path.join(root, member.name))
    if os.path.isabs(member.name) or not (
      target == root or target.startswith(root + os.sep)
    ):
      raise tarfile.TarError(f'member {member.name!r} lies outside the folder')
    if member.isdir():
      os.makedirs(target, exist_ok=True)
    elif member.isfile():
      os.makedirs(os.path.dirname(target), exist_ok=True)
      with tar.extractfile(member) as src, open(target, 'wb') as dst:
        shutil.copyfileobj(src, dst)
    else:
      raise tarfile.TarError(
        f'member {member.name!r} is not a folder or a regular file'
      )


def unpack(path: str, out: str) -> None:
  """Unpacks the CINIC-10 tarball at `path` into `out` (train/, valid/,
  test/; a single top folder in the archive is taken away).

  Raises:
    DataError: the archive is unreadable or unsafe (a member outside
      `out`), or does not hold the class folders of every split.
  """
  try:
    with tarfile.open(path) as tar:
      _extract(tar, out)
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
  for split in SPLITS:
    folder = os.path.join(out, split)
    found = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if tuple(found) != CLASSES:
      raise errors.DataError(
        f'{path}: {split}/ does not hold the class folders '
        f'{", ".join(CLASSES)} (found {", ".join(found) or "nothing"})'
      )
