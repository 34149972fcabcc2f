import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import fedprox
from fedjax_mr.core import errors
from fedjax_mr.training import client
from fedjax_mr.training import engine
from fedjax_mr.training import optimizers
from tests import helpers
from tests.algorithms import contract


def test_one_step_equals_hand_computation():
  # Zero start, 2 classes: the cross-entropy gradient at w = 0 is
  # X^T (1/2 - onehot) / n; the proximal term adds mu (w - g) = -mu g.
  model = helpers.linear_model(num_classes=2, zero_init=True)
  data, (x, y, parts) = helpers.toy_data([3], num_classes=2, seed=2)
  lr, mu = 0.3, 0.7
  local = client.LocalTraining(model, optimizers.sgd(lr), 1, 8)
  update = client.make_local_update(local, loss_term=fedprox.proximal_term(mu))
  start = model.init(jax.random.key(0))
  centre = jax.tree.map(lambda v: v + 0.25, start)
  out = jax.jit(update)(start, data, jnp.int32(0), jax.random.key(1), centre)
  feats = x.reshape(len(x), -1) / 255.0
  resid = 0.5 - np.eye(2)[y]
  grad_w = feats.T @ resid / 3 + mu * (0 - 0.25)
  grad_b = resid.mean(0) + mu * (0 - 0.25)
  got = out.variables['params']['Dense_0']
  helpers.assert_close(got['kernel'], -lr * grad_w, rtol=1e-5)
  helpers.assert_close(got['bias'], -lr * grad_b, rtol=1e-5)
  # The reported loss is the task loss alone.
  helpers.assert_close(out.loss, np.log(2), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize('devices', [1, 2])
def test_mu_zero_is_fedavg_exactly(devices):
  model = helpers.linear_bn_model()
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  local = contract.local_training(model)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ('c',))
  states, sent = [], []
  for algorithm in (fedprox.fedprox(local, 4, mu=0.0), fedavg.fedavg(local, 4)):
    fn = helpers.program_jit(
      engine.make_round_fn(
        algorithm, clients_per_round=4, mesh=mesh if devices > 1 else None
      )
    )
    state = engine.init_state(algorithm, model.init(jax.random.key(0)))
    for _ in range(3):
      state, metrics = fn(state, data, jax.random.key(4))
      sent.append(float(metrics['bytes_communicated']))
    states.append(jax.device_get(state))
  helpers.tree_equal(states[0], states[1])
  # Dense 4->6, BatchNorm scale/bias and mean/var of 6, Dense 6->3, in
  # float32: 75 numbers a model, K = 4 down and 4 up. (The rest of the
  # contract, on FedProx with mu > 0: test_registry's
  # test_every_registered_algorithm_meets_the_contract[fedprox].)
  assert sent[:3] == [2 * 4 * 75 * 4] * 3


@pytest.mark.slow
def test_mu_pulls_towards_the_global_model():
  model = helpers.linear_model()
  data, _ = helpers.toy_data([40, 40])
  local = client.LocalTraining(model, optimizers.sgd(0.05), 5, 4)
  start = model.init(jax.random.key(0))
  dist = []
  for mu in (0.0, 1.0, 5.0):
    update = client.make_local_update(
      local, loss_term=fedprox.proximal_term(mu)
    )
    out = update(start, data, jnp.int32(0), jax.random.key(1), start)
    diff = jax.tree.map(lambda a, b: a - b, out.variables, start)
    dist.append(float(optax.global_norm(diff)))
  assert dist[0] > dist[1] > dist[2] > 0


def test_bad_mu_names_it():
  with pytest.raises(errors.ArgumentError, match='^mu must be'):
    fedprox.fedprox(contract.LOCAL, 4, mu=-0.1)
  with pytest.raises(ValueError, match='mu must be finite'):
    fedprox.fedprox(contract.LOCAL, 4, mu=float('nan'))
