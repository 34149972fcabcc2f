"""DP-FedAvg around an algorithm (`privacy.private`): the reduction to the
plain round, the clip of each client's update, the noise of the sum, and
the algorithms it refuses."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import fedexp
from fedjax_mr.algorithms import fedmut
from fedjax_mr.algorithms import scaffold
from fedjax_mr.core import types
from fedjax_mr.privacy import dp
from fedjax_mr.privacy import private
from fedjax_mr.training import engine
from tests import helpers
from tests.algorithms import contract


def _setting():
  model = helpers.linear_bn_model()
  data, _ = helpers.toy_data([5, 9, 3, 12, 7, 4])
  return model, data, contract.local_training(model)


def _rounds(algorithm, model, data, rounds=2):
  fn = helpers.program_jit(engine.make_round_fn(algorithm, clients_per_round=4))
  state = engine.init_state(algorithm, model.init(jax.random.key(0)), 6)
  for _ in range(rounds):
    state, _ = fn(state, data, jax.random.key(4))
  return jax.device_get(state)


@pytest.mark.parametrize('build', ['fedavg', 'fedmut', 'scaffold'])
def test_no_noise_and_no_clip_is_the_plain_unweighted_round(build):
  model, data, local = _setting()
  make = {
    'fedavg': lambda: fedavg.fedavg(local, 4, weighted=False),
    'fedmut': lambda: fedmut.fedmut(local, 4, weighted=False),
    'scaffold': lambda: scaffold.scaffold(local, 4, 6, weighted=False),
  }[build]
  plain = _rounds(make(), model, data)
  wrapped = _rounds(private.private(make(), math.inf, 0.0), model, data)
  helpers.tree_equal(wrapped, plain)


def test_scaffolds_model_and_control_deltas_are_clipped_together():
  model, data, local = _setting()
  algorithm = scaffold.scaffold(local, 4, 6, weighted=False)
  clip = 0.05
  wrapped = private.private(algorithm, clip, 0.0)
  state = engine.init_state(algorithm, model.init(jax.random.key(0)), 6)
  sent = algorithm.dispatch(state.server, jnp.arange(4), 0, jax.random.key(1))
  control = jax.tree.map(lambda c: c[1], state.clients)
  args = (sent.shared, (), control, data, jnp.int32(1), jax.random.key(2))
  plain, kept = jax.jit(algorithm.client_update)(*args)
  clipped, kept_too = jax.jit(wrapped.client_update)(*args)
  start = sent.shared[0]
  both = lambda out: (  # noqa: E731
    jax.tree.map(lambda t, s: t - s, out.variables, start),
    out.extra,
  )
  norm = float(dp.global_norm(both(plain)))
  assert norm > clip
  helpers.assert_close(float(dp.global_norm(both(clipped))), clip, rtol=1e-4)
  for a, b in zip(jax.tree.leaves(both(clipped)), jax.tree.leaves(both(plain))):
    helpers.assert_close(a, b * (clip / norm), rtol=1e-3, atol=1e-7)
  # The client keeps the control it computed.
  helpers.tree_equal(kept_too, kept)


def test_each_upload_is_the_sent_model_plus_the_clipped_update():
  model, data, local = _setting()
  algorithm = fedavg.fedavg(local, 4, weighted=False)
  clip = 0.05
  wrapped = private.private(algorithm, clip, 0.0)
  start = model.init(jax.random.key(0))
  state = algorithm.init(start)
  sent = algorithm.dispatch(state, jnp.arange(4), 0, jax.random.key(1))
  args = (sent.shared, (), (), data, jnp.int32(1), jax.random.key(2))
  plain, _ = jax.jit(algorithm.client_update)(*args)
  clipped, _ = jax.jit(wrapped.client_update)(*args)
  delta = jax.tree.map(lambda t, s: t - s, plain.variables, start)
  norm = float(dp.global_norm(delta))
  assert norm > clip  # the clip applies
  got = jax.tree.map(lambda t, s: t - s, clipped.variables, start)
  helpers.assert_close(float(dp.global_norm(got)), clip, rtol=1e-5)
  # In the update's direction, scaled by C / |Δ|.
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(delta)):
    helpers.assert_close(a, b * (clip / norm), rtol=1e-4, atol=1e-7)
  # The scalars are the client's own.
  assert int(clipped.num_examples) == int(plain.num_examples)


def test_the_sums_noise_has_standard_deviation_z_times_c():
  # The aggregate of one round over a fixed sum: the mean moves by noise of
  # standard deviation z C / K per element (K = 4 clients of weight 1).
  model, _, local = _setting()
  algorithm = fedavg.fedavg(local, 4, weighted=False)
  z, clip = 1.5, 0.2
  wrapped = private.private(algorithm, clip, z)
  variables = model.init(jax.random.key(0))
  state = algorithm.init(variables)
  total = {
    'weight': jnp.float32(4),
    'models': jax.tree.map(lambda v: 4 * v, variables),
  }
  sums = types.Sums(
    total, jnp.ones(4, jnp.int32), jnp.zeros(4), jnp.ones(4, jnp.int32)
  )
  draws = []
  for seed in range(60):
    new, _ = wrapped.aggregate(
      state, sums, jnp.arange(4), 0, jax.random.key(seed)
    )
    moved = jax.tree.map(lambda a, b: a - b, new.params, variables)
    draws.append(np.concatenate([np.ravel(x) for x in jax.tree.leaves(moved)]))
  draws = np.concatenate(draws)
  # 60 draws of 75 elements: the sample deviation within 5 % (its own
  # relative error is about 1 / sqrt(2 * 4500) = 1 %).
  assert abs(draws.std() / (z * clip / 4) - 1) < 0.05
  assert abs(draws.mean()) < 3 * z * clip / 4 / math.sqrt(draws.size)


def test_algorithms_it_does_not_wrap_are_refused_with_the_reason():
  model, _, local = _setting()
  variables = model.init(jax.random.key(0))
  private.check(fedavg.fedavg(local, 4, weighted=False), variables)
  private.check(fedmut.fedmut(local, 4, weighted=False), variables)
  private.check(scaffold.scaffold(local, 4, 6), variables)
  with pytest.raises(ValueError, match=r"other sums .*\['models', 'sq_norms"):
    private.check(fedexp.fedexp(local, 4), variables)
  with pytest.raises(ValueError, match='needs a finite clip_norm'):
    private.private(fedavg.fedavg(local, 4), math.inf, 1.0)
  with pytest.raises(ValueError, match='clip_norm must be > 0'):
    private.private(fedavg.fedavg(local, 4), 0.0, 1.0)


def test_adaptive_clipping_steps_toward_the_quantile_by_hand():
  # z = 0: no noise; the next C is C exp(-eta (b - gamma)), b the fraction
  # of the round's clients whose update norm was at most C.
  model, data, local = _setting()
  algorithm = fedavg.fedavg(local, 4, weighted=False)
  clip, gamma, eta = 1.0, 0.8, 0.2
  wrapped = private.adaptive(algorithm, clip, 0.0, gamma, learning_rate=eta)
  variables = model.init(jax.random.key(0))
  state = engine.init_state(wrapped, variables)
  fn = helpers.program_jit(engine.make_round_fn(wrapped, clients_per_round=4))
  new, metrics = fn(state, data, jax.random.key(4))
  assert float(metrics['dp_clip_norm']) == np.float32(clip)
  # The round's clients, as the engine samples and keys them.
  ids = jax.jit(engine.make_sample_fn(wrapped, 4))(
    state, data, jax.random.key(4)
  )
  k_clients = engine.round_keys(jax.random.key(4), state.round)[2]
  keys = engine.client_keys(k_clients, 4)
  sent = algorithm.dispatch(algorithm.init(variables), ids, 0, None)
  norms = []
  for cid, key in zip(ids, keys):
    out, _ = jax.jit(algorithm.client_update)(
      sent.shared, (), (), data, cid, key
    )
    delta = jax.tree.map(lambda t, s: t - s, out.variables, variables)
    norms.append(float(dp.global_norm(delta)))
  below = np.mean([n <= clip for n in norms])
  assert 0 < below < 1, norms  # the step's direction is seen
  want = clip * np.exp(-eta * (below - gamma))
  helpers.assert_close(float(new.server.clip_norm), want, rtol=1e-6)
  # The model is FedAvg's of the clipped updates.
  plain = private.private(algorithm, clip, 0.0)
  other, _ = helpers.program_jit(
    engine.make_round_fn(plain, clients_per_round=4)
  )(engine.init_state(plain, variables), data, jax.random.key(4))
  helpers.tree_equal(new.server.params, other.server.params)


def test_adaptive_noise_costs_what_one_gaussian_of_z_costs():
  # Two Gaussians, on the sum (z_update C) and on the count (sigma_b):
  # z_update^-2 + (2 sigma_b)^-2 = z^-2.
  model, _, local = _setting()
  z, sigma_b = 1.0, 4 / 20
  with pytest.raises(ValueError, match='count_stddev must be above'):
    private.adaptive(fedavg.fedavg(local, 4), 0.5, z, 0.5)  # 2 sigma_b < z
  private.adaptive(fedavg.fedavg(local, 4), 0.5, z, 0.5, count_stddev=2.0)
  del sigma_b
  z_update = dp.update_noise_multiplier(z, 2.0)
  assert z_update**-2 + 4.0**-2 == pytest.approx(z**-2)
