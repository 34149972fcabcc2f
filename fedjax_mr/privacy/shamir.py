"""Shamir's t-of-n secret sharing of short byte strings over the prime
field of p = 2^521 - 1.

`split(secret, xs, t)` draws a polynomial f of degree t - 1 with
f(0) = the secret (read as a big-endian integer, at most 64 bytes, so
below p) and its other coefficients uniform in [0, p) (`secrets`), and
gives holder x the share f(x). `combine` recovers f(0) from any t shares
by Lagrange interpolation at 0; fewer than t shares are consistent with
every secret (each value of f(0) has exactly one polynomial through
them), so they tell nothing about it.

References:
  Shamir. "How to Share a Secret". Communications of the ACM, 1979.
"""

from __future__ import annotations

import secrets
from typing import Mapping
from typing import Sequence

PRIME = 2**521 - 1  # a Mersenne prime
SHARE_BYTES = 66  # ceil(521 / 8)
MAX_SECRET_BYTES = 64


def _check_xs(xs: Sequence[int]) -> None:
  if len(set(xs)) != len(xs) or not all(0 < x < PRIME for x in xs):
    raise ValueError(f'xs must be distinct and in (0, p), got {list(xs)}')


def split(secret: bytes, xs: Sequence[int], t: int) -> dict[int, bytes]:
  """`{x: share}` of `secret` for the holders `xs`, any `t` of which
  recover it (`combine`).

  Raises:
    ValueError: a secret over 64 bytes, `xs` not distinct positive
      integers, or `t` not in [1, len(xs)].
  """
  if len(secret) > MAX_SECRET_BYTES:
    raise ValueError(f'secret must be at most 64 bytes, got {len(secret)}')
  _check_xs(xs)
  if not 1 <= int(t) <= len(xs):
    raise ValueError(f't must be in [1, {len(xs)}], got {t}')
  coefficients = [int.from_bytes(secret, 'big')] + [
    secrets.randbelow(PRIME) for _ in range(int(t) - 1)
  ]
  shares = {}
  for x in xs:
    y = 0
    for c in reversed(coefficients):  # Horner
      y = (y * x + c) % PRIME
    shares[int(x)] = y.to_bytes(SHARE_BYTES, 'big')
  return shares


def combine(shares: Mapping[int, bytes], t: int, length: int) -> bytes:
  """The secret of `length` bytes from `t` of `shares` (`{x: share}`; the
  `t` of smallest x are used).

  Raises:
    ValueError: fewer than `t` shares, malformed shares, or a result that
      does not fit in `length` bytes (shares of another secret).
  """
  if len(shares) < int(t):
    raise ValueError(f'shares: {len(shares)} given, {t} needed')
  xs = sorted(shares)[: int(t)]
  _check_xs(xs)
  ys = []
  for x in xs:
    if len(shares[x]) != SHARE_BYTES:
      raise ValueError(f'shares: share {x} is not {SHARE_BYTES} bytes')
    ys.append(int.from_bytes(shares[x], 'big'))
    if ys[-1] >= PRIME:
      raise ValueError(f'shares: share {x} is not in the field')
  secret = 0
  for i, (xi, yi) in enumerate(zip(xs, ys)):
    num = den = 1
    for j, xj in enumerate(xs):
      if i != j:
        num = num * (-xj) % PRIME
        den = den * (xi - xj) % PRIME
    secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
  if secret >= 256**length:
    raise ValueError(f'shares: they do not hold a {length}-byte secret')
  return secret.to_bytes(length, 'big')
