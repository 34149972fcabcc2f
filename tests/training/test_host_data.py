"""Training data in host memory (`engine.HostData`): each round trains on
the view of its sampled clients (`client_data.gather_round`); the results
must be those of the whole training set on the devices, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import scaffold
from fedjax_mr.data import client_data
from fedjax_mr.training import client
from fedjax_mr.training import engine
from fedjax_mr.training import optimizers
from tests import helpers

_SIZES = [5, 9, 3, 12, 7, 4]


def _shuffled_data():
  """Six clients whose index lists are scattered over the examples."""
  rng = np.random.default_rng(3)
  m = sum(_SIZES)
  x = rng.integers(0, 256, (m, 2, 2, 1)).astype(np.uint8)
  y = rng.integers(0, 3, m).astype(np.int32)
  order = rng.permutation(m)
  bounds = np.cumsum([0, *_SIZES])
  parts = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
  return client_data.from_partition(x, y, parts, scale=1 / 255)


def test_capacity_is_the_k_largest_clients():
  assert client_data.round_capacity(np.array(_SIZES), 1) == 12
  assert client_data.round_capacity(np.array(_SIZES), 3) == 12 + 9 + 7
  assert client_data.round_capacity(np.array(_SIZES), 10) == sum(_SIZES)
  with pytest.raises(ValueError, match='clients_per_round'):
    client_data.round_capacity(np.array(_SIZES), 0)


def test_view_reads_each_sampled_clients_examples():
  data = _shuffled_data()
  host = client_data.to_host(data)
  ids = np.array([4, 1, 4])  # a repeat: its examples are copied once
  view = client_data.gather_round(host, ids, capacity=20)
  assert view.x.shape[0] == 20 and view.flat.shape[0] == 20 + data.max_size
  # Client 4's 7 examples, then client 1's 9 (in id order), then zeros.
  assert view.offsets[1] == 0 and view.offsets[4] == 9
  np.testing.assert_array_equal(view.x[16:], 0)
  positions = jnp.arange(data.max_size)
  for c in (1, 4):
    want_x, want_y = data.batch(jnp.int32(c), positions)
    got_x, got_y = view.batch(jnp.int32(c), positions)
    n = _SIZES[c]
    np.testing.assert_array_equal(np.asarray(got_x)[:n], np.asarray(want_x)[:n])
    np.testing.assert_array_equal(np.asarray(got_y)[:n], np.asarray(want_y)[:n])
  with pytest.raises(ValueError, match='capacity=15'):
    client_data.gather_round(host, ids, capacity=15)


def _algorithms(local, k):
  return {
    'fedavg': fedavg.fedavg(local, k),
    'scaffold': scaffold.scaffold(local, k, len(_SIZES)),
  }


@pytest.mark.parametrize('name', ['fedavg', 'scaffold'])
@pytest.mark.parametrize('devices', [1, 2])
def test_host_data_rounds_equal_device_data_rounds(name, devices):
  """Three rounds of K = 3 of 6 clients with partial last batches: the
  round on each round's view equals the round on the whole set."""
  mesh = None
  if devices > 1:
    assert len(jax.devices()) >= 2, 'tests/conftest.py sets 2 host devices'
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('clients',))
  model = helpers.linear_model()
  local = client.LocalTraining(model, optimizers.sgd(0.2, momentum=0.9), 2, 4)
  algorithm = _algorithms(local, 3)[name]
  variables = model.init(jax.random.key(0))
  data = _shuffled_data()
  step = engine.make_host_round(
    jax.jit(engine.make_sample_fn(algorithm, 3)),
    jax.jit(
      engine.make_round_fn(
        algorithm, clients_per_round=3, mesh=mesh, client_rows=True
      )
    ),
  )
  results = []
  for where in (data, engine.host_data(data, 3)):
    state = engine.init_state(algorithm, variables, 6, host_clients=True)
    history = []
    for _ in range(3):
      state, m = step(state, where, jax.random.key(7))
      history.append(jax.device_get(m))
    results.append((jax.device_get(state), history))
  (s1, h1), (s2, h2) = results
  for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for r1, r2 in zip(h1, h2):
    for key in r1:
      np.testing.assert_array_equal(r1[key], r2[key])
