"""Per-client state in host memory (`host_round.make_host_round`): each round
gathers its K rows on the host and writes them back; the results must be
the device-resident round's, bit for bit, and only K rows reach the
devices."""

import jax
import numpy as np
import pytest

from fedjax_mr.algorithms import moon
from fedjax_mr.algorithms import scaffold
from fedjax_mr.training import client
from fedjax_mr.training import engine
from fedjax_mr.training import host_round
from fedjax_mr.training import optimizers
from tests import helpers

_SIZES = [5, 9, 3, 12, 7, 4]
_STATEFUL = {
  'scaffold': lambda local, k, n: scaffold.scaffold(local, k, n),
  'moon': lambda local, k, n: moon.moon(local, k),
}


def _setting(name, k):
  model = helpers.linear_model()
  data, _ = helpers.toy_data(_SIZES)
  local = client.LocalTraining(model, optimizers.sgd(0.2, momentum=0.9), 2, 4)
  algorithm = _STATEFUL[name](local, k, len(_SIZES))
  return algorithm, model.init(jax.random.key(0)), data


def _device_rounds(algorithm, variables, data, k, mesh, rounds=3):
  state = engine.init_state(algorithm, variables, len(_SIZES))
  fn = jax.jit(engine.make_round_fn(algorithm, clients_per_round=k, mesh=mesh))
  history = []
  for _ in range(rounds):
    state, m = fn(state, data, jax.random.key(4))
    history.append(jax.device_get(m))
  return state, history


def _host_rounds(algorithm, variables, data, k, mesh, rounds=3):
  state = engine.init_state(
    algorithm, variables, len(_SIZES), host_clients=True
  )
  # Read-only views of the initial row until written out.
  assert not any(a.flags.writeable for a in jax.tree.leaves(state.clients))
  state = engine.to_host_clients(state)
  arrays = jax.tree.leaves(state.clients)
  step = host_round.make_host_round(
    jax.jit(engine.make_sample_fn(algorithm, k)),
    jax.jit(
      engine.make_round_fn(
        algorithm, clients_per_round=k, mesh=mesh, client_rows=True
      )
    ),
  )
  history = []
  for _ in range(rounds):
    state, m = step(state, data, jax.random.key(4))
    history.append(jax.device_get(m))
  # The same numpy arrays, written in place.
  assert all(a is b for a, b in zip(arrays, jax.tree.leaves(state.clients)))
  assert all(isinstance(a, np.ndarray) for a in arrays)
  return state, history


def _assert_identical(a, b):
  (s1, h1), (s2, h2) = a, b
  l1, l2 = jax.tree.leaves(s1), jax.tree.leaves(s2)
  assert len(l1) == len(l2)
  for x, y in zip(l1, l2):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for r1, r2 in zip(h1, h2):
    assert set(r1) == set(r2)
    for name in r1:
      np.testing.assert_array_equal(r1[name], r2[name])


@pytest.mark.parametrize('name', sorted(_STATEFUL))
@pytest.mark.parametrize('devices', [1, 2])
def test_host_resident_state_equals_device_resident(name, devices):
  """Three rounds of K = 3 of N = 6 (on 2 devices: one filling client):
  every state leaf (server and all N client rows) and every metric equal
  bit for bit."""
  mesh = None
  if devices > 1:
    assert len(jax.devices()) >= 2, 'tests/conftest.py sets 2 host devices'
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('clients',))
  algorithm, variables, data = _setting(name, 3)
  device = _device_rounds(algorithm, variables, data, 3, mesh)
  host = _host_rounds(algorithm, variables, data, 3, mesh)
  _assert_identical(device, host)
  # The rounds changed the state of the clients they trained, only theirs.
  trained = {int(c) for m in host[1] for c in m['client_ids']}
  start = engine.init_state(algorithm, variables, 6, host_clients=True)
  for before, after in zip(
    jax.tree.leaves(start.clients), jax.tree.leaves(host[0].clients)
  ):
    changed = {c for c in range(6) if not np.array_equal(before[c], after[c])}
    assert changed <= trained


def test_round_sees_k_rows_not_n():
  """The compiled round of a host-resident state takes K rows of client
  state, whatever N is."""
  algorithm, variables, data = _setting('scaffold', 2)
  state = engine.init_state(algorithm, variables, 6, host_clients=True)
  seen = []

  def rows_round(s, d, key, ids, rows):
    seen.append(jax.tree.leaves(rows)[0].shape[0])
    return fn(s, d, key, ids, rows)

  fn = engine.make_round_fn(algorithm, clients_per_round=2, client_rows=True)
  step = host_round.make_host_round(
    engine.make_sample_fn(algorithm, 2), rows_round
  )
  step(state, data, jax.random.key(0))
  assert seen == [2]


def test_to_host_clients_copies_device_arrays_once():
  algorithm, variables, _ = _setting('scaffold', 2)
  device = engine.init_state(algorithm, variables, 6)
  host = engine.to_host_clients(device)
  leaves = jax.tree.leaves(host.clients)
  assert all(isinstance(a, np.ndarray) and a.flags.writeable for a in leaves)
  for a, b in zip(leaves, jax.tree.leaves(device.clients)):
    np.testing.assert_array_equal(a, np.asarray(b))
  again = engine.to_host_clients(host)
  assert all(a is b for a, b in zip(leaves, jax.tree.leaves(again.clients)))


def test_initial_client_state_is_written_out_in_c_order():
  """The broadcast initial rows are copied in C order, each client's row
  contiguous: numpy's default order would put the client axis (stride 0)
  innermost, and the checkpoint's digest and write would then copy the
  whole array."""
  algorithm, variables, _ = _setting('scaffold', 2)
  state = engine.init_state(algorithm, variables, 6, host_clients=True)
  host = engine.to_host_clients(state)
  assert all(a.flags.c_contiguous for a in jax.tree.leaves(host.clients))
