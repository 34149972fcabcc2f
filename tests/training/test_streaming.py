"""Streaming aggregation: the engine sums what each client contributes as
clients finish (`streaming.stream_clients`) instead of stacking the K trained
models; it must agree with the stacked sum, and hold a chunk, not K."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedasam
from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import fedexp
from fedjax_mr.algorithms import fedmut
from fedjax_mr.algorithms import fedprox
from fedjax_mr.algorithms import moon
from fedjax_mr.algorithms import scaffold
from fedjax_mr.core import types
from fedjax_mr.training import client
from fedjax_mr.training import engine
from fedjax_mr.training import optimizers
from fedjax_mr.training import streaming
from tests import helpers


def _fake_client(x, state, cid, key):
  """A client whose model is `x` times ones, with `cid + 1` examples."""
  del key
  out = types.ClientOutput(
    variables={'params': {'w': x * jnp.ones((3,), jnp.float32)}},
    num_examples=(cid + 1).astype(jnp.int32),
    loss=x,
    num_steps=cid.astype(jnp.int32),
  )
  return out, state + 1


def _inputs(k):
  """`stream_clients`' per-client inputs of K fake clients: models 1..K,
  no state, ids 0..K-1, keys."""
  return (
    jnp.arange(1.0, k + 1.0),
    jnp.zeros((k,), jnp.int32),
    jnp.arange(k, dtype=jnp.int32),
    jax.random.split(jax.random.key(0), k),
  )


@pytest.mark.parametrize('chunk', [1, 2, 3, 5, 8])
def test_streamed_sum_by_hand(chunk):
  # Five clients: models 1..5 times ones, weights (examples) 1..5, so the
  # weighted sum is 1*1 + 2*2 + ... + 5*5 = 55 and the weights sum to 15;
  # every value is an integer, exact in float32 in any order.
  sums, states = streaming.stream_clients(
    _fake_client,
    lambda out: fedavg.mean_contribution(out, weighted=True),
    _inputs(5),
    chunk,
  )
  np.testing.assert_array_equal(sums.total['models']['params']['w'], [55.0] * 3)
  assert float(sums.total['weight']) == 15.0
  np.testing.assert_array_equal(sums.num_examples, [1, 2, 3, 4, 5])
  np.testing.assert_array_equal(sums.loss, [1, 2, 3, 4, 5])
  np.testing.assert_array_equal(sums.num_steps, [0, 1, 2, 3, 4])
  np.testing.assert_array_equal(states, [1] * 5)


@pytest.mark.parametrize('chunk', [1, 64])
def test_on_the_cpu_clients_add_up_in_their_order_whatever_the_chunk(chunk):
  # 64 clients of magnitudes 1e-4 to 1e4, where float32 shows the order
  # of the additions (XLA's own `sum(axis=0)` of such rows differs from
  # the loop: tests/core/test_tree.py): one chunk of all 64 adds them one
  # after another, as 64 chunks of one do (`types.sum_clients`; a vmapped
  # chunk's reduction was also the slow one on XLA:CPU).
  assert jax.default_backend() == 'cpu'
  x = jax.random.normal(jax.random.key(3), (64,)) * jnp.logspace(-4, 4, 64)
  inputs = (x, *_inputs(64)[1:])
  sums, _ = streaming.stream_clients(
    _fake_client,
    lambda out: fedavg.mean_contribution(out, weighted=False),
    inputs,
    chunk,
  )
  expected = np.float32(0.0)
  for value in np.asarray(x, np.float32):
    expected = np.float32(expected + value)
  np.testing.assert_array_equal(
    sums.total['models']['params']['w'], [expected] * 3
  )


@pytest.mark.parametrize('chunk', [1, 2, 4])
def test_invalid_clients_add_nothing(chunk):
  # Clients 1 and 3 are filling entries: they add zeros to the sums but
  # keep their rows of scalars (the engine drops those).
  sums, _ = streaming.stream_clients(
    _fake_client,
    lambda out: fedavg.mean_contribution(out, weighted=False),
    _inputs(4),
    chunk,
    valid=jnp.array([True, False, True, False]),
  )
  # Plain mean of clients 0 and 2: (1 + 3) / 2.
  np.testing.assert_array_equal(sums.total['models']['params']['w'], [4.0] * 3)
  assert float(sums.total['weight']) == 2.0
  np.testing.assert_array_equal(sums.loss, [1, 2, 3, 4])


def _local(model, epochs=2):
  return client.LocalTraining(
    model, optimizers.sgd(0.2, momentum=0.9), epochs, 4
  )


SUMMING = {
  'fedavg': lambda local, k, n: fedavg.fedavg(local, k),
  'fedavg_plain': lambda local, k, n: fedavg.fedavg(local, k, weighted=False),
  'fedavgm': lambda local, k, n: fedavg.fedavg(
    local, k, server_optimizer=optimizers.server_optimizer('momentum', 0.5)
  ),
  'fedadam': lambda local, k, n: fedavg.fedavg(
    local, k, server_optimizer=optimizers.server_optimizer('adam', 0.05)
  ),
  'fedprox': lambda local, k, n: fedprox.fedprox(local, k, mu=0.1),
  'fedasam': lambda local, k, n: fedasam.fedasam(local, k),
  'moon': lambda local, k, n: moon.moon(local, k),
  'scaffold': lambda local, k, n: scaffold.scaffold(local, k, n),
  'fedexp': lambda local, k, n: fedexp.fedexp(local, k),
  'fedmut': lambda local, k, n: fedmut.fedmut(local, k, alpha=2.0, bound=4),
}


def _rounds(algorithm, state, data, k, rounds=3, **kw):
  fn = jax.jit(engine.make_round_fn(algorithm, clients_per_round=k, **kw))
  history = []
  for _ in range(rounds):
    state, m = fn(state, data, jax.random.key(4))
    history.append(jax.device_get(m))
  return state, history


def _assert_same_run(a, b, rtol):
  (s1, h1), (s2, h2) = a, b
  helpers.assert_close(s1.server, s2.server, rtol=rtol, atol=rtol / 10)
  helpers.assert_close(s1.clients, s2.clients, rtol=rtol, atol=rtol / 10)
  exact = ('client_ids', 'client_examples', 'client_steps', 'num_examples')
  for r1, r2 in zip(h1, h2):
    assert set(r1) == set(r2)
    for name in exact + ('num_steps',):
      np.testing.assert_array_equal(r1[name], r2[name])
    # Losses and server metrics: the rounds' models differ in the last
    # bits from round 2 on.
    helpers.assert_close(
      {m: r1[m] for m in r1 if m not in exact},
      {m: r2[m] for m in r2 if m not in exact},
      rtol=rtol,
      atol=rtol / 10,
    )


@pytest.mark.parametrize('name', sorted(SUMMING))
def test_every_summing_algorithm_declares_its_sums(name):
  model = helpers.linear_model()
  algorithm = SUMMING[name](_local(model), 4, 6)
  assert algorithm.contribution is not None


_SIZES = [5, 9, 3, 12, 7, 4]


@functools.cache
def _stacked_run(name):
  """Three rounds of `name` with the K outputs stacked and summed at once,
  one client after another: the reference every streamed round of `name`
  is compared with (computed once per algorithm; compiling a round takes
  seconds, running it milliseconds)."""
  model = helpers.linear_model()
  data, _ = helpers.toy_data(_SIZES)
  algorithm = SUMMING[name](_local(model), 4, 6)
  state = engine.init_state(algorithm, model.init(jax.random.key(0)), 6)
  return (
    algorithm,
    state,
    data,
    _rounds(algorithm, state, data, 4, stream=False),
  )


# Every algorithm is streamed in chunks of 3 with a remainder of 1 (K = 4):
# its contribution vmapped over a chunk and over the remainder, the sums
# added up, and its own aggregation from them. Chunks of 1 call the same
# contribution on one client at a time (`streaming.stream_clients`, checked
# by hand above at chunks 1 to 8); through the engine they run here for the
# plain mean, and for the weighted mean (which FedProx, FedASAM, MOON,
# FedAvgM and FedAdam send too), SCAFFOLD's, FedExP's and FedMut's sums on
# each device of `test_streamed_on_two_devices_with_a_filling_client`.
STREAMED = [(name, 3) for name in sorted(SUMMING)] + [('fedavg_plain', 1)]


@pytest.mark.slow
@pytest.mark.parametrize(
  'name,chunk', STREAMED, ids=[f'{c}-{n}' for n, c in STREAMED]
)
def test_streamed_round_equals_stacked_round(name, chunk):
  """Three rounds streamed (chunks of 1, or of 3 with a remainder of 1)
  against the K outputs stacked and summed at once: the same clients,
  steps and examples exactly, every float within float32 reassociation
  (the sums add the same terms in another order)."""
  algorithm, state, data, stacked = _stacked_run(name)
  streamed = _rounds(algorithm, state, data, 4, client_chunk=chunk)
  _assert_same_run(streamed, stacked, rtol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize('name', ['fedavg', 'scaffold', 'fedexp', 'fedmut'])
def test_streamed_on_two_devices_with_a_filling_client(name):
  """K = 3 on 2 devices: each device sums its clients, one psum adds the
  two; the filling client adds nothing. Equal to one device's stacked
  round within float32 reassociation."""
  assert len(jax.devices()) >= 2, 'tests/conftest.py sets 2 host devices'
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('clients',))
  model = helpers.linear_model()
  data, _ = helpers.toy_data(_SIZES)
  algorithm = SUMMING[name](_local(model), 3, 6)
  state = engine.init_state(algorithm, model.init(jax.random.key(0)), 6)
  two = _rounds(algorithm, state, data, 3, mesh=mesh)
  one = _rounds(algorithm, state, data, 3, stream=False)
  _assert_same_run(two, one, rtol=2e-5)


@pytest.mark.slow
def test_streamed_round_holds_a_chunk_not_k_models():
  """XLA's own memory analysis of one round: stacking the K trained models
  costs about K models of temporary memory; streamed, the round's memory
  does not grow with K (a few bytes per client: ids, keys, scalars) and
  grows with the chunk instead."""
  model = helpers.linear_model(10, (16, 16, 1))  # 2,570 parameters
  data, _ = helpers.toy_data([5] * 64, (16, 16, 1), 10)
  local = client.LocalTraining(model, optimizers.sgd(0.1), 1, 4)
  variables = model.init(jax.random.key(0))
  model_bytes = sum(x.nbytes for x in jax.tree.leaves(variables))

  def temp(k, make=fedavg.fedavg, **kw):
    algorithm = make(local, k)
    state = engine.init_state(algorithm, variables)
    fn = jax.jit(engine.make_round_fn(algorithm, clients_per_round=k, **kw))
    mem = fn.lower(state, data, jax.random.key(0)).compile().memory_analysis()
    if mem is None:
      pytest.skip('this backend reports no memory analysis')
    return mem.temp_size_in_bytes

  stacked, streamed = temp(64, stream=False), temp(64)
  assert stacked - streamed >= 0.8 * 64 * model_bytes
  assert streamed - temp(16) <= 0.1 * 48 * model_bytes
  assert temp(64, client_chunk=8) - streamed <= 4 * 8 * model_bytes
  # FedMut sends coefficients, not K mutated models: no growth with K.
  assert temp(64, fedmut.fedmut) - temp(16, fedmut.fedmut) <= (
    0.1 * 48 * model_bytes
  )


@pytest.mark.parametrize(
  'n, chunk, summed, want',
  [
    (
      5,
      1,
      True,
      [
        (0, 1, False),
        (1, 2, False),
        (2, 3, False),
        (3, 4, False),
        (4, 5, False),
      ],
    ),
    (5, 2, True, [(0, 2, True), (2, 4, True), (4, 5, True)]),
    (5, 3, False, [(0, 3, True), (3, 5, True)]),
    (4, 8, True, [(0, 4, True)]),
    # One client: alone when summed (`stream_clients`), vmapped in a group
    # of one when stacked (`map_clients`).
    (1, 2, True, [(0, 1, False)]),
    (1, 2, False, [(0, 1, True)]),
  ],
)
def test_groups_are_the_programs_clients_run_in(n, chunk, summed, want):
  assert streaming.groups(n, chunk, summed) == [
    streaming.Group(*g) for g in want
  ]
