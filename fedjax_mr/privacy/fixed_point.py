"""Fixed-point encoding of a client's contribution, for sums of integers
modulo 2^b (secure aggregation).

A round of K clients sums integers modulo 2^b. Each client's value in
[-bound, bound] becomes an integer in [-L, L] units of Δ = bound / L, with
L = `levels(bits, k)` = min(⌊(2^(b-1) - 1) / K⌋, 2^30): K of them sum to at
most 2^(b-1) - 1 in magnitude, so the sum modulo 2^b, read as a signed
b-bit number (`decode`), is the true sum of the integers. Nothing wraps,
whatever the order of the additions: an integer sum is the same on any
placement of the clients, and masks that sum to zero modulo 2^b cancel
exactly.

A float x is clipped to [-bound, bound] (where it was not already, the
client's `clipped` flag is set) and rounded stochastically: with
t = x / Δ (in float32), ⌊t⌋ + 1 with probability t - ⌊t⌋, else ⌊t⌋, so the
encoding is unbiased; the uniform draw comes from the client's key, so the
same client on any machine encodes the same integers. A non-finite value
encodes as 0 and sets the client's `nonfinite` flag.

The integers travel as uint32 (two's complement); the modulus 2^b divides
2^32, so uint32 additions that wrap give the right sum modulo 2^b.

References:
  Kairouz, Liu, Steinke. "The Distributed Discrete Gaussian Mechanism for
  Federated Learning with Secure Aggregation". ICML 2021 (the modular
  clipping and stochastic rounding this follows).
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

# A client's levels are capped where float32 still holds every integer
# that the clipped t can round to (2^30 is exact, and int32 holds it).
MAX_LEVELS = 2**30


def levels(bits: int, k: int) -> int:
  """L, the largest integer magnitude of one client's value: K values of
  at most L in magnitude sum to at most 2^(bits-1) - 1.

  Raises:
    ValueError: `bits` not in [2, 32], `k` < 1, or L < 1 (too many clients
      for `bits`).
  """
  if not 2 <= int(bits) <= 32:
    raise ValueError(f'bits must be in [2, 32], got {bits}')
  if int(k) < 1:
    raise ValueError(f'k must be >= 1, got {k}')
  n = (2 ** (int(bits) - 1) - 1) // int(k)
  if n < 1:
    raise ValueError(
      f'bits={bits} cannot hold a sum of k={k} clients (2^(bits-1) - 1 < k)'
    )
  return min(n, MAX_LEVELS)


class Flags(NamedTuple):
  """What one client's encoding reports (each 0 or 1, uint32; summed over
  the round, the number of clients).

  Attributes:
    clipped: some value was outside [-bound, bound].
    nonfinite: some value was NaN or infinite.
  """

  clipped: jax.Array
  nonfinite: jax.Array


def _encode_float(x, bound, n_levels, key):
  x = x.astype(jnp.float32)
  finite = jnp.isfinite(x)
  x = jnp.where(finite, x, 0.0)
  clipped = jnp.any(jnp.abs(x) > bound)
  top = jnp.float32(n_levels)
  t = jnp.clip(x * jnp.float32(n_levels / bound), -top, top)
  floor = jnp.floor(t)
  up = jax.random.uniform(key, x.shape, jnp.float32) < t - floor
  q = floor.astype(jnp.int32) + up.astype(jnp.int32)
  q = jnp.clip(q, -n_levels, n_levels)
  return q, clipped, jnp.logical_not(jnp.all(finite))


def encode(
  tree: Any, bound: float, n_levels: int, key: jax.Array
) -> tuple[Any, Flags]:
  """`(integers, flags)`: every float leaf of `tree` as uint32 integers in
  units of Δ = `bound` / `n_levels` (module docstring); leaf i rounds
  with `fold_in(key, i)`.

  Args:
    tree: float leaves.
    bound: > 0, the largest magnitude a value keeps.
    n_levels: L (`levels`).
    key: the client's key for the stochastic rounding.

  Raises:
    ValueError: `bound` <= 0. TypeError: a leaf that is not a float.
  """
  if not bound > 0:
    raise ValueError(f'bound must be > 0, got {bound}')
  leaves, treedef = jax.tree.flatten(tree)
  out = []
  clipped = nonfinite = jnp.bool_(False)
  for i, leaf in enumerate(leaves):
    leaf = jnp.asarray(leaf)
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      raise TypeError(f'tree: leaf {i} is {leaf.dtype}, not a float')
    q, c, f = _encode_float(
      leaf, float(bound), n_levels, jax.random.fold_in(key, i)
    )
    out.append(jax.lax.bitcast_convert_type(q, jnp.uint32))
    clipped, nonfinite = clipped | c, nonfinite | f
  flags = Flags(clipped.astype(jnp.uint32), nonfinite.astype(jnp.uint32))
  return jax.tree.unflatten(treedef, out), flags


def signed(total: jax.Array, bits: int) -> jax.Array:
  """A uint32 sum modulo 2^`bits` read as a signed `bits`-bit int32."""
  shift = 32 - int(bits)
  raw = jax.lax.bitcast_convert_type(
    jnp.left_shift(total, jnp.uint32(shift)), jnp.int32
  )
  return jnp.right_shift(raw, jnp.int32(shift))


def decode(total: Any, bound: float, n_levels: int, bits: int) -> Any:
  """The sum of the encoded values: each uint32 leaf of `total` (a sum of
  `encode`d trees modulo 2^32) read modulo 2^`bits` as a signed integer
  (`signed`), times Δ = `bound` / `n_levels`, in float32."""
  step = jnp.float32(bound / n_levels)
  return jax.tree.map(
    lambda t: signed(t, bits).astype(jnp.float32) * step, total
  )
