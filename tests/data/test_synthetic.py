"""Synthetic(α, β) clients generated on demand (`fedjax_mr.data.synthetic`):
determinism, the distribution, the sizes, the test set, and local training
on them as on the same examples stored in a `ClientData`."""

import time
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.data import client_data
from fedjax_mr.data import synthetic
from fedjax_mr.models import model as model_lib
from fedjax_mr.training import client
from fedjax_mr.training import optimizers
from tests import helpers


@pytest.fixture(scope='module')
def data():
  return synthetic.from_seed(50, 1.0, 1.0, seed=3)


def _batch(data, k, positions):
  x, y = jax.jit(data.batch)(jnp.int32(k), jnp.asarray(positions, jnp.int32))
  return np.asarray(x), np.asarray(y)


def test_same_seed_same_examples_other_seed_others(data):
  again = synthetic.from_seed(50, 1.0, 1.0, seed=3)
  np.testing.assert_array_equal(again.sizes, data.sizes)
  x, y = _batch(data, 7, range(10))
  x2, y2 = _batch(again, 7, range(10))
  np.testing.assert_array_equal(x, x2)
  np.testing.assert_array_equal(y, y2)
  other = synthetic.from_seed(50, 1.0, 1.0, seed=4)
  assert not np.array_equal(_batch(other, 7, range(10))[0], x)
  assert x.shape == (10, 60) and x.dtype == np.float32
  assert y.shape == (10,) and y.dtype == np.int32


def test_an_example_is_the_same_whoever_asks(data):
  x, y = _batch(data, 5, range(12))
  # Another order, other company, a repeat.
  xs, ys = _batch(data, 5, [11, 3, 3, 0])
  np.testing.assert_array_equal(xs, x[[11, 3, 3, 0]])
  np.testing.assert_array_equal(ys, y[[11, 3, 3, 0]])
  # Vmapped over clients, as a chunk of clients trains.
  ids = jnp.array([5, 9, 5], jnp.int32)
  pos = jnp.array([[0, 1], [0, 1], [4, 11]], jnp.int32)
  xv, yv = jax.jit(jax.vmap(data.batch))(ids, pos)
  np.testing.assert_array_equal(xv[0], x[:2])
  np.testing.assert_array_equal(xv[2], x[[4, 11]])
  np.testing.assert_array_equal(yv[2], y[[4, 11]])
  assert not np.array_equal(xv[1], x[:2])  # client 9 is another client


def test_labels_are_the_argmax_of_the_clients_own_model(data):
  for k in (0, 17, 49):
    x, y = _batch(data, k, range(200))
    p = jax.device_get(data.params(jnp.int32(k)))
    assert p.w.shape == (60, 10) and p.b.shape == (10,) and p.v.shape == (60,)
    logits = x.astype(np.float64) @ p.w + p.b
    np.testing.assert_array_equal(y, np.argmax(logits, axis=1))


def test_features_scatter_around_the_clients_mean_by_j_to_the_minus_1_2(data):
  n = 4000
  x, _ = _batch(data, 11, range(n))
  v = np.asarray(data.params(jnp.int32(11)).v)
  var = (np.arange(1, 61) ** -1.2).astype(np.float64)
  # The sample variance is within 4.5 standard errors (sqrt(2 / n)).
  helpers.assert_close(x.var(axis=0) / var, np.ones(60), atol=0.1)
  # The sample mean within 4.5 standard errors of v_k.
  assert np.all(np.abs(x.mean(axis=0) - v) < 4.5 * np.sqrt(var / n))


def _spread(alpha, beta, n=300):
  """Over n clients: the std of the mean entry of W_k (≈ α) and of v_k
  (≈ β)."""
  data = synthetic.from_seed(n, alpha, beta, seed=0)
  p = jax.jit(jax.vmap(data.params))(jnp.arange(n, dtype=jnp.int32))
  return (
    float(np.std(np.mean(p.w, axis=(1, 2)))),
    float(np.std(np.mean(p.v, axis=1))),
  )


def test_clients_differ_more_with_larger_alpha_and_beta():
  w0, v0 = _spread(0.0, 0.0)
  w1, v1 = _spread(1.0, 0.0)
  w2, v2 = _spread(0.0, 2.0)
  # α = β = 0: only each entry's own noise (std 1 / sqrt(600), 1 / sqrt(60)).
  assert w0 < 0.06 and v0 < 0.2
  assert 0.85 < w1 < 1.15 and v1 < 0.2
  assert w2 < 0.06 and 1.7 < v2 < 2.3


def test_sizes_of_a_million_clients_fast_small_and_as_documented():
  tracemalloc.start()
  t0 = time.perf_counter()
  sizes = synthetic.client_sizes(10**6, seed=0)
  seconds = time.perf_counter() - t0
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert seconds < 2.0
  assert peak < 40e6  # a few [N] temporaries, 4-8 bytes per client
  assert sizes.shape == (10**6,) and sizes.dtype == np.int32
  assert sizes.min() == synthetic.MIN_SIZE == 10
  assert sizes.max() == synthetic.MAX_SIZE == 200
  assert abs(sizes.mean() - 19.98) < 0.03
  assert np.median(sizes) == 16
  np.testing.assert_array_equal(sizes, synthetic.client_sizes(10**6, seed=0))
  assert not np.array_equal(sizes[:100], synthetic.client_sizes(100, seed=1))


@pytest.mark.parametrize(
  'kwargs,message',
  [
    ({'num_clients': 0}, 'num_clients must be ≥ 1'),
    ({'min_size': 0}, 'min_size must be ≥ 1'),
    ({'mean': 5.0}, r'mean must lie in \(min_size, max_size\)'),
    ({'sigma': 0.0}, 'sigma must be finite and > 0'),
    ({'num_clients': 2**30}, 'exceed int32 counts'),
  ],
)
def test_sizes_refuse_bad_arguments(kwargs, message):
  args = {'num_clients': 10, 'seed': 0, **kwargs}
  with pytest.raises(ValueError, match=message):
    synthetic.client_sizes(**args)


def test_rates_must_be_finite_and_non_negative():
  with pytest.raises(ValueError, match='^alpha must be finite and ≥ 0'):
    synthetic.from_seed(10, -0.5, 1.0, 0)
  with pytest.raises(ValueError, match='^beta must be finite and ≥ 0'):
    synthetic.from_seed(10, 1.0, float('nan'), 0)


def test_with_empty_client(data):
  more = data.with_empty_client()
  assert more.num_clients == data.num_clients + 1 == 51
  assert int(more.sizes[-1]) == 0
  assert more.max_size == data.max_size
  assert int(more.num_examples) == int(data.num_examples)
  np.testing.assert_array_equal(
    _batch(more, 3, range(4))[0], _batch(data, 3, range(4))[0]
  )


def test_the_test_set_is_held_out_seeded_and_bounded():
  data = synthetic.from_seed(3000, 1.0, 1.0, seed=0)
  sizes = np.asarray(data.sizes)
  ids, pos = synthetic.held_out_positions(sizes, seed=0)
  held = np.ceil(sizes * 0.25)
  clients = np.unique(ids)
  assert len(clients) == synthetic.TEST_CLIENTS
  # Each client's own positions n_k .. n_k + ⌈n_k / 4⌉ − 1: never training.
  for k in clients[:50]:
    np.testing.assert_array_equal(
      np.sort(pos[ids == k]), sizes[k] + np.arange(held[k])
    )
  assert np.all(pos >= sizes[ids])
  assert len(ids) == held[clients].sum() <= synthetic.TEST_EXAMPLES
  same = synthetic.held_out_positions(sizes, seed=0)
  np.testing.assert_array_equal(same[0], ids)
  # Bounded: as many clients as the examples allow.
  few, _ = synthetic.held_out_positions(sizes, seed=0, max_examples=100)
  assert 0 < len(few) <= 100
  x, y = synthetic.held_out(synthetic.from_seed(40, 1.0, 1.0, seed=2), 2)
  assert x.dtype == np.float32 and y.dtype == np.int32
  assert x.shape == (len(y), 60) and isinstance(x, np.ndarray)


def test_the_test_examples_are_the_clients_own():
  data = synthetic.from_seed(40, 1.0, 1.0, seed=2)
  ids, pos = synthetic.held_out_positions(np.asarray(data.sizes), 2)
  x, y = synthetic.held_out(data, 2)
  k = ids[0]
  rows = np.flatnonzero(ids == k)
  xk, yk = _batch(data, k, pos[rows])
  helpers.assert_close(x[rows], xk, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(y[rows], yk)


def test_local_training_matches_the_same_examples_stored():
  """`make_client_update` on generated clients trains as on a `ClientData`
  holding the same examples (same sizes, so the same permutations)."""
  gen = synthetic.from_seed(6, 1.0, 1.0, seed=1)
  sizes = np.asarray(gen.sizes)
  xs, ys = zip(*(_batch(gen, k, range(n)) for k, n in enumerate(sizes)))
  bounds = np.cumsum([0, *sizes])
  parts = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
  stored = client_data.from_partition(
    np.concatenate(xs), np.concatenate(ys), parts
  )
  assert stored.max_size == gen.max_size
  model = model_lib.get('logistic', 10, (60,))
  variables = model.init(jax.random.key(0))
  update = jax.jit(
    client.make_client_update(
      model, optimizers.sgd(0.05, 0.9), local_epochs=2, batch_size=8
    )
  )
  for k in range(len(sizes)):
    key = jax.random.key(10 + k)
    a = update(variables, gen, jnp.int32(k), key)
    b = update(variables, stored, jnp.int32(k), key)
    assert int(a.num_steps) == int(b.num_steps) == 2 * -(-sizes[k] // 8)
    assert int(a.num_examples) == sizes[k]
    helpers.assert_close(a.loss, b.loss, rtol=1e-5)
    helpers.assert_close(a.variables, b.variables, rtol=1e-5, atol=1e-6)
