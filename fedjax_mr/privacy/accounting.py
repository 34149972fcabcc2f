"""ε of a run of DP rounds, by Google's `dp-accounting` (its Rényi DP
accountant, the one Flower's accountant wraps).

The event is the one the engine runs: each round samples K of the N
clients uniformly without replacement (`sampling.uniform`) and releases
the sum of their clipped updates (norm at most C each) plus Gaussian
noise of standard deviation z·C. Fixed-size sampling is analysed under
the "replace one client" relation (N public); replacing one client's
data moves the sum by up to 2C, so each round is, to the accountant, a
Gaussian of noise multiplier z / 2 on a sample without replacement of K
of N (`SampledWithoutReplacementDpEvent`), composed over the rounds.
The protection is user-level: all of one client's examples at once.

Host code (numpy and the accountant): it runs between rounds, never
inside one. `dp-accounting` (with scipy's optimizers and statistics:
0.9 s of the 2.3 s of CPU a program took to start, AMD EPYC) is imported
when an ε is first asked for, so a run without DP never loads it.

References:
  Wang, Balle, Kasiviswanathan. "Subsampled Rényi Differential Privacy
  and Analytical Moments Accountant". AISTATS 2019.
  Mironov. "Rényi Differential Privacy". CSF 2017.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from fedjax_mr.privacy import skellam

if TYPE_CHECKING:
  import dp_accounting


def default_delta(num_clients: int) -> float:
  """δ = 1 / N^1.1: below one in N, as a δ for N users must be."""
  if num_clients < 1:
    raise ValueError(f'num_clients must be >= 1, got {num_clients}')
  return 1.0 / num_clients**1.1


class Accountant:
  """ε after T rounds for the run's δ (see the module docstring).

  Args:
    noise_multiplier: z, the noise's standard deviation over the clip
      norm C (0: no noise, ε infinite).
    num_clients: N.
    clients_per_round: K (1 <= K <= N).
    delta: δ in (0, 1).
  """

  def __init__(
    self,
    noise_multiplier: float,
    num_clients: int,
    clients_per_round: int,
    delta: float,
  ):
    if not noise_multiplier >= 0:
      raise ValueError(f'noise_multiplier must be >= 0, got {noise_multiplier}')
    if not 1 <= clients_per_round <= num_clients:
      raise ValueError(
        f'clients_per_round must be in [1, num_clients={num_clients}], '
        f'got {clients_per_round}'
      )
    if not 0 < delta < 1:
      raise ValueError(f'delta must be in (0, 1), got {delta}')
    self.noise_multiplier = float(noise_multiplier)
    self.num_clients = int(num_clients)
    self.clients_per_round = int(clients_per_round)
    self.delta = float(delta)
    self._one = None  # a round's RDP accountant, made when first needed

  def event(self, rounds: int) -> dp_accounting.DpEvent:
    """The `DpEvent` of `rounds` rounds."""
    import dp_accounting

    one = dp_accounting.SampledWithoutReplacementDpEvent(
      self.num_clients,
      self.clients_per_round,
      dp_accounting.GaussianDpEvent(self.noise_multiplier / 2),
    )
    return dp_accounting.SelfComposedDpEvent(one, int(rounds))

  def epsilon(self, rounds: int) -> float:
    """ε after `rounds` rounds (0 after none; inf without noise)."""
    if rounds < 0:
      raise ValueError(f'rounds must be >= 0, got {rounds}')
    if rounds == 0:
      return 0.0
    if self.noise_multiplier == 0:
      return math.inf
    if self._one is None:
      # A round's RDP, once (0.2 s on a CPU): T rounds compose to T times
      # it, as the accountant composes `event(T)` itself.
      self._one = self._round_rdp()
    orders, one = self._one
    from dp_accounting import rdp

    eps, _ = rdp.rdp_privacy_accountant.compute_epsilon(
      orders, int(rounds) * one, self.delta
    )
    return float(eps)

  def _round_rdp(self) -> tuple[np.ndarray, np.ndarray]:
    """`(orders, ε(α) of one round)`."""
    import dp_accounting
    from dp_accounting import rdp

    one = rdp.RdpAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    one.compose(self.event(1))
    return np.asarray(one.orders), np.asarray(one.rdp)

  def rounds_within(self, target_epsilon: float, limit: int) -> int:
    """The most rounds, at most `limit`, whose ε is at most
    `target_epsilon` (ε grows with the rounds: a bisection)."""
    if not target_epsilon > 0:
      raise ValueError(f'target_epsilon must be > 0, got {target_epsilon}')
    if self.epsilon(limit) <= target_epsilon:
      return int(limit)
    low, high = 0, int(limit)  # ε(low) <= target < ε(high)
    while high - low > 1:
      mid = (low + high) // 2
      if self.epsilon(mid) <= target_epsilon:
        low = mid
      else:
        high = mid
    return low


class SkellamAccountant(Accountant):
  """ε of distributed DP with secure aggregation (`distributed_dp`): each
  round samples K of N clients without replacement and releases the sum
  of their integers, each rounded to L2 norm at most B, with Skellam
  noise of variance at least (zB)² (at least m clients summed).
  Replacing one client's data moves the sum by Δ2 = 2B in L2 and Δ1 =
  2 min(B², √d B) in L1 (integers: |x| <= x²), so a round's RDP is
  `skellam.rdp` amplified by `skellam.subsampled_rdp` at the integer
  orders `skellam.ORDERS`, composed over the rounds and converted to ε
  by `dp-accounting` as `Accountant` converts. As the noise grows in
  integer units it tends to `Accountant`'s ε for the same z (the
  Gaussian's term is z's exactly), from above.

  Args:
    noise_multiplier: z > 0.
    num_clients: N.
    clients_per_round: K.
    delta: δ in (0, 1).
    bound: B, in integer units.
    dim: d, the values of an update.
  """

  def __init__(
    self,
    noise_multiplier: float,
    num_clients: int,
    clients_per_round: int,
    delta: float,
    bound: float,
    dim: int,
  ):
    super().__init__(noise_multiplier, num_clients, clients_per_round, delta)
    if not bound > 0 or int(dim) < 1:
      raise ValueError(f'bound > 0 and dim >= 1 needed, got {bound}, {dim}')
    self.bound = float(bound)
    self.dim = int(dim)

  def event(self, rounds: int) -> dp_accounting.DpEvent:
    """`UnsupportedDpEvent`: dp-accounting has no Skellam mechanism (its
    accountants refuse the event); `epsilon` computes ε itself."""
    del rounds
    import dp_accounting

    return dp_accounting.UnsupportedDpEvent()

  def _round_rdp(self) -> tuple[np.ndarray, np.ndarray]:
    b, d = self.bound, self.dim
    l2, l1 = 2 * b, 2 * min(b * b, math.sqrt(d) * b)
    variance = (self.noise_multiplier * b) ** 2
    orders = np.asarray(skellam.ORDERS)
    q = self.clients_per_round / self.num_clients
    one = skellam.subsampled_rdp(
      orders, q, lambda a: skellam.rdp(a, l2, l1, variance)
    )
    return orders.astype(np.float64), one
