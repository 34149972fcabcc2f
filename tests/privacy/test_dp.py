"""The clip, the noise and adaptive clipping of `privacy.dp`."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.privacy import dp
from tests import helpers


def _update():
  return {
    'a': jnp.array([3.0, 0.0], jnp.float32),
    'b': {'c': jnp.array([[4.0]], jnp.bfloat16)},
    'n': jnp.array([7], jnp.int32),
  }


def test_clip_scales_the_whole_update_to_the_clip_norm():
  # Norm 5 over the float leaves (3, 0, 4); the int leaf is no parameter.
  clipped, norm = dp.clip(_update(), 1.0)
  assert float(norm) == 5.0
  # Each leaf times C / norm = 1/5 in float32, back in its own dtype.
  fifth = np.float32(1) / np.float32(5)
  np.testing.assert_array_equal(clipped['a'], [np.float32(3) * fifth, 0])
  assert clipped['b']['c'].dtype == jnp.bfloat16
  assert clipped['b']['c'][0, 0] == jnp.bfloat16(np.float32(4) * fifth)
  np.testing.assert_array_equal(clipped['n'], [7])


def test_an_update_within_the_clip_norm_is_unchanged():
  update = _update()
  for c in (5.0, 6.0, jnp.inf):
    clipped, _ = dp.clip(update, c)
    for x, y in zip(jax.tree.leaves(clipped), jax.tree.leaves(update)):
      np.testing.assert_array_equal(x, y)
  zero, norm = dp.clip({'a': jnp.zeros(3)}, 1.0)
  assert float(norm) == 0 and not np.any(np.isnan(zero['a']))


def test_the_clip_bounds_every_clients_norm():
  keys = jax.random.split(jax.random.key(0), 50)
  scales = jnp.logspace(-3, 3, 50)
  for key, scale in zip(keys, scales):
    update = {
      'w': scale * jax.random.normal(key, (20, 3)),
      'b': scale * jax.random.normal(jax.random.fold_in(key, 1), (3,)),
    }
    for per_layer in (False, True):
      clipped, norm = dp.clip(update, 0.5, per_layer)
      after = float(dp.global_norm(clipped))
      assert after <= 0.5 * (1 + 1e-6), (float(scale), per_layer)
      if not per_layer and float(norm) > 0.5:
        helpers.assert_close(after, 0.5, rtol=1e-6)


def test_per_layer_clipping_gives_each_leaf_its_share():
  # Two float leaves: each to C / sqrt(2); a leaf within its share kept.
  update = {'a': jnp.array([3.0, 4.0]), 'b': jnp.array([0.1])}
  clipped, _ = dp.clip(update, math.sqrt(2), per_layer=True)
  helpers.assert_close(clipped['a'], [0.6, 0.8], rtol=1e-6)
  np.testing.assert_array_equal(clipped['b'], update['b'])


def test_no_noise_changes_nothing():
  tree = _update()
  got = dp.noise(tree, jax.random.key(1), 0.0)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(tree)):
    np.testing.assert_array_equal(x, y)


def test_the_noise_has_the_standard_deviation_asked_for():
  # 10^6 draws: the sample standard deviation's own standard deviation is
  # sigma / sqrt(2n) = 0.07 % of sigma, the mean's sigma / 1000; the
  # tolerances are 7 of each. Fixed key: the test is deterministic.
  n, sigma = 10**6, 0.37
  got = dp.noise(
    {'x': jnp.zeros(n), 'y': jnp.zeros(n)}, jax.random.key(3), sigma
  )
  for leaf in ('x', 'y'):
    draws = np.asarray(got[leaf], np.float64)
    assert abs(draws.std() / sigma - 1) < 7 * math.sqrt(1 / (2 * n))
    assert abs(draws.mean()) < 7 * sigma / math.sqrt(n)
  # Independent leaves: their correlation within 7 standard errors of 0.
  r = np.corrcoef(np.asarray(got['x']), np.asarray(got['y']))[0, 1]
  assert abs(r) < 7 / math.sqrt(n)
  # The same key, the same noise; another key, other noise.
  again = dp.noise(
    {'x': jnp.zeros(n), 'y': jnp.zeros(n)}, jax.random.key(3), sigma
  )
  np.testing.assert_array_equal(got['x'], again['x'])
  other = dp.noise({'x': jnp.zeros(4)}, jax.random.key(4), sigma)
  assert not np.array_equal(other['x'], got['x'][:4])


def test_the_update_noise_leaves_the_run_its_multiplier():
  # z^-2 = z_update^-2 + (2 sigma_b)^-2: the two Gaussians cost one of z.
  z, s = 1.0, 5.0
  zu = dp.update_noise_multiplier(z, s)
  helpers.assert_close(zu**-2 + (2 * s) ** -2, z**-2, rtol=1e-12)
  assert zu > z
  with pytest.raises(ValueError, match='count_stddev'):
    dp.update_noise_multiplier(1.0, 0.5)
  with pytest.raises(ValueError, match='noise_multiplier'):
    dp.update_noise_multiplier(0.0, 5.0)


def test_the_clip_norm_steps_toward_its_quantile():
  # No count noise: 7 of 10 clients within C, target 0.5, step 0.2:
  # C * exp(-0.2 * (0.7 - 0.5)).
  fraction = dp.noised_fraction(7, 10, jax.random.key(0), 0.0)
  helpers.assert_close(fraction, 0.7, rtol=1e-7)
  got = dp.next_clip_norm(2.0, fraction, 0.5, 0.2)
  helpers.assert_close(got, 2.0 * math.exp(-0.2 * 0.2), rtol=1e-6)
  # Too many within C: it shrinks; too few: it grows; at the quantile: kept.
  assert float(dp.next_clip_norm(1.0, 0.9, 0.5, 0.2)) < 1.0
  assert float(dp.next_clip_norm(1.0, 0.1, 0.5, 0.2)) > 1.0
  assert float(dp.next_clip_norm(1.0, 0.5, 0.5, 0.2)) == 1.0
  # The count's noise: mean 0, standard deviation sigma_b / m.
  keys = jax.random.split(jax.random.key(5), 20000)
  draws = jax.vmap(lambda k: dp.noised_fraction(7, 10, k, 3.0))(keys)
  assert abs(float(draws.mean()) - 0.7) < 7 * 0.3 / math.sqrt(20000)
  assert abs(float(draws.std()) / 0.3 - 1) < 7 / math.sqrt(2 * 20000)


@pytest.mark.parametrize(
  'call, says',
  [
    (lambda: dp.clip({'a': jnp.ones(2)}, 0.0), 'clip_norm must be > 0'),
    (lambda: dp.noise({'a': jnp.ones(2)}, jax.random.key(0), -1.0), 'stddev'),
    (lambda: dp.next_clip_norm(1.0, 0.5, 1.5, 0.2), 'quantile'),
  ],
)
def test_bad_arguments_are_named(call, says):
  with pytest.raises(ValueError, match=says):
    call()
