"""The clients' local energy coordinators inside the round loop.

Every round, for every participant (FedStitch §IV-D):

1. the server's deadline T: the slowest completion time of the last round,
   times the depth and pool-size factors (`coordinator.server_deadline`,
   `coordinator.deadline_factors`); the first round has none and runs at
   the highest frequency;
2. the client's coordinator picks the least-energy configuration that
   meets T (`coordinator.choose_config`), predicting the client's work from
   its work units (samples × candidate blocks scored) and its time scale;
3. a backend applies the configuration, the client's real work runs, and
   the backend measures its time and energy;
4. the measured time corrects the client's time model
   (`coordinator.update_time_scale`).

One code path, two backends:

* `SimulatedBackend`: every client is a simulated device (a profile and a
  speed, see `simulation.assign_profiles`). The work still runs; its time
  and energy are the profile's model of it: t = base / speedup_k and
  E = P_k·t, base being the work's time at configs[0] on that device.
* `SysfsBackend`: the configuration is set through `sysfs_dvfs.SysfsDvfs` on a
  Jetson (or a fake tree), the time is the wall clock of the work and the
  energy an `EnergyMeter` on the INA3221 rails. With a dry-run `SysfsDvfs`
  the writes are planned and recorded but never made.

A round's record (`RoundEnergy.record`, JSON-ready) holds the deadline and,
per participant, the configuration, predicted and measured time, energy,
the idle energy of waiting for the round's last client, whether the
deadline was met, the updated time scale, the writes made (sysfs) and what
the same work would have cost at the highest frequency. The records of the
previous rounds are all the coordinators need (`round_deadline`,
`time_scales`), so a run resumed from its records continues exactly.
`summarize` totals them: the coordinator vs the highest frequency, as
`simulation.simulate` reports it.

References:
  Zhan, Wu, Tian, Zhao, Li, "Heterogeneity-Aware Coordination for
  Federated Learning via Stitching Pre-trained blocks" (FedStitch), 2024,
  §IV-D (Eqs. 4-7).
"""

import contextlib
import math
import time
from typing import Any
from typing import Callable
from typing import Iterator
from typing import NamedTuple
from typing import Sequence

from fedjax_mr.energy import coordinator
from fedjax_mr.energy import energy_meter
from fedjax_mr.energy import profiles
from fedjax_mr.energy import simulation
from fedjax_mr.energy import sysfs_dvfs

BACKENDS = ('simulated', 'dry_run', 'sysfs')


class Measurement(NamedTuple):
  """What a backend measured for one client's work.

  Attributes:
    time_s: the work's time.
    energy_j: the energy while it ran.
    writes: the sysfs writes made (or planned, in a dry run) to set the
      client's configuration, as (path, value); empty when none were needed.
  """

  time_s: float
  energy_j: float
  writes: tuple[tuple[str, str], ...] = ()


class SimulatedBackend:
  """Simulated devices: the profile's model of each client's work.

  Attributes:
    devices: the device of every client id (`simulation.SimClient`).
  """

  name = 'simulated'

  def __init__(self, devices: Sequence[simulation.SimClient]):
    if not devices:
      raise ValueError('no simulated devices')
    self.devices = tuple(devices)
    self._pending = None

  def device(self, client: int) -> simulation.SimClient:
    return self.devices[client]

  def start(self, client: int, index: int, base_s: float) -> None:
    """Before the client's work: remembers what to model."""
    self._pending = (client, index, base_s)

  def stop(self) -> Measurement:
    """After the client's work: t = base / speedup_k, E = P_k·t."""
    client, k, base_s = self._pending
    self._pending = None
    profile = self.devices[client].profile
    t = base_s / profile.speedup[k]
    return Measurement(t, profile.p_active_w[k] * t)

  def abort(self) -> None:
    self._pending = None

  def __enter__(self) -> 'SimulatedBackend':
    return self

  def __exit__(self, exc_type, exc, tb) -> bool:
    return False


class SysfsBackend:
  """One real device through sysfs: every client runs on it in turn.

  The DVFS backend's context (entered with this one) restores the clocks
  at the end, also after an exception, Ctrl-C or SIGTERM.
  """

  def __init__(
    self,
    dvfs: sysfs_dvfs.SysfsDvfs,
    profile: profiles.DeviceProfile,
    read_power_w: Callable[[], float],
    *,
    period_s: float = 0.02,
    clock: Callable[[], float] = time.monotonic,
    threaded: bool = True,
  ):
    """Builds the backend; nothing changes before the first client.

    Args:
      dvfs: sets the configurations (`dry_run=True`: plans them only).
      profile: the device's profile (its configurations are applied).
      read_power_w: the total power now, in W (`SysfsPowerMeter.total_w`).
      period_s: power sampling period.
      clock: monotonic clock (a fake one in tests).
      threaded: sample power in a thread (False: at the window's ends).
    """
    self.dvfs = dvfs
    self.profile = profile
    self.name = 'dry_run' if dvfs.dry_run else 'sysfs'
    self._read_power_w = read_power_w
    self._period_s = period_s
    self._clock = clock
    self._threaded = threaded
    self._device = simulation.SimClient(profile, 1.0, profile.name)
    self._current = None  # The configuration index set last.
    self._window = None
    self._writes = ()

  def device(self, client: int) -> simulation.SimClient:
    del client  # One device runs every client.
    return self._device

  def start(self, client: int, index: int, base_s: float) -> None:
    """Sets configuration `index` (if another is set) and starts measuring."""
    del client, base_s
    self._writes = ()
    if index != self._current:
      first = len(self.dvfs.writes)
      self.dvfs.apply(self.profile.configs[index])
      self._current = index
      self._writes = tuple(self.dvfs.writes[first:])
    self._window = energy_meter.EnergyMeter(
      self._read_power_w,
      period_s=self._period_s,
      clock=self._clock,
      threaded=self._threaded,
    ).start()

  def stop(self) -> Measurement:
    reading = self._window.stop()
    self._window = None
    return Measurement(reading.duration_s, reading.energy_j, self._writes)

  def abort(self) -> None:
    if self._window is not None:
      with contextlib.suppress(Exception):  # The work's error matters more.
        self._window.stop()
      self._window = None

  def __enter__(self) -> 'SysfsBackend':
    self.dvfs.__enter__()
    return self

  def __exit__(self, exc_type, exc, tb) -> bool:
    self._current = None
    return self.dvfs.__exit__(exc_type, exc, tb)


class RemoteBackend:
  """The clients' devices are elsewhere (a deployed run): each client's
  coordinator runs on its own device (`RoundEnergy.for_client`) and the
  server adds its figures (`RoundEnergy.add`); nothing runs here.

  Attributes:
    name: the backend the clients' devices use ('simulated', 'dry_run' or
      'sysfs'), as the round records name it.
  """

  def __init__(self, name: str):
    self.name = name

  def _elsewhere(self, *args: Any) -> Any:
    raise RuntimeError('the clients are measured on their own devices')

  device = start = stop = abort = _elsewhere

  def __enter__(self) -> 'RemoteBackend':
    return self

  def __exit__(self, exc_type, exc, tb) -> bool:
    return False


Backend = SimulatedBackend | SysfsBackend | RemoteBackend


def round_deadline(
  history: Sequence[dict[str, Any]], depth: int, pool_size: int
) -> tuple[float | None, float, float]:
  """The server's deadline for the round after `history`.

  Args:
    history: the records of the previous rounds (`RoundEnergy.record`).
    depth: the round's network depth (the deepest candidate network).
    pool_size: the round's number of candidate blocks (over all networks).

  Returns:
    (T, depth factor, pool-size factor): T = the last round's slowest
    completion time × both factors (`coordinator.server_deadline`), or None
    for the first round or when the last round took no time.
  """
  if not history:
    return None, 1.0, 1.0
  prev = history[-1]
  d, p = coordinator.deadline_factors(
    prev['depth'], max(depth, 1), max(prev['pool_size'], 1), max(pool_size, 1)
  )
  t = coordinator.server_deadline(
    [c['time_s'] for c in prev['clients']], depth_factor=d, pool_factor=p
  )
  return (t if t > 0 else None), d, p


def time_scales(history: Sequence[dict[str, Any]]) -> dict[int, float]:
  """Every client's time-model scale after its last round (default 1)."""
  return {
    c['client']: c['time_scale'] for rec in history for c in rec['clients']
  }


class Fleet:
  """The clients' devices and coordinators, measured through one backend.

  Use as a context manager around the run (the clocks of a sysfs backend
  are restored on exit), and per round:

      rnd = fleet.start_round(history, depth=d, pool_size=p)
      for c in participants:
        with rnd.client(c, units):
          do_the_clients_work()
      history.append(rnd.record())
  """

  def __init__(
    self,
    backend: Backend,
    *,
    seconds_per_unit: float,
    margin: float = 0.05,
    alpha: float = 0.5,
  ):
    """Builds the fleet.

    Args:
      backend: measures each client's work (`SimulatedBackend`,
        `SysfsBackend`).
      seconds_per_unit: the time model: one work unit's time at the
        profile's configs[0] on a device of speed 1.
      margin: the coordinators' deadline margin (`choose_config`).
      alpha: feedback weight of the time model (`update_time_scale`).
    """
    if not (seconds_per_unit > 0 and math.isfinite(seconds_per_unit)):
      raise ValueError(f'seconds_per_unit must be > 0: {seconds_per_unit}')
    self.backend = backend
    self.seconds_per_unit = seconds_per_unit
    self.margin = margin
    self.alpha = alpha

  def __enter__(self) -> 'Fleet':
    self.backend.__enter__()
    return self

  def __exit__(self, exc_type, exc, tb) -> bool:
    return self.backend.__exit__(exc_type, exc, tb)

  def start_round(
    self, history: Sequence[dict[str, Any]], *, depth: int, pool_size: int
  ) -> 'RoundEnergy':
    """A round after `history` (the records of the previous rounds)."""
    return RoundEnergy(
      self,
      round_deadline(history, depth, pool_size),
      depth,
      pool_size,
      time_scales(history),
    )


class RoundEnergy:
  """One round of a `Fleet`: each client's work, then `record()`."""

  def __init__(
    self,
    fleet: Fleet,
    deadline: tuple[float | None, float, float],
    depth: int,
    pool_size: int,
    scales: dict[int, float],
  ):
    """Args: the fleet, `round_deadline`'s answer, the round's depth and
    pool size, and the clients' time scales (updated in place)."""
    self._fleet = fleet
    self.deadline_s, self.depth_factor, self.pool_factor = deadline
    self._depth = depth
    self._pool_size = pool_size
    self._scales = scales
    self._clients = []

  @contextlib.contextmanager
  def client(self, client: int, units: float) -> Iterator[None]:
    """Runs the body as `client`'s work of `units` work units.

    Chooses the client's configuration for the deadline, has the backend
    apply it and measure the body, and feeds the time back.
    """
    fleet = self._fleet
    device = fleet.backend.device(client)
    profile = device.profile
    base = units * fleet.seconds_per_unit / device.speed
    scale = self._scales.get(client, 1.0)
    if self.deadline_s is None:
      k = profile.fastest
      predicted = base * scale / profile.speedup[k]
      feasible = None
    else:
      choice = coordinator.choose_config(
        profile,
        self.deadline_s,
        base_time_s=base,
        time_scale=scale,
        margin=fleet.margin,
      )
      k, predicted, feasible = choice.index, choice.time_s, choice.feasible
    fleet.backend.start(client, k, base)
    try:
      yield
    except BaseException:
      fleet.backend.abort()
      raise
    m = fleet.backend.stop()
    if predicted > 0 and m.time_s > 0:
      scale = coordinator.update_time_scale(
        scale, predicted, m.time_s, fleet.alpha
      )
    self._scales[client] = scale
    fast = profile.fastest
    entry = {
      'client': int(client),
      'device': device.label,
      'units': units,
      'base_s': base,
      'config': profile.configs[k].name,
      'config_index': k,
      'feasible': feasible,
      'predicted_s': predicted,
      'time_s': m.time_s,
      'energy_j': m.energy_j,
      'met': None if self.deadline_s is None else m.time_s <= self.deadline_s,
      'time_scale': scale,
      # The same work at the highest frequency (the default governor),
      # from the measured time and the profile's speed-ups.
      'default_time_s': m.time_s * profile.speedup[k] / profile.speedup[fast],
    }
    entry['default_energy_j'] = (
      profile.p_active_w[fast] * entry['default_time_s']
    )
    if fleet.backend.name != 'simulated':
      entry['writes'] = [list(w) for w in m.writes]
    self._clients.append((entry, profile.p_idle_w))

  def terms(self, client: int) -> dict[str, Any]:
    """What `client`'s coordinator needs of this round, JSON-ready: the
    deadline, its factors, the round's depth and pool size and the
    client's time scale (sent to a deployed client, `for_client`)."""
    return {
      'deadline_s': self.deadline_s,
      'depth_factor': self.depth_factor,
      'pool_factor': self.pool_factor,
      'depth': self._depth,
      'pool_size': self._pool_size,
      'time_scale': self._scales.get(client, 1.0),
    }

  @classmethod
  def for_client(
    cls, fleet: Fleet, client: int, terms: dict[str, Any]
  ) -> 'RoundEnergy':
    """The round of `terms` (`RoundEnergy.terms`) as `client`'s own
    coordinator sees it, on the client's device (`fleet`)."""
    return cls(
      fleet,
      (terms['deadline_s'], terms['depth_factor'], terms['pool_factor']),
      terms['depth'],
      terms['pool_size'],
      {client: terms['time_scale']},
    )

  def entries(self) -> list[tuple[dict[str, Any], float]]:
    """Each client's figures so far and its device's idle power (W)."""
    return list(self._clients)

  def add(self, entry: dict[str, Any], p_idle_w: float) -> None:
    """Adds a client's figures measured elsewhere (`entries` of its own
    `for_client` round), in the order the clients are recorded."""
    self._scales[int(entry['client'])] = entry['time_scale']
    self._clients.append((entry, float(p_idle_w)))

  def record(self) -> dict[str, Any]:
    """The round's record: the deadline and every client's figures.

    Every client then waits at idle power for the round's last one, under
    the coordinator (`wait_j`) and at the highest frequency (added to
    `default_energy_j`), as in `simulation.simulate`.
    """
    entries = [e for e, _ in self._clients]
    round_s = max((e['time_s'] for e in entries), default=0.0)
    default_s = max((e['default_time_s'] for e in entries), default=0.0)
    for e, p_idle in self._clients:
      e['wait_j'] = p_idle * (round_s - e['time_s'])
      e['default_energy_j'] += p_idle * (default_s - e['default_time_s'])
    return {
      'backend': self._fleet.backend.name,
      'deadline_s': self.deadline_s,
      'depth_factor': self.depth_factor,
      'pool_factor': self.pool_factor,
      'depth': self._depth,
      'pool_size': self._pool_size,
      'round_time_s': round_s,
      'energy_j': sum(e['energy_j'] + e['wait_j'] for e in entries),
      'default_round_time_s': default_s,
      'default_energy_j': sum(e['default_energy_j'] for e in entries),
      'clients': entries,
    }


def summarize(history: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """Totals of the records: the coordinator vs the highest frequency.

  Returns:
    JSON-ready: rounds, coordinated and default (highest-frequency) time
    and energy, energy_saving (1 − coordinated / default energy),
    time_change (coordinated / default time − 1) and missed (participations
    that finished after their deadline).
  """
  out = {
    'rounds': len(history),
    'coordinated_time_s': sum(r['round_time_s'] for r in history),
    'coordinated_energy_j': sum(r['energy_j'] for r in history),
    'default_time_s': sum(r['default_round_time_s'] for r in history),
    'default_energy_j': sum(r['default_energy_j'] for r in history),
    'missed': sum(c['met'] is False for r in history for c in r['clients']),
  }
  e, t = out['default_energy_j'], out['default_time_s']
  out['energy_saving'] = 1 - out['coordinated_energy_j'] / e if e else 0.0
  out['time_change'] = out['coordinated_time_s'] / t - 1 if t else 0.0
  return out
