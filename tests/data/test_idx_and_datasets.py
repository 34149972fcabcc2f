import gzip
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds

from fedjax_mr.core import errors
from fedjax_mr.data import datasets
from fedjax_mr.data import idx
from tests import conftest


def test_read_idx_roundtrip(tmp_path):
  a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
  path = str(tmp_path / 'a.gz')
  conftest.write_idx(path, a)
  np.testing.assert_array_equal(idx.read_idx(path), a)


def test_read_idx_plain_int32(tmp_path):
  a = np.array([[1, -2], [300000, 4]], '>i4')
  path = tmp_path / 'b'
  path.write_bytes(bytes([0, 0, 0x0C, 2, 0, 0, 0, 2, 0, 0, 0, 2]) + a.tobytes())
  np.testing.assert_array_equal(idx.read_idx(str(path)), a.astype(np.int32))


def test_read_idx_rejects_garbage(tmp_path):
  path = tmp_path / 'bad.gz'
  with gzip.open(path, 'wb') as f:
    f.write(b'not an idx file at all')
  with pytest.raises(errors.DataError, match='not an IDX file'):
    idx.read_idx(str(path))
  trunc = tmp_path / 'trunc'
  trunc.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 9, 1, 2]))
  with pytest.raises(errors.DataError, match='header announces 9 bytes'):
    idx.read_idx(str(trunc))
  short = tmp_path / 'short.gz'  # gzip: found while reading
  with gzip.open(short, 'wb') as f:
    f.write(bytes([0, 0, 8, 1, 0, 0, 0, 9, 1, 2]))
  with pytest.raises(errors.DataError, match='does not match'):
    idx.read_idx(str(short))


@pytest.mark.parametrize('gz', [False, True])
def test_read_idx_refuses_a_huge_header_before_allocating(
  tmp_path, monkeypatch, gz
):
  """A header claiming 2**32 - 1 images of 28×28 (3.4 TB) in a tiny file."""
  header = bytes([0, 0, 8, 3]) + b''.join(
    d.to_bytes(4, 'big') for d in (2**32 - 1, 28, 28)
  )
  path = tmp_path / ('big.gz' if gz else 'big')
  if gz:
    with gzip.open(path, 'wb') as f:
      f.write(header + bytes(100))
  else:
    path.write_bytes(header + bytes(100))

  def no_allocation(*args):
    raise AssertionError('allocated')

  monkeypatch.setattr(idx.host, 'empty', no_allocation)
  with pytest.raises(errors.DataError, match='header announces'):
    idx.read_idx(str(path))


def idx_folder(tmp_path, **changes):
  rng = np.random.default_rng(0)
  arrays = dict(
    x_train=rng.integers(0, 256, (20, 28, 28)),
    y_train=np.arange(20) % 10,
    x_test=rng.integers(0, 256, (5, 28, 28)),
    y_test=np.arange(5),
  )
  arrays.update(changes)
  return conftest.write_idx_dataset(tmp_path, **arrays)


def write_typed(path, array, code):
  header = bytes([0, 0, code, array.ndim])
  header += b''.join(int(d).to_bytes(4, 'big') for d in array.shape)
  with gzip.open(path, 'wb') as f:
    f.write(header + array.tobytes())


def test_idx_labels_out_of_range_name_the_file(tmp_path):
  folder = idx_folder(tmp_path, y_train=np.full(20, 200))
  with pytest.raises(errors.DataError) as e:
    datasets.load('fashion_mnist', folder)
  assert str(e.value) == (
    f'{folder}/train-labels-idx1-ubyte.gz: labels must lie in 0..9, found '
    '200..200'
  )
  write_typed(  # int8 labels of -1
    os.path.join(folder, 'train-labels-idx1-ubyte.gz'),
    np.full(20, 0, np.int8),
    0x09,
  )
  write_typed(
    os.path.join(folder, 't10k-labels-idx1-ubyte.gz'),
    np.full(5, -1, np.int8),
    0x09,
  )
  with pytest.raises(errors.DataError, match=r't10k-labels.*found -1\.\.-1'):
    datasets.load('fashion_mnist', folder)


def test_idx_images_must_be_bytes_of_one_shape(tmp_path):
  folder = idx_folder(tmp_path / 'a', x_test=np.zeros((5, 27, 28)))
  with pytest.raises(
    errors.DataError,
    match=r'test images are \(27, 28\), training images \(28, 28\)',
  ):
    datasets.load('fashion_mnist', folder)
  folder = idx_folder(tmp_path / 'b')
  write_typed(
    os.path.join(folder, 'train-images-idx3-ubyte.gz'),
    np.full((20, 28, 28), np.nan, '>f4'),
    0x0D,
  )
  with pytest.raises(errors.DataError, match='must be unsigned bytes'):
    datasets.load('fashion_mnist', folder)


def test_real_fashion_mnist(fashion_mnist):
  ds = fashion_mnist
  assert ds.x_train.shape == (60000, 28, 28, 1)
  assert ds.x_test.shape == (10000, 28, 28, 1)
  assert ds.x_train.dtype == np.uint8
  assert ds.num_classes == 10
  np.testing.assert_array_equal(np.bincount(ds.y_train), [6000] * 10)
  np.testing.assert_array_equal(np.bincount(ds.y_test), [1000] * 10)
  assert ds.scale == pytest.approx(1 / 255) and ds.shift == 0.0


def test_idx_from_data_dir(tmp_path):
  rng = np.random.default_rng(0)
  folder = conftest.write_idx_dataset(
    tmp_path,
    rng.integers(0, 256, (20, 28, 28)),
    np.arange(20) % 10,
    rng.integers(0, 256, (5, 28, 28)),
    np.arange(5),
  )
  ds = datasets.load('mnist', folder)
  assert ds.x_train.shape == (20, 28, 28, 1) and ds.y_test.tolist() == [
    0,
    1,
    2,
    3,
    4,
  ]


def test_unknown_dataset():
  with pytest.raises(
    errors.ArgumentError, match="^name 'imagenet' is unknown.*fashion_mnist"
  ):
    datasets.load('imagenet')


def test_bad_data_dir():
  with pytest.raises(errors.DataError, match='^`data_dir`: '):
    datasets.load('fashion_mnist', '/nonexistent/folder')


def test_missing_tfds_dataset_message(tmp_path):
  with pytest.raises(errors.DataError) as e:
    datasets.load('cifar10', str(tmp_path))
  msg = str(e.value)
  assert 'cifar10' in msg and 'tfds build' in msg and 'TensorFlow' in msg


def test_missing_fashion_mnist_mentions_apt(tmp_path):
  with pytest.raises(errors.DataError, match='apt-get install -y dataset-fash'):
    datasets.load('fashion_mnist', str(tmp_path))


@pytest.mark.parametrize(
  'name,shape,classes',
  [
    ('cifar10', (32, 32, 3), 10),
    ('cifar100', (32, 32, 3), 100),
    ('mnist', (28, 28, 1), 10),
    ('emnist', (28, 28, 1), 62),
  ],
)
def test_tfds_data_source_with_mock_data(tmp_path, name, shape, classes):
  with tfds.testing.mock_data(num_examples=12):
    ds = datasets.load(name, str(tmp_path) if name == 'mnist' else None)
  assert ds.x_train.shape == (12, *shape)
  assert ds.x_test.shape == (12, *shape)
  assert ds.y_train.dtype == np.int32
  assert ds.num_classes == classes
  assert 0 <= ds.y_train.min() and ds.y_train.max() < classes
  assert os.listdir(tmp_path) == []  # nothing downloaded or written


def test_parse_classes_lists_ranges_and_errors():
  assert datasets.parse_classes('5-9', 10) == (5, 6, 7, 8, 9)
  assert datasets.parse_classes('3,0-1,9', 10) == (3, 0, 1, 9)
  for text, match in [
    ('0,x', "^text holds 'x', not a class id"),
    ('8-10', '^text holds class 10, not in'),
    ('1,2,1', '^text names a class twice'),
    ('4', '^text must name ≥ 2 classes'),
  ]:
    with pytest.raises(errors.ArgumentError, match=match):
      datasets.parse_classes(text, 10)


def test_select_classes_relabels_in_order_and_keeps_train_indices():
  x = np.arange(6, dtype=np.uint8).reshape(6, 1, 1, 1)
  ds = datasets.Dataset(
    'toy',
    x_train=x,
    y_train=np.array([0, 1, 2, 3, 2, 1], np.int32),
    x_test=x[:4],
    y_test=np.array([3, 2, 1, 0], np.int32),
    num_classes=4,
    scale=1.0,
    shift=0.0,
  )
  sub = datasets.select_classes(ds, (2, 1))
  assert sub.num_classes == 2
  # Training arrays keep every example; other classes are −1.
  np.testing.assert_array_equal(sub.x_train, x)
  np.testing.assert_array_equal(sub.y_train, [-1, 1, 0, -1, 0, 1])
  # Test examples of classes 2, 1 only, relabelled 2 → 0, 1 → 1.
  np.testing.assert_array_equal(sub.x_test.ravel(), [1, 2])
  np.testing.assert_array_equal(sub.y_test, [0, 1])


def test_load_task_is_load_then_select_classes(tmp_path):
  with tfds.testing.mock_data(num_examples=12):
    whole, none = datasets.load_task('mnist', str(tmp_path))
    task, ids = datasets.load_task('mnist', str(tmp_path), '3,0-1')
    with pytest.raises(errors.ArgumentError, match='^classes holds class 10'):
      datasets.load_task('mnist', str(tmp_path), '9-10')
  assert none is None and whole.num_classes == 10
  assert ids == (3, 0, 1) and task.num_classes == 3
  expected = datasets.select_classes(whole, ids)
  np.testing.assert_array_equal(task.y_train, expected.y_train)
  np.testing.assert_array_equal(task.y_test, expected.y_test)


@pytest.mark.parametrize(
  'name,shape,classes',
  [('fashion_mnist', (28, 28, 1), 10), ('cifar10', (32, 32, 3), 10)],
)
def test_random_images_stand_in_for_a_dataset(name, shape, classes):
  ds = datasets.random_images(name, 300, 50, seed=1)
  assert ds.x_train.shape == (300, *shape) and ds.x_test.shape == (50, *shape)
  assert ds.x_train.dtype == np.uint8 and ds.y_train.dtype == np.int32
  assert ds.num_classes == classes and ds.input_shape == shape
  assert set(np.unique(ds.y_train).tolist()) == set(range(classes))
  assert ds.x_train.min() == 0 and ds.x_train.max() == 255
  real = datasets._SPECS[name]
  assert (ds.scale, ds.shift) == (real.scale, real.shift)
  again = datasets.random_images(name, 300, 50, seed=1)
  np.testing.assert_array_equal(ds.x_train, again.x_train)


def test_random_images_refuses_what_it_cannot_make():
  with pytest.raises(errors.ArgumentError, match='^name .* no random stand-in'):
    datasets.random_images('shakespeare', 10, 10)
  with pytest.raises(
    errors.ArgumentError, match='^num_train must be a positive'
  ):
    datasets.random_images('cifar10', 0, 10)
