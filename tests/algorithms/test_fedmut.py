import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import fedmut
from fedjax_mr.core import tree
from fedjax_mr.core import types
from tests import helpers
from tests.algorithms import contract

K = 4
IDS = jnp.arange(K, dtype=jnp.int32)

# Dyadic values: every sum below is exact in float32.
GLOBAL = {
  'params': {
    'Dense_0': {
      'kernel': jnp.array([[1.5, -2.0], [0.25, 4.0]]),
      'bias': jnp.array([0.5, -1.0]),
    },
  },
  'batch_stats': {
    'BatchNorm_0': {'mean': jnp.array([0.75]), 'var': jnp.array([2.0])},
  },
}
DELTA = {
  'params': {
    'Dense_0': {
      'kernel': jnp.array([[0.5, -0.25], [1.0, 0.125]]),
      'bias': jnp.array([0.25, 0.5]),
    },
  },
  'batch_stats': {
    'BatchNorm_0': {'mean': jnp.array([0.5]), 'var': jnp.array([-0.25])},
  },
}
PREV = jax.tree.map(lambda g, d: g - d, GLOBAL, DELTA)


def mutate(key, num_models=K, alpha=4.0, beta=0.0, grouping='leaf'):
  return fedmut.mutate(
    key,
    GLOBAL,
    PREV,
    num_models=num_models,
    alpha=alpha,
    beta=beta,
    grouping=grouping,
  )


def coefficients(models, num_models=K, alpha=4.0):
  """v per leaf and model, recovered as (model - global) / (alpha delta)."""
  return jax.tree.map(
    lambda m, g, d: np.asarray((m - g) / (alpha * d)).reshape(num_models, -1),
    models,
    GLOBAL,
    DELTA,
  )


def test_coefficients_are_balanced_and_shuffled_per_layer():
  v = np.asarray(fedmut.mutation_coefficients(jax.random.key(0), 40, 4, 0.25))
  assert v.shape == (40, 4)
  np.testing.assert_array_equal(np.sort(v, 1), [[-0.75, -0.75, 1, 1]] * 40)
  assert len({tuple(row) for row in v}) > 1  # 6 possible orders
  odd = np.asarray(fedmut.mutation_coefficients(jax.random.key(0), 40, 5, 0))
  np.testing.assert_array_equal(odd[:, 0], 0)
  np.testing.assert_array_equal(np.sort(odd[:, 1:], 1), [[-1, -1, 1, 1]] * 40)
  one = fedmut.mutation_coefficients(jax.random.key(0), 3, 1, 0.5)
  np.testing.assert_array_equal(one, np.zeros((3, 1)))


def test_two_models_by_hand():
  # w = 1, w_prev = 0.5, alpha = 2, beta = 0.5: coefficients {1, -0.5}, so
  # the models are 1 + 2 * 1 * 0.5 = 2 and 1 + 2 * (-0.5) * 0.5 = 0.5.
  out = fedmut.mutate(
    jax.random.key(3),
    {'w': jnp.array([1.0])},
    {'w': jnp.array([0.5])},
    num_models=2,
    alpha=2.0,
    beta=0.5,
  )
  np.testing.assert_array_equal(np.sort(out['w'][:, 0]), [0.5, 2.0])


@pytest.mark.slow
def test_beta0_even_k_averages_to_global_at_distance_alpha_delta():
  out = mutate(jax.random.key(1))
  chex.assert_tree_shape_prefix(out, (K,))
  chex.assert_trees_all_equal(tree.weighted_mean(out), GLOBAL)
  # ||model_j - w||^2 = alpha^2 ||delta||^2 for every layer and model.
  jax.tree.map(
    lambda m, g, d: helpers.assert_close(
      np.sum((m - g) ** 2, axis=tuple(range(1, m.ndim))),
      np.full(K, 16.0 * np.sum(d**2)),
      rtol=1e-6,
    ),
    out,
    GLOBAL,
    DELTA,
  )
  # Exactly half of each layer's coefficients are +1, half -1.
  for v in jax.tree.leaves(coefficients(out)):
    np.testing.assert_array_equal(v, np.repeat(v[:, :1], v.shape[1], 1))
    np.testing.assert_array_equal(np.sort(v[:, 0]), [-1, -1, 1, 1])


def test_beta_shifts_the_mean_along_delta():
  out = mutate(jax.random.key(2), beta=0.5)
  # Mean coefficient beta / 2: mean = w + alpha * beta / 2 * delta.
  helpers.assert_close(
    tree.weighted_mean(out),
    jax.tree.map(lambda g, d: g + 4.0 * 0.25 * d, GLOBAL, DELTA),
    rtol=1e-6,
  )
  for v in jax.tree.leaves(coefficients(out)):
    np.testing.assert_array_equal(np.sort(v[:, 0]), [-0.5, -0.5, 1, 1])


def test_odd_k_contains_the_plain_global_once():
  out = mutate(jax.random.key(3), num_models=5)
  chex.assert_trees_all_equal(jax.tree.map(lambda x: x[0], out), GLOBAL)
  for m, g in zip(jax.tree.leaves(out), jax.tree.leaves(GLOBAL)):
    assert not np.any(np.all(m[1:] == g, axis=tuple(range(1, m.ndim))))
  for v in jax.tree.leaves(coefficients(out, 5)):
    np.testing.assert_array_equal(np.sort(v[:, 0]), [-1, -1, 0, 1, 1])


@pytest.mark.slow
def test_layers_draw_independently_and_module_grouping_shares():
  def both(k):
    return mutate(k), mutate(k, grouping='module')

  keys = jax.random.split(jax.random.key(4), 30)
  for grouping, outs in zip(('leaf', 'module'), jax.jit(jax.vmap(both))(keys)):
    # The coefficient of one element of each leaf, [30 keys, K].
    v = jax.tree.map(
      lambda m, g, d: (m - g).reshape(30, K, -1)[..., 0] / (4 * d.ravel()[0]),
      outs,
      GLOBAL,
      DELTA,
    )
    kernel, bias = (
      v['params']['Dense_0']['kernel'],
      v['params']['Dense_0']['bias'],
    )
    mean, var = (
      v['batch_stats']['BatchNorm_0']['mean'],
      v['batch_stats']['BatchNorm_0']['var'],
    )
    if grouping == 'leaf':
      assert np.any(kernel != bias) and np.any(mean != var)
    else:
      np.testing.assert_array_equal(kernel, bias)
      np.testing.assert_array_equal(mean, var)
      assert np.any(kernel != mean)


def test_mutate_is_deterministic_and_jittable():
  key = jax.random.key(5)
  out = mutate(key, beta=0.25)
  chex.assert_trees_all_equal(out, mutate(key, beta=0.25))
  jitted = jax.jit(lambda k, b: mutate(k, beta=b))(key, 0.25)
  helpers.assert_close(jitted, out, rtol=1e-6)
  other = mutate(jax.random.key(6), beta=0.25)
  assert any(
    not np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(out))
  )


def test_batchnorm_statistics_mutate_like_parameters():
  init = contract.bn_variables()
  moved = jax.tree.map(lambda x: x + 0.5, init)
  out = jax.jit(
    lambda k, w, p: fedmut.mutate(k, w, p, num_models=K, alpha=1.0)
  )(jax.random.key(7), moved, init)
  for name in ('mean', 'var'):
    step = (
      out['batch_stats']['BatchNorm_0'][name]
      - moved['batch_stats']['BatchNorm_0'][name]
    )
    helpers.assert_close(np.sort(step[:, 0]), [-0.5, -0.5, 0.5, 0.5])
  helpers.assert_close(tree.weighted_mean(out), moved, rtol=1e-6, atol=1e-6)


def test_beta_schedule():
  values = [float(fedmut.beta_schedule(t, 0.3, 50)) for t in (0, 25, 50, 80)]
  helpers.assert_close(values, [0.3, 0.15, 0.0, 0.0], atol=1e-7)
  assert fedmut.beta_schedule(jnp.int32(10), 0.5, 40).dtype == jnp.float32
  helpers.assert_close(fedmut.beta_schedule(jnp.int32(10), 0.5, 40), 0.375)
  assert float(fedmut.beta_schedule(0, 0.3, 0)) == 0.0


def test_alpha0_is_unweighted_fedavg():
  contract.assert_same_runs(
    fedmut.fedmut(contract.LOCAL, K, alpha=0.0),
    fedavg.fedavg(contract.LOCAL, K, weighted=False),
    K,
  )


def outputs_of(variables, num_examples=(1, 1, 1, 1)):
  return types.ClientOutput(
    variables, jnp.array(num_examples), jnp.zeros(K), jnp.ones(K, jnp.int32)
  )


def test_rounds_mutate_after_round0_with_the_schedule():
  server = fedmut.fedmut(contract.LOCAL, K, alpha=2.0, beta0=0.5, bound=4)
  init = {'w': jnp.array([1.0, -1.0])}
  state = server.init(init)
  chex.assert_trees_all_equal(
    types.dispatched_models(
      server, server.dispatch(state, IDS, 0, jax.random.key(0))
    ),
    tree.broadcast(init, K),
  )
  trained = {
    'w': jnp.array([[1.5, -1.0], [2.0, -0.5], [1.0, 0.0], [1.5, -0.5]])
  }
  state, metrics = types.aggregate_stacked(
    server, state, outputs_of(trained), IDS, 0, jax.random.key(1)
  )
  # New global: mean (1.5, -0.5); previous: init; delta (0.5, 0.5).
  chex.assert_trees_all_equal(state.params, {'w': jnp.array([1.5, -0.5])})
  chex.assert_trees_all_equal(state.prev_params, init)
  helpers.assert_close(metrics['delta_norm'], np.sqrt(0.5))
  helpers.assert_close(metrics['beta'], 0.5)
  # Dispatch of round 1 uses beta_0 = 0.5: mean = w + 2 * 0.25 * delta.
  out = types.dispatched_models(
    server, server.dispatch(state, IDS, 1, jax.random.key(2))
  )
  helpers.assert_close(np.mean(out['w'], 0), [1.75, -0.25])
  helpers.assert_close(np.sort(out['w'][:, 0]), [1.0, 1.0, 2.5, 2.5])
  # Global (2, -0.5) after round 1, delta (0.5, 0); round 2 uses
  # beta_1 = 0.375: coefficients {1, -0.625}.
  trained = tree.broadcast({'w': jnp.array([2.0, -0.5])}, K)
  state, metrics = types.aggregate_stacked(
    server, state, outputs_of(trained), IDS, 1, jax.random.key(3)
  )
  helpers.assert_close(metrics['beta'], 0.375)
  out = types.dispatched_models(
    server, server.dispatch(state, IDS, 2, jax.random.key(4))
  )
  helpers.assert_close(np.sort(out['w'][:, 0]), [1.375, 1.375, 3, 3])
  np.testing.assert_array_equal(out['w'][:, 1], -0.5)


def test_aggregate_sees_only_the_mean():
  server = fedmut.fedmut(contract.LOCAL, K, alpha=2.0)
  state = server.init(jax.tree.map(lambda g: g - 1.0, GLOBAL))
  state, _ = types.aggregate_stacked(
    server,
    state,
    outputs_of(tree.broadcast(PREV, K)),
    IDS,
    0,
    jax.random.key(0),
  )
  base = jax.tree.map(
    lambda g, d: (
      g + jnp.array([0.0, 1.0, -0.5, -0.5]).reshape((K,) + (1,) * g.ndim) * d
    ),
    GLOBAL,
    DELTA,
  )
  # Same mean: rows permuted, and +e / -e on two rows.
  other = jax.tree.map(lambda x: x[jnp.array([2, 0, 3, 1])], base)
  other = jax.tree.map(lambda x: x.at[0].add(0.25).at[1].add(-0.25), other)
  chex.assert_trees_all_equal(
    tree.weighted_mean(base), tree.weighted_mean(other)
  )
  key = jax.random.key(1)
  a = types.aggregate_stacked(server, state, outputs_of(base), IDS, 1, key)
  b = types.aggregate_stacked(server, state, outputs_of(other), IDS, 1, key)
  chex.assert_trees_all_equal(a, b)
  chex.assert_trees_all_equal(
    types.dispatched_models(server, server.dispatch(a[0], IDS, 2, key)),
    types.dispatched_models(server, server.dispatch(b[0], IDS, 2, key)),
  )
  # Weighted: the same holds when rows move with their example counts.
  weighted = fedmut.fedmut(contract.LOCAL, K, weighted=True)
  counts = (1, 1, 2, 4)
  perm = jnp.array([3, 1, 0, 2])
  a = types.aggregate_stacked(
    weighted, state, outputs_of(base, counts), IDS, 1, key
  )
  b = types.aggregate_stacked(
    weighted,
    state,
    outputs_of(
      jax.tree.map(lambda x: x[perm], base), np.array(counts)[np.array(perm)]
    ),
    IDS,
    1,
    key,
  )
  chex.assert_trees_all_equal(a, b)


@pytest.mark.parametrize(
  'num_models, options',
  [(K, {}), (5, {'weighted': True, 'grouping': 'module', 'beta0': 0.5})],
)
def test_fedmut_meets_the_contract(num_models, options):
  history = contract.check_server_side(
    fedmut.fedmut(contract.LOCAL, num_models, **options), num_models
  )
  assert set(history[0]) == {'delta_norm', 'beta', 'bytes_communicated'}
