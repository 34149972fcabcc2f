import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import fedexp
from fedjax_mr.core import errors
from fedjax_mr.core import types
from fedjax_mr.training import engine
from tests import helpers
from tests.algorithms import contract


def _outputs(models, sizes, start=None):
  """Stacked uploads; FedExP's clients also upload ||w_t - w_i||^2 (from
  `start`, the model they were sent)."""
  k = len(sizes)
  extra = ()
  if start is not None:
    extra = jnp.array(
      [
        float(jnp.sum(jnp.square(models['params']['w'][i] - start)))
        for i in range(k)
      ]
    )
  return types.ClientOutput(
    variables=models,
    num_examples=jnp.array(sizes, jnp.int32),
    loss=jnp.zeros((k,)),
    num_steps=jnp.ones((k,), jnp.int32),
    extra=extra,
  )


def test_one_server_update_by_hand():
  # w_t = (0, 0); clients (1, 0) and (-1, 0.2): D_1 = (-1, 0),
  # D_2 = (1, -0.2), mean D = (0, -0.1). sum p |D_i|^2 = (1 + 1.04) / 2
  # = 1.02, |D|^2 = 0.01; eta = 1.02 / (2 (0.01 + 0.001)) = 46.3636...
  # w_{t+1} = w_t - eta D = (0, 4.63636); evaluated: (0, 2.31818).
  # BatchNorm-like statistics are averaged: (2 + 4) / 2 = 3.
  start = {'params': {'w': jnp.zeros(2)}, 'batch_stats': {'m': jnp.ones(1)}}
  models = {
    'params': {'w': jnp.array([[1.0, 0.0], [-1.0, 0.2]])},
    'batch_stats': {'m': jnp.array([[2.0], [4.0]])},
  }
  alg = fedexp.fedexp(contract.LOCAL, 2, epsilon=1e-3)
  state = alg.init(start)
  uploads = _outputs(models, [3, 9], start['params']['w'])
  # What the clients upload beside their models: |D_1|^2 = 1, |D_2|^2 = 1.04.
  helpers.assert_close(uploads.extra, [1.0, 1.04], rtol=1e-6)
  new, metrics = jax.jit(lambda *a: types.aggregate_stacked(alg, *a))(
    state, uploads, jnp.arange(2), 0, jax.random.key(0)
  )
  eta = 1.02 / (2 * 0.011)
  helpers.assert_close(metrics['global_lr'], eta, rtol=1e-5)
  helpers.assert_close(
    new.params['params']['w'], [0, 0.1 * eta], rtol=1e-5, atol=1e-6
  )
  helpers.assert_close(new.params['batch_stats']['m'], [3.0])
  ev = types.evaluated_model(alg, new)
  helpers.assert_close(ev['params']['w'], [0, 0.05 * eta], rtol=1e-5, atol=1e-6)
  helpers.assert_close(ev['batch_stats']['m'], [2.0])
  # The last iterate itself when asked.
  last = fedexp.fedexp(contract.LOCAL, 2, average_last_two=False)
  assert types.evaluated_model(last, new) is new.params
  # Weighted by examples (3 and 9): D = (0.5, -0.15), |D|^2 = 0.2725,
  # sum p |D_i|^2 = 0.25 + 0.75 * 1.04 = 1.03; eta = 1.03 / 0.547.
  weighted = fedexp.fedexp(contract.LOCAL, 2, weighted=True)
  new, metrics = types.aggregate_stacked(
    weighted,
    state,
    uploads,
    jnp.arange(2),
    0,
    jax.random.key(0),
  )
  eta = 1.03 / (2 * (0.2725 + 1e-3))
  helpers.assert_close(metrics['global_lr'], eta, rtol=1e-5)
  helpers.assert_close(
    new.params['params']['w'], [-0.5 * eta, 0.15 * eta], rtol=1e-5
  )


def test_step_size_is_one_when_clients_agree():
  same = {'w': jnp.array([[1.0, -2.0], [1.0, -2.0], [1.0, -2.0]])}
  eta = fedexp.step_size(same, jnp.full((3,), 1 / 3), 0.0)
  assert float(eta) == 1.0
  # Never below 1, whatever eps.
  spread = {'w': jnp.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 3.0]])}
  for eps in (0.0, 1e-3, 10.0, 1e9):
    assert float(fedexp.step_size(spread, jnp.full((3,), 1 / 3), eps)) >= 1


@pytest.mark.slow
@pytest.mark.parametrize('devices', [1, 2])
def test_step_size_one_is_unweighted_fedavg_exactly(devices):
  # A huge eps forces eta_g = 1: the trajectory is FedAvg's, bit for bit.
  model = helpers.linear_bn_model()
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  local = contract.local_training(model)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ('c',))
  states, lrs = [], []
  for algorithm in (
    fedexp.fedexp(local, 4, epsilon=1e30),
    fedavg.fedavg(local, 4, weighted=False),
  ):
    fn = jax.jit(
      engine.make_round_fn(
        algorithm, clients_per_round=4, mesh=mesh if devices > 1 else None
      )
    )
    state = engine.init_state(algorithm, model.init(jax.random.key(0)))
    for _ in range(3):
      state, metrics = fn(state, data, jax.random.key(4))
      lrs.append(metrics.get('global_lr'))
    states.append(jax.device_get(state.server.params))
  helpers.tree_equal(states[0], states[1])
  assert [float(x) for x in lrs[:3]] == [1.0, 1.0, 1.0]


def test_extrapolates_on_heterogeneous_clients():
  # Real local training on clients with random labels: their updates
  # disagree, so eta_g > 1 in the first round.
  model = helpers.linear_model()
  data, _ = helpers.toy_data([20, 20, 20, 20], seed=3)
  local = contract.local_training(model, lr=0.05)
  algorithm = fedexp.fedexp(local, 4)
  fn = jax.jit(engine.make_round_fn(algorithm, clients_per_round=4))
  state = engine.init_state(algorithm, model.init(jax.random.key(0)))
  state, metrics = fn(state, data, jax.random.key(1))
  assert float(metrics['global_lr']) > 1.0


def test_bad_epsilon_names_it():
  with pytest.raises(errors.ArgumentError, match='^epsilon must be'):
    fedexp.fedexp(contract.LOCAL, 2, epsilon=-1.0)
  with pytest.raises(errors.ArgumentError, match='^epsilon must be'):
    fedexp.fedexp(contract.LOCAL, 2, epsilon=float('inf'))
