"""Drawing K of N clients uniformly without replacement
(`sampling.sample_clients`, `sampling.sample_sparse`)."""

import jax
import numpy as np

from fedjax_mr.training import sampling


def _many(n, k, draws=4000):
  keys = jax.random.split(jax.random.key(11), draws)
  return np.asarray(
    jax.vmap(lambda key: sampling.sample_sparse(key, n, k))(keys)
  )


def test_sparse_ids_are_distinct_and_in_range():
  ids = _many(1000, 40, draws=200)
  assert ids.dtype == np.int32 and ids.shape == (200, 40)
  assert ids.min() >= 0 and ids.max() < 1000
  assert all(len(set(row)) == 40 for row in ids.tolist())


def test_sparse_is_uniform_over_ids_and_positions():
  """N = 20, K = 4 (8 draws: some repeat): every id appears in about a
  fifth of the samples, at each of the 4 positions equally often. With
  4,000 samples each count is Binomial(4000, 1/20) (mean 200, sd 13.8)
  per position; 6 sd bounds leave no room for a skewed draw."""
  ids = _many(20, 4)
  for position in range(4):
    counts = np.bincount(ids[:, position], minlength=20)
    assert np.all(np.abs(counts - 200) < 6 * 13.8), counts
  pairs = np.bincount(ids[:, 0] * 20 + ids[:, 1], minlength=400)
  assert pairs.reshape(20, 20).diagonal().sum() == 0  # never twice


def test_sparse_falls_back_when_the_draws_repeat_too_often():
  """K = N = 5: the 10 draws miss some id about half the time, and the
  permutation takes over; every sample is still all five ids."""
  ids = _many(5, 5, draws=300)
  assert all(sorted(row) == [0, 1, 2, 3, 4] for row in ids.tolist())
  # Each sample is the one its path gives (the draws and the permutation
  # from the two halves of its key, as sample_sparse splits it), and both
  # paths ran.
  keys = jax.random.split(jax.random.key(11), 300)
  halves = jax.vmap(jax.random.split)(keys)
  draws = np.asarray(
    jax.vmap(lambda k: jax.random.randint(k, (10,), 0, 5))(halves[:, 0])
  )
  permuted = np.asarray(
    jax.vmap(lambda k: jax.random.choice(k, 5, (5,), replace=False))(
      halves[:, 1]
    )
  )
  complete = 0
  for row, drawn, perm in zip(ids.tolist(), draws.tolist(), permuted):
    distinct = list(dict.fromkeys(drawn))  # first of each, in draw order
    if len(distinct) == 5:
      complete += 1
      assert row == distinct, (row, drawn)
    else:
      assert row == perm.tolist(), (row, drawn)
  assert 0 < complete < 300
  for position in range(5):
    counts = np.bincount(ids[:, position], minlength=5)
    assert np.all(np.abs(counts - 60) < 6 * 6.9), counts


def test_small_populations_keep_their_draws():
  """Up to DENSE_SAMPLING_MAX clients the ids are those of a random
  permutation (`jax.random.choice`), as every recorded run drew them."""
  key = jax.random.key(3)
  want = jax.random.choice(key, 100, (10,), replace=False)
  np.testing.assert_array_equal(sampling.sample_clients(key, 100, 10), want)
  big = sampling.DENSE_SAMPLING_MAX + 1
  np.testing.assert_array_equal(
    sampling.sample_clients(key, big, 10), sampling.sample_sparse(key, big, 10)
  )
  # Many clients a round (more than a quarter of N): the permutation.
  np.testing.assert_array_equal(
    sampling.sample_clients(key, big, big // 2),
    jax.random.choice(key, big, (big // 2,), replace=False),
  )
