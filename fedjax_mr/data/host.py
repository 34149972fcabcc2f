"""Host arrays that a CPU device can use in place, without a second copy.

XLA:CPU aliases a numpy buffer instead of copying it when the buffer is
64-byte aligned, C-contiguous and `jax.device_put(..., may_alias=True)` is
asked for; numpy's own allocations are only 16-byte aligned. The loaders
allocate their example arrays with `empty`, and `to_device` moves them, so
on a CPU backend a dataset occupies host memory once (on an accelerator the
device copy is in device memory anyway).
"""

from __future__ import annotations

import jax
import numpy as np

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
