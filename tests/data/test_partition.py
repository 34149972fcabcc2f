import numpy as np
import pytest

from fedjax_mr.core import errors
from fedjax_mr.data import partition


def _check_disjoint_complete(parts, m):
  allidx = np.concatenate(parts)
  assert len(allidx) == m
  np.testing.assert_array_equal(np.sort(allidx), np.arange(m))


def test_iid_equal_sizes_disjoint_complete():
  parts = partition.iid(1003, 10, seed=0)
  _check_disjoint_complete(parts, 1003)
  sizes = sorted(len(p) for p in parts)
  assert sizes == [100] * 7 + [101] * 3


def test_iid_seeded():
  a = partition.iid(100, 4, seed=1)
  b = partition.iid(100, 4, seed=1)
  c = partition.iid(100, 4, seed=2)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.fixture(scope='module')
def labels():
  return np.repeat(np.arange(10), 600)  # 6,000 examples, 10 classes


@pytest.mark.parametrize('alpha', [0.1, 0.5, 100.0])
def test_dirichlet_invariants(labels, alpha):
  parts = partition.dirichlet(labels, 50, alpha, seed=0, min_size=10)
  assert len(parts) == 50
  _check_disjoint_complete(parts, len(labels))
  assert min(len(p) for p in parts) >= 10


def test_dirichlet_alpha_controls_label_skew(labels):
  def mean_classes(alpha):
    parts = partition.dirichlet(labels, 50, alpha, seed=0)
    s = partition.summary(parts, labels, 10)
    return s['classes_per_client_mean']

  skewed, mid, flat = mean_classes(0.1), mean_classes(0.5), mean_classes(100.0)
  assert skewed < mid < flat
  assert skewed < 4.0  # Dir(0.1): a few classes per client
  assert flat > 9.5  # Dir(100): nearly all classes everywhere


def test_dirichlet_seeded_and_shuffled(labels):
  a = partition.dirichlet(labels, 20, 0.5, seed=3)
  b = partition.dirichlet(labels, 20, 0.5, seed=3)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  # Each client's list is shuffled, not grouped by class.
  big = max(a, key=len)
  assert not np.all(np.diff(labels[big]) >= 0)


def test_dirichlet_cap_limits_largest_client(labels):
  parts = partition.dirichlet(labels, 50, 0.1, seed=0)
  cap = len(labels) / 50
  # A client stops receiving new classes once it holds ≥ M/N examples, so it
  # can exceed the cap by at most one class's worth.
  assert max(len(p) for p in parts) < cap + 600


def test_dirichlet_bad_inputs(labels):
  with pytest.raises(errors.ConfigError, match='--alpha'):
    partition.dirichlet(labels, 10, 0.0, seed=0)
  with pytest.raises(errors.ConfigError, match='--num_clients=700'):
    partition.dirichlet(labels, 700, 0.5, seed=0, min_size=10)
  with pytest.raises(errors.ConfigError, match='no split'):
    partition.dirichlet(labels, 300, 0.01, seed=0, min_size=19, max_tries=3)


def test_summary(labels):
  parts = [np.array([0, 1, 600]), np.array([5999])]
  s = partition.summary(parts, labels, 10)
  assert s['sizes'] == [3, 1]
  assert s['label_histograms'][0][:2] == [2, 1]
  assert s['label_histograms'][1][9] == 1
  assert s['classes_per_client_mean'] == 1.5


def _dirichlet_by_lists(labels, num_clients, alpha, seed, min_size):
  """The procedure written out client list by client list (the papers'
  reference code's shape), drawing the same random numbers."""
  rng = np.random.default_rng(seed)
  cap = len(labels) / num_clients
  while True:
    parts = [[] for _ in range(num_clients)]
    for c in np.unique(labels):
      idx = np.flatnonzero(labels == c)
      rng.shuffle(idx)
      p = rng.dirichlet(np.full(num_clients, alpha))
      sizes = np.array([len(q) for q in parts])
      p = np.where(sizes < cap, p, 0.0)
      p = p / p.sum()
      cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
      for j, chunk in enumerate(np.split(idx, cuts)):
        parts[j].extend(chunk.tolist())
    if min(len(q) for q in parts) >= min_size:
      out = []
      for q in parts:
        q = np.array(q, dtype=np.int64)
        rng.shuffle(q)
        out.append(q)
      return out


@pytest.mark.parametrize('alpha,seed', [(0.1, 0), (0.5, 3), (5.0, 1)])
def test_dirichlet_equals_the_list_by_list_procedure(labels, alpha, seed):
  got = partition.dirichlet(labels, 20, alpha, seed, min_size=5)
  want = _dirichlet_by_lists(labels, 20, alpha, seed, min_size=5)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
