"""Which clients a round trains: K distinct ids of N, drawn with the
round's sampling key (`engine.round_keys`).

`sample_clients` draws uniformly without replacement (a permutation for
small populations, `sample_sparse` for large ones); an algorithm may bring
its own sampler (`Algorithm.sampler`), else `uniform_sampler` is used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fedjax_mr.core import types


def uniform_sampler(clients_per_round: int) -> types.Sampler:
  """The default sampler: K distinct clients, uniformly at random."""
  k = int(clients_per_round)

  def sampler(key, round_index, server_state, data):
    del round_index, server_state
    return sample_clients(key, data.num_clients, k)

  return sampler


def sampler_of(
  algorithm: types.Algorithm, clients_per_round: int
) -> types.Sampler:
  """The algorithm's sampler, or the uniform one."""
  return algorithm.sampler or uniform_sampler(clients_per_round)


# Populations up to this size draw their K clients as every recorded run
# did (`jax.random.choice` without replacement: a random permutation of all
# N, O(N log N)); larger ones with few clients a round draw them by
# rejection (`sample_sparse`, O(K log K)): at N = 10⁶ the permutation cost
# about 0.7 s a round.
DENSE_SAMPLING_MAX = 2**16


def sample_clients(key: jax.Array, num_clients: int, k: int) -> jax.Array:
  """K distinct client ids, uniformly without replacement: `[K]` int32.

  Above `DENSE_SAMPLING_MAX` clients, and at most a quarter of them a
  round, `sample_sparse`; else a random permutation's first K.
  """
  if num_clients > DENSE_SAMPLING_MAX and 4 * k <= num_clients:
    return sample_sparse(key, num_clients, k)
  return jax.random.choice(key, num_clients, (k,), replace=False).astype(
    jnp.int32
  )


def sample_sparse(key: jax.Array, num_clients: int, k: int) -> jax.Array:
  """K distinct ids of `num_clients`, uniformly without replacement, in
  O(K log K): the first K distinct values of 2K independent uniform draws,
  in the order drawn (each is uniform over the ids not drawn before it,
  which is sampling without replacement). When the 2K draws hold fewer
  than K distinct values (likely only when K is near N), a random
  permutation's first K instead; whether that happens depends only on
  which draws repeat, not on their values, so the result stays uniform.
  Returns `[K]` int32."""
  m = 2 * k
  k_draw, k_permute = jax.random.split(key)
  draws = jax.random.randint(k_draw, (m,), 0, num_clients, dtype=jnp.int32)
  order = jnp.argsort(draws, stable=True)
  ordered = draws[order]
  # The stable sort puts each value's earliest draw first among its equals.
  first_sorted = jnp.concatenate(
    [jnp.ones((1,), bool), ordered[1:] != ordered[:-1]]
  )
  first = jnp.zeros((m,), bool).at[order].set(first_sorted)
  (positions,) = jnp.nonzero(first, size=k, fill_value=0)
  return lax.cond(
    jnp.sum(first) >= k,
    lambda: draws[positions],
    lambda: jax.random.choice(
      k_permute, num_clients, (k,), replace=False
    ).astype(jnp.int32),
  )


# The round's per-client metrics (`[K]` each, in sampling order).
