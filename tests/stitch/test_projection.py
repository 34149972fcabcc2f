"""The stitching projection: least squares, spatial policy, folding."""

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.core import errors
from fedjax_mr.stitch import cka
from fedjax_mr.stitch import projection
from tests import helpers
from tests.stitch import common


def _rng(seed=0):
  return np.random.default_rng(seed)


def _rank_deficient(rng, n=40):
  """[n, 5]: two equal columns and one dead (all-zero ReLU) channel."""
  a = rng.standard_normal((n, 3))
  return np.stack(
    [a[:, 0], a[:, 1], a[:, 0], np.zeros(n), np.maximum(a[:, 2], 0)], axis=1
  )


def test_solve_equals_lstsq_minimum_norm_on_rank_deficient_x():
  rng = _rng()
  x = _rank_deficient(rng)
  y = rng.standard_normal((40, 4))
  m = projection.solve(projection.stats(x, y))
  expected = np.linalg.lstsq(x, y, rcond=None)[0]
  helpers.assert_close(m, expected, rtol=1e-8, atol=1e-10)
  # Minimum norm: the duplicate columns share the weight, the dead
  # channel gets none.
  helpers.assert_close(m[0], m[2], rtol=1e-8)
  helpers.assert_close(m[3], 0.0, atol=1e-12)


def test_solve_stays_small_on_rank_deficient_spatial_activations():
  # ReLU maps with dead channels and a channel that is a copy of another:
  # an uncut pseudo-inverse of XᵀX would blow up; the cut one does not.
  rng = _rng(1)
  x = np.maximum(rng.standard_normal((6, 5, 5, 8)), 0)
  x[..., 2] = 0.0
  x[..., 5] = x[..., 1]
  x[..., 7] = 1e-9 * rng.standard_normal((6, 5, 5))  # almost dead
  m_true = rng.standard_normal((8, 3))
  m_true[[2, 5, 7]] = 0.0
  y = x @ m_true
  m = projection.solve(projection.stats(x, y))
  assert np.linalg.norm(m) <= np.linalg.norm(m_true) * (1 + 1e-6)
  helpers.assert_close(
    x.reshape(-1, 8) @ m, y.reshape(-1, 3), rtol=1e-6, atol=1e-8
  )


def test_ridge_close_to_pinv_for_tiny_ridge():
  rng = _rng(2)
  x = rng.standard_normal((50, 6))
  y = rng.standard_normal((50, 3))
  s = projection.stats(x, y)
  pinv = projection.solve(s)
  ridge = projection.solve(s, solver='ridge', ridge=1e-10)
  helpers.assert_close(ridge, pinv, rtol=1e-6, atol=1e-9)
  helpers.assert_close(pinv, np.linalg.lstsq(x, y, rcond=None)[0])
  # On rank-deficient X ridge tends to the minimum-norm solution too.
  x = _rank_deficient(rng, 50)
  s = projection.stats(x, y)
  helpers.assert_close(
    projection.solve(s, solver='ridge', ridge=1e-12),
    projection.solve(s),
    rtol=1e-4,
    atol=1e-6,
  )
  # A large ridge shrinks the solution.
  big = projection.solve(s, solver='ridge', ridge=10.0)
  assert np.linalg.norm(big) < 0.5 * np.linalg.norm(projection.solve(s))


def test_solve_errors_and_zero_statistics():
  s = projection.Stats(np.zeros((3, 3)), np.zeros((3, 2)), 5)
  np.testing.assert_array_equal(projection.solve(s), np.zeros((3, 2)))
  with pytest.raises(errors.ConfigError, match='`solver`'):
    projection.solve(s, solver='lsqr')


def test_stats_of_halves_add_up():
  rng = _rng(3)
  x = rng.standard_normal((6, 4, 4, 3))
  y = rng.standard_normal((6, 2, 2, 5))
  whole = projection.stats(x, y, bias=True)
  parts = projection.stats(x[:2], y[:2], bias=True) + projection.stats(
    x[2:], y[2:], bias=True
  )
  assert whole.rows == parts.rows == 6 * 2 * 2
  assert whole.g.shape == (4, 4) and whole.b.shape == (4, 5)
  helpers.assert_close(parts.g, whole.g, rtol=1e-12)
  helpers.assert_close(parts.b, whole.b, rtol=1e-12)
  # The bias column: its XᵀX entry is the row count.
  assert whole.g[-1, -1] == 24


def _exact(x, y, **kwargs):
  stitch = projection.fit(x, y, **kwargs)
  out = projection.apply(stitch, jnp.asarray(x, jnp.float32))
  assert out.shape == y.shape
  helpers.assert_close(out, y, rtol=1e-4, atol=1e-4)
  return stitch


def test_fit_apply_conv_to_conv_same_size():
  rng = _rng(4)
  x = rng.standard_normal((3, 5, 5, 4)).astype(np.float32)
  m_true = rng.standard_normal((4, 6))
  stitch = _exact(x, x @ m_true)
  assert stitch.size is None and not stitch.pool and stitch.bias is None
  assert stitch.matrix.shape == (4, 6) and stitch.matrix.dtype == jnp.float32
  helpers.assert_close(stitch.matrix, m_true, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('size', [(4, 4), (9, 7)])
def test_fit_apply_conv_to_conv_match_resizes(size):
  rng = _rng(5)
  x = rng.standard_normal((3, 6, 6, 4)).astype(np.float32)
  m_true = rng.standard_normal((4, 3))
  y = cka.resize(x.astype(np.float64), size) @ m_true
  stitch = _exact(x, y)
  assert stitch.size == size and not stitch.pool
  helpers.assert_close(stitch.matrix, m_true, rtol=1e-4, atol=1e-5)


def test_fit_only_fits_resized_but_runs_at_incoming_size():
  rng = _rng(6)
  x = rng.standard_normal((3, 6, 6, 4)).astype(np.float32)
  m_true = rng.standard_normal((4, 3))
  y = cka.resize(x.astype(np.float64), (4, 4)) @ m_true
  stitch = projection.fit(x, y, policy='fit_only')
  assert stitch.size is None
  helpers.assert_close(stitch.matrix, m_true, rtol=1e-4, atol=1e-5)
  out = projection.apply(stitch, jnp.asarray(x))
  assert out.shape == (3, 6, 6, 3)
  helpers.assert_close(out, x @ m_true, rtol=1e-4, atol=1e-4)


def test_fit_apply_conv_to_dense_pools():
  rng = _rng(7)
  x = rng.standard_normal((10, 3, 3, 4)).astype(np.float32)
  m_true = rng.standard_normal((4, 5))
  stitch = _exact(x, x.mean(axis=(1, 2)) @ m_true)
  assert stitch.pool and stitch.size is None


def test_fit_apply_dense_to_dense_and_sequences():
  rng = _rng(8)
  x = rng.standard_normal((12, 5)).astype(np.float32)
  _exact(x, x @ rng.standard_normal((5, 2)))
  s = rng.standard_normal((2, 9, 3)).astype(np.float32)
  m_true = rng.standard_normal((3, 4))
  stitch = _exact(s, s[:, ::2] @ m_true)  # 9 → 5 positions
  assert stitch.size == (5,)


def test_bias_recovers_an_affine_map():
  rng = _rng(9)
  x = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
  m_true = rng.standard_normal((3, 2))
  b_true = np.array([1.5, -2.0])
  stitch = _exact(x, x @ m_true + b_true, bias=True)
  helpers.assert_close(stitch.matrix, m_true, rtol=1e-4, atol=1e-5)
  helpers.assert_close(stitch.bias, b_true, rtol=1e-4, atol=1e-5)
  # Without a bias the fit cannot reproduce the offset.
  plain = projection.fit(x, x @ m_true + b_true)
  out = projection.apply(plain, jnp.asarray(x))
  assert np.abs(np.asarray(out) - (x @ m_true + b_true)).max() > 0.1


def test_check_compatible():
  cc = projection.check_compatible
  assert 'dense' in cc((10,), (4, 4, 3))
  assert 'dense' in cc((10,), (5, 8))
  assert cc((4, 4, 3), (10,)) is None
  assert cc((10,), (7,)) is None
  assert cc((4, 4, 3), (8, 8, 5)) is None
  assert cc((9, 3), (4, 4, 5)) is not None  # sequence vs image
  with pytest.raises(errors.ConfigError, match='`policy`'):
    cc((4, 4, 3), (4, 4, 3), 'crop')
  with pytest.raises(ValueError, match='dense'):
    projection.stats(np.ones((3, 10)), np.ones((3, 4, 4, 2)))


def test_make_stitch_with_bias_splits_the_last_row():
  m = np.arange(12.0).reshape(4, 3)
  s = projection.make_stitch(m, (5, 5, 3), (2, 2, 3), bias=True)
  np.testing.assert_array_equal(s.matrix, m[:3])
  np.testing.assert_array_equal(s.bias, m[3])
  assert s.size == (2, 2) and not s.pool
  s = projection.make_stitch(m[:3], (5, 5, 3), (2, 2, 3), policy='fit_only')
  assert s.size is None and s.bias is None


# --- Folding ----------------------------------------------------------------


def _close(a, b):
  a, b = np.asarray(a), np.asarray(b)
  scale = np.abs(b).max()
  assert scale > 1e-3
  helpers.assert_close(a, b, rtol=0, atol=1e-5 * scale)


def _check_fold(stitch, block, x):
  ref = block.apply(projection.apply(stitch, x))
  rest, folded = projection.fold(stitch, block)
  h = x if rest is None else projection.apply(rest, x)
  _close(folded.apply(h), ref)
  assert folded.in_spec[-1] == stitch.matrix.shape[0]
  assert folded.in_spec[:-1] == block.in_spec[:-1]
  return rest, folded


def _stitch(rng, c_x, x_spec, y_spec):
  m = rng.standard_normal((c_x, y_spec[-1])) / np.sqrt(c_x)
  return projection.make_stitch(m, x_spec, y_spec)


@pytest.mark.parametrize('x_hw', [(12, 12), (15, 10)])
def test_fold_into_cnn_conv_block(x_hw):
  rng = _rng(10)
  block = common.chain('cnn_mnist')[1]  # conv 5x5 VALID, in (12, 12, 20)
  before = np.asarray(block.variables['params']['Conv_1']['kernel']).copy()
  x = jnp.asarray(rng.standard_normal((2, *x_hw, 7)), jnp.float32)
  stitch = _stitch(rng, 7, (*x_hw, 7), block.in_spec)
  rest, folded = _check_fold(stitch, block, x)
  if x_hw == (12, 12):
    assert rest is None
  else:
    assert rest.matrix is None and rest.size == (12, 12)
  assert folded.variables['params']['Conv_1']['kernel'].shape == (5, 5, 7, 50)
  # The block itself is left as it was.
  np.testing.assert_array_equal(
    block.variables['params']['Conv_1']['kernel'], before
  )
  assert block.in_spec == (12, 12, 20)


def test_fold_into_same_padded_conv_block():
  rng = _rng(11)
  block = common.chain('cnn_fedavg')[1]  # conv 5x5 SAME: zero borders
  x = jnp.asarray(rng.standard_normal((2, 14, 14, 5)), jnp.float32)
  _check_fold(_stitch(rng, 5, (14, 14, 5), block.in_spec), block, x)


def test_fold_into_cnn_head_flatten():
  rng = _rng(12)
  head = common.chain('cnn_mnist')[2]  # flatten (4, 4, 50) → dense
  assert head.fold[0] == 'flatten'
  x = jnp.asarray(rng.standard_normal((3, 6, 6, 9)), jnp.float32)
  rest, folded = _check_fold(_stitch(rng, 9, (6, 6, 9), head.in_spec), head, x)
  assert rest.size == (4, 4)
  assert folded.variables['params']['Dense_0']['kernel'].shape == (
    4 * 4 * 9,
    50,
  )


def test_fold_into_resnet20_head_matrix():
  rng = _rng(13)
  head = common.chain('resnet20')[-1]  # gap → dense, in (7, 7, 256)
  assert head.fold == ('matrix', (('linear', 'kernel'),))
  x = jnp.asarray(rng.standard_normal((2, 7, 7, 12)), jnp.float32)
  rest, _ = _check_fold(_stitch(rng, 12, (7, 7, 12), head.in_spec), head, x)
  assert rest is None


def test_fold_pooling_stitch_into_dense_layer():
  rng = _rng(14)
  fc1 = common.chain('cnn_mnist', style='per_linear')[3]  # dense, in (50,)
  assert fc1.fold[0] == 'matrix'
  x = jnp.asarray(rng.standard_normal((4, 5, 5, 8)), jnp.float32)
  stitch = _stitch(rng, 8, (5, 5, 8), fc1.in_spec)
  assert stitch.pool
  rest, folded = _check_fold(stitch, fc1, x)
  assert rest.pool and rest.matrix is None
  assert folded.in_spec == (8,)


def test_fold_raises_for_bias_or_unfoldable_block():
  chain = common.chain('resnet20')
  m = np.ones((3, 16))
  with_bias = projection.make_stitch(
    np.ones((4, 16)), (5, 5, 3), (28, 28, 16), bias=True
  )
  with pytest.raises(ValueError, match='bias'):
    projection.fold(with_bias, chain[1])
  assert chain[1].fold is None  # a pre-activation bottleneck starts with BN
  with pytest.raises(ValueError, match='no foldable'):
    projection.fold(
      projection.make_stitch(m, (28, 28, 3), (28, 28, 16)), chain[1]
    )


def test_fold_into_lstm_input_kernel():
  rng = _rng(15)
  lstm1 = common.chain('char_lstm', 80, common.TOKENS)[1]  # in (80, 256)
  assert lstm1.fold == ('matrix', (('lstm1', 'w_ih'),))
  x = jnp.asarray(rng.standard_normal((2, 80, 6)), jnp.float32)
  rest, _ = _check_fold(_stitch(rng, 6, (80, 6), lstm1.in_spec), lstm1, x)
  assert rest is None
