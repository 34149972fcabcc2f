"""Training data in host memory (`host_round.HostData`): each round trains on
the view of its sampled clients (`client_data.gather_round`); the results
must be those of the whole training set on the devices, bit for bit."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import scaffold
from fedjax_mr.data import client_data
from fedjax_mr.training import client
from fedjax_mr.training import engine
from fedjax_mr.training import host_round
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


@functools.cache
def _round_fns(name, devices):
  """`(algorithm, sample, rows_round, sharding)`: K = 3 of the 6 clients,
  on 1 or 2 devices, jitted once for the module (both tests below run the
  same rounds; tracing and compiling them is most of their time)."""
  mesh = sharding = None
  if devices > 1:
    assert len(jax.devices()) >= 2, 'tests/conftest.py sets 2 host devices'
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('clients',))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  model = helpers.linear_model()
  local = client.LocalTraining(model, optimizers.sgd(0.2, momentum=0.9), 2, 4)
  algorithm = _algorithms(local, 3)[name]
  sample = jax.jit(engine.make_sample_fn(algorithm, 3))
  rows_round = jax.jit(
    engine.make_round_fn(
      algorithm, clients_per_round=3, mesh=mesh, client_rows=True
    )
  )
  return algorithm, sample, rows_round, sharding


@pytest.mark.parametrize('name', ['fedavg', 'scaffold'])
@pytest.mark.parametrize('devices', [1, 2])
def test_host_data_rounds_equal_device_data_rounds(name, devices):
  """Three rounds of K = 3 of 6 clients with partial last batches: the
  round on each round's view equals the round on the whole set."""
  algorithm, sample, rows_round, _ = _round_fns(name, devices)
  step = host_round.make_host_round(sample, rows_round)
  data = _shuffled_data()
  variables = helpers.linear_model().init(jax.random.key(0))
  results = []
  for where in (data, host_round.host_data(data, 3)):
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


def _counting(sample_fn, rounds):
  """`sample_fn` that records the round of every state it draws for."""

  def sample(state, data, key):
    rounds.append(int(state.round))
    return sample_fn(state, data, key)

  return sample


def _host_data_rounds(algorithm, data, step, rounds=3, key=None):
  model = helpers.linear_model()
  state = engine.init_state(
    algorithm, model.init(jax.random.key(0)), 6, host_clients=True
  )
  history = []
  for _ in range(rounds):
    state, m = step(state, data, key or jax.random.key(7))
    history.append(jax.device_get(m))
  return jax.device_get(state), history


def _assert_same(a, b):
  (s1, h1), (s2, h2) = a, b
  for x, y in zip(jax.tree.leaves(s1), jax.tree.leaves(s2), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for r1, r2 in zip(h1, h2, strict=True):
    assert set(r1) == set(r2)
    for key in r1:
      np.testing.assert_array_equal(r1[key], r2[key])


@pytest.mark.parametrize('name', ['fedavg', 'scaffold'])
@pytest.mark.parametrize('devices', [1, 2])
def test_prefetched_and_memory_mapped_rounds_equal_plain_ones(
  name, devices, tmp_path
):
  """The next round's view gathered (and put on the devices) while a
  round runs, and the set memory-mapped from a file: the same three rounds
  as the plain host round, bit for bit; the prefetched step draws each
  round once, one round ahead, and a fresh step (a resumed run) starts
  from any round with the same bits."""
  algorithm, sample, rows_round, sharding = _round_fns(name, devices)
  assert host_round.draws_ahead(algorithm)
  in_memory = host_round.host_data(_shuffled_data(), 3)
  mapped = in_memory._replace(
    data=client_data.memory_mapped(in_memory.data, str(tmp_path))
  )
  assert client_data.is_memory_mapped(mapped.data)
  assert not os.listdir(tmp_path)  # the file has no name
  plain = _host_data_rounds(
    algorithm, in_memory, host_round.make_host_round(sample, rows_round)
  )
  drawn = []
  ahead = host_round.make_host_round(
    _counting(sample, drawn), rows_round, prefetch=True, sharding=sharding
  )
  # A fresh key object of the same value each round still hits.
  _assert_same(plain, _host_data_rounds(algorithm, mapped, ahead))
  assert drawn == [0, 1, 2, 3]  # round 0, then each next one ahead
  # Resumed after round 2 (a new process: nothing drawn ahead).
  first, _ = _host_data_rounds(
    algorithm, mapped, host_round.make_host_round(sample, rows_round), rounds=2
  )
  drawn.clear()
  resumed = host_round.make_host_round(
    _counting(sample, drawn), rows_round, prefetch=True, sharding=sharding
  )
  state, m = resumed(jax.tree.map(np.array, first), mapped, jax.random.key(7))
  assert drawn == [2, 3]
  _assert_same(
    (plain[0], plain[1][2:]),
    (jax.device_get(state), [jax.device_get(m)]),
  )


def test_prefetch_draws_afresh_for_another_round_key_or_data():
  """What was drawn ahead is used only for the round, key and data it was
  drawn for: a step for round 1 with another key or other data, or a
  step repeated from round 0, gives what a plain step gives."""
  model = helpers.linear_model()
  local = client.LocalTraining(model, optimizers.sgd(0.2), 1, 4)
  algorithm = fedavg.fedavg(local, 2)
  sample = jax.jit(engine.make_sample_fn(algorithm, 2))
  rows_round = jax.jit(
    engine.make_round_fn(algorithm, clients_per_round=2, client_rows=True)
  )
  data = host_round.host_data(_shuffled_data(), 2)
  other = data._replace(data=data.data.replace(x=255 - data.data.x))
  plain = host_round.make_host_round(sample, rows_round)
  ahead = host_round.make_host_round(sample, rows_round, prefetch=True)
  state = engine.init_state(algorithm, model.init(jax.random.key(0)), 6)
  one = jax.random.key(1)
  for s, d, key in ((1, data, 2), (1, other, 1), (0, data, 1)):
    after, _ = ahead(state, data, one)  # draws round 1 ahead, for `one`
    at = after if s == 1 else state
    got_state, got = ahead(at, d, jax.random.key(key))
    want_state, want = plain(at, d, jax.random.key(key))
    _assert_same(
      jax.device_get((got_state, [got])), jax.device_get((want_state, [want]))
    )


def test_samplers_that_read_the_round_are_not_drawn_ahead():
  """CluSamp's sampler reads the server state (the clients' last updates):
  its rounds cannot be drawn before the round before them ends."""
  from fedjax_mr.algorithms import clusamp

  local = client.LocalTraining(
    helpers.linear_model(), optimizers.sgd(0.2), 1, 4
  )
  assert host_round.draws_ahead(fedavg.fedavg(local, 2))
  assert not host_round.draws_ahead(clusamp.clustered_sampling(local, 2, 6))
