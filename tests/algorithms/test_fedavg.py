import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.core import types
from fedjax_mr.training import client
from fedjax_mr.training import engine
from fedjax_mr.training import optimizers
from tests import helpers
from tests.algorithms import contract


@pytest.mark.parametrize('weighted', [True, False])
def test_one_round_equals_hand_computation(weighted):
  # Zero-initialised logistic regression, 2 classes: at zero weights the
  # softmax is (1/2, 1/2), so one full-batch SGD step from client k gives
  # W_k = -lr * mean_i x_i (p - e_{y_i})ᵀ and b_k = -lr * mean_i (p - e_{y_i}).
  model = helpers.linear_model(num_classes=2, zero_init=True)
  data, (x, y, parts) = helpers.toy_data([1, 3], num_classes=2, seed=4)
  lr = 0.3
  local = client.LocalTraining(model, optimizers.sgd(lr), 1, 8)
  algorithm = fedavg.fedavg(local, 2, weighted=weighted)
  round_fn = jax.jit(engine.make_round_fn(algorithm, clients_per_round=2))
  state = engine.init_state(algorithm, model.init(jax.random.key(0)))
  state, metrics = round_fn(state, data, jax.random.key(1))

  feats = x.reshape(len(x), -1) / 255.0
  kernels, biases = [], []
  for idx in parts:
    resid = 0.5 - np.eye(2)[y[idx]]  # p - onehot, [n, 2]
    kernels.append(-lr * feats[idx].T @ resid / len(idx))
    biases.append(-lr * resid.mean(0))
  w = np.array([1.0, 3.0]) if weighted else np.array([1.0, 1.0])
  w = w / w.sum()
  params = state.server.params['params']['Dense_0']
  helpers.assert_close(
    params['kernel'],
    w[0] * kernels[0] + w[1] * kernels[1],
    rtol=1e-5,
    atol=1e-7,
  )
  helpers.assert_close(
    params['bias'], w[0] * biases[0] + w[1] * biases[1], rtol=1e-5, atol=1e-7
  )
  assert int(metrics['num_examples']) == 4 and int(metrics['num_steps']) == 2
  assert sorted(np.asarray(metrics['client_ids']).tolist()) == [0, 1]
  helpers.assert_close(metrics['train_loss'], np.log(2), rtol=1e-6)


def test_dispatch_shares_one_model_and_state_exposes_params():
  variables = {'params': {'w': jnp.arange(3.0)}}
  server = fedavg.fedavg(contract.LOCAL, 4)
  state = server.init(variables)
  ids = jnp.arange(4, dtype=jnp.int32)
  sent = server.dispatch(state, ids, jnp.int32(0), jax.random.key(0))
  assert sent.per_client == ()
  np.testing.assert_array_equal(sent.shared['params']['w'], [0, 1, 2])
  out = types.ClientOutput(
    variables={
      'params': {'w': jnp.array([[1.0] * 3, [2] * 3, [3] * 3, [4] * 3])}
    },
    num_examples=jnp.array([1, 1, 1, 5]),
    loss=jnp.zeros(4),
    num_steps=jnp.ones(4, jnp.int32),
  )
  new, metrics = types.aggregate_stacked(
    server, state, out, ids, jnp.int32(0), jax.random.key(0)
  )
  helpers.assert_close(new.params['params']['w'], [26 / 8] * 3)
  # 4 models of 3 float32 down and up.
  assert metrics == {'bytes_communicated': 2 * 4 * 3 * 4}
