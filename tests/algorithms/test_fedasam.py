import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedasam
from fedjax_mr.algorithms import fedavg
from fedjax_mr.core import errors
from fedjax_mr.training import client
from fedjax_mr.training import engine
from fedjax_mr.training import optimizers
from tests import helpers
from tests.algorithms import contract


def _grads(feats, onehot, w, b):
  """Mean cross-entropy gradient of the linear model at (w, b)."""
  logits = feats @ w + b
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  resid = (p - onehot) / len(feats)
  return feats.T @ resid, resid.sum(0)


@pytest.mark.parametrize('adaptive', [False, True])
def test_one_step_equals_hand_computation(adaptive):
  # One full-batch step of plain SGD from w = 0: the first gradient g gives
  # eps (SAM: rho g / |g|; ASAM at w = 0: T = eta for the kernel, 1 for the
  # bias), the step uses the gradient at eps.
  model = helpers.linear_model(num_classes=2, zero_init=True)
  data, (x, y, _) = helpers.toy_data([3], num_classes=2, seed=2)
  lr, rho, eta = 0.3, 0.5, 0.2
  local = client.LocalTraining(model, optimizers.sgd(lr), 1, 8)
  algorithm = fedasam.fedasam(local, 1, rho, eta, adaptive=adaptive)
  start = model.init(jax.random.key(0))
  out, _ = jax.jit(algorithm.client_update)(
    start, (), (), data, jnp.int32(0), jax.random.key(1)
  )
  feats = x.reshape(len(x), -1) / 255.0
  onehot = np.eye(2)[y]
  w0, b0 = np.zeros((4, 2)), np.zeros(2)
  gw, gb = _grads(feats, onehot, w0, b0)
  tw, tb = (eta, 1.0) if adaptive else (1.0, 1.0)
  norm = np.sqrt(np.sum((tw * gw) ** 2) + np.sum((tb * gb) ** 2))
  ew, eb = rho * tw**2 * gw / norm, rho * tb**2 * gb / norm
  gw1, gb1 = _grads(feats, onehot, ew, eb)
  got = out.variables['params']['Dense_0']
  helpers.assert_close(got['kernel'], -lr * gw1, rtol=1e-5)
  helpers.assert_close(got['bias'], -lr * gb1, rtol=1e-5)
  assert not np.allclose(gw1, gw)  # the perturbation mattered
  # The loss reported is the first pass's: log 2 at w = 0.
  helpers.assert_close(out.loss, np.log(2), rtol=1e-6)
  assert int(out.num_steps) == 1


def _rounds(algorithm, model, data, rounds):
  """The state after each of `rounds` engine rounds from the same init and
  key, and each round's total step count."""
  fn = jax.jit(engine.make_round_fn(algorithm, clients_per_round=4))
  state = engine.init_state(algorithm, model.init(jax.random.key(0)))
  states, steps = [], []
  for _ in range(rounds):
    state, metrics = fn(state, data, jax.random.key(4))
    states.append(jax.device_get(state))
    steps.append(int(metrics['num_steps']))
  return states, steps


@pytest.fixture(scope='module')
def toy_setup():
  model = helpers.linear_bn_model()
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  return model, data, contract.local_training(model)


@pytest.fixture(scope='module')
def fedavg_rounds(toy_setup):
  # FedAvg's three rounds, the reference of every test below (they ran it
  # once each before).
  model, data, local = toy_setup
  return _rounds(fedavg.fedavg(local, 4), model, data, 3)


@pytest.mark.slow
@pytest.mark.parametrize('adaptive', [False, True])
def test_rho_zero_is_fedavg_exactly(toy_setup, fedavg_rounds, adaptive):
  model, data, local = toy_setup
  states, steps = _rounds(
    fedasam.fedasam(local, 4, rho=0.0, adaptive=adaptive), model, data, 3
  )
  helpers.tree_equal(states[-1], fedavg_rounds[0][-1])
  assert steps == fedavg_rounds[1]


@pytest.mark.slow
def test_sharpness_aware_steps_differ_but_keep_step_counts(
  toy_setup, fedavg_rounds
):
  model, data, local = toy_setup
  runs = {'fedavg': (fedavg_rounds[0][0].server.params, fedavg_rounds[1][0])}
  for name, algorithm in (
    ('asam', fedasam.fedasam(local, 4)),
    ('sam', fedasam.fedasam(local, 4, rho=0.1, adaptive=False)),
  ):
    states, steps = _rounds(algorithm, model, data, 1)
    runs[name] = (states[0].server.params, steps[0])
  assert runs['asam'][1] == runs['sam'][1] == runs['fedavg'][1]
  for name in ('asam', 'sam'):
    diff = jax.tree.map(
      lambda a, b: float(np.abs(a - b).max()), runs[name][0], runs['fedavg'][0]
    )
    assert max(jax.tree.leaves(diff)) > 1e-4, name


def test_bad_hyper_parameters_name_their_field():
  with pytest.raises(errors.ArgumentError, match='^rho must be'):
    fedasam.fedasam(contract.LOCAL, 2, rho=-0.1)
  with pytest.raises(errors.ArgumentError, match='^eta must be'):
    fedasam.fedasam(contract.LOCAL, 2, eta=float('nan'))
  with pytest.raises(errors.ArgumentError, match='^rho must be'):
    fedasam.fedasam(contract.LOCAL, 2, rho=float('inf'), adaptive=False)
