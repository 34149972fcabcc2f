"""Energy from power samples: a sampling thread and trapezoid integration."""

import threading
import time
from typing import Callable
from typing import NamedTuple
from typing import Sequence


def trapezoid_energy(
  times_s: Sequence[float], powers_w: Sequence[float]
) -> float:
  """Energy in J of a power trace: Σ ½(P_i + P_{i+1})(t_{i+1} − t_i).

  Args:
    times_s: sample times, non-decreasing, in s.
    powers_w: power at each time, in W.

  Returns:
    The integral of the piecewise-linear power, in J (0 for < 2 samples).
  """
  if len(times_s) != len(powers_w):
    raise ValueError(f'{len(times_s)} times but {len(powers_w)} powers')
  energy = 0.0
  for i in range(1, len(times_s)):
    dt = times_s[i] - times_s[i - 1]
    if dt < 0:
      raise ValueError(f'sample times go backwards at index {i}')
    energy += 0.5 * (powers_w[i] + powers_w[i - 1]) * dt
  return energy


class EnergyReading(NamedTuple):
  """The result of one measurement window.

  Attributes:
    energy_j: trapezoid integral of the samples.
    duration_s: last sample time minus first.
    mean_power_w: energy_j / duration_s (the only sample's power if 0 s).
    num_samples: number of power samples.
  """

  energy_j: float
  duration_s: float
  mean_power_w: float
  num_samples: int


class EnergyMeter:
  """Integrates power over a window, sampling in a thread or on demand.

  A sample is taken at `start`, every `period_s` by a thread (when
  `threaded`), at every `sample()` call and at `stop`. Tests pass a fake
  clock and `threaded=False` and call `sample()` themselves.

      with EnergyMeter(power_meter.total_w) as meter:
        run_round()
      print(meter.reading.energy_j)
  """

  def __init__(
    self,
    read_power_w: Callable[[], float],
    *,
    period_s: float = 0.02,
    clock: Callable[[], float] = time.monotonic,
    threaded: bool = True,
  ):
    if period_s <= 0:
      raise ValueError(f'period_s must be > 0: {period_s}')
    self._read_power_w = read_power_w
    self._period_s = period_s
    self._clock = clock
    self._threaded = threaded
    self._lock = threading.Lock()
    self._times: list[float] = []
    self._powers: list[float] = []
    self._thread = None
    self._stop_event = threading.Event()
    self._error = None
    self.reading: EnergyReading | None = None

  def sample(self) -> None:
    """Takes one sample, stamped halfway through the power read."""
    t0 = self._clock()
    power = self._read_power_w()
    t1 = self._clock()
    with self._lock:
      self._times.append(0.5 * (t0 + t1))
      self._powers.append(power)

  def _loop(self) -> None:
    try:
      while not self._stop_event.wait(self._period_s):
        self.sample()
    except Exception as e:  # Re-raised by stop(), in the caller's thread.
      self._error = e

  def start(self) -> 'EnergyMeter':
    """Starts a new window."""
    if self._thread is not None:
      raise RuntimeError('EnergyMeter already started')
    self._times, self._powers = [], []
    self.reading = None
    self._error = None
    self.sample()
    if self._threaded:
      self._stop_event.clear()
      self._thread = threading.Thread(
        target=self._loop, name='EnergyMeter', daemon=True
      )
      self._thread.start()
    return self

  def stop(self) -> EnergyReading:
    """Ends the window with a last sample and integrates."""
    if self._thread is not None:
      self._stop_event.set()
      self._thread.join()
      self._thread = None
    if self._error is not None:
      raise self._error
    self.sample()
    with self._lock:
      times, powers = list(self._times), list(self._powers)
    energy = trapezoid_energy(times, powers)
    duration = times[-1] - times[0]
    mean = energy / duration if duration > 0 else powers[-1]
    self.reading = EnergyReading(energy, duration, mean, len(times))
    return self.reading

  def __enter__(self) -> 'EnergyMeter':
    return self.start()

  def __exit__(self, exc_type, exc, tb):
    self.stop()
    return False
