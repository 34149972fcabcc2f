"""The privacy of the round's sum, as configured: the config part
`Privacy` (flags `dp_*`, `secure_aggregation`, `secagg_*`), its checks
(`check_privacy`), the run's accountant (`accountant`), distributed DP's
integers (`calibration`) and the devices it runs on (`noise_mesh`). `build`
wraps the algorithm as it says (`build.protected`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from fedjax_mr import privacy
from fedjax_mr.core import config_tree
from fedjax_mr.core import errors
from fedjax_mr.core import types
from fedjax_mr.privacy import distributed_dp
from fedjax_mr.runtime import distributed as distributed_lib

_field = config_tree.field


@dataclasses.dataclass(frozen=True)
class SecureAggregation:
  """Secure aggregation of the round's sum (`fedjax_mr.privacy.secure`;
  deployed, `fedjax_mr.privacy.secagg`)."""

  enabled: bool = _field(
    False,
    "Secure aggregation: each client's contribution encoded as integers "
    'modulo 2^secagg_bits, so that the server reads only their sum (masked '
    'by SecAgg+ on a deployment; equal bits simulated).',
    flag='secure_aggregation',
  )
  bits: int = _field(
    32,
    'Secure aggregation: sums are modulo 2^this (2 to 32).',
    flag='secagg_bits',
  )
  range: float = _field(
    10.0,
    'Secure aggregation: each value of a model (and of what a client '
    'uploads beside it) is clipped to [-this, this]; weighted by examples, '
    "n times them to the largest client's n times this.",
    flag='secagg_range',
  )
  neighbours: int = _field(
    0,
    'Secure aggregation, deployed: each client shares its secrets with '
    'this many others (SecAgg+; even); 0: with every other client of the '
    'round (SecAgg).',
    flag='secagg_neighbours',
  )
  threshold: float = _field(
    2 / 3,
    "Secure aggregation, deployed: the fraction of a client's share "
    'holders (its neighbours and itself) whose shares rebuild its secrets '
    '(over 1/2, at most 1).',
    flag='secagg_threshold',
  )


@dataclasses.dataclass(frozen=True)
class Privacy:
  """The privacy of the round's sum: user-level DP
  (`fedjax_mr.privacy.private`) and secure aggregation
  (`fedjax_mr.privacy.secure`, masked on a deployment)."""

  clip: float = _field(
    0.0,
    "DP: clip each client's update (trained minus sent model) to this L2 "
    'norm C, weigh every client 1, and noise the sum; 0: no DP.',
    flag='dp_clip',
  )
  noise_multiplier: float = _field(
    0.0,
    'DP: the noise on the sum has standard deviation this times the clip '
    'norm (0: none, epsilon infinite).',
    flag='dp_noise_multiplier',
  )
  per_layer: bool = _field(
    False, 'DP: clip each layer to dp_clip / sqrt(L).', flag='dp_per_layer'
  )
  adaptive_quantile: float = _field(
    0.0,
    'DP: adapt the clip norm (dp_clip the first) to this quantile of the '
    'update norms (Andrew et al.); 0: a fixed clip norm.',
    flag='dp_adaptive_quantile',
  )
  delta: float = _field(
    0.0, 'DP: delta of the epsilon reported; 0: 1 / N^1.1.', flag='dp_delta'
  )
  target_epsilon: float = _field(
    0.0,
    'DP: stop before the round whose epsilon would exceed this; 0: none.',
    run_only=True,
    flag='dp_target_epsilon',
  )
  secure: SecureAggregation = config_tree.part(SecureAggregation)


# The flags that say nothing where their feature is off (a run without DP,
# a run without secure aggregation): they do not define such a run.
_DP_ONLY = ('dp_noise_multiplier', 'dp_per_layer', 'dp_adaptive_quantile')
_DP_ONLY += ('dp_delta',)
_SECURE_ONLY = ('secagg_bits', 'secagg_range', 'secagg_neighbours')
_SECURE_ONLY += ('secagg_threshold',)


def inactive_flags(privacy: Privacy) -> tuple[str, ...]:
  """The flags of `privacy` whose feature is off: DP's beside `dp_clip`
  when it is 0, secure aggregation's beside `secure_aggregation` when it
  is off. They are left out of a run's identity, so that a run without
  the feature resumes whatever they hold."""
  out: tuple[str, ...] = ()
  if privacy.clip == 0:
    out += _DP_ONLY
  if not privacy.secure.enabled:
    out += _SECURE_ONLY
  return out


def check_privacy(config: Any) -> None:
  """The privacy part's values (`Privacy`): a clip norm >= 0 (0: no DP),
  noise only with a clip, δ in (0, 1) or 0, a target ε only with noise,
  every client weighing 1, an adaptive quantile in [0, 1) with a first
  clip norm and noise below K / 10, and secure aggregation's (`_secure`).

  Raises:
    ConfigError: naming the field.
  """
  p, n = config.privacy, config.partition.num_clients
  k = config.server.clients_per_round
  rules = [
    (
      p.clip >= 0 and math.isfinite(p.clip),
      f'`dp_clip` must be a finite norm >= 0 (0: no DP), got {p.clip}',
    ),
    (
      p.noise_multiplier >= 0 and math.isfinite(p.noise_multiplier),
      f'`dp_noise_multiplier` must be >= 0, got {p.noise_multiplier}',
    ),
    (
      p.clip > 0 or p.noise_multiplier == 0,
      '`dp_noise_multiplier` needs '
      '`dp_clip` > 0: the noise is proportional to the clip norm',
    ),
    (
      0 <= p.delta < 1,
      f'`dp_delta` must be in [0, 1) (0: 1 / N^1.1 = '
      f'{privacy.default_delta(n):.3g}), got {p.delta}',
    ),
    (
      p.target_epsilon >= 0,
      f'`dp_target_epsilon` must be >= 0 (0: none), got {p.target_epsilon}',
    ),
    (
      p.target_epsilon == 0 or p.noise_multiplier > 0,
      '`dp_target_epsilon` '
      'needs `dp_noise_multiplier` > 0 (without noise epsilon is infinite)',
    ),
    (
      p.clip == 0 or config.server.weighting != 'examples',
      '`weighting='
      'examples` cannot go with `dp_clip`: DP weighs every client 1 (a '
      "weight by examples would let a client's data move the sum further)",
    ),
    (
      0 <= p.adaptive_quantile < 1,
      '`dp_adaptive_quantile` must be in [0, 1) (0: a fixed clip norm), '
      f'got {p.adaptive_quantile}',
    ),
    (
      not p.adaptive_quantile or p.clip > 0,
      '`dp_adaptive_quantile` needs `dp_clip` > 0, the first clip norm',
    ),
    (
      not p.adaptive_quantile or p.noise_multiplier < k / 10,
      '`dp_adaptive_quantile` needs `dp_noise_multiplier` < K / 10 = '
      f'{k / 10:g}: the count of clients within the clip norm takes noise '
      'of K / 20, the rest is left for the sum',
    ),
  ]
  for ok, message in rules + _secure(config):
    if not ok:
      raise errors.ConfigError(message)


def distributed(privacy_part: Privacy) -> bool:
  """Whether the run is distributed DP (`privacy.distributed_dp`): noise
  with secure aggregation, drawn by the clients."""
  p = privacy_part
  return p.clip > 0 and p.noise_multiplier > 0 and p.secure.enabled


def _secure(config: Any) -> list[tuple[bool, str]]:
  """Secure aggregation's rules (where it is on): 2 to 32 bits that hold
  K clients' sum, a finite range of at least 1, at least two clients, an
  even number of neighbours below K (0: all), a threshold over 1/2, and
  with noise a fixed clip norm (the bits' fit with the noise is
  `calibration`'s, which knows the model)."""
  p, s = config.privacy, config.privacy.secure
  if not s.enabled:
    return []
  k = config.server.clients_per_round
  bits_ok = 2 <= s.bits <= 32
  return [
    (bits_ok, f'`secagg_bits` must be in [2, 32], got {s.bits}'),
    (
      not bits_ok or 2 ** (s.bits - 1) - 1 >= k,
      f'`secagg_bits={s.bits}` cannot hold the sum of '
      f'`clients_per_round={k}` clients: 2^(bits-1) - 1 < K',
    ),
    (
      s.range >= 1 and math.isfinite(s.range),
      f'`secagg_range` must be finite and at least 1 (a client weighs 1, '
      f"or its share of the largest client's examples), got {s.range}",
    ),
    (
      k >= 2,
      '`secure_aggregation` needs `clients_per_round` >= 2: the sum of one '
      "client is that client's",
    ),
    (
      s.neighbours == 0 or (2 <= s.neighbours < k and s.neighbours % 2 == 0),
      '`secagg_neighbours` must be 0 (every other client) or even, at '
      f'least 2 and below `clients_per_round={k}`, got '
      f'{s.neighbours}',
    ),
    (
      0.5 < s.threshold <= 1,
      '`secagg_threshold` must be over 1/2 (else a server could get both '
      "kinds of a client's shares) and at most 1, got "
      f'{s.threshold}',
    ),
    (
      p.noise_multiplier == 0 or not p.adaptive_quantile,
      '`dp_adaptive_quantile` cannot go with `secure_aggregation` and '
      '`dp_noise_multiplier` > 0: the clients draw the noise in integer '
      'units set from `dp_clip` before the run, and the count of clients '
      'within the clip norm would be a sum without noise',
    ),
  ]


def accountant(
  config: Any,
  algorithm: types.Algorithm | None = None,
  variables: types.Variables | None = None,
  data: Any = None,
) -> privacy.Accountant | None:
  """The run's privacy accountant (`dp_clip` set), else None: the
  Gaussian's, or with noise and secure aggregation the Skellam
  mechanism's (`privacy.SkellamAccountant`), which needs the algorithm
  as the registry builds it (`build.registry_algorithm`), the model and the
  clients' data."""
  p, n = config.privacy, config.partition.num_clients
  if p.clip == 0:
    return None
  k = config.server.clients_per_round
  delta = p.delta or privacy.default_delta(n)
  if not distributed(p):
    return privacy.Accountant(p.noise_multiplier, n, k, delta)
  if algorithm is None or variables is None or data is None:
    raise ValueError('algorithm, variables, data: distributed DP needs them')
  cal = calibration(config, algorithm, variables, data)
  return privacy.SkellamAccountant(
    p.noise_multiplier, n, k, delta, cal.bound, cal.dim
  )


def calibration(
  config: Any,
  algorithm: types.Algorithm,
  variables: types.Variables,
  data: Any,
) -> distributed_dp.Calibration:
  """The integers of distributed DP (`distributed_dp.calibrate`) for
  `algorithm` (the registry's), the model `variables` and the clients'
  `data`.

  Raises:
    ConfigError: too few `secagg_bits` for them.
  """
  p, s = config.privacy, config.privacy.secure
  k = config.server.clients_per_round
  try:
    return distributed_dp.calibrate(
      distributed_dp.dimension(algorithm, variables, data),
      p.clip,
      p.noise_multiplier,
      k,
      distributed_dp.min_clients(k, s.threshold),
      s.bits,
      s.range,
    )
  except ValueError as e:
    raise errors.ConfigError(
      f'`secagg_bits={s.bits}` is too few for distributed DP: {e}; more '
      'bits, a smaller `secagg_range` or fewer clients a round'
    ) from None


def noise_mesh(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
  """`mesh`, or one device of it where it is several CPU devices:
  distributed DP's clients draw their noise on the host from inside the
  round (`jax.pure_callback`), whose arguments JAX first puts on CPU
  device 0; a callback from another CPU device of the same program then
  waits for device 0, which waits for it (a deadlock). Accelerators run
  the program, not CPU device 0, and keep their mesh.

  Raises:
    ConfigError: several processes of CPU devices.
  """
  if mesh.devices.size == 1 or mesh.devices.flat[0].platform != 'cpu':
    return mesh
  if jax.process_count() > 1:
    raise errors.ConfigError(
      '`secure_aggregation` with `dp_noise_multiplier` > 0 runs on one CPU '
      'device (its clients draw their noise on the host, from inside the '
      'round); run one process'
    )
  return distributed_lib.make_mesh(1)
