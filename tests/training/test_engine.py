import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import fedmr
from fedjax_mr.core import tree
from fedjax_mr.core import types
from fedjax_mr.data import client_data
from fedjax_mr.training import client
from fedjax_mr.training import engine
from fedjax_mr.training import evaluation
from fedjax_mr.training import optimizers
from fedjax_mr.training import placement
from fedjax_mr.training import sampling
from tests import helpers
from tests.algorithms import contract


def _local(model):
  return client.LocalTraining(model, optimizers.sgd(0.2, momentum=0.9), 2, 4)


@functools.cache
def _setup(chunk=1, k=4):
  """`(round_fn, state, data)` of FedAvg, jitted once per (chunk, K) for
  the module: several tests run the same round."""
  model = helpers.linear_model()
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  server = fedavg.fedavg(_local(model), k)
  round_fn = jax.jit(
    engine.make_round_fn(server, clients_per_round=k, client_chunk=chunk)
  )
  state = engine.init_state(server, model.init(jax.random.key(0)))
  return round_fn, state, data


def _run(round_fn, state, data, key, rounds=3):
  history = []
  for _ in range(rounds):
    state, m = round_fn(state, data, key)
    history.append(jax.device_get(m))
  return state, history


def test_same_seed_identical_different_seed_differs():
  round_fn, state, data = _setup(chunk=1)
  s1, h1 = _run(round_fn, state, data, jax.random.key(7))
  s2, h2 = _run(round_fn, state, data, jax.random.key(7))
  s3, h3 = _run(round_fn, state, data, jax.random.key(8))
  helpers.tree_equal(s1, s2)
  for a, b in zip(h1, h2):
    helpers.tree_equal(a, b)
  k1 = s1.server.params['params']['Dense_0']['kernel']
  k3 = s3.server.params['params']['Dense_0']['kernel']
  assert not np.allclose(k1, k3)
  assert int(s1.round) == 3


@pytest.mark.slow
@pytest.mark.parametrize('chunk', [2, 3, 4])
def test_client_chunking_gives_same_result(chunk):
  ref_fn, state, data = _setup(chunk=1)
  fn, _, _ = _setup(chunk=chunk)
  s_ref, h_ref = _run(ref_fn, state, data, jax.random.key(3), rounds=2)
  s, h = _run(fn, state, data, jax.random.key(3), rounds=2)
  helpers.assert_close(
    s_ref.server.params, s.server.params, rtol=1e-5, atol=1e-6
  )
  helpers.assert_close(h_ref[-1]['train_loss'], h[-1]['train_loss'], rtol=1e-5)


def test_sampling_distinct_and_varies_by_round():
  ids = [
    np.asarray(sampling.sample_clients(jax.random.key(r), 10, 4))
    for r in range(20)
  ]
  for i in ids:
    assert len(set(i.tolist())) == 4 and i.min() >= 0 and i.max() < 10
  assert len({tuple(i) for i in ids}) > 10
  counts = np.bincount(np.concatenate(ids), minlength=10)
  assert counts.min() > 0


def test_train_loss_is_example_weighted_and_steps_exact():
  round_fn, state, data = _setup(k=6)
  _, m = round_fn(state, data, jax.random.key(0))
  sizes = np.array([5, 9, 3, 12, 7, 4])
  assert int(m['num_examples']) == sizes.sum()
  assert int(m['num_steps']) == 2 * np.sum(-(-sizes // 4))
  # The clients' mean losses, weighted by their examples (in the order the
  # round reports them), which their plain mean is not.
  n = np.asarray(m['client_examples'], np.float64)
  loss = np.asarray(m['client_loss'], np.float64)
  assert sorted(n.tolist()) == sorted(sizes.tolist())
  weighted = np.sum(n * loss) / n.sum()
  helpers.assert_close(m['train_loss'], weighted, rtol=1e-6)
  assert abs(weighted - loss.mean()) > 1e-3 * abs(weighted)


def test_evaluate_counts_padding_out():
  model = helpers.linear_model(zero_init=True)
  x = np.zeros((7, 2, 2, 1), np.uint8)
  y = np.array([0, 0, 0, 1, 2, 0, 1])
  evaluate = jax.jit(evaluation.make_evaluate(model))
  res = evaluate(model.init(jax.random.key(0)), client_data.eval_data(x, y, 3))
  # Zero model: all logits equal, argmax = class 0: 4 of 7 correct.
  helpers.assert_close(res['accuracy'], 4 / 7, rtol=1e-6)
  helpers.assert_close(res['loss'], np.log(3), rtol=1e-6)


def test_evaluate_split_over_two_devices_is_the_same_evaluation():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('clients',))
  model = helpers.linear_model()
  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, (7, 2, 2, 1)).astype(np.uint8)
  y = np.array([0, 2, 0, 1, 2, 0, 1])
  variables = model.init(jax.random.key(1))
  # 7 examples in batches of 3: 3 batches, padded to 4 for two devices.
  test = client_data.eval_data(x, y, 3, num_shards=2)
  assert test.x.shape[0] == 4 and float(test.mask.sum()) == 7
  one = jax.jit(evaluation.make_evaluate(model))(variables, test)
  two = jax.jit(evaluation.make_evaluate(model, mesh))(variables, test)
  for key in ('accuracy', 'loss'):
    assert float(two[key]) == float(one[key]), key
  stacked = jax.tree.map(lambda v: jnp.stack([v, -v, 2 * v]), variables)
  many = jax.jit(evaluation.make_evaluate_many(model, mesh))(stacked, test)
  for i, sign in enumerate([1, -1, 2]):
    alone = jax.jit(evaluation.make_evaluate(model))(
      jax.tree.map(lambda v: sign * v, variables), test
    )
    assert float(many['accuracy'][i]) == float(alone['accuracy'])
    helpers.assert_close(many['loss'][i], alone['loss'], rtol=1e-6)
  with pytest.raises(ValueError, match='do not split over 2 devices'):
    evaluation.make_evaluate(model, mesh)(
      variables, client_data.eval_data(x, y, 3)
    )


def test_balanced_order_hand_case():
  perm = placement.balanced_order(jnp.array([1, 10, 3, 7]), 2)
  np.testing.assert_array_equal(perm, [1, 0, 3, 2])  # shard sums 11 and 10


def test_balanced_order_balances_steps():
  rng = np.random.default_rng(0)
  for _ in range(20):
    sizes = rng.integers(1, 1000, 12)
    perm = np.asarray(placement.balanced_order(jnp.asarray(sizes), 3))
    assert sorted(perm.tolist()) == list(range(12))
    sums = sizes[perm].reshape(3, 4).sum(1)
    assert sums.max() - sums.min() <= sizes.max()


@pytest.mark.slow
def test_sharded_round_equals_one_device():
  assert len(jax.devices()) >= 2, 'tests/conftest.py sets 2 host devices'
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('clients',))
  model = helpers.linear_model()
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  server = fedavg.fedavg(_local(model), 4)
  state = engine.init_state(server, model.init(jax.random.key(0)))
  one = _setup(chunk=1)[0]  # the same FedAvg round on one device
  two = jax.jit(engine.make_round_fn(server, clients_per_round=4, mesh=mesh))
  s1, h1 = _run(one, state, data, jax.random.key(5))
  s2, h2 = _run(two, state, data, jax.random.key(5))
  helpers.assert_close(s1.server.params, s2.server.params, rtol=1e-5, atol=1e-6)
  for a, b in zip(h1, h2):
    np.testing.assert_array_equal(a['client_ids'], b['client_ids'])
    assert a['num_steps'] == b['num_steps']
    helpers.assert_close(a['train_loss'], b['train_loss'], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['shared', 'stacked', 'client_state'])
def test_three_clients_on_two_devices_equal_one_device(kind):
  """K = 3 on 2 devices: the client axis is filled up with an empty client
  (no steps, output dropped); every client trains as on one device."""
  from fedjax_mr.algorithms import scaffold

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('clients',))
  model = helpers.linear_model()
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  algorithm = {
    'shared': lambda: fedavg.fedavg(_local(model), 3),
    'stacked': lambda: _stacked(fedavg.fedavg(_local(model), 3), 3),
    'client_state': lambda: scaffold.scaffold(_local(model), 3, 6),
  }[kind]()
  state = engine.init_state(algorithm, model.init(jax.random.key(0)), 6)
  one = jax.jit(engine.make_round_fn(algorithm, clients_per_round=3))
  two = jax.jit(engine.make_round_fn(algorithm, clients_per_round=3, mesh=mesh))
  s1, h1 = _run(one, state, data, jax.random.key(5))
  s2, h2 = _run(two, state, data, jax.random.key(5))
  helpers.assert_close(s1.server, s2.server, rtol=1e-5, atol=1e-6)
  helpers.assert_close(s1.clients, s2.clients, rtol=1e-5, atol=1e-6)
  for a, b in zip(h1, h2):
    np.testing.assert_array_equal(a['client_ids'], b['client_ids'])
    # The empty client adds no steps, no examples and no loss.
    assert a['num_steps'] == b['num_steps']
    assert a['num_examples'] == b['num_examples']
    helpers.assert_close(a['train_loss'], b['train_loss'], rtol=1e-5)


def _stacked(algorithm, k):
  """The same algorithm sending K stacked copies of its model instead of
  one shared model."""

  def dispatch(state, ids, r, key):
    sent = algorithm.dispatch(state, ids, r, key)
    return types.Dispatch(per_client=tree.broadcast(sent.shared, k))

  def client_update(shared, per_client, client_state, data, cid, key):
    return algorithm.client_update(per_client, (), client_state, data, cid, key)

  return algorithm._replace(dispatch=dispatch, client_update=client_update)


@pytest.mark.slow
@pytest.mark.parametrize('devices,chunk', [(1, 1), (1, 2), (1, 4), (2, 1)])
def test_shared_dispatch_equals_stacked_dispatch(devices, chunk):
  """FedAvg hands its one global model to every client without stacking it;
  the round is the same as dispatching K stacked copies."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ('clients',))
  model = helpers.linear_model()
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  shared = fedavg.fedavg(_local(model), 4)
  stacked = _stacked(shared, 4)
  state = engine.init_state(shared, model.init(jax.random.key(0)))
  fns = [
    jax.jit(
      engine.make_round_fn(
        s,
        clients_per_round=4,
        client_chunk=chunk,
        mesh=mesh if devices > 1 else None,
      )
    )
    for s in (shared, stacked)
  ]
  (s1, h1), (s2, h2) = [_run(f, state, data, jax.random.key(2)) for f in fns]
  helpers.assert_close(s1.server.params, s2.server.params, rtol=1e-6, atol=1e-7)
  for a, b in zip(h1, h2):
    helpers.assert_close(a['train_loss'], b['train_loss'], rtol=1e-6)


@pytest.mark.slow
def test_shared_dispatch_holds_one_copy_of_the_model():
  """XLA's own memory analysis: K stacked inputs cost K model copies of
  temporary memory, the shared model none."""
  model = helpers.linear_model()
  data, _ = helpers.toy_data([5] * 64)
  local = client.LocalTraining(model, optimizers.sgd(0.1), 1, 4)
  shared = fedavg.fedavg(local, 64)
  state = engine.init_state(shared, model.init(jax.random.key(0)))
  temp = []
  for s in (shared, _stacked(shared, 64)):
    fn = jax.jit(engine.make_round_fn(s, clients_per_round=64))
    mem = fn.lower(state, data, jax.random.key(0)).compile().memory_analysis()
    if mem is None:
      pytest.skip('this backend reports no memory analysis')
    temp.append(mem.temp_size_in_bytes)
  model_bytes = sum(x.nbytes for x in jax.tree.leaves(state.server.params))
  assert temp[1] - temp[0] >= 0.9 * 64 * model_bytes


def test_a_round_of_another_k_than_the_algorithms_is_refused():
  algorithm = fedmr.fedmr(contract.LOCAL, 5)
  with pytest.raises(ValueError, match='built for clients_per_round=5'):
    engine.make_round_fn(algorithm, clients_per_round=10)
  # An Algorithm assembled by hand (no K of its own) runs at any K.
  engine.make_round_fn(
    algorithm._replace(clients_per_round=None), clients_per_round=10
  )
