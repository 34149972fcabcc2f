import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from fedjax_mr.models import layers


def _stock(x, w, strides, padding):
  return lax.conv_general_dilated(
    x, w, strides, padding, dimension_numbers=('NHWC', 'HWIO', 'NHWC')
  )


@pytest.mark.parametrize(
  'shape,kernel,strides,padding',
  [
    ((3, 12, 12, 2), (5, 5), (1, 1), 'VALID'),
    ((2, 9, 11, 3), (5, 3), (1, 1), 'SAME'),
    ((2, 9, 9, 4), (3, 3), (2, 2), 'SAME'),
    ((2, 10, 7, 4), (3, 3), (2, 2), 'VALID'),
    ((2, 8, 8, 3), (1, 1), (2, 2), 'VALID'),
    ((1, 7, 8, 2), (3, 2), (2, 1), ((1, 2), (0, 1))),
  ],
)
@pytest.mark.slow
def test_conv2d_values_and_gradients_match_lax(shape, kernel, strides, padding):
  kx, kw, kd = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, shape)
  w = jax.random.normal(kw, (*kernel, shape[-1], 5))
  pads = layers._pad_pairs(padding, kernel, strides, shape[1:3])
  y = layers.conv2d(x, w, strides, pads)
  y_ref = _stock(x, w, strides, pads)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  dy = jax.random.normal(kd, y.shape)
  grads = jax.grad(
    lambda x, w: jnp.sum(layers.conv2d(x, w, strides, pads) * dy), (0, 1)
  )(x, w)
  grads_ref = jax.grad(
    lambda x, w: jnp.sum(_stock(x, w, strides, pads) * dy), (0, 1)
  )(x, w)
  for g, g_ref in zip(grads, grads_ref):
    assert g.shape == g_ref.shape
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_conv_module_matches_flax_conv():
  x = jax.random.normal(jax.random.key(1), (2, 10, 10, 3))
  ours = layers.Conv(7, (3, 3), strides=(2, 2), padding='SAME')
  ref = nn.Conv(7, (3, 3), strides=(2, 2), padding='SAME')
  v = ref.init(jax.random.key(2), x)
  v_ours = ours.init(jax.random.key(2), x)
  assert jax.tree.map(jnp.shape, v) == jax.tree.map(jnp.shape, v_ours)
  np.testing.assert_allclose(ours.apply(v, x), ref.apply(v, x), atol=1e-5)


def test_conv2d_gradient_inside_scan_matches():
  # The whole point of the custom VJP: same numbers inside a loop.
  x = jax.random.normal(jax.random.key(3), (4, 8, 8, 2))
  w0 = jax.random.normal(jax.random.key(4), (3, 3, 2, 3))
  pads = ((0, 0), (0, 0))

  def run(conv):
    def step(w, _):
      g = jax.grad(lambda w: jnp.sum(conv(x, w, (1, 1), pads) ** 2))(w)
      return w - 1e-3 * g, None

    return jax.jit(lambda w: lax.scan(step, w, None, length=3)[0])(w0)

  np.testing.assert_allclose(run(layers.conv2d), run(_stock), rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize('shape', [(2, 8, 8, 3), (1, 7, 9, 2)])
def test_max_pool_matches_flax(shape):
  x = jax.random.normal(jax.random.key(5), shape)  # no ties
  y = layers.max_pool_2x2(x)
  y_ref = nn.max_pool(x, (2, 2), (2, 2))
  np.testing.assert_array_equal(y, y_ref)
  dy = jax.random.normal(jax.random.key(6), y.shape)
  g = jax.grad(lambda x: jnp.sum(layers.max_pool_2x2(x) * dy))(x)
  g_ref = jax.grad(lambda x: jnp.sum(nn.max_pool(x, (2, 2), (2, 2)) * dy))(x)
  np.testing.assert_allclose(g, g_ref, atol=1e-6)
