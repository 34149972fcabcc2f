"""The Skellam mechanism: integer noise that secure aggregation can sum.

A symmetric Skellam variable of variance v is X - Y with X, Y independent
Poisson(v / 2); the sum of independent ones is Skellam with the summed
variance, so clients that each add Skellam noise of variance v / m to
their integers give a sum whose noise is Skellam of variance at least v
when at least m of them are summed. Agarwal, Kairouz and Liu bound its
Rényi DP: for an integer-valued query of L2 sensitivity Δ2 and L1
sensitivity Δ1, Skellam noise of variance v on every coordinate is
(α, ε(α))-RDP for every integer α > 1 with

  ε(α) = α Δ2² / (2v) + min(((2α - 1) Δ2² + 6 Δ1) / (4v²), 3 Δ1 / (2v))

(`rdp`): the Gaussian's α Δ2² / (2v) and a term that vanishes as v grows.
Sampling m of n without replacement amplifies it (`subsampled_rdp`: the
general bound of Wang, Balle and Kasiviswanathan, Theorem 9).

A client's update, scaled to integers, is rounded stochastically and
again until its L2 norm is at most `norm_bound` (conditional rounding,
Kairouz, Liu, Steinke): its norm is then bounded whatever the rounding
drew, so Δ2 is exact, and the bound exceeds the scaled clip norm c by
little (c² + d/4 + c + √d/2 under the root, β = e^(-1/2)).

`randomize(x, bound, variance, seed)` is the client's host step: the
rounding and the noise, drawn from SHAKE-256 (a cryptographic stream:
who does not hold the seed cannot tell the noise), Poisson variables by
Hörmann's transformed rejection (PTRS) in float64 and exact integer norms.

References:
  Agarwal, Kairouz, Liu. "The Skellam Mechanism for Differentially Private
  Federated Learning". NeurIPS 2021.
  Kairouz, Liu, Steinke. "The Distributed Discrete Gaussian Mechanism for
  Federated Learning with Secure Aggregation". ICML 2021.
  Wang, Balle, Kasiviswanathan. "Subsampled Rényi Differential Privacy and
  Analytical Moments Accountant". AISTATS 2019.
  Hörmann. "The transformed rejection method for generating Poisson random
  variables". Insurance: Mathematics and Economics 12, 1993.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

# Integer orders α of the accountant (Theorem 9 holds at integers).
ORDERS = tuple(range(2, 65)) + tuple(range(72, 257, 8)) + (384, 512)

# A rounding is drawn again up to this many times; after them the
# client's update is 0 (its norm is then within any bound).
MAX_ROUNDINGS = 100


def _gammaln(x):
  """log Γ(x), elementwise (scipy's, imported when first needed: a run
  without distributed DP does not pay for its import)."""
  from scipy import special

  return special.gammaln(x)


def rdp(
  orders: np.ndarray, l2: float, l1: float, variance: float
) -> np.ndarray:
  """ε(α) of Skellam noise of `variance` on an integer query of L2 and L1
  sensitivities `l2`, `l1`, at each integer α of `orders` (module
  docstring); inf where `variance` is 0."""
  a = np.asarray(orders, np.float64)
  if np.any(a < 2) or np.any(a != np.round(a)):
    raise ValueError(f'orders must be integers >= 2, got {orders}')
  if not variance >= 0:
    raise ValueError(f'variance must be >= 0, got {variance}')
  if variance == 0:
    return np.full(a.shape, np.inf)
  v = float(variance)
  gauss = a * l2**2 / (2 * v)
  extra = np.minimum(
    ((2 * a - 1) * l2**2 + 6 * l1) / (4 * v**2), 3 * l1 / (2 * v)
  )
  return gauss + extra


def subsampled_rdp(orders: np.ndarray, q: float, base) -> np.ndarray:
  """The RDP of a mechanism of RDP `base(α)` run on m of n elements drawn
  without replacement (q = m / n), at each integer order: Wang, Balle
  and Kasiviswanathan's Theorem 9 with ε(∞) = ∞,

    (α - 1) ε'(α) <= log(1 + q² C(α, 2) min(4 (e^ε(2) - 1), 2 e^ε(2))
                     + Σ_{j=3..α} 2 q^j C(α, j) e^((j - 1) ε(j))),

  and never above `base(α)` itself.

  Args:
    orders: integers >= 2.
    q: in (0, 1].
    base: `base(np.ndarray of orders) -> np.ndarray`, the mechanism's RDP.
  """
  if not 0 < q <= 1:
    raise ValueError(f'q must be in (0, 1], got {q}')
  orders = np.asarray(orders, np.int64)
  own = np.asarray(base(orders), np.float64)
  if q == 1:
    return own
  top = int(orders.max())
  j = np.arange(2, top + 1)
  eps = np.asarray(base(j), np.float64)  # ε(j), j = 2..top
  out = np.empty(len(orders))
  for i, alpha in enumerate(orders):
    js, e = j[: alpha - 1], eps[: alpha - 1]
    log_comb = _gammaln(alpha + 1) - _gammaln(js + 1) - _gammaln(alpha - js + 1)
    terms = js * math.log(q) + log_comb + math.log(2) + (js - 1) * e
    # j = 2: min(4 (e^ε(2) - 1), 2 e^ε(2)).
    second = min(
      math.log(4) + e[0] + math.log(-math.expm1(-e[0])),
      math.log(2) + e[0],
    )
    terms[0] = 2 * math.log(q) + log_comb[0] + second
    total = np.logaddexp.reduce(np.concatenate([[0.0], terms]))
    out[i] = min(total / (alpha - 1), own[i])
  return out


def norm_bound(scaled_norm: float, dim: int) -> float:
  """The L2 norm a conditionally rounded vector keeps to: for a vector of
  `dim` values and norm at most `scaled_norm` (c), sqrt(c² + d/4 + c +
  √d/2), which a stochastic rounding exceeds with probability at most
  e^(-1/2) (Kairouz, Liu, Steinke, Lemma 23 with β = e^(-1/2))."""
  c, d = float(scaled_norm), int(dim)
  if not c >= 0 or d < 1:
    raise ValueError(f'scaled_norm >= 0 and dim >= 1 needed, got {c}, {d}')
  return math.sqrt(c * c + d / 4 + c + math.sqrt(d) / 2)


class _Stream:
  """Uniforms in [0, 1) from SHAKE-256 of a seed, block after block."""

  def __init__(self, seed: bytes):
    self._seed = seed
    self._block = 0

  def uniform(self, n: int) -> np.ndarray:
    """`n` float64 uniforms on the grid of 2^-53."""
    shake = hashlib.shake_256(self._seed + self._block.to_bytes(8, 'little'))
    self._block += 1
    words = np.frombuffer(shake.digest(8 * n), '<u8') >> np.uint64(11)
    return words.astype(np.float64) * 2.0**-53


def _poisson_small(lam: float, n: int, stream: _Stream) -> np.ndarray:
  """Poisson(`lam`) for lam < 10, by inversion of its distribution."""
  u = stream.uniform(n)
  k = np.arange(int(lam + 20 * math.sqrt(lam) + 40))
  cdf = np.cumsum(np.exp(k * math.log(lam) - lam - _gammaln(k + 1)))
  return np.searchsorted(cdf, u, side='right').astype(np.int64)


def poisson(lam: float, n: int, stream: _Stream) -> np.ndarray:
  """`n` Poisson(`lam`) variables (int64) from `stream` (PTRS for lam >=
  10, as numpy's own; inversion below)."""
  if lam == 0:
    return np.zeros(n, np.int64)
  if lam < 10:
    return _poisson_small(lam, n, stream)
  slam, loglam = math.sqrt(lam), math.log(lam)
  b = 0.931 + 2.53 * slam
  a = -0.059 + 0.02483 * b
  invalpha = 1.1239 + 1.1328 / (b - 3.4)
  vr = 0.9277 - 3.6224 / (b - 2)
  out = np.empty(n, np.int64)
  todo = np.arange(n)
  while todo.size:
    m = todo.size
    u = stream.uniform(m) - 0.5
    v = stream.uniform(m)
    us = 0.5 - np.abs(u)
    with np.errstate(divide='ignore', invalid='ignore'):
      k = np.floor((2 * a / us + b) * u + lam + 0.43)
    ok = (us >= 0.07) & (v <= vr)  # the squeeze: most are taken here
    # The rest: the exact test where k can be taken (us = 0, u = -1/2,
    # makes k infinite: never `possible`).
    possible = ~ok & (k >= 0) & ~((us < 0.013) & (v > us))
    at = np.flatnonzero(possible)
    kk, ua, va = k[at], us[at], v[at]
    with np.errstate(divide='ignore'):
      left = np.log(va) + math.log(invalpha) - np.log(a / (ua * ua) + b)
    ok[at] = left <= -lam + kk * loglam - _gammaln(kk + 1)
    out[todo[ok]] = k[ok].astype(np.int64)
    todo = todo[~ok]
  return out


def randomize(
  x: np.ndarray, bound: float, variance: float, seed: bytes
) -> np.ndarray:
  """A client's integers: `x` (float, already scaled to integer units)
  rounded stochastically until its L2 norm is at most `bound` (zeros
  after `MAX_ROUNDINGS` draws), plus Skellam noise of `variance` on each
  value; int64 of x's shape. Everything is drawn from SHAKE-256 of
  `seed` (the rounding from one stream, the noise from another).

  Raises:
    ValueError: a value of `x` not finite.
  """
  x = np.asarray(x, np.float64)
  if not np.all(np.isfinite(x)):
    raise ValueError('x: a value is not finite')
  flat = x.reshape(-1)
  low = np.floor(flat)
  rounding = _Stream(b'round' + seed)
  limit = math.floor(bound * bound)  # the norm², an integer, at most this
  q = np.zeros(flat.shape, np.int64)
  for _ in range(MAX_ROUNDINGS):
    up = rounding.uniform(flat.size) < flat - low
    tried = low.astype(np.int64) + up
    if int(np.dot(tried, tried)) <= limit:
      q = tried
      break
  noise = _Stream(b'noise' + seed)
  half = variance / 2
  q = q + poisson(half, flat.size, noise) - poisson(half, flat.size, noise)
  return q.reshape(x.shape)
