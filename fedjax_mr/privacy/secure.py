"""Secure aggregation's encoding around an algorithm: the server reads
only the sum of the clients' contributions, as integers modulo 2^b.

`secure(algorithm, bits, bound, max_examples)` wraps an algorithm whose
server reads sums (its `contribution`: FedAvg and the FedOpt optimizers,
FedProx, MOON, FedASAM, FedMut, SCAFFOLD, FedExP, or any of them wrapped
by `private`). Client k computes its contribution as the algorithm does,
then encodes it (`fixed_point.encode`: clipped to [-bound, bound],
stochastically rounded to L = `fixed_point.levels(bits, K)` levels with
its own key folded with `ROUNDING_KEY`) and uploads the integers, with
n_k · min(loss_k, `LOSS_CAP`) encoded the same way (bound `LOSS_CAP` ·
`max_examples`) and two flags (a value clipped, a value not finite); its
loss is not uploaded otherwise (the wrapped output's `loss` is NaN). The
round sums those uint32 trees (the engine's fold, or a deployment's
secure aggregation, whose masks cancel modulo 2^b); the server decodes
the sum (`fixed_point.decode`) and gives it to the algorithm's own
aggregate. Metrics: 'train_loss' from the encoded losses over the
examples of the clients summed (NaN where a client's value was not
finite, so the run stops as diverged), 'secagg_clipped' (the clients
that had a value clipped).

Integer sums do not depend on their order, so a simulated round and a
deployed one (any placement, any arrival order) give the same bits.

References:
  Bonawitz et al. "Practical Secure Aggregation for Privacy-Preserving
  Machine Learning". CCS 2017.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_mr.core import types
from fedjax_mr.privacy import fixed_point

# Folded into a client's key for its stochastic rounding.
ROUNDING_KEY = 0x7361
# A client's mean loss above this is encoded as this (a cross-entropy so
# high is a diverged model; NaN or inf still flags `nonfinite`).
LOSS_CAP = 100.0


def _contribution_shape(algorithm: types.Algorithm, variables: Any) -> Any:
  """The shape of `algorithm`'s contribution for a model like
  `variables`, or None where none of the extra uploads tried fits."""
  for extra in ((), variables, jnp.float32(0)):
    output = types.ClientOutput(
      variables, jnp.int32(1), jnp.float32(0), jnp.int32(1), extra
    )
    try:
      return jax.eval_shape(algorithm.contribution, output)
    except (TypeError, ValueError):
      continue
  return None


def check(algorithm: types.Algorithm, variables: types.Variables) -> None:
  """Raises `ValueError` naming `algorithm` where secure aggregation does
  not apply to it: no `contribution` (its server reads every client's
  model, not their sum), no `clients_per_round`, or a contribution with
  a leaf that is not a float."""
  if algorithm.contribution is None:
    raise ValueError(
      'algorithm: its server reads every client model, not their sum; '
      'secure aggregation reveals only a sum'
    )
  if not algorithm.clients_per_round:
    raise ValueError('algorithm: its clients_per_round is needed')
  shape = _contribution_shape(algorithm, variables)
  if shape is None:
    raise ValueError('algorithm: its contribution could not be traced')
  for leaf in jax.tree.leaves(shape):
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      raise ValueError(
        f'algorithm: its contribution holds a {leaf.dtype} leaf; the '
        'encoding takes floats'
      )


def secure(
  algorithm: types.Algorithm,
  bits: int,
  bound: float,
  max_examples: int,
) -> types.Algorithm:
  """`algorithm` with secure aggregation's encoding (module docstring).

  Args:
    algorithm: one that `check` accepts.
    bits: b in [2, 32], the sums are modulo 2^b.
    bound: > 0, the largest magnitude of a contribution's value (every
      leaf: with weighting by examples, the weight n_k and n_k times a
      model's value).
    max_examples: the largest client's number of examples (the bound of
      its weighted loss).

  Returns:
    The wrapped `Algorithm`: the same state, dispatch and sampler; its
    `contribution` is the encoded upload, a dict of uint32 trees.
  """
  inner = algorithm
  if not inner.clients_per_round:
    raise ValueError('algorithm: its clients_per_round is needed')
  if not (bound > 0 and math.isfinite(bound)):
    raise ValueError(f'bound must be finite and > 0, got {bound}')
  if int(max_examples) < 1:
    raise ValueError(f'max_examples must be >= 1, got {max_examples}')
  n_levels = fixed_point.levels(bits, inner.clients_per_round)
  loss_bound = LOSS_CAP * int(max_examples)

  def client_update(shared, per_client_k, client_state_k, data, cid, key):
    output, state = inner.client_update(
      shared, per_client_k, client_state_k, data, cid, key
    )
    key = jax.random.fold_in(key, ROUNDING_KEY)
    part, flags = fixed_point.encode(
      inner.contribution(output),
      bound,
      n_levels,
      jax.random.fold_in(key, 0),
    )
    weighted = output.num_examples.astype(jnp.float32) * jnp.minimum(
      output.loss, LOSS_CAP
    )
    loss, loss_flags = fixed_point.encode(
      weighted, loss_bound, n_levels, jax.random.fold_in(key, 1)
    )
    upload = {
      'sum': part,
      'loss': loss,
      'clipped': flags.clipped,
      'nonfinite': flags.nonfinite | loss_flags.nonfinite,
    }
    hidden = jnp.float32(jnp.nan)
    return output._replace(loss=hidden, extra=upload), state

  def aggregate(state, sums, client_ids, round_index, key):
    total = sums.total
    decoded = fixed_point.decode(total['sum'], bound, n_levels, bits)
    loss = fixed_point.decode(total['loss'], loss_bound, n_levels, bits)
    examples = jnp.sum(sums.num_examples).astype(jnp.float32)
    nonfinite = fixed_point.signed(total['nonfinite'], bits)
    train_loss = jnp.where(nonfinite > 0, jnp.nan, loss / examples)
    new, metrics = inner.aggregate(
      state, sums._replace(total=decoded), client_ids, round_index, key
    )
    return new, {
      **metrics,
      'train_loss': train_loss,
      'secagg_clipped': fixed_point.signed(total['clipped'], bits),
    }

  return inner._replace(
    client_update=client_update,
    aggregate=aggregate,
    contribution=lambda output: output.extra,
  )
