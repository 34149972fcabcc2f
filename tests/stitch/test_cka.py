"""Linear CKA (feature and Gram forms, views, debiasing) and resizing."""

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.stitch import cka
from tests import helpers


def _rng(seed=0):
  return np.random.default_rng(seed)


def _orthogonal(d, seed=0):
  q, _ = np.linalg.qr(_rng(seed).standard_normal((d, d)))
  return q


def test_feature_form_equals_gram_form_2d():
  rng = _rng()
  x = rng.standard_normal((20, 7))
  y = x[:, :3] @ rng.standard_normal((3, 5)) + rng.standard_normal((20, 5))
  value = cka.linear_cka(x, y)
  assert 0.05 < value < 0.95
  assert value == pytest.approx(cka.linear_cka_gram(x, y), rel=1e-10)


@pytest.mark.parametrize('view', ['flatten', 'gap', 'positions'])
def test_feature_form_equals_gram_form_views(view):
  rng = _rng(1)
  x = rng.standard_normal((6, 4, 4, 3))
  y = np.maximum(x @ rng.standard_normal((3, 5)), 0) + rng.standard_normal(
    (6, 4, 4, 5)
  )
  mx, my = cka.as_matrices(x, y, view)
  rows = {'flatten': 6, 'gap': 6, 'positions': 6 * 16}[view]
  cols = {'flatten': (48, 80), 'gap': (3, 5), 'positions': (3, 5)}[view]
  assert mx.shape == (rows, cols[0]) and my.shape == (rows, cols[1])
  assert mx.dtype == np.float64
  assert cka.linear_cka(x, y, view) == pytest.approx(
    cka.linear_cka_gram(mx, my), rel=1e-10
  )


def test_gap_and_flatten_views_by_hand():
  x = np.arange(2 * 2 * 2 * 3, dtype=np.float32).reshape(2, 2, 2, 3)
  y = np.ones((2, 5))
  gx, gy = cka.as_matrices(x, y, 'gap')
  helpers.assert_close(gx, x.mean(axis=(1, 2)))
  np.testing.assert_array_equal(gy, y)
  fx, _ = cka.as_matrices(x, y, 'flatten')
  np.testing.assert_array_equal(fx, x.reshape(2, 12))


@pytest.mark.parametrize('view', ['flatten', 'gap', 'positions'])
def test_invariances(view):
  rng = _rng(2)
  x = rng.standard_normal((12, 3, 3, 4))
  y = np.tanh(x @ rng.standard_normal((4, 6))) + 0.5 * rng.standard_normal(
    (12, 3, 3, 6)
  )
  base = cka.linear_cka(x, y, view)
  assert 0.05 < base < 0.99
  # Orthogonal maps of the channels (flatten: of all features) and
  # isotropic scaling, on either side.
  if view == 'flatten':
    qx = _orthogonal(36, 3)
    x2 = (x.reshape(12, -1) @ qx).reshape(12, -1)
    y2 = (y.reshape(12, -1) @ _orthogonal(54, 4)).reshape(12, -1)
  else:
    x2 = x @ _orthogonal(4, 3)
    y2 = y @ _orthogonal(6, 4)
  assert cka.linear_cka(x2, y, view) == pytest.approx(base, rel=1e-9)
  assert cka.linear_cka(x, y2, view) == pytest.approx(base, rel=1e-9)
  assert cka.linear_cka(7.5 * x, y, view) == pytest.approx(base, rel=1e-9)
  assert cka.linear_cka(x, 0.01 * y, view) == pytest.approx(base, rel=1e-9)
  # Symmetric.
  assert cka.linear_cka(y, x, view) == pytest.approx(base, rel=1e-9)


def test_symmetric_to_the_last_bit():
  # Two candidates whose scores are one number (a block after a network,
  # and that network's next block after the block's model) must tie
  # exactly on every CPU: the server's ranking breaks an exact tie by
  # its fixed order, an ulp by the machine. One product's sum of squares
  # parts these cases by an ulp on this very data.
  rng = _rng(11)
  for _ in range(8):
    x = rng.standard_normal((500, 16))
    y = np.tanh(x @ rng.standard_normal((16, 20)))
    y = y + rng.standard_normal((500, 20))
    for debiased in (False, True):
      assert cka.linear_cka(x, y, 'gap', debiased) == cka.linear_cka(
        y, x, 'gap', debiased
      )


def test_identical_inputs_give_one():
  x = _rng(3).standard_normal((10, 5, 5, 3)).astype(np.float32)
  for view in cka.VIEWS:
    assert cka.linear_cka(x, x, view) == pytest.approx(1.0, abs=1e-12)
  assert cka.linear_cka(jnp.asarray(x), jnp.asarray(x)) == pytest.approx(1.0)


def test_constant_side_gives_zero():
  x = _rng(4).standard_normal((10, 4, 4, 3))
  const = np.full((10, 4, 4, 2), 3.0)
  for view in cka.VIEWS:
    assert cka.linear_cka(x, const, view) == 0.0
    assert cka.linear_cka(const, x, view) == 0.0
  assert cka.linear_cka(x, const, debiased=True) == 0.0


def test_gram_form_constant_side_gives_zero():
  # Its `denom == 0` branch means 0 for a side without variance; centring
  # by H = I − 11ᵀ/n leaves ~1e-30 rounding there, not 0.
  x = _rng(4).standard_normal((10, 5))
  assert cka.linear_cka_gram(x, np.ones((10, 2))) == pytest.approx(0.0)
  assert cka.linear_cka_gram(np.full((10, 3), 3.0), x) == pytest.approx(0.0)


def test_positions_view_resizes_the_larger_map_per_axis():
  rng = _rng(5)
  x = rng.standard_normal((2, 6, 6, 3))
  y = rng.standard_normal((2, 4, 8, 5))
  mx, my = cka.as_matrices(x, y)
  assert mx.shape == (2 * 4 * 6, 3) and my.shape == (2 * 4 * 6, 5)
  helpers.assert_close(mx, cka.resize(x, (4, 6)).reshape(-1, 3), rtol=1e-12)
  helpers.assert_close(my, cka.resize(y, (4, 6)).reshape(-1, 5), rtol=1e-12)
  # The smaller map is left as it is.
  x = rng.standard_normal((2, 6, 6, 3))
  y = rng.standard_normal((2, 3, 3, 5))
  mx, my = cka.as_matrices(x, y)
  np.testing.assert_array_equal(my, y.reshape(-1, 5))
  assert mx.shape == (18, 3)


def test_positions_view_sequences():
  rng = _rng(6)
  x = rng.standard_normal((3, 9, 4))
  y = rng.standard_normal((3, 5, 2))
  mx, my = cka.as_matrices(x, y)
  assert mx.shape == (15, 4) and my.shape == (15, 2)
  # 9 → 5 align-corners picks every other position exactly.
  helpers.assert_close(mx, x[:, ::2].reshape(-1, 4), atol=1e-12)


def test_positions_view_map_against_vector_pools_the_map():
  rng = _rng(7)
  x = rng.standard_normal((5, 4, 4, 3))
  v = rng.standard_normal((5, 6))
  mx, mv = cka.as_matrices(x, v)
  helpers.assert_close(mx, x.mean(axis=(1, 2)))
  np.testing.assert_array_equal(mv, v)
  mv, mx = cka.as_matrices(v, x)
  helpers.assert_close(mx, x.mean(axis=(1, 2)))
  assert cka.linear_cka(x, v) == pytest.approx(
    cka.linear_cka_gram(x.mean(axis=(1, 2)), v), rel=1e-10
  )


def test_as_matrices_errors():
  with pytest.raises(ValueError, match='view'):
    cka.as_matrices(np.ones((2, 3)), np.ones((2, 3)), 'pixels')
  with pytest.raises(ValueError, match='same examples'):
    cka.as_matrices(np.ones((2, 3)), np.ones((3, 3)))


def _hsic_unbiased(k, m):
  """Song et al.'s unbiased HSIC estimator, Gram form."""
  n = k.shape[0]
  k = k - np.diag(np.diag(k))
  m = m - np.diag(np.diag(m))
  one = np.ones(n)
  return (
    np.trace(k @ m)
    + (one @ k @ one) * (one @ m @ one) / ((n - 1) * (n - 2))
    - 2 / (n - 2) * (one @ k @ m @ one)
  ) / (n * (n - 3))


def test_debiased_equals_gram_form_u_statistic():
  rng = _rng(8)
  x = rng.standard_normal((15, 4))
  y = x @ rng.standard_normal((4, 3)) + rng.standard_normal((15, 3))
  xc, yc = x - x.mean(0), y - y.mean(0)
  k, m = xc @ xc.T, yc @ yc.T
  expected = _hsic_unbiased(k, m) / np.sqrt(
    _hsic_unbiased(k, k) * _hsic_unbiased(m, m)
  )
  got = cka.linear_cka(x, y, debiased=True)
  assert got == pytest.approx(expected, rel=1e-9)
  assert abs(got - cka.linear_cka(x, y)) > 1e-3  # a different value


def test_debiased_identical_is_one_and_independent_is_near_zero():
  rng = _rng(9)
  x = rng.standard_normal((400, 30))
  assert cka.linear_cka(x, x, debiased=True) == pytest.approx(1.0, abs=1e-12)
  y = x + 0.01 * rng.standard_normal((400, 30))
  assert cka.linear_cka(x, y, debiased=True) == pytest.approx(1.0, abs=1e-3)
  # Independent features: the biased estimate is far from 0, the
  # debiased one is not.
  z = rng.standard_normal((400, 30))
  assert cka.linear_cka(x, z) > 0.05
  assert abs(cka.linear_cka(x, z, debiased=True)) < 0.02
  with pytest.raises(ValueError, match='4 rows'):
    cka.linear_cka(x[:3], z[:3], debiased=True)


def test_interp_matrix_upsample_by_hand():
  expected = np.array(
    [[1, 0, 0], [0.5, 0.5, 0], [0, 1, 0], [0, 0.5, 0.5], [0, 0, 1]]
  )
  helpers.assert_close(cka.interp_matrix(3, 5), expected, atol=1e-15)


def test_interp_matrix_cases():
  np.testing.assert_array_equal(
    cka.interp_matrix(5, 3)[[0, 1, 2]], np.eye(5)[[0, 2, 4]]
  )
  np.testing.assert_array_equal(cka.interp_matrix(4, 4), np.eye(4))
  # 2 → 4: coordinates 0, 1/3, 2/3, 1.
  helpers.assert_close(
    cka.interp_matrix(2, 4),
    [[1, 0], [2 / 3, 1 / 3], [1 / 3, 2 / 3], [0, 1]],
    atol=1e-15,
  )
  np.testing.assert_array_equal(cka.interp_matrix(1, 3), np.ones((3, 1)))
  np.testing.assert_array_equal(cka.interp_matrix(4, 1), [[1, 0, 0, 0]])
  for n_in, n_out in [(3, 5), (7, 4), (6, 6), (2, 9)]:
    r = cka.interp_matrix(n_in, n_out)
    helpers.assert_close(r.sum(axis=1), 1.0)
    assert np.all(r >= 0)


def test_resize_downsize_picks_positions_exactly():
  x = _rng(10).standard_normal((2, 5, 5, 3))
  out = cka.resize(x, (3, 3))
  np.testing.assert_array_equal(out, x[:, ::2, ::2])


def test_resize_constant_map_stays_constant():
  x = np.full((2, 4, 7, 3), 2.5)
  for size in [(9, 3), (2, 2), (4, 11), (1, 1)]:
    out = cka.resize(x, size)
    assert out.shape == (2, *size, 3)
    helpers.assert_close(out, 2.5, rtol=1e-14)


def test_resize_numpy_and_jax_agree():
  x = _rng(11).standard_normal((2, 5, 7, 3)).astype(np.float32)
  for size in [(3, 4), (8, 10), (5, 2)]:
    a = cka.resize(x, size)
    b = cka.resize(jnp.asarray(x), size, xp=jnp)
    assert isinstance(b, jnp.ndarray) and b.dtype == jnp.float32
    helpers.assert_close(np.asarray(b), a, rtol=1e-5, atol=1e-6)


def test_resize_linear_ramp_by_hand():
  # Align-corners interpolation of a linear ramp is the ramp.
  ramp = np.arange(4.0).reshape(1, 4, 1)
  out = cka.resize(ramp, (7,))
  helpers.assert_close(out[0, :, 0], np.linspace(0, 3, 7), atol=1e-14)
  with pytest.raises(ValueError, match='cannot resize'):
    cka.resize(np.ones((1, 4, 4, 1)), (2,))


def test_global_pool():
  x = np.arange(24.0).reshape(2, 3, 4)
  helpers.assert_close(cka.global_pool(x), x.mean(axis=1))
  v = np.ones((2, 3))
  assert cka.global_pool(v) is v
