"""`--classes` and `--init_from` of the experiment config: the training
baselines of FedStitch's transfer setting (a pool pre-trained on some
classes, clients learning others)."""

import json

import jax
import numpy as np
import pytest

from fedjax_mr.core import errors
from fedjax_mr.models import model as model_lib
from fedjax_mr.pipeline import build
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.stitch import pool as pool_lib

# Labels after `datasets.select_classes`: −1 for the classes left out.
LABELS = np.array([0, -1, 1, 1, -1, 0, 2, -1, 2, 0, 1, 2])


def config(**kw):
  return config_lib.ExperimentConfig.from_flat(
    **{'num_clients': 3, 'clients_per_round': 2, 'classes': '5-7', **kw}
  )


@pytest.mark.parametrize(
  'partition', ['iid', 'dirichlet', 'dirichlet_equal', 'shards']
)
def test_partition_covers_the_kept_classes_only(partition):
  kw = {'partition': partition}
  if partition == 'dirichlet':
    kw.update(alpha=1.0, min_client_size=1)
  if partition == 'dirichlet_equal':
    kw.update(alpha=1.0)
  if partition == 'shards':
    kw.update(shards_per_client=1)
  parts = build.make_partition(config(**kw), LABELS)
  got = np.sort(np.concatenate(parts))
  np.testing.assert_array_equal(got, np.flatnonzero(LABELS >= 0))
  if partition in ('iid', 'dirichlet_equal'):  # 9 kept examples, 3 clients
    assert [len(p) for p in parts] == [3, 3, 3]


def test_iid_partition_is_the_plain_one_of_the_kept_examples():
  from fedjax_mr.data import partition

  parts = build.make_partition(config(partition='iid'), LABELS)
  keep = np.flatnonzero(LABELS >= 0)
  plain = partition.iid(len(keep), 3, 0)
  for p, q in zip(parts, plain):
    np.testing.assert_array_equal(p, keep[q])


def test_partition_file_with_a_left_out_example_is_refused(tmp_path):
  path = tmp_path / 'clients.json'
  path.write_text(json.dumps({'clients': [[0, 2], [3, 4], [5, 6]]}))
  c = config(partition='file', partition_file=str(path))
  with pytest.raises(errors.ConfigError, match='client 1 holds example 4'):
    build.make_partition(c, LABELS)
  path.write_text(json.dumps({'clients': [[0, 2], [3, 5], [6, 8]]}))
  c = config(partition='file', partition_file=str(path))
  parts = build.make_partition(c, LABELS)
  assert [p.tolist() for p in parts] == [[0, 2], [3, 5], [6, 8]]


def _pool_model(tmp_path, classes):
  model = model_lib.get('cnn_mnist', 3, (28, 28, 1))
  saved = model.init(jax.random.key(7))
  pool_lib.save_model(
    str(tmp_path),
    'cnn_mnist',
    model,
    saved,
    dataset='fashion_mnist',
    classes=classes,
  )
  return model, saved


def _same(a, b):
  return all(
    np.array_equal(x, y)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def test_init_from_a_model_of_the_same_classes_takes_it_whole(tmp_path):
  model, saved = _pool_model(tmp_path, [5, 6, 7])
  fresh = model.init(jax.random.key(0))
  c = config(init_from=str(tmp_path / 'cnn_mnist'), model='cnn_mnist')
  got = build.pretrained_variables(c, model, fresh)
  assert _same(got, saved)


def test_init_from_other_classes_keeps_the_fresh_classifier(tmp_path):
  model, saved = _pool_model(tmp_path, [0, 1, 2])
  fresh = model.init(jax.random.key(0))
  c = config(init_from=str(tmp_path / 'cnn_mnist'), model='cnn_mnist')
  got = build.pretrained_variables(c, model, fresh)
  head = list(fresh['params'])[-1]
  for name in fresh['params']:
    want = fresh if name == head else saved
    assert _same(got['params'][name], want['params'][name]), name
  assert not _same(got['params'][head], saved['params'][head])


def test_init_from_another_model_is_refused_in_one_line(tmp_path):
  model, _ = _pool_model(tmp_path, [5, 6, 7])
  c = config(init_from=str(tmp_path / 'cnn_mnist'), model='cnn_femnist')
  with pytest.raises(errors.ConfigError, match='`init_from=.*cnn_mnist model'):
    build.pretrained_variables(c, model, model.init(jax.random.key(0)))
  wide = model_lib.get('cnn_mnist', 4, (28, 28, 1))
  c = config(init_from=str(tmp_path / 'cnn_mnist'), model='cnn_mnist')
  with pytest.raises(errors.ConfigError, match='answers 3 classes'):
    build.pretrained_variables(c, wide, wide.init(jax.random.key(0)))


def test_init_from_without_a_model_folder_is_refused_before_anything(
  tmp_path,
):
  c = config(init_from=str(tmp_path / 'nothing'))
  with pytest.raises(errors.ConfigError, match='`init_from=.*`: no meta.json'):
    checks.validate(c)
