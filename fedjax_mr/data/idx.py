"""Reader for the IDX format of (Fashion-)MNIST, plain or gzip-compressed."""

from __future__ import annotations

import gzip
import os

import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.data import host

_DTYPES = {
  0x08: np.uint8,
  0x09: np.int8,
  0x0B: np.dtype('>i2'),
  0x0C: np.dtype('>i4'),
  0x0D: np.dtype('>f4'),
  0x0E: np.dtype('>f8'),
}


_CHUNK = 1 << 22
# deflate cannot compress better than about 1032:1.
_MAX_DEFLATE_RATIO = 1100


def _check_size(path: str, header_bytes: int, data_bytes: int) -> None:
  """Refuses a header whose data cannot be in the file, before allocating.

  A plain file's size is exact. A gzip file bounds it: deflate compresses
  at most about 1032:1, and the trailer holds the uncompressed size modulo
  2**32 (of the last member only, so a mismatch is trusted only for claims
  over 1 GiB, which no multi-member IDX file reaches); the read itself
  checks the exact size.
  """
  disk = os.path.getsize(path)
  want = header_bytes + data_bytes
  holds = None
  if not path.endswith('.gz'):
    if disk != want:
      holds = f'the file holds {max(disk - header_bytes, 0)}'
  elif want > disk * _MAX_DEFLATE_RATIO:
    holds = f'more than a {disk}-byte gzip file can hold'
  elif want > 2**30 and disk >= 18:
    with open(path, 'rb') as raw:
      raw.seek(-4, os.SEEK_END)
      if int.from_bytes(raw.read(4), 'little') != want % 2**32:
        holds = "its gzip trailer's size differs"
  if holds:
    raise errors.DataError(
      f'{path}: its header announces {data_bytes} bytes of data; {holds}'
    )


def read_idx(path: str) -> np.ndarray:
  """Reads one IDX file (`.gz` or not) into a numpy array.

  Raises:
    DataError: the file is not valid IDX.
  """
  opener = gzip.open if path.endswith('.gz') else open
  try:
    with opener(path, 'rb') as f:
      magic = f.read(4)
      if len(magic) < 4 or magic[:2] != b'\0\0' or magic[2] not in _DTYPES:
        raise errors.DataError(f'{path} is not an IDX file (bad magic number)')
      dtype = np.dtype(_DTYPES[magic[2]])
      ndim = magic[3]
      dims = f.read(4 * ndim)
      if len(dims) != 4 * ndim:
        raise errors.DataError(f'{path}: truncated header')
      shape = tuple(
        int.from_bytes(dims[4 * i : 4 * i + 4], 'big') for i in range(ndim)
      )
      size = 1
      for d in shape:
        size *= d
      _check_size(path, 4 + 4 * ndim, size * dtype.itemsize)
      # Read straight into the aligned array: the file's bytes are never
      # held twice.
      out = host.empty(shape, dtype)
      view = memoryview(out.reshape(-1).view(np.uint8))
      got = 0
      while got < len(view):
        # In chunks: gzip's readinto goes through a temporary of its size.
        n = f.readinto(view[got : got + _CHUNK])
        if not n:
          break
        got += n
      extra = len(f.read(1))
  except (OSError, EOFError) as e:
    raise errors.DataError(f'cannot read IDX file {path}: {e}') from None
  if got != out.nbytes or extra:
    size = 4 + 4 * ndim + got + extra
    raise errors.DataError(
      f'{path}: size {size}{"+" if extra else ""} does not match its header '
      f'shape {shape}'
    )
  if not dtype.isnative and dtype.itemsize > 1:
    out.byteswap(inplace=True)
    out = out.view(dtype.newbyteorder('='))
  return out


def find_idx_file(data_dir: str, stem: str) -> str | None:
  """Returns `data_dir/stem` or `data_dir/stem.gz`, whichever exists."""
  for name in (stem + '.gz', stem):
    path = os.path.join(data_dir, name)
    if os.path.isfile(path):
      return path
  return None
