"""ε of `privacy.accounting.Accountant` against `dp-accounting` by hand."""

import math

import dp_accounting
import pytest
from dp_accounting import rdp

from fedjax_mr.privacy import accounting
from tests import helpers


def _by_hand(z, n, k, rounds, delta):
  # K of N without replacement, replace-one (sensitivity 2C: multiplier
  # z / 2), composed `rounds` times.
  acc = rdp.RdpAccountant(
    neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
  )
  one = dp_accounting.SampledWithoutReplacementDpEvent(
    n, k, dp_accounting.GaussianDpEvent(z / 2)
  )
  acc.compose(one, rounds)
  return acc.get_epsilon(delta)


@pytest.mark.parametrize(
  'z, n, k, rounds', [(1.0, 1000, 100, 50), (2.5, 10**4, 100, 200)]
)
def test_epsilon_is_dp_accountings_for_the_same_event(z, n, k, rounds):
  delta = accounting.default_delta(n)
  acc = accounting.Accountant(z, n, k, delta)
  helpers.assert_close(
    acc.epsilon(rounds), _by_hand(z, n, k, rounds, delta), rtol=1e-12
  )


def test_epsilon_grows_with_rounds_and_falls_with_noise():
  acc = accounting.Accountant(1.0, 1000, 100, 1e-4)
  eps = [acc.epsilon(t) for t in (0, 1, 10, 100)]
  assert eps[0] == 0 and eps == sorted(eps) and len(set(eps)) == 4
  assert accounting.Accountant(2.0, 1000, 100, 1e-4).epsilon(100) < eps[-1]
  assert accounting.Accountant(0.0, 1000, 100, 1e-4).epsilon(1) == math.inf


def test_rounds_within_a_target_are_the_most_that_fit():
  acc = accounting.Accountant(1.0, 1000, 100, 1e-4)
  target = acc.epsilon(37) * 1.0001
  t = acc.rounds_within(target, 1000)
  assert t == 37
  assert acc.epsilon(t) <= target < acc.epsilon(t + 1)
  assert acc.rounds_within(1e9, 50) == 50
  assert acc.rounds_within(1e-9, 50) == 0


def test_default_delta_is_below_one_over_n():
  assert accounting.default_delta(1000) == 1000**-1.1 < 1e-3


@pytest.mark.parametrize(
  'args, says',
  [
    ((-1.0, 10, 2, 1e-3), 'noise_multiplier'),
    ((1.0, 10, 11, 1e-3), 'clients_per_round'),
    ((1.0, 10, 0, 1e-3), 'clients_per_round'),
    ((1.0, 10, 2, 0.0), 'delta'),
  ],
)
def test_bad_arguments_are_named(args, says):
  with pytest.raises(ValueError, match=says):
    accounting.Accountant(*args)
