import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import moon
from fedjax_mr.core import errors
from fedjax_mr.models import model as model_lib
from fedjax_mr.models import projection
from fedjax_mr.training import client
from fedjax_mr.training import engine
from fedjax_mr.training import optimizers
from tests import helpers
from tests.algorithms import contract


def test_contrastive_loss_by_hand():
  z = jnp.array([[1.0, 0.0], [3.0, 4.0], [1.0, 1.0]])
  z_glob = jnp.array([[2.0, 0.0], [3.0, 4.0], [1.0, 1.0]])
  z_prev = jnp.array([[0.0, 5.0], [-3.0, -4.0], [1.0, 1.0]])
  has = jnp.array([True, True, False])
  got = moon.contrastive_loss(z, z_glob, z_prev, has, 0.5)
  # Row 0: cos 1 with the global, 0 with the previous: -log(e^2 / (e^2 +
  # e^0)). Row 1: cos 1 and -1: -log(e^2 / (e^2 + e^-2)). Row 2: no
  # previous model, no negative: 0.
  want = [
    -np.log(np.e**2 / (np.e**2 + 1)),
    -np.log(np.e**2 / (np.e**2 + np.e**-2)),
    0.0,
  ]
  helpers.assert_close(got, want, rtol=1e-6)

  # A zero representation (an all-zero ReLU layer before a zero-bias
  # projection) has cosine 0 and a finite gradient, not 0/0.
  def loss_at(z):
    return moon.contrastive_loss(z, z_glob[:1], z_prev[:1], has[:1], 0.5)[0]

  zero = jnp.zeros((1, 2))
  helpers.assert_close(loss_at(zero), np.log(2), rtol=1e-6)
  assert np.isfinite(jax.grad(loss_at)(zero)).all()


class BodyHead(nn.Module):
  """z = x W (no bias), logits = z V + c: a body with parameters."""

  @nn.compact
  def __call__(
    self, x, train=False, mask=None, *, features_only=False, from_features=False
  ):
    del train, mask
    if not from_features:
      x = nn.Dense(3, use_bias=False, name='body')(x.reshape(x.shape[0], -1))
      if features_only:
        return x
    return nn.Dense(3, name='head')(x)


def _numpy_step(w, v, c, x, y, w_glob, w_prev, mu, tau):
  """Gradient of mean_i [CE_i + mu * l_con_i] by the chain rule by hand."""
  z, zg, zp = x @ w, x @ w_glob, x @ w_prev
  logits = z @ v + c
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  r = p - np.eye(3)[y]

  def cos_and_grad(z, u):
    nz, nu = np.linalg.norm(z, axis=1), np.linalg.norm(u, axis=1)
    cos = (z * u).sum(1) / (nz * nu)
    grad = u / (nz * nu)[:, None] - (cos / nz**2)[:, None] * z
    return cos, grad

  ca, ga = cos_and_grad(z, zg)
  cb, gb = cos_and_grad(z, zp)
  sig = 1 / (1 + np.exp(-(cb - ca) / tau))
  dz = r @ v.T + mu * sig[:, None] * (gb - ga) / tau
  n = len(x)
  return x.T @ dz / n, z.T @ r / n, r.sum(0) / n


@pytest.mark.slow
def test_local_steps_equal_hand_computation():
  # Two full-batch steps of plain SGD (E = 2, B = n = 2): the first starts
  # at the global model (z = z_glob), the second does not.
  model = model_lib.Model('body_head', BodyHead(), (2, 2, 1), 3)
  data, (x, y, parts) = helpers.toy_data([2, 3], num_classes=3, seed=5)
  lr, mu, tau = 0.5, 2.0, 0.5
  local = client.LocalTraining(model, optimizers.sgd(lr), 2, 2)
  algorithm = moon.moon(local, 1, mu=mu, temperature=tau)
  start = model.init(jax.random.key(0))
  prev_vars = model.init(jax.random.key(9))
  previous = moon.PreviousModel(prev_vars, jnp.bool_(True))
  out, state = jax.jit(algorithm.client_update)(
    start, (), previous, data, jnp.int32(0), jax.random.key(1)
  )
  p = jax.tree.map(np.asarray, start['params'])
  w, v, c = p['body']['kernel'], p['head']['kernel'], p['head']['bias']
  w_glob, w_prev = w.copy(), np.asarray(prev_vars['params']['body']['kernel'])
  feats = x[parts[0]].reshape(2, -1).astype(np.float64) / 255
  for _ in range(2):
    gw, gv, gc = _numpy_step(
      w, v, c, feats, y[parts[0]], w_glob, w_prev, mu, tau
    )
    w, v, c = w - lr * gw, v - lr * gv, c - lr * gc
  got = out.variables['params']
  helpers.assert_close(got['body']['kernel'], w, rtol=2e-5, atol=1e-6)
  helpers.assert_close(got['head']['kernel'], v, rtol=2e-5, atol=1e-6)
  helpers.assert_close(got['head']['bias'], c, rtol=2e-5, atol=1e-6)
  # The new client state is the trained model.
  helpers.tree_equal(state.variables, out.variables)
  assert bool(state.valid)
  # The contrastive term moved the body: without a previous model it is 0
  # and the step is plain cross-entropy SGD.
  plain, _ = algorithm.client_update(
    start,
    (),
    previous._replace(valid=jnp.bool_(False)),
    data,
    jnp.int32(0),
    jax.random.key(1),
  )
  fedavg_out = client.make_local_update(local)(
    start, data, jnp.int32(0), jax.random.key(1)
  )
  helpers.assert_close(plain.variables, fedavg_out.variables, rtol=1e-6)
  assert not np.allclose(plain.variables['params']['body']['kernel'], w)


@pytest.mark.slow
def test_mu_zero_is_fedavg_exactly():
  # On 2 devices, with previous models stored per client (the contract:
  # test_registry).
  model = projection.with_projection(helpers.linear_bn_model(), 4)
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  local = contract.local_training(model)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('c',))
  states, history = [], []
  for algorithm in (moon.moon(local, 4, mu=0.0), fedavg.fedavg(local, 4)):
    fn = helpers.program_jit(
      engine.make_round_fn(algorithm, clients_per_round=4, mesh=mesh)
    )
    state = engine.init_state(algorithm, model.init(jax.random.key(0)), 6)
    for _ in range(3):
      state, metrics = fn(state, data, jax.random.key(4))
      history.append(jax.device_get(metrics))
    states.append(jax.device_get(state))
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(states[0]))
  helpers.tree_equal(states[0].server, states[1].server)
  # The sampled clients now hold a previous model.
  ids = history[2]['client_ids']
  assert states[0].clients.valid[ids].all()
  # MOON sends and receives what FedAvg does: K models each way (the
  # projected network: body, two projection layers, head; batch stats).
  params = 4 * 6 + 6 + 2 * 6 + 6 * 6 + 6 + 6 * 4 + 4 + 4 * 3 + 3
  assert history[0]['bytes_communicated'] == 2 * 4 * (params + 2 * 6) * 4


@pytest.mark.slow
def test_projection_head_shapes_and_split():
  base = model_lib.get('cnn_mnist', 10, (28, 28, 1))
  model = projection.with_projection(base, 256)
  v = model.init(jax.random.key(0))
  assert list(v['params']) == [
    'encoder',
    'projection_1',
    'projection_2',
    'head',
  ]
  # The encoder is the zoo body without its output layer.
  assert 'Dense_2' not in v['params']['encoder']
  # cnn_mnist's body ends in fc50.
  assert v['params']['projection_1']['kernel'].shape == (50, 50)
  assert v['params']['projection_2']['kernel'].shape == (50, 256)
  assert v['params']['head']['kernel'].shape == (256, 10)
  assert model.feature_dim() == 256
  x = jax.random.normal(jax.random.key(1), (3, 28, 28, 1))
  logits, z, _ = model.apply_train_features(v, x, jax.random.key(2))
  np.testing.assert_array_equal(logits, model.apply_eval(v, x))
  np.testing.assert_array_equal(z, model.apply_features(v, x))
  helpers.assert_close(model.apply_head(v, z), logits, rtol=1e-6)


def test_bad_hparams_name_the_field():
  with pytest.raises(errors.ArgumentError, match='^mu must be'):
    moon.moon(contract.LOCAL, 4, mu=-1.0)
  with pytest.raises(errors.ArgumentError, match='^temperature must be'):
    moon.moon(contract.LOCAL, 4, temperature=0.0)
  with pytest.raises(errors.ArgumentError, match='^projection_dim must be'):
    moon.Hparams(projection_dim=-1).validate()
