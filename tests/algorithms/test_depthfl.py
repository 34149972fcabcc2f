import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import depthfl
from fedjax_mr.algorithms import fedavg
from fedjax_mr.core import errors
from fedjax_mr.models import model as model_lib
from fedjax_mr.models import multi_exit
from fedjax_mr.training import budgets
from tests import helpers
from tests.algorithms import contract


class TinyMultiExit(nn.Module):
  """Two stages (Dense → masked BatchNorm → ReLU), an exit after each:
  the naming of `multi_exit` (layer{i}_0, exit{i}) on a network that
  compiles fast."""

  num_classes: int = 3
  depth: int = 0
  inference: str = 'ensemble'

  def num_stages(self):
    return self.depth or 2

  @nn.compact
  def __call__(self, x, train=False, mask=None, *, all_exits=False):
    h = x.reshape(x.shape[0], -1)
    m = None if mask is None else (mask[:, None] > 0)
    exits = []
    for i in range(self.num_stages()):
      h = nn.Dense(4, name=f'layer{i + 1}_0')(h)
      bn = nn.BatchNorm(not train, momentum=0.8, name=f'layer{i + 1}_1')
      h = nn.relu(bn(h, mask=m))
      exits.append(nn.Dense(self.num_classes, name=f'exit{i + 1}')(h))
    z = jnp.stack(exits, axis=1)
    if all_exits:
      return z
    return z[:, -1] if self.inference == 'last' else z.mean(axis=1)


def tiny(inference='ensemble'):
  return model_lib.Model(
    'tiny_multi_exit', TinyMultiExit(inference=inference), (2, 2, 1), 3
  )


_distil = jax.jit(depthfl.self_distillation, static_argnums=3)


def _kl(p, q):
  return float(np.sum(p * (np.log(p) - np.log(q))))


def _softmax(z):
  e = np.exp(z - z.max())
  return e / e.sum()


def test_self_distillation_by_hand():
  # One example, 3 exits, 2 classes, T = 2; the client holds exits 1, 2.
  z = np.array([[[1.0, -1.0], [0.5, 0.0], [3.0, 1.0]]], np.float32)
  t = 2.0
  q = [_softmax(z[0, i] / t) for i in range(3)]
  on = jnp.array([1.0, 1.0, 0.0])
  got = _distil(jnp.asarray(z), on, on, t)
  want = t * t * (_kl(q[1], q[0]) + _kl(q[0], q[1])) / 1
  helpers.assert_close(got, [want], rtol=1e-5)
  # All three exits: each learns from the two others, divided by 2.
  on3 = jnp.ones(3)
  got = _distil(jnp.asarray(z), on3, on3, t)
  want = sum(_kl(q[j], q[i]) for i in range(3) for j in range(3) if i != j)
  helpers.assert_close(got, [t * t * want / 2], rtol=1e-5)
  # Only the deepest exit learns (extended=False): KL towards the others.
  students, teachers = depthfl.exit_masks(jnp.int32(3), 3, extended=False)
  got = _distil(jnp.asarray(z), students, teachers, t)
  want = t * t * (_kl(q[0], q[2]) + _kl(q[1], q[2])) / 2
  helpers.assert_close(got, [want], rtol=1e-5)
  # One exit: nothing to distil.
  one = jnp.array([1.0, 0.0, 0.0])
  assert float(_distil(jnp.asarray(z), one, one)[0]) == 0


def test_distillation_gradient_reaches_only_the_student():
  z = jnp.array([[[1.0, -1.0], [0.5, 0.0]]])
  students = jnp.array([0.0, 1.0])
  g = jax.grad(lambda z: _distil(z, students, jnp.ones(2))[0])(z)
  assert float(jnp.abs(g[0, 0]).sum()) == 0  # the teacher is detached
  assert float(jnp.abs(g[0, 1]).sum()) > 0


def test_masked_aggregation_by_hand():
  # Leaves of depth 1 (stem, exit1) and 2 (layer2_0, exit2).
  glob = {
    'params': {
      'conv1': jnp.array([0.0]),
      'exit1': jnp.array([0.0]),
      'layer2_0': {'conv1': jnp.array([9.0])},
      'exit2': jnp.array([9.0]),
    }
  }
  clients = jax.tree.map(
    lambda g: jnp.stack([g + 1, g + 2, g + 4]).astype(jnp.float32), glob
  )
  weights = jnp.array([1, 3, 4])
  depths = jnp.array([1, 2, 1])
  got = depthfl.masked_mean(clients, glob, depths, weights)
  # Depth 1: all three, (1*1 + 3*2 + 4*4) / 8; depth 2: client 1 alone.
  helpers.assert_close(got['params']['conv1'], [23 / 8])
  helpers.assert_close(got['params']['exit1'], [23 / 8])
  helpers.assert_close(got['params']['layer2_0']['conv1'], [11.0])
  helpers.assert_close(got['params']['exit2'], [11.0])
  # Nobody holds depth 2: those leaves keep their global values.
  got = depthfl.masked_mean(clients, glob, jnp.array([1, 1, 1]))
  helpers.assert_close(got['params']['conv1'], [7 / 3])
  helpers.assert_close(got['params']['exit2'], [9.0])


def test_leaf_depths_of_the_multi_exit_resnet18():
  model = multi_exit.resnet18(10, (32, 32, 3))
  variables = jax.eval_shape(model.init, jax.random.key(0))
  depths = multi_exit.leaf_depths(variables)
  p = depths['params']
  assert p['conv1']['kernel'] == 1 and p['bn1']['scale'] == 1
  assert p['layer1_1']['conv2']['kernel'] == 1
  assert p['layer3_0']['shortcut_conv']['kernel'] == 3
  assert p['exit4']['kernel'] == 4
  assert depths['batch_stats']['layer4_1']['bn2']['mean'] == 4
  # Every exit's logits, or their mean.
  x = jnp.zeros((2, 32, 32, 3))
  apply = model.module.apply
  out = jax.eval_shape(lambda v: apply(v, x, all_exits=True), variables)
  assert out.shape == (2, 4, 10)
  assert jax.eval_shape(lambda v: apply(v, x), variables).shape == (2, 10)
  # The last exit is the zoo ResNet-18's head: same parameter count.
  n = sum(x.size for x in jax.tree.leaves(variables['params']))
  assert n == 11_173_962 + 3 * 10 + (64 + 128 + 256) * 10


def test_the_quarter_width_zoo_resnet18_gets_four_exits():
  zoo = model_lib.get('resnet18_w16', 10, (28, 28, 1))
  model = multi_exit.from_zoo(zoo)
  plain = jax.eval_shape(zoo.init, jax.random.key(0))['params']
  exits = jax.eval_shape(model.init, jax.random.key(0))['params']
  # The body is the zoo network's, the head its four exits.
  body = {k: v for k, v in plain.items() if k != 'linear'}
  chex.assert_trees_all_equal_shapes(
    body, {k: v for k, v in exits.items() if k in body}
  )
  assert set(exits) - set(body) == {'exit1', 'exit2', 'exit3', 'exit4'}
  assert exits['exit4']['kernel'].shape == plain['linear']['kernel'].shape
  assert exits['exit1']['kernel'].shape == (16, 10)


def test_budgets_give_the_deepest_fitting_depth():
  gb = budgets.GB
  needs = [int(0.9 * gb), int(1.5 * gb), int(3 * gb), int(7 * gb)]
  got = depthfl.depths_from_budgets(np.array([1, 2, 4, 8, 0.5, 3]) * gb, needs)
  np.testing.assert_array_equal(got, [1, 2, 3, 4, 1, 3])
  # None fits anywhere: every client the shallowest.
  big = [g * 100 * gb for g in (1, 2, 3, 4)]
  np.testing.assert_array_equal(
    depthfl.depths_from_budgets(np.array([1, 8]) * gb, big), [1, 1]
  )
  # The deepest that fits, even where a shallower one would need more.
  odd = [3 * gb, 2 * gb]
  np.testing.assert_array_equal(
    depthfl.depths_from_budgets(np.array([2, 3]) * gb, odd), [2, 2]
  )


@pytest.mark.slow
def test_measured_depth_memory_grows_with_depth():
  needs = depthfl.depth_memory(tiny(), batch_size=4, input_shape=(8, 8, 1))
  assert len(needs) == 2 and 0 < needs[0] < needs[1]


def test_kd_weight_ramps_up_as_the_authors_code():
  w = [float(depthfl.kd_weight_at(jnp.int32(r), 2.0, 300)) for r in (0, 150)]
  helpers.assert_close(w, [2 * np.exp(-5), 2 * np.exp(-1.25)], 1e-6)
  assert float(depthfl.kd_weight_at(jnp.int32(500), 2.0, 300)) == 2.0
  assert float(depthfl.kd_weight_at(jnp.int32(0), 2.0, 0)) == 2.0


@pytest.mark.slow
def test_shallow_client_leaves_deeper_variables_alone():
  model = tiny()
  local = contract.local_training(model)
  data, _ = helpers.toy_data([6])
  update = jax.jit(depthfl.make_depth_update(local, 1.0, True))
  start = model.init(jax.random.key(0))
  out = update(start, data, jnp.int32(0), jax.random.key(1), 1, 1.0)
  # Stage 2 (Dense layer2_0, BatchNorm layer2_1) and exit 2 as received.
  for col, name in (
    ('params', 'layer2_0'),
    ('params', 'layer2_1'),
    ('batch_stats', 'layer2_1'),
    ('params', 'exit2'),
  ):
    chex.assert_trees_all_equal(out.variables[col][name], start[col][name])
  moved = (
    out.variables['params']['exit1']['kernel']
    - start['params']['exit1']['kernel']
  )
  assert float(jnp.abs(moved).sum()) > 0
  assert np.isfinite(float(out.loss)) and int(out.num_steps) == 4


@pytest.mark.slow
def test_full_depth_last_exit_without_distillation_is_fedavg():
  # Every client at full depth, no distillation, only the last exit
  # trained and evaluated: FedAvg on the same network.
  model = tiny('last')
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  local = contract.local_training(model)
  algorithms = (
    depthfl.depthfl(
      local, 4, [2] * 6, kd_weight=0.0, extended=False, weighted=True
    ),
    fedavg.fedavg(local, 4),
  )
  states = contract.server_params_after(algorithms, model, data)
  # The multi-exit network rounds differently from the plain one; two
  # rounds of momentum SGD carry those last bits to ~3e-5 relative on AMD
  # EPYC and to 2.5e-4 (4e-5 absolute, one entry) on Intel Sapphire
  # Rapids. A wrong aggregate or exit would be off by far more.
  helpers.assert_close(states[0], states[1], rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_contract():
  history = contract.check_algorithm(
    lambda local, k, n: depthfl.depthfl(local, k, [1, 2, 2, 1, 2, 1]),
    model=tiny(),
  )
  depths = np.array([1, 2, 2, 1, 2, 1], np.float32)
  for m in history:  # of the sampled clients, not of all six
    assert m['mean_depth'] == np.mean(depths[m['client_ids']])
  assert len({float(m['mean_depth']) for m in history}) > 1


def test_wrap_model_and_bad_hparams():
  zoo = helpers.linear_bn_model()
  wrapped = depthfl.wrap_model(zoo, depthfl.Hparams())
  assert multi_exit.num_exits(wrapped.module) == 1
  np.testing.assert_array_equal(
    depthfl.client_depths(wrapped, 3, 0, 0), [1, 1, 1]
  )
  with pytest.raises(errors.ArgumentError, match='^depth must be <= 2'):
    depthfl.client_depths(tiny(), 3, 3, 0)
  with pytest.raises(errors.ArgumentError, match='^kd_weight must be'):
    depthfl.Hparams(kd_weight=-1.0).validate()
  with pytest.raises(errors.ArgumentError, match='^inference must be'):
    depthfl.Hparams(inference='mean').validate()
