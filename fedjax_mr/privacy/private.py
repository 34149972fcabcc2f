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
`adaptive` is the same with a clip norm that follows a quantile of the
updates' norms (Andrew et al., 2021).

References:
  McMahan, Ramage, Talwar, Zhang. "Learning Differentially Private
  Recurrent Language Models". ICLR 2018.
"""

from __future__ import annotations

import functools
import math
from typing import Any
from typing import NamedTuple

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


def update_of(start: types.Variables, output: types.ClientOutput) -> tuple:
  """A client's update, in float32: `(trained - start, extra)`, the
  model's change from the model it was sent and its further uploads
  (SCAFFOLD's control delta)."""
  return (
    jax.tree.map(
      lambda t, s: t.astype(jnp.float32) - s.astype(jnp.float32),
      output.variables,
      start,
    ),
    jax.tree.map(lambda e: e.astype(jnp.float32), output.extra),
  )


def _clipped(
  start: types.Variables,
  output: types.ClientOutput,
  clip_norm: float,
  per_layer: bool,
) -> tuple[types.ClientOutput, jax.Array]:
  """`(output, norm)`: `output` with its update clipped (`dp.clip`): the
  model's change from `start` and its further uploads (`extra`: SCAFFOLD's
  control delta) together, a leaf that no factor below 1 scales kept as
  trained; and the update's norm before."""
  update = update_of(start, output)
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
  return output._replace(variables=variables, extra=extra), norm


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
  `contribution` (its server reads the K models, not their sum), other
  sums than FedAvg's mean of models and SCAFFOLD's control deltas
  (FedExP's squared norms), or a dispatch in which the model a client is
  sent cannot be found (`start_model`)."""
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
    return _clipped(start, output, clip_norm, per_layer)[0], state

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


# Folded into the round's key for the noise of the count of clients whose
# update was within the clip norm (adaptive clipping).
COUNT_KEY = 0x6462


class AdaptiveState(NamedTuple):
  """The state of an algorithm wrapped by `adaptive`: the algorithm's own
  and the clip norm the next round's clients clip to.

  Attributes:
    inner: the wrapped algorithm's state.
    clip_norm: float32 scalar, C of the next round.
  """

  inner: Any
  clip_norm: jax.Array

  @property
  def params(self) -> types.Variables:
    return self.inner.params


def adaptive(
  algorithm: types.Algorithm,
  clip_norm: float,
  noise_multiplier: float,
  quantile: float,
  per_layer: bool = False,
  learning_rate: float = 0.2,
  count_stddev: float | None = None,
) -> types.Algorithm:
  """`private` with the clip norm adapting to a quantile of the updates'
  norms (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private
  Learning with Adaptive Clipping", NeurIPS 2021): each round's clients
  clip to the C the dispatch sends them and report whether their update's
  norm was at most C; the server noises that count (standard deviation
  σ_b, `dp.noised_fraction`), steps C toward the `quantile` γ
  geometrically (`dp.next_clip_norm`, rate η = `learning_rate`), and noises
  the sum with multiplier z_Δ = `dp.update_noise_multiplier(z, σ_b)`, so
  that a round costs what one Gaussian of multiplier z costs (the
  accountant's z). σ_b defaults to K / 20 (their choice). Metrics:
  'dp_clip_norm', the C of the round.

  Args:
    algorithm: one that `check` accepts, with its `clients_per_round`.
    clip_norm: the first round's C > 0.
    noise_multiplier: z >= 0 (0: neither sum nor count noised).
    quantile: γ in [0, 1].
    per_layer: as `private`'s.
    learning_rate: η > 0.
    count_stddev: σ_b (> z / 2 with noise); None: K / 20.

  Returns:
    The wrapped `Algorithm`, its state an `AdaptiveState`.
  """
  if not 0 < clip_norm < math.inf:
    raise ValueError(f'clip_norm must be finite and > 0, got {clip_norm}')
  if not 0 <= quantile <= 1:
    raise ValueError(f'quantile must be in [0, 1], got {quantile}')
  if not learning_rate > 0:
    raise ValueError(f'learning_rate must be > 0, got {learning_rate}')
  inner = algorithm
  k = inner.clients_per_round
  if not k:
    raise ValueError('algorithm: its clients_per_round is needed')
  sigma_b = k / 20 if count_stddev is None else float(count_stddev)
  z = float(noise_multiplier)
  z_update = dp.update_noise_multiplier(z, sigma_b) if z > 0 else 0.0

  def init(variables):
    return AdaptiveState(inner.init(variables), jnp.float32(clip_norm))

  def dispatch(state, client_ids, round_index, key):
    sent = inner.dispatch(state.inner, client_ids, round_index, key)
    return sent._replace(shared=(sent.shared, state.clip_norm))

  def client_model(shared, per_client_k):
    return start_model(inner, shared[0], per_client_k)

  def aggregate(state, sums, client_ids, round_index, key):
    clip = state.clip_norm
    sums, fraction = _noised_adaptive(sums, key, k, z_update, clip, sigma_b)
    new, metrics = inner.aggregate(
      state.inner, sums, client_ids, round_index, key
    )
    step = dp.next_clip_norm(clip, fraction, quantile, learning_rate)
    return AdaptiveState(new, step), {**metrics, 'dp_clip_norm': clip}

  return inner._replace(
    init=init,
    dispatch=dispatch,
    client_update=functools.partial(_adaptive_update, inner, per_layer),
    aggregate=aggregate,
    contribution=functools.partial(_adaptive_contribution, inner),
    client_model=client_model,
  )


def _adaptive_update(
  inner, per_layer, shared, per_client_k, client_state_k, data, cid, key
):
  """`adaptive`'s client: trains as `inner`'s, clips to the dispatched C,
  and uploads, beside its own further uploads, whether its update's norm
  was at most C (1.0 or 0.0)."""
  own, clip = shared
  output, state = inner.client_update(
    own, per_client_k, client_state_k, data, cid, key
  )
  start = start_model(inner, own, per_client_k)
  clipped, norm = _clipped(start, output, clip, per_layer)
  below = (norm <= clip).astype(jnp.float32)
  return clipped._replace(extra=(clipped.extra, below)), state


def _adaptive_contribution(inner, output: types.ClientOutput) -> dict:
  """`_contribution` of an `_adaptive_update` upload, and its report."""
  own, below = output.extra
  output = output._replace(extra=own)
  controls = 'controls' in jax.eval_shape(inner.contribution, output)
  return {**_contribution(output, controls), 'below': below}


def _noised_adaptive(
  sums: types.Sums,
  key: jax.Array,
  k: int,
  z_update: float,
  clip: jax.Array,
  count_stddev: float,
) -> tuple[types.Sums, jax.Array]:
  """`(sums, fraction)`: the sums without the count of reports, each noised
  by z_update · `clip`, and the fraction of the `k` clients that were
  within the clip norm, noised by `count_stddev`; nothing noised where
  `z_update` is 0."""
  total = dict(sums.total)
  below = total.pop('below')
  if not z_update:
    return sums._replace(total=total), below / k
  summed = {name: v for name, v in total.items() if name != 'weight'}
  noise_key = jax.random.fold_in(key, NOISE_KEY)
  total.update(dp.noise(summed, noise_key, z_update * clip))
  fraction = dp.noised_fraction(
    below, k, jax.random.fold_in(key, COUNT_KEY), count_stddev
  )
  return sums._replace(total=total), fraction
