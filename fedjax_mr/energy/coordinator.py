"""The local energy coordinator and the server deadline (FedStitch §IV-D).

Per round, the server sends every participant a deadline T: the slowest
completion time of the last round, scaled when the stitched network gets
deeper or the candidate pool changes size. Each client then picks the DVFS
configuration that finishes before T at the least energy:

  Eq. 4  t_k = c·D / f_k                time of D samples at frequency f_k
  Eq. 5  E_k = P_k·t_k + P_idle·(T − t_k)   energy in the deadline window
  Eq. 6  k* = argmin_k E_k
  Eq. 7  subject to t_k <= T

Our choices where the paper is open:

* Eq. 4 generalised: t_k = t_0 / speedup_k, where t_0 is the time at the
  profile's first configuration (measured, or c·D / f_0). Eq. 4 is the case
  speedup_k = f_k / f_0; profiled speed-ups also cover memory-bound work
  (the TX2 table's 1.38x for 1.67x the CPU clock).
* Eq. 5's two inference phases (current stitched network and pre-trained
  network) are folded into one active phase at power P_k.
* The paper tunes f up and down until t is just under T. With a handful of
  configurations we evaluate them all and take the least-energy one with
  t_k <= T·(1 − margin); this is the same answer when energy falls with the
  clock, and the right one when it does not. If none fits, the fastest.
* Feedback: the measured round time corrects the time model through a
  multiplicative scale s, updated as an exponential moving average
  s ← (1 − α)·s + α·s·t_measured / t_predicted.
* Deadline factors are parameters (default 1): `deadline_factors` offers
  depth and pool-size ratios, since a candidate's inference cost grows with
  the depth of the stitched network and the round's work with the number of
  candidate blocks.

References:
  FedStitch, §III Q3 (Table II, Principle 3) and §IV-D (Eqs. 4-7).
"""

import math
from typing import NamedTuple
from typing import Sequence

from fedjax_mr.energy import profiles


def cycle_time_s(
  cycles_per_sample: float, num_samples: float, freq_hz: float
) -> float:
  """Eq. 4: time to process `num_samples` at `freq_hz`, c·D/f seconds."""
  return cycles_per_sample * num_samples / freq_hz


def reference_time_s(
  profile: profiles.DeviceProfile,
  *,
  base_time_s: float | None = None,
  num_samples: float | None = None,
) -> float:
  """Time of the work at `profile.configs[0]`, from seconds or from samples.

  Args:
    profile: the device profile.
    base_time_s: the time at configs[0], if known directly.
    num_samples: D, the number of samples (needs the profile's c and f_0).

  Returns:
    t_0 in seconds.
  """
  if (base_time_s is None) == (num_samples is None):
    raise ValueError('give exactly one of base_time_s and num_samples')
  if base_time_s is not None:
    return float(base_time_s)
  if profile.cycles_per_sample is None:
    raise ValueError(
      f'profile {profile.name} has no cycles_per_sample: give base_time_s'
    )
  return cycle_time_s(profile.cycles_per_sample, num_samples, profile.ref_hz)


def predict_times(
  profile: profiles.DeviceProfile, base_s: float, time_scale: float = 1.0
) -> tuple[float, ...]:
  """Predicted time at every configuration: s·t_0 / speedup_k [K]."""
  return tuple(base_s * time_scale / u for u in profile.speedup)


def predict_energies(
  profile: profiles.DeviceProfile,
  times_s: Sequence[float],
  deadline_s: float,
) -> tuple[float, ...]:
  """Eq. 5: E_k = P_k·t_k + P_idle·max(0, T − t_k) in J [K]."""
  return tuple(
    p * t + profile.p_idle_w * max(0.0, deadline_s - t)
    for p, t in zip(profile.p_active_w, times_s)
  )


class Choice(NamedTuple):
  """The coordinator's decision for one round.

  Attributes:
    index: chosen configuration index.
    config: the chosen configuration.
    time_s: its predicted time.
    energy_j: its predicted energy in the deadline window.
    feasible: whether it meets the deadline with the margin.
    deadline_s: the deadline T.
    times_s: predicted time of every configuration [K].
    energies_j: predicted energy of every configuration [K].
  """

  index: int
  config: profiles.DvfsConfig
  time_s: float
  energy_j: float
  feasible: bool
  deadline_s: float
  times_s: tuple[float, ...]
  energies_j: tuple[float, ...]


def choose_config(
  profile: profiles.DeviceProfile,
  deadline_s: float,
  *,
  base_time_s: float | None = None,
  num_samples: float | None = None,
  time_scale: float = 1.0,
  margin: float = 0.05,
) -> Choice:
  """Eqs. 6-7: the least-energy configuration that meets the deadline.

  Args:
    profile: the device profile.
    deadline_s: T, the server's deadline for this round (s).
    base_time_s: the work's time at configs[0] (or give num_samples).
    num_samples: D, for Eq. 4 with the profile's c and f_0.
    time_scale: feedback correction of the time model (1 = trust it).
    margin: a configuration is feasible if t_k <= T·(1 − margin).

  Returns:
    The least-energy feasible configuration (ties: the faster one); if none
    is feasible, the fastest.

  References:
    FedStitch §IV-D, Eqs. 4-7.
  """
  if not 0 <= margin < 1:
    raise ValueError(f'margin must be in [0, 1): {margin}')
  if not deadline_s > 0 or math.isinf(deadline_s):
    raise ValueError(f'deadline_s must be finite and > 0: {deadline_s}')
  t0 = reference_time_s(
    profile, base_time_s=base_time_s, num_samples=num_samples
  )
  times = predict_times(profile, t0, time_scale)
  energies = predict_energies(profile, times, deadline_s)
  limit = deadline_s * (1 - margin)
  feasible = [k for k, t in enumerate(times) if t <= limit]
  if feasible:
    k = min(feasible, key=lambda i: (energies[i], times[i]))
  else:
    k = min(range(len(times)), key=lambda i: times[i])
  return Choice(
    index=k,
    config=profile.configs[k],
    time_s=times[k],
    energy_j=energies[k],
    feasible=bool(feasible),
    deadline_s=deadline_s,
    times_s=times,
    energies_j=energies,
  )


def update_time_scale(
  time_scale: float, predicted_s: float, measured_s: float, alpha: float = 0.5
) -> float:
  """Feedback: moves the time-model scale toward what the round measured.

  Args:
    time_scale: the scale used for the prediction.
    predicted_s: the predicted time (made with `time_scale`).
    measured_s: the measured time of the same work and configuration.
    alpha: EMA weight of the new observation, in (0, 1].

  Returns:
    (1 − α)·s + α·s·measured/predicted; with α = 1 the model then predicts
    the measured time exactly.
  """
  if not 0 < alpha <= 1:
    raise ValueError(f'alpha must be in (0, 1]: {alpha}')
  if predicted_s <= 0 or measured_s <= 0:
    raise ValueError('predicted and measured times must be > 0')
  target = time_scale * measured_s / predicted_s
  return (1 - alpha) * time_scale + alpha * target


def server_deadline(
  prev_completion_s: Sequence[float],
  *,
  depth_factor: float = 1.0,
  pool_factor: float = 1.0,
) -> float:
  """The round's deadline: last round's slowest completion time, scaled.

  Args:
    prev_completion_s: completion time of every client of the last round.
    depth_factor: how much longer one candidate takes this round (e.g.
      depth / previous depth); 1 when the stitched network kept its depth.
    pool_factor: how much more work the candidate pool is (e.g. pool size /
      previous pool size); 1 when the pool kept its size.

  Returns:
    max_i t_i × depth_factor × pool_factor, in seconds.
  """
  if not prev_completion_s:
    raise ValueError('no completion times from the last round')
  if depth_factor <= 0 or pool_factor <= 0:
    raise ValueError('deadline factors must be > 0')
  return max(prev_completion_s) * depth_factor * pool_factor


def deadline_factors(
  prev_depth: int, depth: int, prev_pool_size: int, pool_size: int
) -> tuple[float, float]:
  """(depth_factor, pool_factor) as plain ratios: our choice of the factors.

  A candidate's forward pass grows with the stitched network's depth, and a
  round evaluates every candidate in the pool.
  """
  if min(prev_depth, depth, prev_pool_size, pool_size) <= 0:
    raise ValueError('depths and pool sizes must be > 0')
  return depth / prev_depth, pool_size / prev_pool_size
