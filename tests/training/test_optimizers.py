"""Client and server optimizers: hand-computed steps of FedAvgM and the
FedOpt family, SGD at rate 1 as the exact aggregate, named errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.core import errors
from fedjax_mr.core import types
from fedjax_mr.training import optimizers
from tests import helpers
from tests.algorithms import contract


def _steps(opt, w, targets):
  """`server_step` from `w` toward each target in turn; the iterates."""
  state = opt.init(w)
  out = []
  for t in targets:
    w, state = optimizers.server_step(opt, state, w, t)
    out.append(w)
  return out


def test_sgd_at_rate_one_lands_on_the_target_bit_for_bit():
  rng = np.random.default_rng(0)
  # Magnitudes from 1e-30 to 1e30, both signs, and a negative zero.
  w = {
    'a': jnp.asarray(
      rng.standard_normal(64) * 10.0 ** rng.integers(-30, 30, 64)
    )
  }
  t = {
    'a': jnp.asarray(
      np.concatenate(
        [[-0.0], rng.standard_normal(63) * 10.0 ** rng.integers(-30, 30, 63)]
      ),
      jnp.float32,
    )
  }
  w = jax.tree.map(lambda x: x.astype(jnp.float32), w)
  (got,) = _steps(optimizers.sgd(1.0), w, [t])
  np.testing.assert_array_equal(
    np.asarray(got['a']).view(np.uint32), np.asarray(t['a']).view(np.uint32)
  )


def test_sgd_steps_a_fraction_of_the_way():
  w = {'a': jnp.array([1.0, -2.0])}
  t = {'a': jnp.array([3.0, 2.0])}
  (got,) = _steps(optimizers.sgd(0.25), w, [t])
  helpers.assert_close(got['a'], [1.5, -1.0], rtol=1e-6)


def test_fedavgm_two_steps_by_hand():
  # g = w - t; trace v = g + beta v; w <- w - lr v (Hsu et al.).
  opt = optimizers.server_optimizer('momentum', 0.5, momentum=0.9)
  w = {'a': jnp.array([0.0])}
  got = _steps(opt, w, [{'a': jnp.array([-2.0])}, {'a': jnp.array([0.0])}])
  # Round 1: g = 2, v = 2, w = -1. Round 2: g = -1, v = -1 + 1.8 = 0.8,
  # w = -1 - 0.4 = -1.4.
  helpers.assert_close(got[0]['a'], [-1.0], rtol=1e-6)
  helpers.assert_close(got[1]['a'], [-1.4], rtol=1e-6)


@pytest.mark.parametrize('kind', ['adam', 'yogi', 'adagrad'])
def test_fedopt_two_steps_by_hand(kind):
  """Reddi et al., Algorithm 2, with Delta = t - w: m = b1 m + (1 - b1)
  Delta, v by the variant, x <- x + lr m / (sqrt(v) + tau)."""
  lr, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
  opt = optimizers.server_optimizer(kind, lr, b1=b1, b2=b2, tau=tau)
  x, m, v = 1.0, 0.0, tau**2
  targets = [0.5, 0.8]
  got = _steps(
    opt, {'a': jnp.array([x])}, [{'a': jnp.array([t])} for t in targets]
  )
  for t, step in zip(targets, got):
    delta = t - x
    m = b1 * m + (1 - b1) * delta
    if kind == 'adam':
      v = b2 * v + (1 - b2) * delta**2
    elif kind == 'yogi':
      v = v - (1 - b2) * delta**2 * np.sign(v - delta**2)
    else:
      v = v + delta**2
    x = x + lr * m / (np.sqrt(v) + tau)
    helpers.assert_close(step['a'], [x], rtol=1e-5)


def test_yogi_differs_from_adam_once_v_exceeds_the_square():
  # Yogi's v moves by (1 - b2) g^2 against sign(v - g^2); Adam's decays.
  opts = [optimizers.server_optimizer(k, 0.1) for k in ('adam', 'yogi')]
  targets = [{'a': jnp.array([5.0])}, {'a': jnp.array([0.0])}]
  adam, yogi = (_steps(o, {'a': jnp.array([0.0])}, targets) for o in opts)
  assert float(adam[1]['a'][0]) != float(yogi[1]['a'][0])


def test_only_trainable_parameters_step_and_batch_statistics_average():
  variables = contract.tiny_variables()
  algorithm = fedavg.fedavg(
    contract.LOCAL, 3, server_optimizer=optimizers.server_optimizer('adam', 0.1)
  )
  state = algorithm.init(variables)
  ids = jnp.arange(3, dtype=jnp.int32)
  sent = algorithm.dispatch(state, ids, jnp.int32(0), jax.random.key(0))
  outputs = contract.fake_outputs(
    contract.models_sent(sent, 3), jax.random.key(1)
  )
  new, _ = types.aggregate_stacked(
    algorithm, state, outputs, ids, jnp.int32(0), jax.random.key(2)
  )
  mean = fedavg.mean_of(
    types.sum_outputs(algorithm.contribution, outputs).total, state.params
  )
  helpers.tree_equal(new.params['batch_stats'], mean['batch_stats'])
  moved = jax.tree.map(
    lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))),
    new.params['params'],
    mean['params'],
  )
  assert all(d > 0 for d in jax.tree.leaves(moved))
  # Adam's state is float32 moments shaped like the parameters.
  moments = new.server_state[0]
  chex_shapes = jax.tree.map(lambda x: (x.shape, x.dtype), moments.m)
  assert chex_shapes == jax.tree.map(
    lambda p: (p.shape, jnp.dtype('float32')), variables['params']
  )


def test_fedavg_with_server_sgd_at_rate_one_is_the_plain_mean():
  variables = contract.tiny_variables()
  ids = jnp.arange(4, dtype=jnp.int32)
  plain = fedavg.fedavg(contract.LOCAL, 4)
  explicit = fedavg.fedavg(
    contract.LOCAL, 4, server_optimizer=optimizers.server_optimizer('sgd', 1.0)
  )
  for algorithm in (plain, explicit):
    state = algorithm.init(variables)
    for r in range(3):
      sent = algorithm.dispatch(state, ids, jnp.int32(r), jax.random.key(r))
      outputs = contract.fake_outputs(
        contract.models_sent(sent, 4), jax.random.key(10 + r)
      )

      # The mean and the aggregate in one jitted function (the same sums,
      # added in the same order): the server step at rate 1 must hand the
      # mean on unchanged.
      def both(state, outputs, r, algorithm=algorithm):
        sums = types.sum_outputs(algorithm.contribution, outputs)
        new, _ = algorithm.aggregate(state, sums, ids, r, jax.random.key(0))
        return new, fedavg.mean_of(sums.total, state.params)

      state, mean = jax.jit(both)(state, outputs, jnp.int32(r))
      helpers.tree_equal(state.params, mean)


@pytest.mark.slow
# Two state layouts: a momentum trace, and the FedOpt moments (m, v) that
# adam, yogi and adagrad share (one code path, `scale_by_fedopt`).
@pytest.mark.parametrize('name', ['momentum', 'adam'])
def test_contract_with_each_server_optimizer_state(name):
  contract.check_algorithm(
    lambda local, k, n: fedavg.fedavg(
      local, k, server_optimizer=optimizers.server_optimizer(name, 0.05)
    )
  )


def test_sgd_hparams_come_from_the_optimizer_or_are_unknown():
  assert optimizers.sgd_hparams(optimizers.sgd(0.1, 0.9)) == (0.1, 0.9)
  assert optimizers.sgd_hparams(optimizers.adam(0.1)) is None
  assert optimizers.sgd_hparams(optax.sgd(0.1)) is None
  assert optimizers.describe(optimizers.adam(0.1)) == 'adam'


def test_client_sgd_is_optax_sgd_bit_for_bit():
  params = {'w': jnp.array([1.0, -3.0, 0.5])}
  grads = {'w': jnp.array([0.3, 0.1, -2.0])}
  for momentum in (0.0, 0.9):
    ours, theirs = (
      optimizers.sgd(0.05, momentum),
      optax.sgd(0.05, momentum=momentum or None),
    )
    a, b = ours.init(params), theirs.init(params)
    for _ in range(3):
      ua, a = ours.update(grads, a, params)
      ub, b = theirs.update(grads, b, params)
      helpers.tree_equal(ua, ub)


@pytest.mark.parametrize(
  'build,argument',
  [
    (lambda: optimizers.sgd(0.0), 'learning_rate'),
    (lambda: optimizers.sgd(float('nan')), 'learning_rate'),
    (lambda: optimizers.sgd(0.1, 1.0), 'momentum'),
    (lambda: optimizers.adam(0.1, b2=1.0), 'b2'),
    (lambda: optimizers.adam(0.1, eps=0.0), 'eps'),
    (lambda: optimizers.server_optimizer('lamb'), 'name'),
    (lambda: optimizers.server_optimizer('momentum', momentum=0.0), 'momentum'),
    (lambda: optimizers.server_optimizer('adam', tau=0.0), 'tau'),
    (lambda: optimizers.server_optimizer('yogi', b1=-0.1), 'b1'),
    (lambda: optimizers.scale_by_fedopt('rms', 0.9, 0.99, 1e-3), 'kind'),
  ],
)
def test_bad_arguments_are_named(build, argument):
  with pytest.raises(errors.ArgumentError) as e:
    build()
  assert e.value.argument == argument
