"""Reader for the IDX format of (Fashion-)MNIST, plain or gzip-compressed."""

from __future__ import annotations

import gzip
import os

import numpy as np

from fedjax_mr.core import errors

_DTYPES = {
  0x08: np.uint8,
  0x09: np.int8,
  0x0B: np.dtype('>i2'),
  0x0C: np.dtype('>i4'),
  0x0D: np.dtype('>f4'),
  0x0E: np.dtype('>f8'),
}


def read_idx(path: str) -> np.ndarray:
  """Reads one IDX file (`.gz` or not) into a numpy array.

  Raises:
    DataError: the file is not valid IDX.
  """
  opener = gzip.open if path.endswith('.gz') else open
  try:
    with opener(path, 'rb') as f:
      data = f.read()
  except (OSError, EOFError) as e:
    raise errors.DataError(f'cannot read IDX file {path}: {e}') from None
  if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _DTYPES:
    raise errors.DataError(f'{path} is not an IDX file (bad magic number)')
  dtype = np.dtype(_DTYPES[data[2]])
  ndim = data[3]
  header = 4 + 4 * ndim
  shape = tuple(
    int.from_bytes(data[4 + 4 * i : 8 + 4 * i], 'big') for i in range(ndim)
  )
  count = int(np.prod(shape)) if shape else 1
  if len(data) != header + count * dtype.itemsize:
    raise errors.DataError(
      f'{path}: size {len(data)} does not match its header shape {shape}'
    )
  arr = np.frombuffer(data, dtype=dtype, offset=header, count=count)
  return arr.reshape(shape).astype(dtype.newbyteorder('='))


def find_idx_file(data_dir: str, stem: str) -> str | None:
  """Returns `data_dir/stem` or `data_dir/stem.gz`, whichever exists."""
  for name in (stem + '.gz', stem):
    path = os.path.join(data_dir, name)
    if os.path.isfile(path):
      return path
  return None
