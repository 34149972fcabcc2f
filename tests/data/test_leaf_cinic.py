"""LEAF json, CINIC-10 folders and the new tfds datasets, on small fixtures
written here in the real on-disk formats."""

import json
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds

from fedjax_mr.core import errors
from fedjax_mr.data import cinic
from fedjax_mr.data import client_data
from fedjax_mr.data import datasets
from fedjax_mr.data import leaf
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from tests import helpers

# ---------------------------------------------------------------- writers --


def write_leaf_file(path, user_data, key_order=('users', 'num_samples')):
  """Writes one LEAF json file: {"users", "num_samples", "user_data"}."""
  users = list(user_data)
  fields = {
    'users': users,
    'num_samples': [len(user_data[u]['y']) for u in users],
  }
  doc = {k: fields[k] for k in key_order}
  doc['user_data'] = user_data
  for k in fields:
    doc.setdefault(k, fields[k])
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(doc, f)


def femnist_users(sizes, seed=0, prefix='f'):
  """User → {'x': n lists of 784 multiples of 1/255, 'y': n labels}."""
  rng = np.random.default_rng(seed)
  out = {}
  for i, n in enumerate(sizes):
    pixels = rng.integers(0, 256, (n, 784))
    out[f'{prefix}{i:04d}'] = {
      'x': (pixels / 255).tolist(),
      'y': rng.integers(0, 62, n).tolist(),
    }
  return out


def write_femnist(folder, train_sizes, test_sizes, seed=0):
  """LEAF FEMNIST (`-t sample`): every user in train and test; the train
  users over two files."""
  train = femnist_users(train_sizes, seed)
  test = femnist_users(test_sizes, seed + 1)
  names = list(train)
  half = len(names) // 2
  write_leaf_file(
    os.path.join(folder, 'train', 'a_train.json'),
    {u: train[u] for u in names[:half]},
  )
  write_leaf_file(
    os.path.join(folder, 'train', 'b_train.json'),
    {u: train[u] for u in names[half:]},
  )
  write_leaf_file(os.path.join(folder, 'test', 'a_test.json'), test)
  return str(folder), train, test


def shakespeare_users(sizes, seed=0):
  rng = np.random.default_rng(seed)
  letters = np.array(list(leaf.ALL_LETTERS))
  out = {}
  for i, n in enumerate(sizes):
    text = ''.join(rng.choice(letters, n + leaf.SEQ_LEN))
    out[f'ROLE_{i}'] = {
      'x': [text[j : j + leaf.SEQ_LEN] for j in range(n)],
      'y': [text[j + leaf.SEQ_LEN] for j in range(n)],
    }
  return out


def write_shakespeare(folder, train_sizes, test_sizes, seed=0):
  train = shakespeare_users(train_sizes, seed)
  test = shakespeare_users(test_sizes, seed + 1)
  write_leaf_file(os.path.join(folder, 'train', 'all_train.json'), train)
  write_leaf_file(os.path.join(folder, 'test', 'all_test.json'), test)
  return str(folder), train, test


def write_cinic(root, per_class=1, seed=0, splits=('train', 'valid', 'test')):
  """CINIC-10 layout: <split>/<class>/*.png, 32×32; one greyscale image."""
  from PIL import Image

  rng = np.random.default_rng(seed)
  images = {}
  for split in splits:
    for name in cinic.CLASSES:
      folder = os.path.join(root, split, name)
      os.makedirs(folder, exist_ok=True)
      for i in range(per_class):
        path = os.path.join(folder, f'img_{i}.png')
        if split == 'train' and name == 'cat' and i == 0:
          grey = rng.integers(0, 256, (32, 32), dtype=np.uint8)
          Image.fromarray(grey, 'L').save(path)
          images[path] = np.repeat(grey[..., None], 3, axis=-1)
        else:
          rgb = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
          Image.fromarray(rgb, 'RGB').save(path)
          images[path] = rgb
  return str(root), images


# ------------------------------------------------------------------ FEMNIST --


def test_femnist_arrays_clients_and_normalisation(tmp_path):
  folder, train, test = write_femnist(tmp_path, [3, 5, 2, 4], [1, 2, 1, 1])
  ds = datasets.load('femnist', folder)
  assert ds.x_train.shape == (14, 28, 28, 1) and ds.x_train.dtype == np.uint8
  assert ds.x_test.shape == (5, 28, 28, 1)
  assert ds.num_classes == 62 and ds.input_shape == (28, 28, 1)
  assert [len(c) for c in ds.clients] == [3, 5, 2, 4]
  assert [len(c) for c in ds.test_clients] == [1, 2, 1, 1]
  for k, user in enumerate(train):
    want = np.asarray(train[user]['x']).reshape(-1, 28, 28, 1)
    got = ds.x_train[ds.clients[k]]
    np.testing.assert_array_equal(got, np.rint(want * 255))
    np.testing.assert_array_equal(ds.y_train[ds.clients[k]], train[user]['y'])
    # Model input: (0.5 - x) / 0.5 of LEAF's x.
    model_in = np.asarray(client_data.normalize(got, ds.scale, ds.shift))
    helpers.assert_close(model_in, (0.5 - want) / 0.5, atol=1e-6)
  for k, user in enumerate(test):
    np.testing.assert_array_equal(
      ds.y_test[ds.test_clients[k]], test[user]['y']
    )


def test_femnist_min_samples_counts_train_plus_test(tmp_path):
  # Totals 4, 7, 3, 5: '> 4' keeps users 1 and 3, in train and test.
  folder, train, test = write_femnist(tmp_path, [3, 5, 2, 4], [1, 2, 1, 1])
  ds = datasets.load('femnist', folder, leaf_min_samples=4)
  assert [len(c) for c in ds.clients] == [5, 4]
  assert len(ds.x_test) == 3
  users = list(train)
  np.testing.assert_array_equal(
    ds.y_train, train[users[1]]['y'] + train[users[3]]['y']
  )
  with pytest.raises(errors.DataError, match='more than 7 samples'):
    datasets.load('femnist', folder, leaf_min_samples=7)


def test_natural_clients_keeps_a_seeded_subset_and_its_test_data(tmp_path):
  folder, train, test = write_femnist(tmp_path, [3, 5, 2, 4], [1, 2, 1, 1])
  ds = datasets.load('femnist', folder)
  sub = datasets.natural_clients(ds, 2, seed=3)
  again = datasets.natural_clients(ds, 2, seed=3)
  np.testing.assert_array_equal(sub.x_train, again.x_train)
  sizes = [len(c) for c in sub.clients]
  kept = [k for k in range(4) if len(ds.clients[k]) in sizes]
  assert len(sub.x_train) == sum(sizes) and len(sub.clients) == 2
  users = list(train)
  want_y = sum((train[users[k]]['y'] for k in kept), [])
  np.testing.assert_array_equal(sub.y_train, want_y)
  want_test = sum((test[list(test)[k]]['y'] for k in kept), [])
  np.testing.assert_array_equal(sub.y_test, want_test)
  assert datasets.natural_clients(ds, 4, seed=0) is ds
  with pytest.raises(errors.ArgumentError, match='^num_clients exceeds'):
    datasets.natural_clients(ds, 5, seed=0)


def test_users_without_test_data(tmp_path):
  folder, _, _ = write_femnist(tmp_path, [3, 5], [0, 2])
  ds = datasets.load('femnist', folder)
  assert [len(c) for c in ds.test_clients] == [0, 2]
  kept_sizes = set()
  for seed in range(20):
    try:
      sub = datasets.natural_clients(ds, 1, seed=seed)
    except errors.DataError as e:  # kept only the user without test data
      assert 'have no test examples' in str(e)
      kept_sizes.add(3)
    else:
      assert len(sub.x_test) == 2
      kept_sizes.add(len(sub.x_train))
  assert kept_sizes == {3, 5}


def test_user_split_keeps_whole_test_set(tmp_path):
  # LEAF `-t user`: test users are not training users.
  write_leaf_file(
    str(tmp_path / 'train' / 'tr.json'), femnist_users([2, 3], prefix='a')
  )
  write_leaf_file(
    str(tmp_path / 'test' / 'te.json'), femnist_users([4], prefix='b')
  )
  ds = datasets.load('femnist', str(tmp_path))
  assert ds.test_clients is None
  sub = datasets.natural_clients(ds, 1, seed=0)
  assert len(sub.x_test) == 4 and len(sub.clients) == 1


def test_leaf_layout_with_data_folder_and_other_key_order(tmp_path):
  root = tmp_path / 'data'
  write_leaf_file(
    str(root / 'train' / 'x.json'),
    femnist_users([2, 2]),
    key_order=('num_samples',),  # user_data before users: parsed whole
  )
  write_leaf_file(str(root / 'test' / 'x.json'), femnist_users([1, 1]))
  ds = datasets.load('femnist', str(tmp_path))
  assert [len(c) for c in ds.clients] == [2, 2]


def test_leaf_errors(tmp_path):
  with pytest.raises(errors.DataError, match='preprocess.sh'):
    datasets.load('femnist')
  with pytest.raises(errors.DataError, match='no LEAF json files'):
    datasets.load('shakespeare', str(tmp_path))
  bad = femnist_users([2])
  bad['f0000']['x'][1] = bad['f0000']['x'][1][:100]
  write_leaf_file(str(tmp_path / 'train' / 'x.json'), bad)
  write_leaf_file(str(tmp_path / 'test' / 'x.json'), femnist_users([1]))
  with pytest.raises(errors.DataError, match="user 'f0000'"):
    datasets.load('femnist', str(tmp_path))
  bad = femnist_users([2])
  bad['f0000']['y'] = [0, 62]
  write_leaf_file(str(tmp_path / 'train' / 'x.json'), bad)
  with pytest.raises(errors.DataError, match=r'labels must lie in \[0, 62\)'):
    datasets.load('femnist', str(tmp_path))


# -------------------------------------------------------------- Shakespeare --


def test_shakespeare_token_ids(tmp_path):
  assert len(leaf.ALL_LETTERS) == 80 == len(set(leaf.ALL_LETTERS))
  folder, train, test = write_shakespeare(tmp_path, [4, 3], [2, 1])
  ds = datasets.load('shakespeare', folder)
  assert ds.x_train.shape == (7, 80) and ds.x_train.dtype == np.uint8
  assert ds.input_shape == (80,) and ds.num_classes == 80
  assert (ds.scale, ds.shift) == (1.0, 0.0)
  role = train['ROLE_1']
  first = ds.clients[1][0]
  assert ''.join(leaf.ALL_LETTERS[i] for i in ds.x_train[first]) == role['x'][0]
  assert leaf.ALL_LETTERS[ds.y_train[first]] == role['y'][0]
  # Integer inputs reach the model unchanged.
  assert client_data.normalize(ds.x_train, ds.scale, ds.shift) is ds.x_train


def test_shakespeare_bad_text(tmp_path):
  users = shakespeare_users([2])
  users['ROLE_0']['x'][1] = users['ROLE_0']['x'][1][:-1] + '$'
  write_leaf_file(str(tmp_path / 'train' / 'x.json'), users)
  write_leaf_file(str(tmp_path / 'test' / 'x.json'), shakespeare_users([1]))
  with pytest.raises(errors.DataError, match=r"vocabulary: \['\$'\]"):
    datasets.load('shakespeare', str(tmp_path))
  users['ROLE_0']['x'][1] = 'too short'
  write_leaf_file(str(tmp_path / 'train' / 'x.json'), users)
  with pytest.raises(errors.DataError, match='strings of 80 characters'):
    datasets.load('shakespeare', str(tmp_path))


# ----------------------------------------------------------------- CINIC-10 --


def test_cinic_decodes_pngs_in_place(tmp_path):
  root, images = write_cinic(tmp_path, per_class=2)
  ds = datasets.load('cinic10', root)
  assert ds.x_train.shape == (20, 32, 32, 3) and ds.x_train.dtype == np.uint8
  assert ds.x_test.shape == (20, 32, 32, 3)  # 'valid' is not read
  np.testing.assert_array_equal(ds.y_train, np.repeat(np.arange(10), 2))
  cat = cinic.CLASSES.index('cat')
  for i in range(2):
    path = os.path.join(root, 'train', 'cat', f'img_{i}.png')
    np.testing.assert_array_equal(ds.x_train[2 * cat + i], images[path])
  assert (ds.scale, ds.shift) == (1 / 127.5, -1.0)
  x, y = cinic.load_split(root, ('train', 'valid'))
  assert len(x) == 40 and y[-1] == 9


def test_cinic_errors(tmp_path):
  from PIL import Image

  with pytest.raises(errors.DataError, match='CINIC-10'):
    datasets.load('cinic10')
  root, _ = write_cinic(tmp_path / 'a', splits=('train',))
  with pytest.raises(errors.DataError, match='no test/ folder'):
    datasets.load('cinic10', root)
  root, _ = write_cinic(tmp_path / 'b')
  path = os.path.join(root, 'test', 'ship', 'img_0.png')
  Image.fromarray(np.zeros((16, 32, 3), np.uint8)).save(path)
  with pytest.raises(errors.DataError, match='is 32×16'):
    datasets.load('cinic10', root)
  with open(path, 'wb') as f:
    f.write(b'not a png')
  with pytest.raises(errors.DataError, match='not a readable image'):
    datasets.load('cinic10', root)
  os.makedirs(os.path.join(root, 'train', 'unicorn'))
  with pytest.raises(errors.DataError, match='found airplane.*unicorn'):
    datasets.load('cinic10', root)


# ------------------------------------------------------------ tfds datasets --


@pytest.mark.parametrize(
  'name,options,shape,classes',
  [
    ('svhn_cropped', {}, (32, 32, 3), 10),
    ('fashion_mnist', {}, (28, 28, 1), 10),
    ('cifar100', {'cifar100_labels': 'fine'}, (32, 32, 3), 100),
    ('cifar100', {'cifar100_labels': 'coarse'}, (32, 32, 3), 20),
  ],
)
def test_tfds_mock_data(tmp_path, name, options, shape, classes):
  with tfds.testing.mock_data(num_examples=40):
    # An empty data_dir: no IDX files, so fashion_mnist goes to tfds too.
    ds = datasets.load(name, str(tmp_path), **options)
  assert ds.x_train.shape == (40, *shape) and ds.x_train.dtype == np.uint8
  assert ds.num_classes == classes and ds.clients is None
  assert 0 <= ds.y_train.min() and ds.y_train.max() < classes
  assert os.listdir(tmp_path) == []


def test_cifar10_normalisation_is_half_half():
  with tfds.testing.mock_data(num_examples=4):
    ds = datasets.load('cifar10')
  x = np.array([0, 255], np.uint8)
  helpers.assert_close(
    client_data.normalize(x, ds.scale, ds.shift), [-1.0, 1.0]
  )


def test_bad_options():
  with pytest.raises(errors.ArgumentError, match="^cifar100_labels 'medium'"):
    datasets.load('cifar100', cifar100_labels='medium')
  with pytest.raises(errors.ArgumentError, match='^leaf_min_samples must'):
    datasets.load('femnist', leaf_min_samples=-1)
  with tfds.testing.mock_data(num_examples=4):
    ds = datasets.load('cifar10')
  with pytest.raises(errors.ArgumentError, match='^dataset cifar10 has no'):
    datasets.natural_clients(ds, 2, seed=0)


@pytest.mark.parametrize(
  'changes,message',
  [
    ({'partition': 'natural'}, '^`partition=natural` needs a dataset'),
    ({'leaf_min_samples': 100}, '^`leaf_min_samples` applies to LEAF'),
    ({'cifar100_labels': 'coarse'}, '^`cifar100_labels=coarse` applies to'),
    ({'cifar100_labels': 'x', 'dataset': 'cifar100'}, '^`cifar100_labels`'),
    ({'leaf_min_samples': -1, 'dataset': 'femnist'}, '^`leaf_min_samples`'),
    (
      {'model': 'char_lstm'},
      '`model=char_lstm` takes tokens; `dataset=cifar10` gives',
    ),
    (
      {'dataset': 'shakespeare'},
      '`model=cnn_cifar` takes images; `dataset=shakes',
    ),
  ],
)
def test_config_validation(changes, message):
  cfg = config_lib.ExperimentConfig.from_flat(
    dataset='cifar10', model='cnn_cifar'
  ).replace(**changes)
  with pytest.raises(errors.ConfigError, match=message):
    checks.validate(cfg)


def test_natural_partition_is_valid_for_leaf_datasets():
  for name, model in (('femnist', 'cnn_femnist'), ('shakespeare', 'char_lstm')):
    checks.validate(
      config_lib.ExperimentConfig.from_flat(
        dataset=name, model=model, partition='natural', leaf_min_samples=100
      )
    )
