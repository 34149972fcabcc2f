import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from fedjax_mr.models import layers
from tests import helpers


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
@pytest.mark.parametrize('impl', ['im2col', 'conv'])
@pytest.mark.slow
def test_conv2d_values_and_gradients_match_lax(
  shape, kernel, strides, padding, impl
):
  kx, kw, kd = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, shape)
  w = jax.random.normal(kw, (*kernel, shape[-1], 5))
  pads = layers._pad_pairs(padding, kernel, strides, shape[1:3])
  y = layers.conv2d(x, w, strides, pads)
  y_ref = _stock(x, w, strides, pads)
  helpers.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
  dy = jax.random.normal(kd, y.shape)

  def ours(x, w):
    return jnp.sum(layers.conv2d(x, w, strides, pads) * dy)

  with layers.conv_implementation(impl):
    # Under jit too: the training loops compile it.
    grads = jax.grad(ours, (0, 1))(x, w)
    jitted = jax.jit(jax.grad(ours, (0, 1)))(x, w)
  grads_ref = jax.grad(
    lambda x, w: jnp.sum(_stock(x, w, strides, pads) * dy), (0, 1)
  )(x, w)
  for g, g_jit, g_ref in zip(grads, jitted, grads_ref):
    assert g.shape == g_ref.shape
    helpers.assert_close(g, g_ref, rtol=1e-4, atol=1e-4)
    helpers.assert_close(g_jit, g_ref, rtol=1e-4, atol=1e-4)


def test_the_conv_implementation_is_chosen_at_trace_time():
  x = jax.random.normal(jax.random.key(5), (2, 6, 6, 3))
  w = jax.random.normal(jax.random.key(6), (3, 3, 3, 4))
  pads = ((1, 1), (1, 1))

  def jaxpr(impl):
    with layers.conv_implementation(impl):
      return str(
        jax.make_jaxpr(
          jax.grad(lambda w: jnp.sum(layers.conv2d(x, w, (1, 1), pads)))
        )(w)
      )

  # im2col: the kernel's gradient is a matrix product, no convolution in
  # the backward pass; conv: convolutions only.
  assert jaxpr('im2col').count('conv_general_dilated') == 0
  assert 'dot_general' in jaxpr('im2col')
  assert 'dot_general' not in jaxpr('conv')
  auto = 'im2col' if jax.default_backend() == 'cpu' else 'conv'
  assert jaxpr('auto') == jaxpr(auto)
  # Not differentiated: the stock convolution, whatever the setting.
  with layers.conv_implementation('im2col'):
    plain = str(
      jax.make_jaxpr(lambda x, w: layers.conv2d(x, w, (1, 1), pads))(x, w)
    )
  assert 'conv_general_dilated' in plain
  with pytest.raises(ValueError, match='not one of'):
    with layers.conv_implementation('winograd'):
      pass


@pytest.mark.slow
def test_conv_module_matches_flax_conv():
  x = jax.random.normal(jax.random.key(1), (2, 10, 10, 3))
  ours = layers.Conv(7, (3, 3), strides=(2, 2), padding='SAME')
  ref = nn.Conv(7, (3, 3), strides=(2, 2), padding='SAME')
  v = ref.init(jax.random.key(2), x)
  v_ours = ours.init(jax.random.key(2), x)
  assert jax.tree.map(jnp.shape, v) == jax.tree.map(jnp.shape, v_ours)
  helpers.assert_close(ours.apply(v, x), ref.apply(v, x), atol=1e-5)


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

  for impl in ('im2col', 'conv'):
    with layers.conv_implementation(impl):
      got = run(layers.conv2d)
    helpers.assert_close(got, run(_stock), rtol=1e-4)


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
  helpers.assert_close(g, g_ref, atol=1e-6)
