"""Distributed DP with secure aggregation: each client noises its own
integers, so the server never holds a sum without noise.

`distributed(algorithm, calibration)` wraps an algorithm that `private`
accepts (FedAvg and the FedOpt optimizers, FedProx, MOON, FedASAM,
FedMut, SCAFFOLD). Client k trains as the algorithm says, clips its
update Δ_k (its trained model minus the model it was sent, with its
further uploads: SCAFFOLD's control delta) to L2 norm C (`dp.clip`), and
uploads integers modulo 2^b (b = `bits`):

- the update scaled by s = S / C (S integer units to the clip norm),
  rounded stochastically until its norm is at most B =
  `skellam.norm_bound(S, d)` (conditional rounding; d values), plus
  Skellam noise of variance (zB)² / m on each value (`skellam.randomize`,
  a host step inside the client's program: `jax.pure_callback`);
- the model it was sent, clipped to ±R and rounded stochastically at the
  same scale (the server knows it: no noise);
- a weight of 1 and whether the sent model had a value beyond ±R (both
  known to the server).

The round sums them (the engine's fold; deployed, SecAgg+ masks that
cancel modulo 2^b); the server reads the sum as signed integers, divides
by s and gives the algorithm's own aggregate the sum of the models and
the exact number of clients summed, as `private` does: the mean of the
sent models plus the mean of the clipped updates plus noise. Replacing
one client's data moves the integer sum by at most 2B in L2 (whatever
the rounding drew), and any m clients summed carry Skellam noise of
variance at least (zB)²: a round is the Skellam mechanism of Agarwal,
Kairouz and Liu on a sample of K of N (`accounting.SkellamAccountant`),
which a deployed round keeps by refusing to finish with fewer than m of
its clients summed. S is 2^16, or less where b bits would not hold
K clients' sum with 12 standard deviations of noise (`calibrate`).

The noise's seed is SHA-256 of the client's key and a secret: none in a
simulation; on a deployed node, its own random bytes (`node_secret`), so
that the server, which made the key, cannot draw the noise again.
A client's loss is not uploaded (the output's `loss` is NaN; the
round's `train_loss` metric is NaN: a loss summed in the clear would be
a sum without noise), and a non-finite update is uploaded as 0.

References:
  Agarwal, Kairouz, Liu. "The Skellam Mechanism for Differentially Private
  Federated Learning". NeurIPS 2021.
  Kairouz, Liu, Steinke. "The Distributed Discrete Gaussian Mechanism for
  Federated Learning with Secure Aggregation". ICML 2021.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from typing import Any
from typing import Callable
from typing import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.core import types
from fedjax_mr.privacy import dp
from fedjax_mr.privacy import fixed_point
from fedjax_mr.privacy import private
from fedjax_mr.privacy import skellam

# Integer units to the clip norm where the bits allow (the rounding then
# adds d/4 to S² = 2^32 under the bound's root).
MAX_UNITS = 2.0**16
# A scale below this many times √d is refused: the rounding would add
# more than about 0.2 % to the bound (d/4 beside S² = 64 d), and so to
# the noise.
MIN_UNITS_PER_ROOT_DIM = 8.0
# Standard deviations of the summed noise that the bits hold beyond the
# largest sum (a value past them has probability about e^-72, by
# Bernstein's inequality for the Poisson variables).
TAIL = 12.0
# Folded into a client's key for the rounding of the model it was sent.
ROUNDING_KEY = 0x6464
_DOMAIN = b'fedjax_mr distributed dp noise v1'


def min_clients(clients_per_round: int, fraction: float) -> int:
  """m = ⌈fraction · K⌉, at least ⌊K/2⌋ + 1: the fewest clients a round
  may sum (secure aggregation's threshold)."""
  k = int(clients_per_round)
  if k < 1 or not 0.5 < fraction <= 1:
    raise ValueError(
      f'clients_per_round >= 1 and fraction in (1/2, 1] needed, got {k}, '
      f'{fraction}'
    )
  return min(k, max(math.ceil(fraction * k - 1e-9), k // 2 + 1))


class Calibration(NamedTuple):
  """The integers of a run (`calibrate`).

  Attributes:
    dim: d, the values of an update (the model's and further uploads').
    clip_norm: C.
    noise_multiplier: z.
    units: S, integer units to C.
    bound: B, the L2 norm of a client's rounded update.
    client_variance: (zB)² / m, each client's Skellam variance.
    min_clients: m.
    clients_per_round: K.
    bits: b.
    value_range: R, the bound of a sent model's values.
  """

  dim: int
  clip_norm: float
  noise_multiplier: float
  units: float
  bound: float
  client_variance: float
  min_clients: int
  clients_per_round: int
  bits: int
  value_range: float

  @property
  def scale(self) -> float:
    """s = S / C, integer units to one unit of a value."""
    return self.units / self.clip_norm


def _largest_sum(units, dim, c, z, k, m, value_range) -> float:
  bound = skellam.norm_bound(units, dim)
  noise = z * bound * math.sqrt(k / m)
  return k * (units / c * value_range + 1 + bound) + TAIL * noise + 1


def calibrate(
  dim: int,
  clip_norm: float,
  noise_multiplier: float,
  clients_per_round: int,
  min_clients: int,
  bits: int,
  value_range: float,
) -> Calibration:
  """The largest S <= `MAX_UNITS` whose sums fit in `bits` (module
  docstring) and the run's other integers.

  Raises:
    ValueError: an argument out of its range, or `bits` too few for a
      scale of `MIN_UNITS_PER_ROOT_DIM` · √d (the message says how many
      would do).
  """
  d, c, z = int(dim), float(clip_norm), float(noise_multiplier)
  k, m, r = int(clients_per_round), int(min_clients), float(value_range)
  if d < 1 or not 0 < c < math.inf or not 0 < z < math.inf:
    raise ValueError(
      'dim >= 1, a finite clip_norm > 0 and a finite noise_multiplier > 0 '
      f'needed, got {d}, {c}, {z}'
    )
  if not 1 <= m <= k or not 0 < r < math.inf:
    raise ValueError(
      f'min_clients in [1, clients_per_round={k}] and a finite '
      f'value_range > 0 needed, got {m}, {r}'
    )
  fixed_point.levels(bits, k)  # bits in [2, 32], enough for K ones
  top = 2.0 ** (int(bits) - 1) - 1

  def fits(units):
    return _largest_sum(units, d, c, z, k, m, r) <= top

  units = MAX_UNITS
  if not fits(units):
    low, high = 0.0, MAX_UNITS  # fits(low), not fits(high)
    for _ in range(60):
      mid = (low + high) / 2
      low, high = (mid, high) if fits(mid) else (low, mid)
    units = math.floor(low)
  least = MIN_UNITS_PER_ROOT_DIM * math.sqrt(d)
  if units < least:
    raise ValueError(
      f'bits={bits} cannot hold the noised sum of {k} clients at '
      f'value_range={r} and clip_norm={c}: the scale would be {units:g} '
      f'units to the clip norm, below {least:.0f} (8 √d)'
    )
  bound = skellam.norm_bound(units, d)
  return Calibration(
    d, c, z, units, bound, (z * bound) ** 2 / m, m, k, int(bits), r
  )


_SECRET: list[Callable[[int], bytes] | None] = [None]


@contextlib.contextmanager
def node_secret(secret: Callable[[int], bytes]) -> Iterator[None]:
  """Within it, client c's noise is seeded by `secret(c)` (bytes) with its
  key: a deployed node's own random bytes, which the server does not
  hold (a simulation, holding every node's, gives the same bits)."""
  before = _SECRET[0]
  _SECRET[0] = secret
  try:
    yield
  finally:
    _SECRET[0] = before


def _host_randomize(calibration: Calibration):
  """The host step of a client (`skellam.randomize` with its seed)."""

  def run(x, client, key_data):
    secret = b'' if _SECRET[0] is None else bytes(_SECRET[0](int(client)))
    seed = hashlib.sha256(
      _DOMAIN
      + len(secret).to_bytes(4, 'little')
      + secret
      + np.asarray(key_data, '<u4').tobytes()
    ).digest()
    q = skellam.randomize(
      x, calibration.bound, calibration.client_variance, seed
    )
    if np.any(np.abs(q) >= 2**31):
      raise ValueError('a noised value does not fit in 32 bits')
    return q.astype(np.int32)

  return run


def _split(flat: jax.Array, like: Any) -> Any:
  """`flat` cut into leaves of the shapes of `like`'s."""
  leaves, treedef = jax.tree.flatten(like)
  out, at = [], 0
  for leaf in leaves:
    out.append(flat[at : at + leaf.size].reshape(leaf.shape))
    at += leaf.size
  return jax.tree.unflatten(treedef, out)


def _codes(x: Any) -> Any:
  return jax.tree.map(lambda v: jax.lax.bitcast_convert_type(v, jnp.uint32), x)


def _sent_codes(start, calibration: Calibration, key) -> tuple[Any, Any]:
  """The model a client was sent as int32 codes at scale s (clipped to
  ±R, rounded stochastically), and whether a value was beyond ±R."""
  s, r = calibration.scale, calibration.value_range
  leaves, treedef = jax.tree.flatten(start)
  out, beyond = [], jnp.bool_(False)
  for i, leaf in enumerate(leaves):
    x = leaf.astype(jnp.float32)
    beyond = beyond | jnp.any(jnp.abs(x) > r)
    t = jnp.clip(x, -r, r) * jnp.float32(s)
    low = jnp.floor(t)
    draw = jax.random.uniform(jax.random.fold_in(key, i), x.shape)
    out.append(low.astype(jnp.int32) + (draw < t - low).astype(jnp.int32))
  return jax.tree.unflatten(treedef, out), beyond


def dimension(
  algorithm: types.Algorithm, variables: types.Variables, data: Any
) -> int:
  """d: the values of an update of `algorithm` (one that `private.check`
  accepts) for a model like `variables` and clients' `data` (shapes
  only, nothing trained): its model's and its further uploads' (SCAFFOLD's
  control delta)."""
  k = algorithm.clients_per_round or 1
  state = jax.eval_shape(algorithm.init, variables)
  sent = jax.eval_shape(
    algorithm.dispatch,
    state,
    jnp.zeros((k,), jnp.int32),
    jnp.int32(0),
    jax.random.key(0),
  )
  row = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), sent.per_client
  )
  client_state = ()
  if algorithm.init_client_state is not None:
    client_state = jax.eval_shape(algorithm.init_client_state, variables)
  out, _ = jax.eval_shape(
    algorithm.client_update,
    sent.shared,
    row,
    client_state,
    data,
    jnp.int32(0),
    jax.random.key(0),
  )
  leaves = jax.tree.leaves((out.variables, out.extra))
  return sum(int(np.prod(x.shape)) for x in leaves)


def distributed(
  algorithm: types.Algorithm,
  calibration: Calibration,
  per_layer: bool = False,
) -> types.Algorithm:
  """`algorithm` with distributed DP over secure aggregation's integers
  (module docstring).

  Args:
    algorithm: one that `private.check` accepts, with its
      `clients_per_round` K = `calibration.clients_per_round`.
    calibration: `calibrate`'s, for d = `dimension(algorithm, ...)`.
    per_layer: clip each leaf of the update to C / √L (`dp.clip`).

  Returns:
    The wrapped `Algorithm`: the same state, dispatch and sampler; its
    `contribution` is the uint32 upload.
  """
  inner, cal = algorithm, calibration
  if inner.clients_per_round != cal.clients_per_round:
    raise ValueError(
      f'algorithm: built for {inner.clients_per_round} clients a round, '
      f'the calibration for {cal.clients_per_round}'
    )
  host = _host_randomize(cal)
  return inner._replace(
    client_update=functools.partial(
      _client_update, inner, cal, host, per_layer
    ),
    aggregate=functools.partial(_aggregate, inner, cal),
    contribution=lambda output: output.extra,
  )


def _client_update(
  inner, cal, host, per_layer, shared, per_client_k, client_state_k, data,
  cid, key,
):  # fmt: skip
  """`distributed`'s client: trains as `inner`'s, clips its update, and
  uploads the integers of the module docstring (its loss NaN)."""
  output, state = inner.client_update(
    shared, per_client_k, client_state_k, data, cid, key
  )
  start = private.start_model(inner, shared, per_client_k)
  update = private.update_of(start, output)
  clipped, _ = dp.clip(update, cal.clip_norm, per_layer)
  flat = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(clipped)])
  if flat.size != cal.dim:
    raise ValueError(
      f'calibration: made for d={cal.dim}, the update has {flat.size}'
    )
  flat = jnp.where(jnp.all(jnp.isfinite(flat)), flat, 0.0)
  noised = jax.pure_callback(
    host,
    jax.ShapeDtypeStruct(flat.shape, jnp.int32),
    flat * jnp.float32(cal.scale),
    cid,
    jax.random.key_data(key),
    vmap_method='sequential',
  )
  model_part, extra_part = _split(noised, clipped)
  sent, beyond = _sent_codes(start, cal, jax.random.fold_in(key, ROUNDING_KEY))
  upload = {
    'models': _codes(jax.tree.map(jnp.add, sent, model_part)),
    'weight': jnp.uint32(1),
    'clipped': beyond.astype(jnp.uint32),
  }
  if jax.tree.leaves(extra_part):
    upload['controls'] = _codes(extra_part)
  hidden = jnp.float32(jnp.nan)
  return output._replace(loss=hidden, extra=upload), state


def _aggregate(inner, cal, state, sums, client_ids, round_index, key):
  """`distributed`'s server: the sum read as signed integers over the
  scale, the exact count of clients, `inner`'s aggregate."""
  total = sums.total
  step = jnp.float32(1 / cal.scale)

  def values(tree):
    return jax.tree.map(
      lambda t: fixed_point.signed(t, cal.bits).astype(jnp.float32) * step,
      tree,
    )

  count = fixed_point.signed(total['weight'], cal.bits)
  decoded = {
    'weight': count.astype(jnp.float32),
    'models': values(total['models']),
  }
  if 'controls' in total:
    decoded['controls'] = values(total['controls'])
  new, metrics = inner.aggregate(
    state, sums._replace(total=decoded), client_ids, round_index, key
  )
  return new, {
    **metrics,
    'train_loss': jnp.float32(jnp.nan),
    'secagg_clipped': fixed_point.signed(total['clipped'], cal.bits),
    'dp_clients': count,
  }
