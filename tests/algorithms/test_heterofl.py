import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import heterofl
from fedjax_mr.core import errors
from fedjax_mr.core import types
from fedjax_mr.models import model as model_lib
from fedjax_mr.training import budgets
from tests import helpers
from tests.algorithms import contract

RATES = (1.0, 0.5, 0.25)


def _masks(params, rate_index, rates=RATES):
  lay = heterofl.layout(params)
  masks = jax.jit(lambda i: heterofl.masks(lay, rates, i))
  return jax.device_get(masks(jnp.int32(rate_index)))


def test_masks_by_hand():
  # Conv 1->4 channels, a Dense on the flattened 2x1x4 map (8 features,
  # channel fastest), a hidden Dense of 5 and the head of 2 classes.
  params = {
    'Conv_0': {'kernel': jnp.zeros((3, 3, 1, 4)), 'bias': jnp.zeros(4)},
    'BatchNorm_0': {'scale': jnp.zeros(4), 'bias': jnp.zeros(4)},
    'Dense_0': {'kernel': jnp.zeros((8, 5)), 'bias': jnp.zeros(5)},
    'Dense_1': {'kernel': jnp.zeros((5, 2)), 'bias': jnp.zeros(2)},
  }
  m = _masks(params, 1)  # rate 1/2: 2 of 4 channels, 3 of 5 units
  np.testing.assert_array_equal(m['Conv_0']['kernel'][0, 0, 0], [1, 1, 0, 0])
  np.testing.assert_array_equal(m['Conv_0']['bias'], [1, 1, 0, 0])
  np.testing.assert_array_equal(m['BatchNorm_0']['scale'], [1, 1, 0, 0])
  np.testing.assert_array_equal(
    m['Dense_0']['kernel'],
    np.outer([1, 1, 0, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0]),
  )
  np.testing.assert_array_equal(m['Dense_0']['bias'], [1, 1, 1, 0, 0])
  np.testing.assert_array_equal(
    m['Dense_1']['kernel'], np.outer([1, 1, 1, 0, 0], [1, 1])
  )
  np.testing.assert_array_equal(m['Dense_1']['bias'], [1, 1])
  m = _masks(params, 2)  # rate 1/4: ceil(1) = 1 channel, ceil(1.25) = 2
  np.testing.assert_array_equal(m['BatchNorm_0']['bias'], [1, 0, 0, 0])
  np.testing.assert_array_equal(m['Dense_0']['bias'], [1, 1, 0, 0, 0])
  assert all(np.all(x == 1) for x in jax.tree.leaves(_masks(params, 0)))
  assert heterofl.width(0.1, 50) == 5 and heterofl.width(0.01, 8) == 1


def _algorithm(client_rates, weighted=False, masked_loss=False):
  local = contract.local_training(helpers.linear_bn_model())
  return heterofl.heterofl(
    local,
    len(client_rates),
    client_rates,
    RATES,
    masked_loss=masked_loss,
    weighted=weighted,
  )


@pytest.mark.slow
def test_one_aggregation_by_hand():
  # linear_bn: Dense_0 4->6, BatchNorm(6), Dense_1 6->3. Rates 1, 1/2,
  # 1/4 hold 6, 3 and 2 of the 6 hidden channels.
  model = helpers.linear_bn_model()
  variables = jax.device_get(jax.jit(model.init)(jax.random.key(0)))
  algorithm = _algorithm([0, 1, 2])
  state = algorithm.init(variables)
  value = np.array([1.0, 2.0, 4.0])  # client k uploads value[k] everywhere

  def outputs(ids):
    k = len(ids)
    return types.ClientOutput(
      variables=jax.tree.map(
        lambda v: np.multiply.outer(value[ids], np.ones_like(v)), variables
      ),
      num_examples=np.array([1, 1, 2][:k], np.int32),
      loss=np.zeros(k, np.float32),
      num_steps=np.ones(k, np.int32),
      extra=jax.tree.map(
        lambda s: np.stack([s + i for i in range(k)]),
        variables['batch_stats'],
      ),
    )

  ids = jnp.array([0, 1, 2])
  new, metrics = jax.jit(algorithm.aggregate)(
    state, outputs([0, 1, 2]), ids, jnp.int32(0), jax.random.key(0)
  )
  bn = new.params['params']['BatchNorm_0']['scale']
  helpers.assert_close(bn, [7 / 3, 7 / 3, 3 / 2, 1, 1, 1], rtol=1e-6)
  head = new.params['params']['Dense_1']['kernel']
  helpers.assert_close(head[:, 0], [7 / 3, 7 / 3, 3 / 2, 1, 1, 1])
  helpers.assert_close(new.params['params']['Dense_1']['bias'], 7 / 3)
  # The queried statistics: the example-weighted mean (weights 1, 1, 2).
  mean = variables['batch_stats']['BatchNorm_0']['mean']
  helpers.assert_close(
    new.queried['batch_stats']['BatchNorm_0']['mean'], mean + 5 / 4
  )
  # bytes: each client's sub-model (Dense_0 4x6+6, BN 2x6, Dense_1 6x3+3)
  # down and up, float32: rate 1: 63, rate 1/2: 15+6+12 = 33, rate 1/4:
  # 8+2+4+6+3 = 23.
  assert metrics['bytes_communicated'] == 2 * 4 * (63 + 33 + 23)
  # Only the rates 1/2 and 1/4 (weighted by examples 1 and 2): channels
  # 3-5 are held by no one and keep their value.
  algorithm = _algorithm([0, 1, 2], weighted=True)
  new, _ = jax.jit(algorithm.aggregate)(
    state,
    jax.tree.map(lambda x: x[1:], outputs([0, 1, 2])),
    np.array([1, 2], np.int32),
    jnp.int32(0),
    jax.random.key(0),
  )
  bn = new.params['params']['BatchNorm_0']['scale']
  old = variables['params']['BatchNorm_0']['scale']
  helpers.assert_close(bn[:3], [(2 + 4 * 2) / 3] * 2 + [2.0])
  np.testing.assert_array_equal(bn[3:], old[3:])
  # No client has rate 1: the evaluated model is the rate-1/2 sub-model.
  algorithm = _algorithm([1, 2])
  got = jax.jit(algorithm.evaluated)(algorithm.init(variables))['params']
  scale = got['BatchNorm_0']['scale']
  np.testing.assert_array_equal(scale, np.r_[old[:3], 0, 0, 0])


class Tiny(nn.Module):
  """conv(c) → scaler → BN → ReLU → flatten → dense(u) → scaler → ReLU →
  dense(3): HeteroFL's narrow network at `rate` when c, u are narrow."""

  channels: int = 4
  units: int = 5
  rate: float = 1.0

  @nn.compact
  def __call__(self, x, train=False, mask=None, **kwargs):
    del kwargs
    h = nn.Conv(self.channels, (3, 3))(x) / self.rate
    h = nn.BatchNorm(use_running_average=not train)(h)
    h = nn.relu(h).reshape(h.shape[0], -1)
    h = nn.relu(nn.Dense(self.units)(h) / self.rate)
    return nn.Dense(3)(h)


def _cut(params, keep):
  """The narrow network's parameters: the first 2 channels and 3 units."""
  return {
    'Conv_0': {
      'kernel': params['Conv_0']['kernel'][..., :2],
      'bias': params['Conv_0']['bias'][:2],
    },
    'BatchNorm_0': jax.tree.map(lambda v: v[:2], params['BatchNorm_0']),
    'Dense_0': {
      'kernel': params['Dense_0']['kernel'][keep, :3],
      'bias': params['Dense_0']['bias'][:3],
    },
    'Dense_1': {
      'kernel': params['Dense_1']['kernel'][:3],
      'bias': params['Dense_1']['bias'],
    },
  }


@pytest.mark.slow
def test_masked_network_is_the_narrow_network():
  full = model_lib.Model('tiny', Tiny(), (2, 2, 1), 3)
  narrow = model_lib.Model('tiny', Tiny(2, 3, 0.5), (2, 2, 1), 3)
  keep = np.arange(16) % 4 < 2  # flattened 2x2x4 features of 2 channels
  x = jax.random.normal(jax.random.key(3), (6, 2, 2, 1))
  y = jnp.array([0, 1, 2, 0, 1, 2])
  key = jax.random.key(0)

  def loss(model, p, others):
    logits, _ = model.apply_train({'params': p, **others}, x, key)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return ce.mean(), logits

  @jax.jit
  def both():
    variables = full.init(jax.random.key(1))
    params = jax.tree.map(  # noise, so that BN scales and biases matter
      lambda p: p + 0.1 * jax.random.normal(jax.random.key(2), p.shape),
      variables['params'],
    )
    lay = heterofl.layout(params)
    info = {'rate_index': jnp.int32(1), 'labels': jnp.ones(3, jnp.bool_)}
    sub = heterofl.WidthModel(full, lay, RATES)
    others = {'batch_stats': variables['batch_stats'], 'heterofl': info}
    grad = jax.value_and_grad(loss, argnums=1, has_aux=True)
    stats = jax.tree.map(lambda v: v[:2], variables['batch_stats'])
    return (
      grad(sub, params, others),
      grad(narrow, _cut(params, keep), {'batch_stats': stats}),
      heterofl.masks(lay, RATES, jnp.int32(1)),
    )

  ((l_full, z_full), g), ((l_cut, z_cut), g_cut), mask = jax.device_get(both())
  helpers.assert_close(z_full, z_cut, rtol=1e-5, atol=1e-6)
  helpers.assert_close(l_full, l_cut, rtol=1e-6)
  # The same gradient on the kept entries, none outside the sub-model.
  helpers.assert_close(_cut(g, keep), g_cut, rtol=1e-5, atol=1e-6)
  jax.tree.map(
    lambda gl, m: np.testing.assert_array_equal(gl[m == 0], 0), g, mask
  )


@pytest.mark.slow
def test_query_statistics_is_the_data_statistics():
  model = helpers.linear_bn_model()
  variables = model.init(jax.random.key(0))
  data, (x, _, parts) = helpers.toy_data([5, 3])
  query = jax.jit(heterofl.query_statistics, static_argnums=(0, 4))
  got = query(model, variables, data, jnp.int32(0), 8)
  p = variables['params']['Dense_0']
  h = (x[parts[0]].reshape(5, -1) / 255.0) @ p['kernel'] + p['bias']
  bn = got['BatchNorm_0']
  helpers.assert_close(bn['mean'], h.mean(0), rtol=1e-4, atol=1e-6)
  helpers.assert_close(bn['var'], h.var(0), rtol=1e-3, atol=1e-6)
  # All clients: their example-weighted mean (client 1 in one batch too).
  final = jax.jit(heterofl.data_statistics, static_argnums=(0, 3))
  got_all = final(model, variables, data, 8)['batch_stats']['BatchNorm_0']
  h1 = (x[parts[1]].reshape(3, -1) / 255.0) @ p['kernel'] + p['bias']
  helpers.assert_close(
    got_all['mean'], (5 * h.mean(0) + 3 * h1.mean(0)) / 8, rtol=1e-4
  )


def test_rates_from_budgets():
  gb = budgets.GB
  memory = [5 * gb, 2.5 * gb, 1.2 * gb, 0.6 * gb, 0.3 * gb]
  client_budgets = np.array([0.2, 1, 2, 4, 8, 1.2]) * gb
  got = heterofl.assign_rates(
    client_budgets.astype(np.int64), heterofl.PAPER_RATES, memory
  )
  # 0.2 GB fits none: the smallest rate.
  np.testing.assert_array_equal(got, [4, 3, 2, 1, 0, 2])


def test_narrow_model_is_narrow():
  model = model_lib.get('cnn_mnist', 10, (28, 28, 1))
  narrow = heterofl.narrow_model(model, 0.25)
  params = jax.eval_shape(narrow.init, jax.random.key(0))['params']
  # conv 1->5, conv 5->13, dense 4*4*13->13, head 13->10.
  assert jax.tree.map(lambda v: v.shape, params) == {
    'inner': {
      'Conv_0': {'kernel': (5, 5, 1, 5), 'bias': (5,)},
      'Conv_1': {'kernel': (5, 5, 5, 13), 'bias': (13,)},
      'Dense_0': {'kernel': (208, 13), 'bias': (13,)},
      'Dense_1': {'kernel': (13, 10), 'bias': (10,)},
    }
  }
  # ResNet-18: the blocks narrow their planes (no shortcut appears where
  # the full network has none), every layer is cut to ceil(planes / 4).
  model = model_lib.get('resnet18', 10, (8, 8, 3))
  full = jax.eval_shape(model.init, jax.random.key(0))['params']
  narrow = heterofl.narrow_model(model, 0.25)
  cut = jax.eval_shape(narrow.init, jax.random.key(0))['params']['inner']
  assert jax.tree.structure(cut) == jax.tree.structure(full)
  lay = heterofl.layout(full)
  expected = jax.tree.map(
    lambda leaf: tuple(
      a.size if a.kind == 'whole' else heterofl.width(0.25, a.size)
      for a in leaf.axes
    ),
    lay,
    is_leaf=lambda x: isinstance(x, heterofl.LeafLayout),
  )
  assert jax.tree.map(lambda v: v.shape, cut) == expected


@pytest.mark.slow
def test_all_rates_one_is_fedavg():
  model = helpers.linear_bn_model()
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  local = contract.local_training(model)
  algorithms = (
    heterofl.heterofl(local, 4, [0] * 6, RATES, False, weighted=True),
    fedavg.fedavg(local, 4),
  )
  states = [
    s['params'] for s in contract.server_params_after(algorithms, model, data)
  ]
  # Equal up to the order of the sums of the two means.
  helpers.assert_close(states[0], states[1], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_contract():
  history = contract.check_algorithm(
    lambda local, k, n: heterofl.heterofl(
      local, k, np.arange(n) % 3, RATES, masked_loss=True
    ),
    rounds=2,
  )
  rates = np.asarray(RATES, np.float32)[np.arange(6) % 3]
  for h in history:  # of the sampled clients
    assert h['mean_rate'] == np.mean(rates[h['client_ids']])


def test_bad_hparams_name_their_flag():
  with pytest.raises(errors.ArgumentError, match='^rates must'):
    heterofl.Hparams(rates='1,0').validate()
  with pytest.raises(errors.ArgumentError, match='^budget_fractions'):
    heterofl.Hparams(budget_fractions='0.5,0.5').validate()
