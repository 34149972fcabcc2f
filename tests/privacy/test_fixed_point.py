"""Fixed-point encoding for sums modulo 2^b (`privacy.fixed_point`):
levels by hand, exact codes, unbiased rounding, sums that wrap back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.privacy import fixed_point
from tests import helpers


def test_levels_hold_k_clients_sum():
  assert fixed_point.levels(32, 10) == (2**31 - 1) // 10 == 214748364
  assert fixed_point.levels(8, 3) == 42  # 127 // 3
  assert fixed_point.levels(2, 1) == 1
  assert fixed_point.levels(32, 1) == 2**30  # the float32-exact cap
  with pytest.raises(ValueError, match=r'bits=8 cannot hold a sum of k=128'):
    fixed_point.levels(8, 128)
  with pytest.raises(ValueError, match='bits must be in'):
    fixed_point.levels(33, 2)
  with pytest.raises(ValueError, match='k must be'):
    fixed_point.levels(8, 0)


def _codes(x, bound=1.0, n_levels=4, key=0):
  ints, flags = fixed_point.encode(
    {'x': jnp.asarray(x, jnp.float32)}, bound, n_levels, jax.random.key(key)
  )
  q = np.asarray(jax.lax.bitcast_convert_type(ints['x'], jnp.int32))
  return q, int(flags.clipped), int(flags.nonfinite)


def test_exact_codes_clip_and_nonfinite():
  # bound 1, L 4: a step of 1/4; multiples of it have no fraction.
  q, clipped, nonfinite = _codes([0.5, -0.75, 0.0, 1.0, -1.0])
  np.testing.assert_array_equal(q, [2, -3, 0, 4, -4])
  assert (clipped, nonfinite) == (0, 0)
  q, clipped, nonfinite = _codes([2.0, -7.0, 0.25])
  np.testing.assert_array_equal(q, [4, -4, 1])
  assert (clipped, nonfinite) == (1, 0)
  q, clipped, nonfinite = _codes([np.nan, np.inf, 0.5])
  np.testing.assert_array_equal(q, [0, 0, 2])
  assert nonfinite == 1


def test_stochastic_rounding_is_unbiased_and_keyed():
  # 0.1 / (1/4) = 0.4: code 1 with probability 0.4, else 0.
  x = jnp.full((20000,), 0.1, jnp.float32)
  q, _, _ = _codes(x)
  assert set(np.unique(q)) == {0, 1}
  sd = np.sqrt(0.4 * 0.6 / q.size)
  assert abs(q.mean() - 0.4) < 4 * sd
  again, _, _ = _codes(x)
  other, _, _ = _codes(x, key=1)
  np.testing.assert_array_equal(q, again)
  assert (q != other).any()


def test_signed_reads_the_low_bits():
  u = lambda v: jnp.uint32(v)  # noqa: E731
  assert int(fixed_point.signed(u(255), 8)) == -1
  assert int(fixed_point.signed(u(127), 8)) == 127
  assert int(fixed_point.signed(u(128), 8)) == -128
  assert int(fixed_point.signed(u(0x100 + 5), 8)) == 5
  assert int(fixed_point.signed(u(0xFFFFFFFF), 32)) == -1
  assert int(fixed_point.signed(u(2**31), 32)) == -(2**31)


@pytest.mark.parametrize('bits', [8, 20, 32])
def test_a_sum_with_cancelling_masks_decodes_to_the_codes_sum(bits):
  k, bound = 5, 3.0
  n_levels = fixed_point.levels(bits, k)
  rng = np.random.default_rng(bits)
  xs = rng.uniform(-4, 4, (k, 7)).astype(np.float32)
  codes, total = [], jnp.zeros(7, jnp.uint32)
  for i in range(k):
    ints, _ = fixed_point.encode(xs[i], bound, n_levels, jax.random.key(i))
    codes.append(np.asarray(jax.lax.bitcast_convert_type(ints, jnp.int32)))
    total = total + ints
  # Masks that sum to 0 modulo 2^bits (their high bits anything).
  masks = rng.integers(0, 2**32, (k - 1, 7), dtype=np.uint64)
  last = (-masks.sum(0)) % (2**bits) + (rng.integers(0, 2**10) << bits)
  for m in (*masks, last):
    total = total + jnp.asarray(m % 2**32, jnp.uint32)
  want = np.sum(codes, axis=0).astype(np.float64)
  assert np.abs(want).max() <= k * n_levels < 2 ** (bits - 1)
  got = fixed_point.decode(total, bound, n_levels, bits)
  helpers.assert_close(got, (want * (bound / n_levels)).astype(np.float32))
  # Each code is the clipped value to within one step, and the rounding
  # of t = x / step to float32 (its relative 2^-24, at most 2^-23 of x).
  step = bound / n_levels
  clipped = np.clip(xs, -bound, bound).astype(np.float64)
  error = np.abs(np.asarray(codes) * step - clipped)
  assert np.all(error <= step * 1.0001 + np.abs(clipped) * 2**-23)


def test_only_floats_are_encoded():
  with pytest.raises(TypeError, match='leaf 0 is int32'):
    fixed_point.encode(jnp.int32(3), 1.0, 4, jax.random.key(0))
  with pytest.raises(ValueError, match='bound must be'):
    fixed_point.encode(jnp.float32(3), 0.0, 4, jax.random.key(0))
