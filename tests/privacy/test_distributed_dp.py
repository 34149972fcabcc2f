"""Distributed DP over secure aggregation (`privacy.distributed_dp`): the
calibration by hand, the round against a plain loop over the clients'
integer uploads, the noise the server's sum carries and where it comes
from, the reduction to DP-FedAvg without noise, and the accountant."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import fedmut
from fedjax_mr.algorithms import scaffold
from fedjax_mr.privacy import accounting
from fedjax_mr.privacy import distributed_dp
from fedjax_mr.privacy import private
from fedjax_mr.privacy import skellam
from fedjax_mr.training import engine
from tests import helpers
from tests.privacy import test_secure as secure_test

K = secure_test.K
CLIP = 0.5
_setting, _round = secure_test._setting, secure_test._round


def _make(name, local):
  return {
    'fedavg': lambda: fedavg.fedavg(local, K, weighted=False),
    'fedmut': lambda: fedmut.fedmut(local, K, weighted=False),
    'scaffold': lambda: scaffold.scaffold(local, K, 6, weighted=False),
  }[name]()


def _wrapped(name, z=1.0, m=3, bits=32, value_range=10.0):
  model, data, local = _setting()
  inner = _make(name, local)
  variables = model.init(jax.random.key(0))
  d = distributed_dp.dimension(inner, variables, data)
  cal = distributed_dp.calibrate(d, CLIP, z, K, m, bits, value_range)
  return model, data, inner, distributed_dp.distributed(inner, cal), cal


def test_min_clients_by_hand():
  assert distributed_dp.min_clients(10, 2 / 3) == 7
  assert distributed_dp.min_clients(3, 2 / 3) == 2
  assert distributed_dp.min_clients(4, 0.51) == 3  # at least K//2 + 1
  assert distributed_dp.min_clients(100, 1.0) == 100
  with pytest.raises(ValueError, match='fraction'):
    distributed_dp.min_clients(10, 0.5)


def test_calibration_by_hand():
  """With 32 bits S is 2^16; with 24 it is the largest S whose sum fits:
  S + 1 would not; below 8 √d it is refused naming the bits."""
  cal = distributed_dp.calibrate(10_000, 0.5, 1.0, 10, 7, 32, 10.0)
  assert cal.units == 2.0**16 and cal.scale == 2.0**17
  assert cal.bound == skellam.norm_bound(2.0**16, 10_000)
  assert cal.client_variance == pytest.approx(cal.bound**2 / 7, rel=1e-12)
  small = distributed_dp.calibrate(10_000, 0.5, 1.0, 10, 7, 24, 10.0)
  top = 2**23 - 1

  def largest(units):
    b = skellam.norm_bound(units, 10_000)
    noise = 1.0 * b * math.sqrt(10 / 7)
    return 10 * (units / 0.5 * 10 + 1 + b) + 12 * noise + 1

  assert largest(small.units) <= top < largest(small.units + 1)
  with pytest.raises(ValueError, match='bits=16 cannot hold'):
    distributed_dp.calibrate(10_000, 0.5, 1.0, 10, 7, 16, 10.0)


@pytest.mark.parametrize('name', ['fedavg', 'fedmut', 'scaffold'])
def test_the_round_is_the_aggregate_of_the_uploads_integer_sum(name):
  """The engine's round against a plain loop: each client's wrapped update
  alone, the uint32 uploads summed in reverse, the wrapped aggregate:
  the same bits."""
  model, data, _, wrapped, _ = _wrapped(name)
  state, (new, metrics) = _round(wrapped, model, data)
  want, want_metrics, total = secure_test.plain_round(wrapped, state, data)
  helpers.tree_equal(new.server, want)
  assert int(metrics['dp_clients']) == K == int(want_metrics['dp_clients'])
  assert np.isnan(metrics['train_loss'])
  assert int(metrics['secagg_clipped']) == 0
  assert ('controls' in total) == (name == 'scaffold')


@pytest.mark.parametrize('name', ['fedavg', 'fedmut', 'scaffold'])
def test_without_noise_it_is_dp_fedavgs_round_within_the_steps(name):
  """z tiny: the round is `private`'s clip-only round up to the K codes'
  rounding (each within 1/s of its value) and the noise (std z·B/s)."""
  model, data, inner, wrapped, cal = _wrapped(name, z=1e-6)
  _, (plain, _) = _round(private.private(inner, CLIP, 0.0), model, data)
  _, (new, _) = _round(wrapped, model, data)
  for a, b in zip(
    jax.tree.leaves(new.server.params), jax.tree.leaves(plain.server.params)
  ):
    assert np.abs(a - b).max() < 4 / cal.scale + 1e-6


def test_the_sum_carries_the_accounted_noise():
  """z = 1: the decoded mean minus the noise-free one (z tiny), over every
  value of 5 rounds' models, has the variance of K clients' noise,
  K (zB)² / m, over (sK)²; within 6 standard errors (0.44 of it)."""
  model, data, _, wrapped, cal = _wrapped('fedavg', z=1.0)
  _, _, _, quiet, _ = _wrapped('fedavg', z=1e-6)
  diffs = []
  for key in range(5):
    _, (new, _) = _round(wrapped, model, data, key)
    _, (ref, _) = _round(quiet, model, data, key)
    for a, b in zip(
      jax.tree.leaves(new.server.params), jax.tree.leaves(ref.server.params)
    ):
      diffs.append((np.asarray(a) - np.asarray(b)).ravel())
  diff = np.concatenate(diffs)
  want = cal.client_variance * K / (cal.scale * K) ** 2
  assert diff.size >= 350
  assert abs(diff.var() / want - 1) < 6 * math.sqrt(2 / diff.size)


def test_the_noise_comes_from_the_node_secret_not_the_key_alone():
  """A client's upload under a node's secret differs from the same
  client's without it (the server, which made the key, cannot draw its
  noise), its noise-free part being the same: the difference is noise
  of twice the client's variance."""
  model, data, _, wrapped, cal = _wrapped('fedavg', z=1.0)
  state = engine.init_state(wrapped, model.init(jax.random.key(0)), 6)
  sent = wrapped.dispatch(
    state.server, jnp.arange(K), jnp.int32(0), jax.random.key(1)
  )
  update = jax.jit(wrapped.client_update)

  def upload():
    out, _ = update(sent.shared, (), (), data, jnp.int32(2), jax.random.key(9))
    leaves = jax.tree.leaves(out.extra['models'])
    return np.concatenate(
      [np.asarray(x).view(np.int32).ravel() for x in leaves]
    )

  plain = upload()
  with distributed_dp.node_secret(lambda c: b'node one secret'):
    one = upload()
    again = upload()
  with distributed_dp.node_secret(lambda c: b'node two secret'):
    two = upload()
  np.testing.assert_array_equal(one, again)
  for other in (plain, two):
    diff = (one.astype(np.int64) - other).astype(float)
    assert abs(diff.var() / (2 * cal.client_variance) - 1) < 0.1


def test_a_sent_value_beyond_the_range_is_counted():
  model, data, _, wrapped, _ = _wrapped('fedavg', value_range=1e-3)
  _, (_, metrics) = _round(wrapped, model, data)
  assert int(metrics['secagg_clipped']) == K


def test_it_refuses_another_clients_per_round():
  _, _, inner, _, cal = _wrapped('fedavg')
  with pytest.raises(ValueError, match='calibration'):
    distributed_dp.distributed(inner, cal._replace(clients_per_round=K + 1))


def test_the_accountant_tends_to_the_gaussians_from_above():
  """ε of the Skellam mechanism at z against the Gaussian's at z: never
  below, within 1e-6 at B = 2^16, and further off for a small B."""
  n, k, delta, d = 10_000, 100, 1e-4, 66_130
  gauss = accounting.Accountant(1.127, n, k, delta)
  near = accounting.SkellamAccountant(1.127, n, k, delta, 65536.6, d)
  far = accounting.SkellamAccountant(1.127, n, k, delta, 30.0, d)
  for rounds in (1, 50, 200):
    g = gauss.epsilon(rounds)
    assert g <= near.epsilon(rounds) <= g * (1 + 1e-6)
    assert far.epsilon(rounds) > near.epsilon(rounds) * 1.001
  assert near.rounds_within(near.epsilon(120), 200) == 120


def test_dp_accounting_is_told_it_has_no_event_for_skellam():
  import dp_accounting

  acct = accounting.SkellamAccountant(1.0, 100, 10, 1e-3, 65536.6, 1000)
  event = acct.event(5)
  assert isinstance(event, dp_accounting.UnsupportedDpEvent)
  assert not dp_accounting.rdp.RdpAccountant().supports(event)
