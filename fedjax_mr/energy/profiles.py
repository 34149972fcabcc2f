"""DVFS configurations and device profiles, with the built-in TX2 ones.

A `DvfsConfig` is one setting of the clocks (and, for nvpmodel modes, of the
online cores). A `DeviceProfile` is what the coordinator and the simulator
know about a device: its configurations, each one's speed-up over the first,
its active power, and the idle power.

The paper's Table II (FedStitch, §III Q3) lists three TX2 configurations:

  config | CPU GHz | GPU GHz | SpeedUp | PowerUp
  1      | 1.2     | 0.85    | 1       | 1
  2      | 1.4     | 1.12    | 1.21    | 1.25
  3      | 2.0     | 1.30    | 1.38    | 1.14

They are the TX2 nvpmodel modes MAXQ (1), MAXP_CORE_ALL (2) and MAXN (0). The
PowerUp column has two readings, and both are shipped:

* literal (`TX2_TABLE2_LITERAL`): each PowerUp is relative to config 1, so
  powers are 1, 1.25, 1.14. Energy per task (PowerUp / SpeedUp) is then 1.000,
  1.033, 0.826: the highest frequency is the most efficient and racing to idle
  wins, which contradicts the paper's Principle 3.
* chained (`TX2_TABLE2_CHAINED`): each PowerUp is relative to the previous
  row, so powers are 1, 1.25, 1.425. Energy per task is 1.000, 1.033, 1.033
  and the lowest configuration wins when the deadline allows it, which is the
  behaviour the paper's coordinator relies on.

Absolute powers are our assumptions, not the paper's: 7.5 W active at config
1 (the MaxQ budget of the TX2's Parker SoC) and 1.9 W idle (an idle TX2 reads
VDD_IN = 1876 mW in tegrastats).
"""

import dataclasses
import json
import math
import os
from typing import Any
from typing import Mapping

from fedjax_mr.core import errors
from fedjax_mr.core import files
from fedjax_mr.core import jsonfile
from fedjax_mr.energy import sysfs

# TX2 (L4T 32) frequency tables. The A57 and Denver clusters share one table.
TX2_CPU_KHZ = (
  345600, 499200, 652800, 806400, 960000, 1113600, 1267200, 1420800, 1574400,
  1728000, 1881600, 2035200,
)  # fmt: skip
TX2_GPU_HZ = (
  114750000, 216750000, 318750000, 420750000, 522750000, 624750000,
  726750000, 854250000, 930750000, 1032750000, 1122000000, 1236750000,
  1300500000,
)  # fmt: skip
TX2_EMC_HZ = (
  40800000, 68000000, 102000000, 204000000, 408000000, 665600000, 800000000,
  1062400000, 1331200000, 1600000000, 1866000000,
)  # fmt: skip
# TX2 cores: cpu0 and cpu3-5 are the A57 cluster (policy0), cpu1-2 the Denver
# cluster (policy1).
TX2_A57 = 'policy0'
TX2_DENVER = 'policy1'
TX2_ALL_CPUS = (0, 1, 2, 3, 4, 5)
TX2_A57_CPUS = (0, 3, 4, 5)

ASSUMED_TX2_P_ACTIVE0_W = 7.5
ASSUMED_TX2_P_IDLE_W = 1.9


@dataclasses.dataclass(frozen=True)
class DvfsConfig:
  """One DVFS configuration.

  Attributes:
    name: a label, e.g. 'MAXQ'.
    cpu_khz: CPU clock (kHz) per cpufreq policy name ('policy0', ...); the key
      '*' stands for every policy not named. Policies left out are untouched.
    gpu_hz: GPU clock (Hz), or None to leave it.
    emc_hz: memory clock (Hz), or None; applied only when EMC writes are
      allowed, since EMC is read-only by default.
    online_cpus: the cores that must be online (the others go offline), or
      None to leave hotplug alone.
    nvpmodel_id: the nvpmodel mode this configuration is, if any.
  """

  name: str
  cpu_khz: Mapping[str, int] = dataclasses.field(default_factory=dict)
  gpu_hz: int | None = None
  emc_hz: int | None = None
  online_cpus: tuple[int, ...] | None = None
  nvpmodel_id: int | None = None

  def __post_init__(self):
    object.__setattr__(self, 'cpu_khz', dict(self.cpu_khz))
    if self.online_cpus is not None:
      object.__setattr__(self, 'online_cpus', tuple(self.online_cpus))
    for key, khz in self.cpu_khz.items():
      if khz <= 0:
        raise ValueError(f'{self.name}: CPU clock of {key} must be > 0: {khz}')
    for field in ('gpu_hz', 'emc_hz'):
      value = getattr(self, field)
      if value is not None and value <= 0:
        raise ValueError(f'{self.name}: {field} must be > 0: {value}')

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d['online_cpus'] = (
      None if self.online_cpus is None else list(self.online_cpus)
    )
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> 'DvfsConfig':
    return cls(**d)

  def describe(self) -> str:
    parts = [f'{k}={v} kHz' for k, v in self.cpu_khz.items()]
    if self.gpu_hz is not None:
      parts.append(f'gpu={self.gpu_hz} Hz')
    if self.emc_hz is not None:
      parts.append(f'emc={self.emc_hz} Hz')
    if self.online_cpus is not None:
      parts.append(f'online={sysfs.format_list(self.online_cpus)}')
    if self.nvpmodel_id is not None:
      parts.append(f'nvpmodel={self.nvpmodel_id}')
    return f'{self.name}: {", ".join(parts) or "no change"}'


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
  """What the coordinator and the simulator know about one device kind.

  Attributes:
    name: profile name.
    configs: the DVFS configurations [K].
    speedup: time(configs[0]) / time(configs[k]) for the workload [K].
    p_active_w: power while the workload runs at configs[k], in W [K].
    p_idle_w: power while the device waits (the paper's base power), in W.
    cycles_per_sample: the paper's c (Eq. 4): processor cycles per data object
      at configs[0], or None when only base times are used.
    ref_hz: the processor frequency at configs[0] that c counts cycles of, so
      the time at configs[k] is c·D / (ref_hz·speedup[k]) (Eq. 4 when the
      speed-up is proportional to the frequency).
    description: where the numbers come from.
  """

  name: str
  configs: tuple[DvfsConfig, ...]
  speedup: tuple[float, ...]
  p_active_w: tuple[float, ...]
  p_idle_w: float
  cycles_per_sample: float | None = None
  ref_hz: float | None = None
  description: str = ''

  def __post_init__(self):
    for field in ('configs', 'speedup', 'p_active_w'):
      object.__setattr__(self, field, tuple(getattr(self, field)))
    k = len(self.configs)
    if k == 0:
      raise ValueError(f'profile {self.name}: no configurations')
    if len(self.speedup) != k or len(self.p_active_w) != k:
      raise ValueError(
        f'profile {self.name}: {k} configs but {len(self.speedup)} speed-ups'
        f' and {len(self.p_active_w)} powers'
      )
    values = (*self.speedup, *self.p_active_w)
    if min(values) <= 0 or self.p_idle_w < 0:
      raise ValueError(f'profile {self.name}: speed-ups and powers must be > 0')
    if (self.cycles_per_sample is None) != (self.ref_hz is None):
      raise ValueError(
        f'profile {self.name}: give both cycles_per_sample and ref_hz, or none'
      )

  @property
  def powerup(self) -> tuple[float, ...]:
    """p_active_w[k] / p_active_w[0], the paper's PowerUp."""
    return tuple(p / self.p_active_w[0] for p in self.p_active_w)

  @property
  def fastest(self) -> int:
    """Index of the fastest configuration (what the default governor runs)."""
    return max(range(len(self.configs)), key=lambda k: self.speedup[k])

  def to_dict(self) -> dict[str, Any]:
    return {
      'name': self.name,
      'configs': [c.to_dict() for c in self.configs],
      'speedup': list(self.speedup),
      'p_active_w': list(self.p_active_w),
      'p_idle_w': self.p_idle_w,
      'cycles_per_sample': self.cycles_per_sample,
      'ref_hz': self.ref_hz,
      'description': self.description,
    }

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> 'DeviceProfile':
    d = dict(d)
    d['configs'] = tuple(DvfsConfig.from_dict(c) for c in d['configs'])
    return cls(**d)


def save_profile(profile: DeviceProfile, path: str | os.PathLike[str]) -> None:
  """Writes `profile` as JSON."""

  def write(f) -> None:
    json.dump(profile.to_dict(), f, indent=2)
    f.write('\n')

  files.write_atomic(os.fspath(path), write)


# A profile holds a few DVFS configurations: a few KiB.
MAX_PROFILE_BYTES = 1 << 20
_NUMBER = (int, float)
_CONFIG_FIELDS = {
  'name': str,
  'cpu_khz': dict,
  'gpu_hz': int,
  'emc_hz': int,
  'online_cpus': list,
  'nvpmodel_id': int,
}
_PROFILE_FIELDS = {
  'name': str,
  'configs': list,
  'speedup': list,
  'p_active_w': list,
  'p_idle_w': _NUMBER,
  'cycles_per_sample': _NUMBER,
  'ref_hz': _NUMBER,
  'description': str,
}
_OPTIONAL = {'gpu_hz', 'emc_hz', 'online_cpus', 'nvpmodel_id', 'cpu_khz'}
_OPTIONAL_PROFILE = {'cycles_per_sample', 'ref_hz', 'description'}


def _fields(
  obj: Any, kinds: dict, optional: set, path: str, where: str
) -> dict[str, Any]:
  """The fields of the JSON object `obj` (at `where` in the file `path`),
  each of its type in `kinds`; numbers finite; no other key."""
  obj = jsonfile.check(obj, dict, path, where)
  for key in obj:
    if key not in kinds:
      name = f'"{errors.clip(key, 40)}"'
      raise jsonfile.JsonFileError(
        path,
        f'{where or "the profile"} has an unknown field {name} (known: '
        f'{", ".join(kinds)})',
      )
  out = {}
  for key, kind in kinds.items():
    if key in optional and obj.get(key) is None:
      continue
    name = f'{where}["{key}"]' if where else f'"{key}"'
    value = jsonfile.check(obj.get(key), kind, path, name)
    if isinstance(value, float) and not math.isfinite(value):
      raise jsonfile.JsonFileError(path, f'{name} is {value}, not finite')
    out[key] = value
  return out


def _numbers(values: list, path: str, name: str) -> list[float]:
  """The list `values` (the file's `name`), each a finite number."""
  out = [
    jsonfile.check(v, _NUMBER, path, f'{name}[{i}]')
    for i, v in enumerate(values)
  ]
  for i, v in enumerate(out):
    if not math.isfinite(v):
      raise jsonfile.JsonFileError(path, f'{name}[{i}] is {v}, not finite')
  return out


def load_profile(path: str | os.PathLike[str]) -> DeviceProfile:
  """Reads a profile written by `save_profile`.

  Raises:
    JsonFileError: not a regular file of at most `MAX_PROFILE_BYTES`, not
      JSON, or a field missing, unknown or of the wrong type (one line
      naming the file and the field).
    ValueError: the values do not make a profile (`DeviceProfile`).
  """
  path = os.fspath(path)
  d = _fields(
    jsonfile.load(path, MAX_PROFILE_BYTES),
    _PROFILE_FIELDS,
    _OPTIONAL_PROFILE,
    path,
    '',
  )
  configs = []
  for i, c in enumerate(d['configs']):
    where = f'"configs"[{i}]'
    c = _fields(c, _CONFIG_FIELDS, _OPTIONAL, path, where)
    for key, khz in c.get('cpu_khz', {}).items():
      jsonfile.check(khz, int, path, f'{where}["cpu_khz"]["{key}"]')
    for j, cpu in enumerate(c.get('online_cpus') or ()):
      jsonfile.check(cpu, int, path, f'{where}["online_cpus"][{j}]')
    configs.append(DvfsConfig(**c))
  d['configs'] = tuple(configs)
  for key in ('speedup', 'p_active_w'):
    d[key] = tuple(_numbers(d[key], path, f'"{key}"'))
  return DeviceProfile(**d)


# The TX2 nvpmodel modes (/etc/nvpmodel.conf, L4T 28/32). Clocks are the
# mode's caps as written in the file; the kernel runs a table entry near each
# cap. MAXN has no EMC cap.
TX2_NVPMODEL_MODES = (
  DvfsConfig(
    'MAXN',
    {TX2_A57: 2035200, TX2_DENVER: 2035200},
    gpu_hz=1300500000,
    online_cpus=TX2_ALL_CPUS,
    nvpmodel_id=0,
  ),
  DvfsConfig(
    'MAXQ',
    {TX2_A57: 1200000},
    gpu_hz=850000000,
    emc_hz=1331200000,
    online_cpus=TX2_A57_CPUS,
    nvpmodel_id=1,
  ),
  DvfsConfig(
    'MAXP_CORE_ALL',
    {TX2_A57: 1400000, TX2_DENVER: 1400000},
    gpu_hz=1120000000,
    emc_hz=1600000000,
    online_cpus=TX2_ALL_CPUS,
    nvpmodel_id=2,
  ),
  DvfsConfig(
    'MAXP_CORE_ARM',
    {TX2_A57: 2000000},
    gpu_hz=1120000000,
    emc_hz=1600000000,
    online_cpus=TX2_A57_CPUS,
    nvpmodel_id=3,
  ),
  DvfsConfig(
    'MAXP_CORE_DENVER',
    {TX2_A57: 345600, TX2_DENVER: 2035200},
    gpu_hz=1120000000,
    emc_hz=1600000000,
    online_cpus=(0, 1),
    nvpmodel_id=4,
  ),
)

# Table II's configurations as the clocks those modes run at: a cpufreq cap
# runs the highest table entry at or below it (1.2 GHz -> 1113.6 MHz, 1.4 GHz
# -> 1267.2 MHz), a devfreq cap the lowest entry at or above it (0.85 GHz ->
# 854.25 MHz, 1.12 GHz -> 1122 MHz). Exact table entries, so applying them
# through sysfs needs no snapping.
TX2_TABLE2_CONFIGS = (
  DvfsConfig(
    'table2_1_MAXQ',
    {TX2_A57: 1113600},
    gpu_hz=854250000,
    emc_hz=1331200000,
    online_cpus=TX2_A57_CPUS,
    nvpmodel_id=1,
  ),
  DvfsConfig(
    'table2_2_MAXP_CORE_ALL',
    {TX2_A57: 1267200, TX2_DENVER: 1267200},
    gpu_hz=1122000000,
    emc_hz=1600000000,
    online_cpus=TX2_ALL_CPUS,
    nvpmodel_id=2,
  ),
  DvfsConfig(
    'table2_3_MAXN',
    {TX2_A57: 2035200, TX2_DENVER: 2035200},
    gpu_hz=1300500000,
    emc_hz=1866000000,
    online_cpus=TX2_ALL_CPUS,
    nvpmodel_id=0,
  ),
)
TX2_TABLE2_SPEEDUP = (1.0, 1.21, 1.38)
TX2_TABLE2_POWERUP = (1.0, 1.25, 1.14)

TX2_TABLE2_LITERAL = DeviceProfile(
  name='tx2_literal',
  configs=TX2_TABLE2_CONFIGS,
  speedup=TX2_TABLE2_SPEEDUP,
  p_active_w=tuple(ASSUMED_TX2_P_ACTIVE0_W * u for u in TX2_TABLE2_POWERUP),
  p_idle_w=ASSUMED_TX2_P_IDLE_W,
  description=(
    'FedStitch Table II, PowerUp relative to config 1; 7.5 W active at'
    ' config 1 and 1.9 W idle are assumptions'
  ),
)

TX2_TABLE2_CHAINED = DeviceProfile(
  name='tx2_chained',
  configs=TX2_TABLE2_CONFIGS,
  speedup=TX2_TABLE2_SPEEDUP,
  p_active_w=(
    ASSUMED_TX2_P_ACTIVE0_W,
    ASSUMED_TX2_P_ACTIVE0_W * 1.25,
    ASSUMED_TX2_P_ACTIVE0_W * 1.25 * 1.14,
  ),
  p_idle_w=ASSUMED_TX2_P_IDLE_W,
  description=(
    'FedStitch Table II, PowerUp relative to the previous row; 7.5 W active'
    ' at config 1 and 1.9 W idle are assumptions'
  ),
)

BUILTIN_PROFILES = {p.name: p for p in (TX2_TABLE2_LITERAL, TX2_TABLE2_CHAINED)}


def get_profile(name_or_path: str) -> DeviceProfile:
  """A built-in profile by name ('tx2_literal', 'tx2_chained') or JSON file."""
  if name_or_path in BUILTIN_PROFILES:
    return BUILTIN_PROFILES[name_or_path]
  if os.path.lexists(name_or_path):  # a folder or a device says so
    return load_profile(name_or_path)
  raise ValueError(
    f'unknown profile {name_or_path!r}: not one of'
    f' {", ".join(sorted(BUILTIN_PROFILES))} and not a file'
  )
