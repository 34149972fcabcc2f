"""DP-FedAvg around an algorithm: every client's update clipped, the
round's sum noised, the rest of the algorithm as it is.

`private(algorithm, clip_norm, noise_multiplier)` wraps an algorithm whose
server reads the clients' mean model (its `contribution` is FedAvg's:
`{'weight', 'models'}`: FedAvg and the FedOpt optimizers, FedProx, MOON,
FedASAM, FedMut) and maybe their mean control delta beside it (SCAFFOLD's
`'controls'`). Client k's update Δ_k, its trained model minus the one it
was sent (`start_model`) together with its further uploads (SCAFFOLD's
control delta), is clipped to L2 norm C (`dp.clip`, over the whole update
or per layer) on the client, which uploads the sent model plus the clipped
model update (and the clipped control delta; it keeps its own control as it
computed it); each client weighs 1 (example counts would make a client's
influence depend on its data); the server adds N(0, (zC)²) to every element
of the models' sum (and of the control deltas') (`dp.noise`, its key folded
from the round's) before the algorithm's own aggregate divides it by the
number of clients (K in a simulated round; in a deployed round with failed
clients, those that answered: a count the server sees, which does not
depend on any client's data). Replacing one client's data moves the sum by
at most 2C (the sent models depend on a client's place in the round, not on
its data), so a round is the Gaussian mechanism of multiplier z/2 under the
replace-one relation (`accounting.Accountant`).

With z = 0 and C = inf nothing is clipped or noised: the wrapped round is
the plain unweighted round, bit for bit (a client's model is its trained
model wherever no factor below 1 applies, and no zero noise is added).

References:
  McMahan, Ramage, Talwar, Zhang. "Learning Differentially Private
  Recurrent Language Models". ICLR 2018.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_mr.core import types
from fedjax_mr.privacy import dp

# Folded into the round's key for the noise of its sum.
NOISE_KEY = 0x6470


def start_model(
  algorithm: types.Algorithm, shared: Any, per_client_k: Any
) -> types.Variables:
  """The model client k was sent: `client_model(shared, per_client_k)`
  where the algorithm has one (FedMut), else its row of the dispatch's
  per-client part where there is one, else the shared part (FedAvg)."""
  if algorithm.client_model is not None:
    return algorithm.client_model(shared, per_client_k)
  if jax.tree.leaves(per_client_k):
    return per_client_k
  return shared


def _clipped(
  start: types.Variables,
  output: types.ClientOutput,
  clip_norm: float,
  per_layer: bool,
) -> types.ClientOutput:
  """`output` with its update clipped (`dp.clip`): the model's change from
  `start` and its further uploads (`extra`: SCAFFOLD's control delta)
  together; a leaf that no factor below 1 scales is kept as trained."""
  update = (
    jax.tree.map(
      lambda t, s: t.astype(jnp.float32) - s.astype(jnp.float32),
      output.variables,
      start,
    ),
    jax.tree.map(lambda e: e.astype(jnp.float32), output.extra),
  )
  clipped, norm = dp.clip(update, clip_norm, per_layer)
  if per_layer:
    bound = clip_norm / math.sqrt(len(jax.tree.leaves(update)))
    scaled = jax.tree.map(lambda d: dp.global_norm(d) > bound, update)
  else:
    scaled = jax.tree.map(lambda d: norm > clip_norm, update)

  def kept(trained, value, yes):
    return jnp.where(yes, value.astype(trained.dtype), trained)

  variables = jax.tree.map(
    lambda t, s, c, yes: kept(t, s.astype(jnp.float32) + c, yes),
    output.variables,
    start,
    clipped[0],
    scaled[0],
  )
  extra = jax.tree.map(kept, output.extra, clipped[1], scaled[1])
  return output._replace(variables=variables, extra=extra)


# The sums a wrapped algorithm's server may read: FedAvg's mean of models,
# and SCAFFOLD's control deltas beside it (each linear in the update).
_SUMS = ({'weight', 'models'}, {'weight', 'models', 'controls'})


def _contribution(output: types.ClientOutput, controls: bool) -> dict:
  """An unweighted part of the sums: weight 1, the model and, with
  `controls`, the further uploads (as FedAvg's and SCAFFOLD's unweighted
  contributions, the same operations)."""
  one = jnp.float32(1)
  part = {
    'weight': one,
    'models': jax.tree.map(
      lambda x: one * x.astype(jnp.float32), output.variables
    ),
  }
  if controls:
    part['controls'] = jax.tree.map(
      lambda d: d.astype(jnp.float32), output.extra
    )
  return part


def check(algorithm: types.Algorithm, variables: types.Variables) -> None:
  """Raises `ValueError` naming `algorithm` where DP-FedAvg does not apply
  to it: its own sampler (one the accountant cannot model), no
  `contribution` (its server reads the K models, not their sum), or
  another contribution than FedAvg's mean of models (SCAFFOLD's controls,
  FedExP's norms: not wrapped here)."""
  if algorithm.sampler is not None:
    raise ValueError(
      'algorithm: it samples its clients itself; the accountant models K '
      'clients drawn uniformly without replacement'
    )
  if algorithm.contribution is None:
    raise ValueError(
      'algorithm: its server reads every client model, not their sum; '
      'DP-FedAvg protects a sum'
    )
  shape = None
  # What a client uploads beside its model: nothing, a tree like the
  # model's (SCAFFOLD's control delta) or a number (FedExP's norm).
  for extra in ((), variables, jnp.float32(0)):
    output = types.ClientOutput(
      variables, jnp.int32(1), jnp.float32(0), jnp.int32(1), extra
    )
    try:
      shape = jax.eval_shape(algorithm.contribution, output)
      break
    except (TypeError, ValueError):
      continue
  if not isinstance(shape, dict) or set(shape) not in _SUMS:
    parts = sorted(shape) if isinstance(shape, dict) else type(shape).__name__
    raise ValueError(
      "algorithm: its server reads other sums than FedAvg's mean of models "
      f"and SCAFFOLD's control deltas ({parts}); DP-FedAvg does not wrap "
      'them'
    )
  k = algorithm.clients_per_round or 1

  def first_start(variables):
    state = algorithm.init(variables)
    sent = algorithm.dispatch(
      state, jnp.arange(k), jnp.int32(0), jax.random.key(0)
    )
    row = jax.tree.map(lambda x: x[0], sent.per_client)
    return start_model(algorithm, sent.shared, row)

  start = jax.eval_shape(first_start, variables)
  if jax.tree.structure(start) != jax.tree.structure(variables):
    raise ValueError(
      'algorithm: the model a client is sent is not found in its dispatch '
      '(no client_model, and the shared part is not the model); the '
      "update's clip needs it"
    )


def private(
  algorithm: types.Algorithm,
  clip_norm: float,
  noise_multiplier: float,
  per_layer: bool = False,
) -> types.Algorithm:
  """`algorithm` with DP-FedAvg's clipping and noise (module docstring).

  Args:
    algorithm: one that `check` accepts.
    clip_norm: C > 0 (`math.inf`: no clipping).
    noise_multiplier: z >= 0; the noise's standard deviation is z·C
      (z > 0 needs a finite C).
    per_layer: clip each leaf of the update to C / sqrt(L) (`dp.clip`).

  Returns:
    The wrapped `Algorithm`: the same state, dispatch and sampler.
  """
  if not clip_norm > 0:
    raise ValueError(f'clip_norm must be > 0, got {clip_norm}')
  if not noise_multiplier >= 0:
    raise ValueError(f'noise_multiplier must be >= 0, got {noise_multiplier}')
  if noise_multiplier > 0 and math.isinf(clip_norm):
    raise ValueError('noise_multiplier > 0 needs a finite clip_norm')
  stddev = float(noise_multiplier) * float(clip_norm)
  inner = algorithm

  def contribution(output):
    controls = 'controls' in jax.eval_shape(inner.contribution, output)
    return _contribution(output, controls)

  def client_update(shared, per_client_k, client_state_k, data, cid, key):
    output, state = inner.client_update(
      shared, per_client_k, client_state_k, data, cid, key
    )
    start = start_model(inner, shared, per_client_k)
    return _clipped(start, output, clip_norm, per_layer), state

  def aggregate(state, sums, client_ids, round_index, key):
    if stddev > 0:
      summed = {k: v for k, v in sums.total.items() if k != 'weight'}
      noised = dp.noise(summed, jax.random.fold_in(key, NOISE_KEY), stddev)
      sums = sums._replace(total={**sums.total, **noised})
    return inner.aggregate(state, sums, client_ids, round_index, key)

  return inner._replace(
    client_update=client_update,
    aggregate=aggregate,
    contribution=contribution,
  )
