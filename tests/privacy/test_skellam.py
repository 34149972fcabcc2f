"""The Skellam mechanism (`privacy.skellam`): its RDP bound and the
subsampling bound by hand, the Gaussian they tend to, the sampler's
distributions, and conditional rounding's norm bound."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp as rdp_lib
from scipy import stats

from fedjax_mr.privacy import skellam
from tests import helpers


def test_rdp_by_hand():
  # α 2, Δ2 2, Δ1 3, v 4: 2·4/8 + min((3·4 + 18)/64, 9/8) = 1 + 30/64.
  got = skellam.rdp(np.array([2]), 2.0, 3.0, 4.0)
  helpers.assert_close(got, [1 + 30 / 64], rtol=1e-15)
  # the other branch: v 1 → min((3·4 + 18)/4, 9/2) = 4.5, plus 2·4/2.
  helpers.assert_close(
    skellam.rdp(np.array([2]), 2.0, 3.0, 1.0), [4 + 4.5], rtol=1e-15
  )
  assert np.isinf(skellam.rdp(np.array([3]), 1.0, 1.0, 0.0)).all()
  with pytest.raises(ValueError, match='orders'):
    skellam.rdp(np.array([1.5]), 1.0, 1.0, 1.0)


def test_rdp_tends_to_the_gaussians_as_the_noise_grows():
  orders = np.array(skellam.ORDERS)
  for scale in (1e2, 1e4, 1e6):
    l2, v = 2 * scale, (1.3 * scale) ** 2
    gauss = orders * l2**2 / (2 * v)
    got = skellam.rdp(orders, l2, math.sqrt(1000) * l2, v)
    assert np.all(got >= gauss)
    assert np.max(got / gauss - 1) < 50 / scale


def test_subsampled_by_hand_and_at_q_1():
  # α 2: log(1 + q² min(4 (e^ε(2) - 1), 2 e^ε(2))).
  q, e2 = 0.1, 0.5
  got = skellam.subsampled_rdp(
    np.array([2]), q, lambda a: np.full(np.shape(a), e2)
  )
  want = math.log1p(q * q * min(4 * math.expm1(e2), 2 * math.exp(e2)))
  helpers.assert_close(got, [want], rtol=1e-12)
  base = lambda a: np.asarray(a) * 0.3  # noqa: E731
  orders = np.array([2, 5, 64])
  np.testing.assert_array_equal(
    skellam.subsampled_rdp(orders, 1.0, base), base(orders)
  )
  with pytest.raises(ValueError, match='q'):
    skellam.subsampled_rdp(orders, 0.0, base)


@pytest.mark.parametrize('z,n,k', [(1.127, 10_000, 100), (0.8, 100, 10)])
def test_subsampled_gaussian_bounds_dp_accountings(z, n, k):
  """The general bound (Theorem 9) with the Gaussian's RDP is never below
  dp-accounting's own bound for the Gaussian (Theorem 27, tighter where
  it differs), and close to it."""
  orders = np.array(skellam.ORDERS)
  ours = skellam.subsampled_rdp(
    orders, k / n, lambda a: np.asarray(a) * 2 / z**2
  )
  theirs = rdp_lib.RdpAccountant(
    orders=[float(o) for o in orders],
    neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE,
  )
  theirs.compose(
    dp_accounting.SampledWithoutReplacementDpEvent(
      n, k, dp_accounting.GaussianDpEvent(z / 2)
    )
  )
  theirs = np.asarray(theirs.rdp)
  assert np.all(ours >= theirs * (1 - 1e-12))
  assert np.all(ours <= theirs * 1.5)


def test_norm_bound_by_hand():
  assert skellam.norm_bound(3.0, 4) == math.sqrt(9 + 1 + 3 + 1)
  with pytest.raises(ValueError):
    skellam.norm_bound(-1.0, 4)


@pytest.mark.parametrize('lam', [0.5, 7.0, 30.0, 2500.0])
def test_poisson_follows_its_distribution(lam):
  """A chi-squared test of 40,000 draws against the Poisson pmf (cells
  with an expected count of at least 20; the tails pooled), p > 1e-6."""
  n = 40_000
  x = skellam.poisson(lam, n, skellam._Stream(b'test' + str(lam).encode()))
  lo, hi = stats.poisson.ppf([1e-3, 1 - 1e-3], lam).astype(int)
  edges = np.arange(lo, hi + 1)
  expected = np.concatenate(
    [
      [stats.poisson.cdf(lo - 1, lam)],
      stats.poisson.pmf(edges, lam),
      [stats.poisson.sf(hi, lam)],
    ]
  )
  counts = np.concatenate(
    [[np.sum(x < lo)], [np.sum(x == e) for e in edges], [np.sum(x > hi)]]
  )
  keep = expected * n >= 20
  obs, exp = counts[keep], expected[keep] * n
  obs[-1] += counts[~keep].sum()  # the rare cells pooled into one
  exp[-1] += expected[~keep].sum() * n
  assert stats.chisquare(obs, exp).pvalue > 1e-6


def test_poisson_of_a_large_rate_has_its_moments():
  lam, n = 5e8, 200_000
  x = skellam.poisson(lam, n, skellam._Stream(b'large'))
  assert abs(x.mean() - lam) < 5 * math.sqrt(lam / n)
  assert abs(x.var() / lam - 1) < 5 * math.sqrt(2 / n)


def test_the_noise_is_skellam_and_sums_to_skellam():
  """Zeros plus noise of variance v: mean 0, variance v, symmetric; the
  sum of 8 clients' draws of v / 8 has variance v (closure)."""
  v, n = 3.0e6, 50_000
  one = skellam.randomize(np.zeros(n), 1e12, v, b'one')
  parts = [
    skellam.randomize(np.zeros(n), 1e12, v / 8, bytes([i])) for i in range(8)
  ]
  summed = np.sum(parts, axis=0)
  for x in (one, summed):
    assert x.dtype == np.int64
    assert abs(x.mean()) < 5 * math.sqrt(v / n)
    assert abs(x.var() / v - 1) < 5 * math.sqrt(2 / n)
    assert abs(stats.skew(x)) < 5 * math.sqrt(6 / n)


def test_the_draws_follow_the_seed():
  x = np.linspace(-3, 3, 101)
  a = skellam.randomize(x, 100.0, 50.0, b'seed')
  np.testing.assert_array_equal(a, skellam.randomize(x, 100.0, 50.0, b'seed'))
  assert not np.array_equal(a, skellam.randomize(x, 100.0, 50.0, b'other'))


def test_conditional_rounding_keeps_the_norm_and_is_unbiased_within_it():
  """A vector of norm c rounded 400 times with no noise: every result an
  integer vector of norm at most the bound, each within one of x, and
  their mean near x (a few draws are rejected, so slightly shrunk)."""
  d, c = 64, 40.0
  x = np.random.default_rng(0).normal(size=d)
  x *= c / np.linalg.norm(x)
  bound = skellam.norm_bound(c, d)
  draws = np.stack(
    [
      skellam.randomize(x, bound, 0.0, i.to_bytes(4, 'little'))
      for i in range(400)
    ]
  )
  assert np.all(np.sqrt((draws.astype(float) ** 2).sum(1)) <= bound)
  assert np.all(np.abs(draws - x) < 1)
  assert np.abs(draws.mean(0) - x).max() < 0.15
  # Rounded values differ from run to run (not a fixed rounding).
  assert len({d.tobytes() for d in draws}) > 300


def test_a_bound_no_rounding_meets_gives_zeros():
  x = np.full(10, 3.4)
  assert not skellam.randomize(x, 5.0, 0.0, b'x').any()
  with pytest.raises(ValueError, match='finite'):
    skellam.randomize(np.array([1.0, np.nan]), 5.0, 0.0, b'x')
