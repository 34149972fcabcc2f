"""Simulated rounds: energy and time with the coordinator vs the default.

The default governor runs inference at the highest frequency (FedStitch
Table II: 98% of the selection time); the coordinator picks each client's
configuration against the server's deadline. Both are simulated on the same
workloads and devices; every client waits, at idle power, until the round's
slowest client is done. Plain numbers in, a plain report out:

    clients = assign_profiles('tx2_chained@1:0.5,tx2_chained@0.5:0.5', 20)
    report = simulate(workloads, clients, client_ids=ids)
    report.to_dict()  # JSON-ready

Training runs give their workloads by `training_workloads` (examples ×
local epochs × seconds per example). FedStitch runs do not replay: their
clients' coordinators choose and measure inside the round loop (`fleet`).

A mix spec is 'profile[@speed]:weight,...': `profile` is a built-in name
('tx2_literal', 'tx2_chained') or a JSON profile file, `speed` the device's
speed relative to the profile (0.5 takes twice as long; default 1), and the
weights are normalised. Counts are rounded by largest remainder, then shuffled
with the seed.
"""

import math
from typing import Any
from typing import Callable
from typing import NamedTuple
from typing import Sequence

import numpy as np

from fedjax_mr.energy import coordinator
from fedjax_mr.energy import profiles

WORK_UNITS = ('seconds', 'samples')
DEADLINE_MODES = ('previous', 'oracle')


class SimClient(NamedTuple):
  """A simulated device: a profile, run `speed` times as fast."""

  profile: profiles.DeviceProfile
  speed: float = 1.0
  label: str = ''


def parse_mix(spec: str) -> list[tuple[str, float, float]]:
  """Parses `name[@speed][:weight],...` into (name, speed, weight) triples."""
  entries = []
  for item in spec.split(','):
    item = item.strip()
    if not item:
      continue
    name, _, weight = item.partition(':')
    name, _, speed = name.partition('@')
    try:
      entry = (name.strip(), float(speed or 1), float(weight or 1))
    except ValueError:
      raise ValueError(f'bad mix entry {item!r}: want name[@speed][:weight]')
    if not entry[0] or entry[1] <= 0 or entry[2] < 0:
      raise ValueError(f'bad mix entry {item!r}: want name[@speed][:weight]')
    entries.append(entry)
  if not entries or sum(w for _, _, w in entries) <= 0:
    raise ValueError(f'empty mix spec {spec!r}')
  return entries


def assign_profiles(
  mix: str, num_clients: int, seed: int = 0
) -> tuple[SimClient, ...]:
  """Assigns devices to clients 0..num_clients-1 following a mix spec.

  Args:
    mix: 'profile[@speed]:weight,...', e.g. 'tx2_literal:0.5,tx2_chained:0.5'.
    num_clients: number of simulated clients.
    seed: shuffles which client gets which device.

  Returns:
    One `SimClient` per client id; the counts follow the weights (largest
    remainder rounding).
  """
  entries = parse_mix(mix)
  total = sum(w for _, _, w in entries)
  quotas = [num_clients * w / total for _, _, w in entries]
  counts = [math.floor(q) for q in quotas]
  by_remainder = sorted(
    range(len(entries)), key=lambda i: (counts[i] - quotas[i], i)
  )
  for i in by_remainder[: num_clients - sum(counts)]:
    counts[i] += 1
  pool = []
  for (name, speed, _), n in zip(entries, counts):
    profile = profiles.get_profile(name)
    label = name if speed == 1 else f'{name}@{speed:g}'
    pool += [SimClient(profile, speed, label)] * n
  order = np.random.default_rng(seed).permutation(num_clients)
  return tuple(pool[i] for i in order)


def sample_rounds(
  num_clients: int,
  clients_per_round: int,
  num_rounds: int,
  *,
  base_s: float = 10.0,
  spread: float = 0.5,
  seed: int = 0,
) -> tuple[list[list[int]], list[list[float]]]:
  """Seeded participants and workloads for a simulation.

  Every client has a fixed amount of local work, uniform in
  base_s·[1 − spread, 1 + spread] seconds at the profile's first
  configuration (its data size); every round samples `clients_per_round`
  clients without replacement.

  Returns:
    (client_ids, workloads): per round, the participants and their work.
  """
  rng = np.random.default_rng(seed)
  work = base_s * rng.uniform(1 - spread, 1 + spread, size=num_clients)
  client_ids, workloads = [], []
  for _ in range(num_rounds):
    ids = sorted(
      int(i) for i in rng.choice(num_clients, clients_per_round, replace=False)
    )
    client_ids.append(ids)
    workloads.append([float(work[i]) for i in ids])
  return client_ids, workloads


def training_workloads(
  client_ids: Sequence[Sequence[int]],
  sizes: Sequence[int],
  local_epochs: int,
  seconds_per_sample: float,
) -> list[list[float]]:
  """The local work of training rounds, in seconds at a profile's first
  configuration.

  A client trains `local_epochs` passes over its `sizes[i]` examples, each
  example taking `seconds_per_sample` on the reference device. The
  coordinator's saving does not depend on that constant (every time, and so
  every energy, scales with it); the reported times do.

  Args:
    client_ids: per round, the participants.
    sizes: every client's number of training examples.
    local_epochs: local passes per round.
    seconds_per_sample: training time per example at the reference
      configuration.

  Returns:
    Per round, each participant's work (the `workloads` of `simulate`).
  """
  if local_epochs < 1 or seconds_per_sample <= 0:
    raise ValueError(
      'local_epochs must be ≥ 1 and seconds_per_sample > 0, got '
      f'{local_epochs} and {seconds_per_sample}'
    )
  work = []
  for r, ids in enumerate(client_ids):
    bad = [i for i in ids if not 0 <= i < len(sizes)]
    if bad:
      raise ValueError(
        f'round {r}: client ids {bad} outside the {len(sizes)} clients'
      )
    work.append(
      [local_epochs * int(sizes[i]) * seconds_per_sample for i in ids]
    )
  return work


class RoundReport(NamedTuple):
  """One simulated round.

  Attributes:
    round: round index.
    clients: participating client ids.
    deadline_s: the deadline the coordinator got (None: first round).
    default_time_s: round time at the highest frequency (slowest client).
    default_energy_j: all participants' energy, at the highest frequency.
    coordinated_time_s: round time with the coordinator.
    coordinated_energy_j: all participants' energy with the coordinator.
    configs: the configuration index each participant ran.
    missed: participants that finished after the deadline.
  """

  round: int
  clients: tuple[int, ...]
  deadline_s: float | None
  default_time_s: float
  default_energy_j: float
  coordinated_time_s: float
  coordinated_energy_j: float
  configs: tuple[int, ...]
  missed: int


class SimulationReport(NamedTuple):
  """Totals over all rounds; `to_dict()` gives a JSON-ready dict."""

  rounds: tuple[RoundReport, ...]
  client_labels: tuple[str, ...]
  default_time_s: float
  default_energy_j: float
  coordinated_time_s: float
  coordinated_energy_j: float

  @property
  def energy_saving(self) -> float:
    """1 − coordinated / default energy."""
    return 1 - self.coordinated_energy_j / self.default_energy_j

  @property
  def time_change(self) -> float:
    """coordinated / default time − 1 (> 0: the coordinator is slower)."""
    return self.coordinated_time_s / self.default_time_s - 1

  @property
  def missed(self) -> int:
    """Participations that finished after their round's deadline."""
    return sum(r.missed for r in self.rounds)

  def summary(self) -> dict[str, Any]:
    """Totals and per-round figures, JSON-ready (no client labels)."""
    d = self.to_dict()
    del d['client_labels']
    d['missed'] = self.missed
    return d

  def to_dict(self) -> dict[str, Any]:
    return {
      'default_time_s': self.default_time_s,
      'default_energy_j': self.default_energy_j,
      'coordinated_time_s': self.coordinated_time_s,
      'coordinated_energy_j': self.coordinated_energy_j,
      'energy_saving': self.energy_saving,
      'time_change': self.time_change,
      'client_labels': list(self.client_labels),
      'rounds': [
        {
          k: list(v) if isinstance(v, tuple) else v
          for k, v in r._asdict().items()
        }
        for r in self.rounds
      ],
    }


def _round_energy(
  clients: Sequence[SimClient], configs: Sequence[int], times: Sequence[float]
) -> tuple[float, float]:
  """(round time, energy): active time at P_k, then idle until the last."""
  round_time = max(times)
  energy = sum(
    c.profile.p_active_w[k] * t + c.profile.p_idle_w * (round_time - t)
    for c, k, t in zip(clients, configs, times)
  )
  return round_time, energy


def _time_factors(
  num_clients: int,
  model_error: float,
  time_factors: Sequence[float] | None,
  seed: int,
) -> Sequence[float]:
  """Each client's true time over its predicted time (see `simulate`)."""
  if time_factors is None:
    rng = np.random.default_rng(seed)
    return 1 + model_error * rng.uniform(-1, 1, size=num_clients)
  if len(time_factors) != num_clients:
    raise ValueError('time_factors needs one factor per client')
  return list(time_factors)


def _base_times(
  devices: Sequence[SimClient], works: Sequence[float], work_unit: str
) -> list[float]:
  """Each client's time at configuration 0 on its own device."""
  base = []
  for c, w in zip(devices, works):
    if work_unit == 'seconds':
      t0 = coordinator.reference_time_s(c.profile, base_time_s=w)
    else:
      t0 = coordinator.reference_time_s(c.profile, num_samples=w)
    base.append(t0 / c.speed)
  return base


def _deadline(
  deadline_mode: str,
  default_round: float,
  prev_times: Sequence[float] | None,
  deadline_factors: Sequence[float] | None,
  r: int,
) -> float | None:
  """Round `r`'s deadline for the coordinators (see `simulate`); None:
  none yet (the first round of mode 'previous')."""
  if deadline_mode == 'oracle':
    return default_round
  if prev_times is None:
    return None
  factor = deadline_factors[r] if deadline_factors is not None else 1.0
  return coordinator.server_deadline(prev_times) * factor


def _coordinated(
  devices: Sequence[SimClient],
  ids: Sequence[int],
  base: Sequence[float],
  true_time: Callable[[int, int], float],
  scale: list[float],
  deadline: float | None,
  margin: float,
  alpha: float,
) -> tuple[list[int], list[float]]:
  """One round under the coordinators: each participant j picks its
  configuration against `deadline` (the fastest without one), runs it for
  `true_time(j, k)` and updates its feedback `scale[ids[j]]` in place.

  Returns:
    (chosen configurations, true times), per participant.
  """
  chosen, times = [], []
  for j, c in enumerate(devices):
    i = ids[j]
    if deadline is None:
      k = c.profile.fastest
      predicted = base[j] * scale[i] / c.profile.speedup[k]
    else:
      choice = coordinator.choose_config(
        c.profile,
        deadline,
        base_time_s=base[j],
        time_scale=scale[i],
        margin=margin,
      )
      k, predicted = choice.index, choice.time_s
    t = true_time(j, k)
    scale[i] = coordinator.update_time_scale(scale[i], predicted, t, alpha)
    chosen.append(k)
    times.append(t)
  return chosen, times


def simulate(
  workloads: Sequence[Sequence[float]],
  clients: Sequence[SimClient],
  *,
  client_ids: Sequence[Sequence[int]] | None = None,
  work_unit: str = 'seconds',
  margin: float = 0.05,
  alpha: float = 0.5,
  deadline_mode: str = 'previous',
  deadline_factors: Sequence[float] | None = None,
  model_error: float = 0.0,
  time_factors: Sequence[float] | None = None,
  seed: int = 0,
) -> SimulationReport:
  """Simulates rounds with the coordinator and with the default governor.

  Args:
    workloads: per round, the work of each participant `[R][n_r]`: seconds at
      the profile's first configuration (`work_unit='seconds'`) or a number
      of samples (`'samples'`, needs the profile's cycles_per_sample).
    clients: the device of every client id (see `assign_profiles`).
    client_ids: per round, the participants' ids `[R][n_r]`; by default
      0..n_r-1.
    work_unit: 'seconds' or 'samples'.
    margin: the coordinator's deadline margin (see `choose_config`).
    alpha: feedback weight of the time model (see `update_time_scale`).
    deadline_mode: 'previous' (the paper: last round's slowest completion
      time, times `deadline_factors`; the first round runs at the highest
      frequency) or 'oracle' (this round's time at the highest frequency, a
      bound on what the coordinator can save without slowing any round).
    deadline_factors: per round, the depth × pool-size factor applied to the
      last round's time (index 0 unused); default 1.
    model_error: each client's true time is its predicted time times a
      persistent factor uniform in [1 − e, 1 + e] (seeded), which feedback
      has to learn; 0 makes the model exact.
    time_factors: the per-client factors themselves (overrides model_error).
    seed: seeds the model-error factors.

  Returns:
    Per-round and total time and energy under both policies.
  """
  client_ids = _checked_ids(workloads, client_ids, work_unit, deadline_mode)
  bias = _time_factors(len(clients), model_error, time_factors, seed)
  scale = [1.0] * len(clients)  # The coordinators' feedback state.

  rounds = []
  prev_times = None
  for r, (ids, works) in enumerate(zip(client_ids, workloads)):
    report, prev_times = _simulate_round(
      r,
      ids,
      works,
      clients,
      bias,
      scale,
      prev_times,
      work_unit=work_unit,
      margin=margin,
      alpha=alpha,
      deadline_mode=deadline_mode,
      deadline_factors=deadline_factors,
    )
    rounds.append(report)
  return _report(rounds, clients)


def _simulate_round(
  r: int,
  ids: Sequence[int],
  works: Sequence[float],
  clients: Sequence[SimClient],
  bias: Sequence[float],
  scale: list[float],
  prev_times: Sequence[float] | None,
  *,
  work_unit: str,
  margin: float,
  alpha: float,
  deadline_mode: str,
  deadline_factors: Sequence[float] | None,
) -> tuple[RoundReport, list[float]]:
  """Round `r` (participants `ids`, their `works`) under the default
  governor and under the coordinators, whose feedback `scale` it updates;
  returns its report and the coordinated true times (the next round's
  `prev_times`). The options are `simulate`'s."""
  if len(ids) != len(works):
    raise ValueError(f'round {r}: {len(ids)} clients, {len(works)} workloads')
  devices = [clients[i] for i in ids]
  base = _base_times(devices, works, work_unit)

  def true_time(j, k):
    return base[j] * bias[ids[j]] / devices[j].profile.speedup[k]

  fastest = [c.profile.fastest for c in devices]
  default_times = [true_time(j, k) for j, k in enumerate(fastest)]
  default_round, default_energy = _round_energy(devices, fastest, default_times)

  deadline = _deadline(
    deadline_mode, default_round, prev_times, deadline_factors, r
  )
  chosen, times = _coordinated(
    devices, ids, base, true_time, scale, deadline, margin, alpha
  )
  coord_round, coord_energy = _round_energy(devices, chosen, times)
  report = RoundReport(
    round=r,
    clients=tuple(ids),
    deadline_s=deadline,
    default_time_s=default_round,
    default_energy_j=default_energy,
    coordinated_time_s=coord_round,
    coordinated_energy_j=coord_energy,
    configs=tuple(int(k) for k in chosen),
    missed=0 if deadline is None else int(sum(t > deadline for t in times)),
  )
  return report, times


def _checked_ids(
  workloads: Sequence[Sequence[float]],
  client_ids: Sequence[Sequence[int]] | None,
  work_unit: str,
  deadline_mode: str,
) -> Sequence[Sequence[int]]:
  """`simulate`'s arguments checked; the participants' ids of each round
  (by default 0..n_r-1)."""
  if work_unit not in WORK_UNITS:
    raise ValueError(f'work_unit must be one of {WORK_UNITS}: {work_unit!r}')
  if deadline_mode not in DEADLINE_MODES:
    raise ValueError(
      f'deadline_mode must be one of {DEADLINE_MODES}: {deadline_mode!r}'
    )
  if client_ids is None:
    client_ids = [list(range(len(w))) for w in workloads]
  if len(client_ids) != len(workloads):
    raise ValueError('client_ids and workloads must have one entry per round')
  return client_ids


def _report(
  rounds: Sequence[RoundReport], clients: Sequence[SimClient]
) -> SimulationReport:
  """The rounds and their totals under both policies."""
  return SimulationReport(
    rounds=tuple(rounds),
    client_labels=tuple(c.label for c in clients),
    default_time_s=sum(r.default_time_s for r in rounds),
    default_energy_j=sum(r.default_energy_j for r in rounds),
    coordinated_time_s=sum(r.coordinated_time_s for r in rounds),
    coordinated_energy_j=sum(r.coordinated_energy_j for r in rounds),
  )
