import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import finetune
from fedjax_mr.core import errors
from fedjax_mr.models import model as model_lib
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import registry
from fedjax_mr.training import budgets
from fedjax_mr.training import client
from fedjax_mr.training import engine
from fedjax_mr.training import optimizers
from tests import helpers
from tests.algorithms import contract

# linear_bn: Dense_0 (4 -> 6), BatchNorm_0 (6), Dense_1 (6 -> 3).
MODULES = ('Dense_0', 'BatchNorm_0', 'Dense_1')


def _setting(local, k, n, weighted=True):
  return registry.Setting(
    local, k, n, weighted, local.model.init(jax.random.key(0))
  )


def _run(algorithm, variables, data, k, rounds=2, seed=4):
  """`rounds` jitted engine rounds; (server params, metrics of each)."""
  # Stacked (stream=False): FT-Part's mean is FedAvg's stacked one.
  fn = jax.jit(
    engine.make_round_fn(algorithm, clients_per_round=k, stream=False)
  )
  state = engine.init_state(algorithm, variables)
  history = []
  for _ in range(rounds):
    state, metrics = fn(state, data, jax.random.key(seed))
    history.append(jax.device_get(metrics))
  return jax.device_get(state.server.params), history


def _bits(x):
  """The bit patterns of a float array (tells -0.0 from 0.0)."""
  x = np.asarray(x)
  return x.view(np.dtype(f'u{x.dtype.itemsize}'))


def test_modules_in_forward_order():
  # ResNet-18 calls conv1 before bn1; a traced init returns its params with
  # sorted keys (bn1 first), which the order must not follow.
  model = model_lib.get('resnet18', 10, (8, 8, 3))
  shapes = jax.eval_shape(model.init, jax.random.key(0))['params']
  assert list(shapes)[:2] == ['bn1', 'conv1']
  order = finetune.module_order(model)
  assert order[:3] == ('conv1', 'bn1', 'layer1_0') and len(order) == 11
  assert finetune.final_modules(model, 2) == ('layer4_1', 'linear')
  cnn = model_lib.get('cnn_mnist', 10, (28, 28, 1))
  assert finetune.final_modules(cnn, 2) == ('Dense_0', 'Dense_1')
  assert finetune.module_order(helpers.linear_bn_model()) == MODULES
  with pytest.raises(errors.ArgumentError, match=r'^layers must be in 1\.\.4'):
    finetune.final_modules(cnn, 5)


@pytest.mark.slow
def test_one_part_round_by_hand():
  # FT-Part with only the head (Dense_1) trainable: Dense_0 and BatchNorm_0
  # are frozen, BatchNorm in evaluation mode (its running statistics).
  # One full-batch SGD step per client, then FedAvg of the heads by
  # examples (3 and 5).
  model = helpers.linear_bn_model()
  data, (x, y, parts) = helpers.toy_data([3, 5], seed=1)
  variables = jax.device_get(model.init(jax.random.key(0)))
  variables['batch_stats'] = {
    'BatchNorm_0': {
      'mean': np.linspace(-0.3, 0.4, 6).astype(np.float32),
      'var': np.linspace(0.5, 2.0, 6).astype(np.float32),
    }
  }
  variables['params']['BatchNorm_0'] = {
    'scale': np.linspace(0.5, 1.5, 6).astype(np.float32),
    'bias': np.linspace(-0.2, 0.2, 6).astype(np.float32),
  }
  lr = 0.5
  local = client.LocalTraining(model, optimizers.sgd(lr), 1, 8)
  algorithm = finetune.ft_part(local, 2, [0, 1], ['Dense_1'])
  new, (metrics,) = _run(algorithm, variables, data, 2, rounds=1)

  p, s = variables['params'], variables['batch_stats']['BatchNorm_0']

  def loss(head, xs, ys):
    h = xs @ p['Dense_0']['kernel'] + p['Dense_0']['bias']
    bn = p['BatchNorm_0']
    h = (h - s['mean']) / jnp.sqrt(s['var'] + 1e-5) * bn['scale'] + bn['bias']
    logits = jax.nn.relu(h) @ head['kernel'] + head['bias']
    return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean()

  heads = []
  for idx in parts:
    xs = x[idx].reshape(len(idx), -1) / 255.0
    g = jax.grad(loss)(p['Dense_1'], xs, y[idx])
    heads.append(jax.tree.map(lambda w, d: w - lr * d, p['Dense_1'], g))
  expected = jax.tree.map(lambda a, b: (3 * a + 5 * b) / 8, *heads)
  helpers.assert_close(new['params']['Dense_1'], expected, rtol=1e-5, atol=1e-6)
  # The head moved; the frozen modules and the statistics did not, bit for
  # bit.
  assert not np.allclose(
    new['params']['Dense_1']['kernel'], p['Dense_1']['kernel']
  )
  for name in ('Dense_0', 'BatchNorm_0'):
    chex.assert_trees_all_equal(new['params'][name], p[name])
  chex.assert_trees_all_equal(new['batch_stats'], variables['batch_stats'])
  # Down: the whole model (Dense_0 30, BatchNorm 12 + 12 statistics,
  # Dense_1 21 floats); up: the head; 2 clients.
  assert metrics['bytes_communicated'] == 2 * 4 * (75 + 21)
  assert metrics['eligible_clients'] == 2


def test_frozen_modules_are_untouched_under_momentum():
  # Several momentum steps: the frozen Dense_0 comes back bit for bit (a
  # -0.0 entry included), the trainable tail (BatchNorm_0, Dense_1) moves
  # and its BatchNorm updates its running statistics.
  model = helpers.linear_bn_model()
  data, _ = helpers.toy_data([7, 9], seed=2)
  variables = jax.tree.map(np.array, model.init(jax.random.key(1)))
  variables['params']['Dense_0']['kernel'][0, 0] = -0.0
  local = contract.local_training(model)  # momentum 0.9, E = 2, B = 4
  algorithm = finetune.ft_part(local, 2, [0, 1], MODULES[1:])
  update = jax.jit(algorithm.client_update)
  # The optimizer keeps momentum for the tail alone (6 + 6 + 6 x 3 + 3).
  opt = finetune.frozen_optimizer(local.optimizer, {'Dense_0'})
  opt_state = opt.init(variables['params'])
  assert sum(np.size(v) for v in jax.tree.leaves(opt_state)) == 33
  for cid in (0, 1):
    out, _ = update(variables, (), (), data, jnp.int32(cid), jax.random.key(3))
    out = jax.device_get(out.variables)
    assert np.signbit(out['params']['Dense_0']['kernel'][0, 0])
    jax.tree.map(
      lambda a, b: np.testing.assert_array_equal(_bits(a), _bits(b)),
      out['params']['Dense_0'],
      variables['params']['Dense_0'],
    )
    for name in MODULES[1:]:
      for got, old in zip(
        jax.tree.leaves(out['params'][name]),
        jax.tree.leaves(variables['params'][name]),
      ):
        assert not np.allclose(got, old)
    assert not np.allclose(
      out['batch_stats']['BatchNorm_0']['mean'],
      variables['batch_stats']['BatchNorm_0']['mean'],
    )


class _Trunk(nn.Module):
  """Dense → BatchNorm → Dropout, their mode given as an attribute or as a
  call argument."""

  as_argument: bool

  @nn.compact
  def __call__(self, x, train):
    x = nn.Dense(5)(x)
    if self.as_argument:  # by keyword and by position
      x = nn.BatchNorm()(x, use_running_average=not train)
      return nn.Dropout(0.5)(x, not train)
    x = nn.BatchNorm(use_running_average=not train)(x)
    return nn.Dropout(0.5, deterministic=not train)(x)


class _TrunkHead(nn.Module):
  as_argument: bool

  @nn.compact
  def __call__(self, x, train=False, mask=None):
    del mask
    h = _Trunk(self.as_argument, name='trunk')(x.reshape(len(x), -1), train)
    return nn.Dense(3, name='head')(h)


@pytest.mark.slow
@pytest.mark.parametrize('as_argument', [False, True])
def test_frozen_modules_run_in_evaluation_mode(as_argument):
  # With the trunk frozen, a training pass is the evaluation pass: running
  # statistics, no dropout, statistics left as they are.
  model = model_lib.Model('trunk', _TrunkHead(as_argument), (2, 2, 1), 3)
  variables = model.init(jax.random.key(0))
  variables['batch_stats'] = jax.tree.map(
    lambda v: v + 0.5, variables['batch_stats']
  )
  x = jax.random.normal(jax.random.key(1), (8, 2, 2, 1))
  part = finetune.PartModel(model, frozenset({'trunk'}))
  logits, state = part.apply_train(variables, x, jax.random.key(2))
  np.testing.assert_array_equal(logits, model.apply_eval(variables, x))
  chex.assert_trees_all_equal(state, {'batch_stats': variables['batch_stats']})
  # Trainable, the trunk uses batch statistics and dropout.
  every = finetune.PartModel(model, frozenset())
  logits, state = every.apply_train(variables, x, jax.random.key(2))
  assert not np.allclose(logits, model.apply_eval(variables, x))
  assert not np.allclose(
    state['batch_stats']['trunk']['BatchNorm_0']['mean'],
    variables['batch_stats']['trunk']['BatchNorm_0']['mean'],
  )


@pytest.fixture(scope='module')
def full_run():
  """FT-Full's two rounds on the toy setup (the next two tests compare it
  with FedAvg and with FT-Part; each ran it before): the setup and
  `_run`'s result."""
  model = helpers.linear_bn_model()
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  local = contract.local_training(model)
  variables = model.init(jax.random.key(0))
  # The tiny model's step fits every default budget: all 6 are eligible.
  ft = finetune.build_full(_setting(local, 4, 6), finetune.Hparams())
  return (local, variables, data), _run(ft, variables, data, 4)


@pytest.mark.slow
def test_full_with_everyone_eligible_is_fedavg(full_run):
  (local, variables, data), (got, h_ft) = full_run
  h_ft = [dict(h) for h in h_ft]  # popped below; the fixture's stay whole
  want, h_avg = _run(fedavg.fedavg(local, 4), variables, data, 4)
  chex.assert_trees_all_equal(got, want)
  for a, b in zip(h_ft, h_avg):
    assert a.pop('eligible_clients') == 6
    chex.assert_trees_all_equal(a, b)


def test_part_training_every_module_is_full(full_run):
  (local, variables, data), (want, h_full) = full_run
  setting = _setting(local, 4, 6)
  part = finetune.build_part(setting, finetune.PartHparams(layers=3))
  got, h_part = _run(part, variables, data, 4)
  chex.assert_trees_all_equal(got, want)
  chex.assert_trees_all_equal(h_part, h_full)


def _budgets_between(m_part, m_full):
  """Budgets (GB, as flags) below FT-Part's memory, between the two, and
  above FT-Full's, for 30, 40 and 30 % of the clients."""
  gbs = [m_part / 2, (m_part + m_full) / 2, 2 * m_full]
  return ','.join(repr(b / budgets.GB) for b in gbs), '0.3,0.4,0.3'


@pytest.mark.slow
def test_eligibility_and_sampling_from_measured_memory():
  model = helpers.linear_bn_model(shape=(8, 8, 3))
  local = contract.local_training(model)
  m_full = finetune.training_memory(model, None, 32, None)
  m_part = finetune.training_memory(model, ['Dense_1'], 32, None)
  # Freezing the trunk saves at least the updated copy of its kernel.
  assert 0 < m_part < m_full
  assert m_full - m_part >= 4 * (8 * 8 * 3 * 6)
  gbs, fractions = _budgets_between(m_part, m_full)
  hp = dict(budgets_gb=gbs, budget_fractions=fractions, reference_size=0)
  n = 10
  client_budgets = budgets.client_budgets(
    n, 0, [float(g) for g in gbs.split(',')], [0.3, 0.4, 0.3]
  )
  full_ids = np.flatnonzero(client_budgets >= m_full)
  part_ids = np.flatnonzero(client_budgets >= m_part)
  assert len(full_ids) == 3 and len(part_ids) == 7
  np.testing.assert_array_equal(
    finetune.eligible_clients(client_budgets, m_full), full_ids
  )
  data, _ = helpers.toy_data([3] * n, shape=(8, 8, 3))
  setting = _setting(local, 3, n)
  algorithms = {
    'full': (finetune.build_full(setting, finetune.Hparams(**hp)), full_ids),
    'part': (
      finetune.build_part(setting, finetune.PartHparams(layers=1, **hp)),
      part_ids,
    ),
  }
  for algorithm, ids in algorithms.values():
    sample = jax.jit(algorithm.sampler)
    seen = set()
    for r in range(40):
      key = jax.random.key(r)
      got = np.asarray(sample(key, jnp.int32(r), None, data))
      assert got.dtype == np.int32 and len(set(got.tolist())) == 3
      assert set(got.tolist()) <= set(ids.tolist())
      np.testing.assert_array_equal(
        got, sample(key, jnp.int32(r + 1), None, data)
      )
      seen.update(got.tolist())
    assert seen == set(ids.tolist())  # every eligible client is drawn
  # K = 4 of the 3 clients that hold a full step: one line naming the flag.
  with pytest.raises(errors.ArgumentError) as e:
    finetune.build_full(_setting(local, 4, n), finetune.Hparams(**hp))
  message = str(e.value)
  assert message.startswith(
    'clients_per_round must be at most 3: only 3 of 10 clients'
  )
  assert '\n' not in message and "FT-Full's training step" in message
  flags = registry.flags_of('ft_full')
  assert 'ft_budgets_gb' in flags and 'ft_budget_fractions' in flags
  assert str(checks.as_config_error('ft_full', e.value)).startswith(
    '`clients_per_round` must be at most 3'
  )
  # FT-Part takes K = 7 but not 8.
  finetune.build_part(
    _setting(local, 7, n), finetune.PartHparams(layers=1, **hp)
  )
  with pytest.raises(errors.ArgumentError, match='^clients_per_round .* 7:'):
    finetune.build_part(
      _setting(local, 8, n), finetune.PartHparams(layers=1, **hp)
    )


def test_bad_hparams_name_their_flag():
  with pytest.raises(errors.ArgumentError, match='^layers must be ≥ 1'):
    finetune.PartHparams(layers=0).validate()
  with pytest.raises(errors.ArgumentError, match='^budget_fractions must'):
    finetune.Hparams(budget_fractions='0.5,0.5').validate()
  with pytest.raises(errors.ArgumentError, match='^budgets_gb must be'):
    finetune.Hparams(budgets_gb='1,x').validate()
  assert checks.field_of('ft_part', 'layers') == 'ft_layers'
  local = contract.local_training(helpers.linear_bn_model())
  with pytest.raises(errors.ArgumentError, match='^layers must be in 1..3'):
    finetune.build_part(_setting(local, 2, 4), finetune.PartHparams(layers=4))


@pytest.mark.slow
def test_part_contract_with_a_frozen_trunk():
  # Only 4 of 6 clients eligible, the head alone trains.
  contract.check_algorithm(
    lambda local, k, n: finetune.ft_part(
      local, k, [0, 2, 3, 5], ['Dense_1'], weighted=True
    ),
    rounds=2,
  )
