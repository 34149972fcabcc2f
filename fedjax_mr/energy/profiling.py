"""Measuring a `DeviceProfile` on a device (`experiments/profile_device.py`).

For each configuration: apply it, run the workload once to warm up, then
time `repeats` runs while an `EnergyMeter` integrates the power. The idle
power is measured first, while the device sleeps. Speed-ups are relative to
the first configuration.
"""

import logging
import time
from typing import Callable
from typing import Sequence

import numpy as np

from fedjax_mr.energy import discovery
from fedjax_mr.energy import energy_meter
from fedjax_mr.energy import nvpmodel
from fedjax_mr.energy import profiles
from fedjax_mr.energy import sysfs
from fedjax_mr.energy import sysfs_dvfs

logger = logging.getLogger(__name__)


def _spread(table: Sequence[int], levels: int) -> list[int]:
  """`levels` entries of an ascending table, evenly by index, ends included."""
  if levels == 1:
    return [table[-1]]
  return [
    table[round(i * (len(table) - 1) / (levels - 1))] for i in range(levels)
  ]


def sweep_configs(
  info: discovery.DeviceInfo, levels: int = 3
) -> tuple[profiles.DvfsConfig, ...]:
  """`levels` configurations from the lowest to the highest table entries.

  Level i takes the entry at fraction i / (levels − 1) of every CPU policy's
  table and of the GPU's, so level 0 is the slowest and the last the fastest.
  Policies or GPUs without a table are left alone.
  """
  if levels < 1:
    raise ValueError(f'levels must be >= 1: {levels}')
  cpu = {
    p.name: _spread(p.frequencies_khz, levels)
    for p in info.cpu_policies
    if p.frequencies_khz
  }
  gpu = None
  if info.gpu is not None and info.gpu.frequencies_hz:
    gpu = _spread(info.gpu.frequencies_hz, levels)
  if not cpu and gpu is None:
    raise sysfs.EnergyError('no CPU or GPU frequency table found')
  return tuple(
    profiles.DvfsConfig(
      f'level{i}',
      {name: khz[i] for name, khz in cpu.items()},
      gpu_hz=gpu[i] if gpu else None,
    )
    for i in range(levels)
  )


def matmul_workload(size: int = 256, steps: int = 10, seed: int = 0):
  """A fixed amount of CPU work: `steps` float32 matmuls of size×size."""
  rng = np.random.default_rng(seed)
  a = rng.standard_normal((size, size), dtype=np.float32)

  def run() -> None:
    x = a
    for _ in range(steps):
      x = np.tanh(x @ a)

  return run


def measure_profile(
  backend: sysfs_dvfs.SysfsDvfs | nvpmodel.NvpmodelDvfs,
  read_power_w: Callable[[], float],
  configs: Sequence[profiles.DvfsConfig],
  workload: Callable[[], None],
  *,
  name: str,
  repeats: int = 3,
  idle_s: float = 2.0,
  period_s: float = 0.02,
  clock: Callable[[], float] = time.monotonic,
  sleep: Callable[[float], None] = time.sleep,
  threaded: bool = True,
  description: str = '',
) -> profiles.DeviceProfile:
  """Measures idle power, then time and power of `workload` per config.

  The caller owns `backend` (open it as a context manager, so the clocks are
  restored).

  Args:
    backend: the DVFS backend that applies each configuration.
    read_power_w: the total power now, in W (e.g. `SysfsPowerMeter.total_w`).
    configs: configurations to measure; configs[0] is the speed-up reference.
    workload: runs one unit of work.
    name: the profile's name.
    repeats: timed runs per configuration (after one warm-up run).
    idle_s: how long to measure the idle power.
    period_s: power sampling period.
    clock: monotonic clock (injectable for tests).
    sleep: sleep function used while measuring idle power.
    threaded: sample in a thread (False: only at the window's ends and after
      every run; for tests with a fake clock).
    description: stored in the profile.

  Returns:
    A profile whose configs are the clocks read back while measuring.
  """
  if repeats < 1 or not configs:
    raise ValueError('need repeats >= 1 and at least one configuration')

  def meter():
    return energy_meter.EnergyMeter(
      read_power_w, period_s=period_s, clock=clock, threaded=threaded
    )

  idle = meter().start()
  sleep(idle_s)
  p_idle = idle.stop().mean_power_w
  logger.info('idle power %.3f W', p_idle)

  measured, times, powers = [], [], []
  for config in configs:
    result = backend.apply(config)
    workload()  # Warm-up (caches, clock ramp-up).
    window = meter().start()
    for _ in range(repeats):
      workload()
      window.sample()
    reading = window.stop()
    if reading.duration_s <= 0:
      raise sysfs.EnergyError(f'{config.name}: the workload took no time')
    times.append(reading.duration_s / repeats)
    powers.append(reading.mean_power_w)
    measured.append(result.effective)
    logger.info(
      '%s: %.4f s per run, %.3f W', config.name, times[-1], powers[-1]
    )
  return profiles.DeviceProfile(
    name=name,
    configs=tuple(measured),
    speedup=tuple(times[0] / t for t in times),
    p_active_w=tuple(powers),
    p_idle_w=p_idle,
    description=description,
  )
