"""Host arrays that a CPU device can use in place, without a second copy,
and host arrays kept in a file instead of memory (`memory_mapped`).

XLA:CPU aliases a numpy buffer instead of copying it when the buffer is
64-byte aligned, C-contiguous and `jax.device_put(..., may_alias=True)` is
asked for; numpy's own allocations are only 16-byte aligned. The loaders
allocate their example arrays with `empty`, and `to_device` moves them, so
on a CPU backend a dataset occupies host memory once (on an accelerator the
device copy is in device memory anyway).
"""

from __future__ import annotations

import tempfile
from typing import Sequence

import jax
import numpy as np

from fedjax_mr.core import files

ALIGN = 64


def empty(shape, dtype) -> np.ndarray:
  """`np.empty(shape, dtype)` whose data starts on an `ALIGN`-byte boundary."""
  dtype = np.dtype(dtype)
  shape = (int(shape),) if np.isscalar(shape) else tuple(map(int, shape))
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  buf = np.empty(nbytes + ALIGN, np.uint8)
  start = (-buf.ctypes.data) % ALIGN
  return buf[start : start + nbytes].view(dtype).reshape(shape)


def is_aligned(x: np.ndarray) -> bool:
  """C-contiguous and starting on an `ALIGN`-byte boundary (or empty)."""
  return x.flags.c_contiguous and (x.size == 0 or x.ctypes.data % ALIGN == 0)


def to_device(x: np.ndarray, dtype=None) -> jax.Array:
  """`jnp.asarray(x, dtype)`, sharing `x`'s memory on CPU where it can.

  The caller must not write to `x` afterwards.
  """
  x = np.asarray(x)
  if dtype is not None and x.dtype != np.dtype(dtype):
    x = x.astype(dtype)
  if is_aligned(x):
    return jax.device_put(x, may_alias=True)
  return jax.device_put(x)


def memory_mapped(
  arrays: Sequence[np.ndarray], folder: str
) -> list[np.ndarray]:
  """Read-only copies of `arrays` memory-mapped from one file in `folder`.

  The file has no name: it is created unlinked (`tempfile.TemporaryFile`),
  so nothing is left in `folder` however the process ends, no other
  process can see or write it, and nothing is ever read back by name (no
  `np.load`, no unpickling). Its pages are read from disk when touched
  and are the kernel's to evict, so the arrays need not fit in memory
  once written; the arrays given may be dropped afterwards. The bytes are
  written with `write`, never through the mapping, so writing them makes
  no page of the mapping resident. Each array starts on an
  `ALIGN`-byte boundary; empty ones stay in memory (read-only views).

  Args:
    arrays: host arrays (any dtype but object).
    folder: an existing folder on a disk (not a RAM file system, where
      the file would take memory anyway).

  Returns:
    One `np.memmap` per non-empty array (same shape, dtype and values),
    in order.

  Raises:
    OSError: the file cannot be written (its `filename` is `folder`).
  """
  arrays = [np.ascontiguousarray(a) for a in arrays]
  for a in arrays:
    if a.dtype.hasobject:
      raise TypeError(f'cannot memory-map an array of {a.dtype}')
  starts = []
  with files.named(folder), tempfile.TemporaryFile(dir=folder) as f:
    end = 0
    for a in arrays:
      pad = -end % ALIGN
      f.write(bytes(pad))
      starts.append(end + pad)
      f.write(memoryview(a.reshape(-1).view(np.uint8)))
      end += pad + a.nbytes
    f.flush()
    # The mappings hold the file open after `f` is closed.
    return [
      _read_only(a)
      if a.size == 0
      else np.memmap(f, a.dtype, mode='r', offset=start, shape=a.shape)
      for a, start in zip(arrays, starts)
    ]


def _read_only(a: np.ndarray) -> np.ndarray:
  view = a.view()
  view.flags.writeable = False
  return view
