import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_mr.algorithms import scaffold
from fedjax_mr.core import errors
from fedjax_mr.training import client
from fedjax_mr.training import engine
from fedjax_mr.training import optimizers
from tests import helpers
from tests.algorithms import contract

SIZES = [3, 4, 2]
# Round 0 samples clients 0 and 1, round 1 clients 1 and 2: client 1 is
# sampled twice and must start round 1 from its updated control.
SCHEDULE = np.array([[0, 1], [1, 2]], np.int32)


def _scheduled(key, round_index, server_state, data):
  del key, server_state, data
  return jnp.asarray(SCHEDULE)[round_index]


def _softmax_grads(w, b, feats, labels):
  logits = feats @ w + b
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  resid = p - np.eye(w.shape[1])[labels]
  return feats.T @ resid / len(labels), resid.mean(0)


def _reference(w, b, feats, y, parts, lr, epochs, eta_g, beta, divisor):
  """SCAFFOLD option II in plain NumPy (full-batch local steps, heavy-ball
  momentum `beta` with a fresh buffer per client and round; the control
  update divides x - y by lr * divisor)."""
  n = len(parts)
  c = [np.zeros_like(w), np.zeros_like(b)]
  c_i = [[np.zeros_like(w), np.zeros_like(b)] for _ in range(n)]
  for ids in SCHEDULE:
    dys, dcs = [], []
    for i in ids:
      yw, yb = w.copy(), b.copy()
      vw, vb = np.zeros_like(w), np.zeros_like(b)
      for _ in range(epochs):  # one full batch per epoch
        gw, gb = _softmax_grads(yw, yb, feats[parts[i]], y[parts[i]])
        vw = beta * vw + (gw - c_i[i][0] + c[0])
        vb = beta * vb + (gb - c_i[i][1] + c[1])
        yw, yb = yw - lr * vw, yb - lr * vb
      new = [
        c_i[i][0] - c[0] + (w - yw) / (divisor * lr),
        c_i[i][1] - c[1] + (b - yb) / (divisor * lr),
      ]
      dys.append((yw - w, yb - b))
      dcs.append((new[0] - c_i[i][0], new[1] - c_i[i][1]))
      c_i[i] = new
    w = w + eta_g * np.mean([d[0] for d in dys], 0)
    b = b + eta_g * np.mean([d[1] for d in dys], 0)
    c = [c[0] + sum(d[0] for d in dcs) / n, c[1] + sum(d[1] for d in dcs) / n]
  return w, b, c, c_i


# (momentum, control_steps, divisor of lr in the control update for 3
# steps): at momentum 0 'effective' is the paper's steps_i = 3 ('taken'
# runs the same arithmetic there); with momentum 0.5 'effective' is
# S(3) = 1 + 1.5 + 1.75 = 4.25.
CASES = [(0.0, 'effective', 3), (0.5, 'effective', 4.25), (0.5, 'taken', 3)]


@pytest.mark.parametrize('beta,steps,divisor', CASES)
def test_two_rounds_equal_a_plain_python_reference(beta, steps, divisor):
  model = helpers.linear_model(num_classes=3)
  data, (x, y, parts) = helpers.toy_data(SIZES, num_classes=3, seed=5)
  lr, epochs, eta_g = 0.5, 3, 0.7
  # Batch 8 >= every client: one full batch per epoch, so the order of the
  # examples does not matter and steps_i = epochs.
  opt = optimizers.sgd(lr, beta)
  local = client.LocalTraining(model, opt, epochs, 8)
  algorithm = scaffold.scaffold(
    local,
    2,
    3,
    control_steps=steps,
    server_optimizer=optimizers.sgd(eta_g),
  )._replace(sampler=_scheduled)
  variables = model.init(jax.random.key(0))
  state = engine.init_state(algorithm, variables, 3)
  fn = jax.jit(engine.make_round_fn(algorithm, clients_per_round=2))
  for r in range(2):
    state, metrics = fn(state, data, jax.random.key(9))
    np.testing.assert_array_equal(metrics['client_ids'], SCHEDULE[r])
  dense = variables['params']['Dense_0']
  w, b, c, c_i = _reference(
    np.asarray(dense['kernel'], np.float64),
    np.asarray(dense['bias'], np.float64),
    x.reshape(len(x), -1) / 255.0,
    y,
    parts,
    lr,
    epochs,
    eta_g,
    beta,
    divisor,
  )
  got = state.server.params['params']['Dense_0']
  helpers.assert_close(got['kernel'], w, rtol=1e-5, atol=1e-6)
  helpers.assert_close(got['bias'], b, rtol=1e-5, atol=1e-6)
  control = state.server.control['Dense_0']
  helpers.assert_close(control['kernel'], c[0], rtol=1e-4, atol=1e-5)
  helpers.assert_close(control['bias'], c[1], rtol=1e-4, atol=1e-5)
  for i in range(3):
    row = state.clients['Dense_0']
    helpers.assert_close(row['kernel'][i], c_i[i][0], atol=1e-5)
    helpers.assert_close(row['bias'][i], c_i[i][1], atol=1e-5)
  assert np.abs(c_i[1][0]).sum() > 0  # client 1's control moved twice
  # The server control is the mean of the clients' controls.
  helpers.assert_close(
    control['kernel'], np.mean(state.clients['Dense_0']['kernel'], 0), atol=1e-6
  )
  # x and c down, y and dc up, for K = 2 clients: 4 model-sized tensors each.
  assert float(metrics['bytes_communicated']) == 2 * 2 * 2 * (4 * 3 + 3) * 4


@pytest.mark.parametrize('beta', [0.0, 0.5, 0.9, 0.99])
def test_effective_steps_is_the_distance_momentum_travels(beta):
  """n heavy-ball steps on a constant gradient move as far as S(n) plain
  steps."""
  for n in [1, 2, 7, 60]:
    v = w = 0.0
    for _ in range(n):
      v = beta * v + 1.0
      w -= v
    got = float(scaffold.effective_steps(jnp.int32(n), beta))
    assert got == pytest.approx(-w, rel=1e-5), n
  assert float(scaffold.effective_steps(jnp.int32(7), 0.0)) == 7


def test_zero_controls_first_round_is_plain_local_sgd():
  """With c = c_i = 0 the first round's clients train as FedAvg's do (the
  server step differs: a plain mean times eta_g)."""
  model = helpers.linear_model()
  data, _ = helpers.toy_data([5, 9, 3, 12])
  local = client.LocalTraining(model, optimizers.sgd(0.2), 2, 4)
  variables = model.init(jax.random.key(0))
  zeros = jax.tree.map(jnp.zeros_like, variables['params'])
  algorithm = scaffold.scaffold(local, 4, 4)
  out, c_new = algorithm.client_update(
    (variables, zeros), (), zeros, data, jnp.int32(1), jax.random.key(3)
  )
  plain = client.make_local_update(local)(
    variables, data, jnp.int32(1), jax.random.key(3)
  )
  helpers.tree_equal(out.variables, plain.variables)
  # c_i+ = (x - y) / (steps * lr), and it is uploaded as dc.
  steps = int(out.num_steps)
  assert steps == 2 * 3
  expected = jax.tree.map(
    lambda a, b: (a - b) / (steps * 0.2),
    variables['params'],
    plain.variables['params'],
  )
  helpers.assert_close(c_new, expected, rtol=1e-5, atol=1e-7)
  helpers.assert_close(out.extra, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_contract_with_bfloat16_controls():
  # float32 controls (the default) meet the contract in test_registry's
  # test_every_registered_algorithm_meets_the_contract[scaffold]; their
  # norms: test_bfloat16_controls_halve_memory_and_keep_the_mean.
  history = contract.check_algorithm(
    lambda local, k, n: scaffold.scaffold(local, k, n, control_dtype='bfloat16')
  )
  assert all(m['control_norm'] > 0 for m in history)


@pytest.mark.slow
def test_bfloat16_controls_halve_memory_and_keep_the_mean():
  model = helpers.linear_bn_model()
  local = contract.local_training(model)
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  variables = model.init(jax.random.key(0))
  sizes = {}
  for dtype in ('float32', 'bfloat16'):
    algorithm = scaffold.scaffold(local, 3, 6, control_dtype=dtype)
    state = engine.init_state(algorithm, variables, 6)
    sizes[dtype] = sum(x.nbytes for x in jax.tree.leaves(state.clients))
    fn = jax.jit(engine.make_round_fn(algorithm, clients_per_round=3))
    for _ in range(3):
      state, metrics = fn(state, data, jax.random.key(1))
      assert metrics['control_norm'] > 0
    # c stays the mean of the stored c_i (dc is taken from stored values).
    helpers.assert_close(
      state.server.control,
      jax.tree.map(lambda v: jnp.mean(v.astype(jnp.float32), 0), state.clients),
      rtol=1e-4,
      atol=1e-6,
    )
  assert sizes['bfloat16'] * 2 == sizes['float32']
  # 30 + 12 + 21 params (no batch statistics) for each of N = 6 clients.
  assert sizes['float32'] == 6 * 63 * 4


def test_bad_arguments_are_named():
  with pytest.raises(errors.ArgumentError, match='^control_dtype'):
    scaffold.scaffold(contract.LOCAL, 2, 4, control_dtype='int8')
  # The control update needs the client's SGD rate: an optimizer that does
  # not say it (a plain optax one, or Adam) is refused, named.
  for opt in (optax.sgd(0.1), optimizers.adam(0.1)):
    with pytest.raises(errors.ArgumentError, match='^optimizer must be sgd'):
      scaffold.scaffold(contract.LOCAL._replace(optimizer=opt), 2, 4)


def test_the_client_rate_and_momentum_come_from_the_optimizer():
  """One optimizer object, no copies: the control update divides by the
  rate and the momentum-aware steps of the optimizer the clients run."""
  model = helpers.linear_model()
  data, _ = helpers.toy_data([5, 9, 3, 12])
  variables = model.init(jax.random.key(0))
  zeros = jax.tree.map(jnp.zeros_like, variables['params'])
  for lr, beta in ((0.2, 0.0), (0.1, 0.9)):
    local = client.LocalTraining(model, optimizers.sgd(lr, beta), 2, 4)
    out, c_new = scaffold.scaffold(local, 4, 4).client_update(
      (variables, zeros), (), zeros, data, jnp.int32(1), jax.random.key(3)
    )
    s = scaffold.effective_steps(out.num_steps, beta)
    expected = jax.tree.map(
      lambda a, b: (a - b) / (s * lr),
      variables['params'],
      out.variables['params'],
    )
    helpers.assert_close(c_new, expected, rtol=1e-5, atol=1e-7)
