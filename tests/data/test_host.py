"""Host arrays shared in place with the CPU device."""

import jax
import numpy as np
import pytest

from fedjax_mr.data import client_data
from fedjax_mr.data import host


@pytest.mark.parametrize('shape', [(7, 3), (1000, 28, 28, 1), (0,), ()])
def test_empty_is_aligned(shape):
  x = host.empty(shape, np.float32)
  assert x.shape == shape and x.dtype == np.float32
  assert host.is_aligned(x)


def test_to_device_aliases_on_cpu_and_keeps_values():
  x = host.empty((64, 5), np.uint8)
  x[...] = np.arange(320).reshape(64, 5) % 251
  y = host.to_device(x)
  np.testing.assert_array_equal(np.asarray(y), x)
  if jax.devices()[0].platform == 'cpu':
    assert y.unsafe_buffer_pointer() == x.ctypes.data  # no second copy
  # An unaligned or wrongly typed array is copied, values unchanged.
  z = host.to_device(np.arange(10, dtype=np.int64)[1:], np.int32)
  assert z.dtype == np.int32 and list(np.asarray(z)) == list(range(1, 10))


def test_client_data_shares_the_loaders_buffer():
  x = host.empty((6, 2, 2, 1), np.uint8)
  x[...] = 3
  data = client_data.from_partition(x, np.arange(6) % 2, [np.arange(6)])
  if jax.devices()[0].platform == 'cpu':
    assert data.x.unsafe_buffer_pointer() == x.ctypes.data
  ev = client_data.eval_data(x, np.arange(6) % 2, 4)
  np.testing.assert_array_equal(np.asarray(ev.x).reshape(8, 2, 2, 1)[6:], 0)
  np.testing.assert_array_equal(np.asarray(ev.mask).ravel(), [1] * 6 + [0] * 2)


def test_memory_mapped_arrays_keep_values_and_leave_no_file(tmp_path):
  import ml_dtypes

  arrays = [
    np.arange(30, dtype=np.uint8).reshape(5, 3, 2),
    np.arange(7, dtype=np.int32),
    np.zeros((0, 4), np.float32),
    np.linspace(0, 1, 5).astype(ml_dtypes.bfloat16),
  ]
  mapped = host.memory_mapped(arrays, str(tmp_path))
  assert not list(tmp_path.iterdir())  # unnamed: nothing to clean up
  for a, m in zip(arrays, mapped, strict=True):
    assert m.shape == a.shape and m.dtype == a.dtype
    np.testing.assert_array_equal(m, a)
    assert not m.flags.writeable
  assert all(isinstance(m, np.memmap) for m in mapped[:2] + mapped[3:])
  assert all(host.is_aligned(m) for m in mapped)
  with pytest.raises(TypeError, match='object'):
    host.memory_mapped([np.array([None])], str(tmp_path))
  with pytest.raises(OSError) as e:
    host.memory_mapped(arrays, str(tmp_path / 'missing'))
  assert str(e.value.filename).startswith(str(tmp_path / 'missing'))
