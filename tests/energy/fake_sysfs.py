"""Fake Jetson sysfs trees and a small kernel emulator for the energy tests.

`build_tx2_tree` writes a TX2 on JetPack 4 (INA3221 through IIO, GPU gp10b,
BPMP EMC); `build_orin_tree` an AGX Orin on JetPack 5/6 (INA3221 through
hwmon, GPU ga10b or gpu, no readable EMC). Both are plain files and relative
symlinks, laid out as on the devices.

`FakeKernel` is a `SysfsRoot` over such a tree that behaves like the kernel
on writes: it rejects min > max and unknown governors with EINVAL, clamps
limits to the hardware range, answers EACCES for files marked denied, EBUSY
for reads of a policy whose cores are all offline, recomputes the running
clocks (optionally throttled) and writes rail powers that follow a device
profile. Every accepted write is logged in order.

The Orin tables are plausible values for tests, not an authoritative copy of
the device's tables.
"""

import errno
import os
import pathlib
from typing import Mapping

from fedjax_mr.energy import discovery
from fedjax_mr.energy import profiles
from fedjax_mr.energy import sysfs

TX2_MODEL = 'NVIDIA Jetson TX2'
ORIN_MODEL = 'NVIDIA Jetson AGX Orin Developer Kit'
TX2_GPU = 'sys/class/devfreq/17000000.gp10b'
TX2_POLICIES = {'policy0': (0, 3, 4, 5), 'policy1': (1, 2)}
ORIN_POLICIES = {
  'policy0': (0, 1, 2, 3),
  'policy4': (4, 5, 6, 7),
  'policy8': (8, 9, 10, 11),
}
ORIN_CPU_KHZ = (115200, 422400, 729600, 1036800, 1344000, 1651200, 1958400,
                2201600)  # fmt: skip
ORIN_GPU_HZ = (306000000, 408000000, 510000000, 612000000, 714000000,
               816000000, 918000000, 1020000000, 1122000000, 1224000000,
               1300500000)  # fmt: skip
CPUFREQ = 'sys/devices/system/cpu/cpufreq'

# How the emulator splits the total power over the rails. TX2: VDD_IN is the
# module input and the others are parts of it; AGX Orin has no VDD_IN and its
# rails add up to the total.
TX2_RAIL_SHARES = {
  'VDD_IN': 1.0,
  'VDD_SYS_CPU': 0.25,
  'VDD_SYS_GPU': 0.35,
  'VDD_SYS_SOC': 0.15,
  'VDD_SYS_DDR': 0.1,
  'VDD_4V0_WIFI': 0.0,
}
ORIN_RAIL_SHARES = {
  'VDD_GPU_SOC': 0.5,
  'VDD_CPU_CV': 0.2,
  'VIN_SYS_5V0': 0.2,
  'VDDQ_VDD2_1V8AO': 0.1,
}

# A two-configuration Orin profile for the emulator (our test numbers).
ORIN_TEST_PROFILE = profiles.DeviceProfile(
  name='orin_test',
  configs=(
    profiles.DvfsConfig('slow', {'*': 1036800}, gpu_hz=612000000),
    profiles.DvfsConfig('fast', {'*': 2201600}, gpu_hz=1300500000),
  ),
  speedup=(1.0, 2.0),
  p_active_w=(10.0, 20.0),
  p_idle_w=5.0,
)


def write(root: pathlib.Path, rel: str, text: str | int) -> None:
  path = root / rel
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(f'{text}\n')


def link(root: pathlib.Path, rel: str, target_rel: str) -> None:
  """A relative symlink root/rel -> root/target_rel, as sysfs has."""
  path = root / rel
  path.parent.mkdir(parents=True, exist_ok=True)
  os.symlink(os.path.relpath(root / target_rel, path.parent), path)


def _cpus(root, cpus, policies, table, governors):
  for c in cpus:
    (root / f'sys/devices/system/cpu/cpu{c}').mkdir(parents=True, exist_ok=True)
    if c != 0:  # As on the boards, cpu0 cannot be hot-unplugged.
      write(root, f'sys/devices/system/cpu/cpu{c}/online', 1)
  for name, members in policies.items():
    d = f'{CPUFREQ}/{name}'
    files = {
      'related_cpus': ' '.join(map(str, members)),
      'affected_cpus': ' '.join(map(str, members)),
      'scaling_available_frequencies': ' '.join(map(str, table)),
      'scaling_available_governors': governors,
      'scaling_governor': 'schedutil',
      'scaling_min_freq': table[0],
      'scaling_max_freq': table[-1],
      'scaling_cur_freq': table[-1],
      'cpuinfo_cur_freq': table[-1],
      'cpuinfo_min_freq': table[0],
      'cpuinfo_max_freq': table[-1],
      'scaling_setspeed': '<unsupported>',
    }
    for f, v in files.items():
      write(root, f'{d}/{f}', v)
    for c in members:
      link(root, f'sys/devices/system/cpu/cpu{c}/cpufreq', d)


def _devfreq(root, device_dir, node, of_name, table, governor, governors):
  d = f'{device_dir}/devfreq/{node}'
  files = {
    'available_frequencies': ' '.join(map(str, table)),
    'available_governors': governors,
    'governor': governor,
    'min_freq': table[0],
    'max_freq': table[-1],
    'cur_freq': table[-1],
  }
  for f, v in files.items():
    write(root, f'{d}/{f}', v)
  write(root, f'{device_dir}/of_node/name', f'{of_name}\0')
  link(root, f'{d}/device', device_dir)
  link(root, f'sys/class/devfreq/{node}', d)


def _i2c_device(root, platform_dir, device, name):
  d = f'{platform_dir}/{device}'
  write(root, f'{d}/name', name)
  link(root, f'sys/bus/i2c/devices/{device}', d)
  return d


def _iio_monitor(root, platform_dir, device, index, rails):
  d = _i2c_device(root, platform_dir, device, 'ina3221x')
  link(root, f'sys/bus/i2c/drivers/ina3221x/{device}', d)
  iio = f'{d}/iio:device{index}'
  for n, (label, mv, mw) in enumerate(rails):
    write(root, f'{iio}/rail_name_{n}', label)
    write(root, f'{iio}/in_voltage{n}_input', mv)
    write(root, f'{iio}/in_current{n}_input', mw * 1000 // mv)
    write(root, f'{iio}/in_power{n}_input', mw)
    write(root, f'{iio}/crit_current_limit_{n}', 5000)


def _hwmon_monitor(root, platform_dir, device, index, labels):
  d = _i2c_device(root, platform_dir, device, 'ina3221')
  link(root, f'sys/bus/i2c/drivers/ina3221/{device}', d)
  hw = f'{d}/hwmon/hwmon{index}'
  write(root, f'{hw}/name', 'ina3221')
  write(root, f'{hw}/update_interval', 1000)
  for n, label in enumerate(labels, start=1):
    write(root, f'{hw}/in{n}_label', label)
    write(root, f'{hw}/in{n}_input', 5000)  # Bus voltage, mV.
    write(root, f'{hw}/curr{n}_input', 200)  # mA.
    write(root, f'{hw}/curr{n}_crit', 5000)
    write(root, f'{hw}/in{n + 3}_input', 4000)  # Shunt voltage, uV.
  write(root, f'{hw}/in7_label', 'sum of shunt voltages')
  write(root, f'{hw}/in7_input', 12000)
  write(root, f'{hw}/curr4_input', 600)


def build_tx2_tree(root: str | os.PathLike[str]) -> pathlib.Path:
  """A Jetson TX2 on JetPack 4 (L4T 32) below `root`; returns the root."""
  root = pathlib.Path(root)
  write(root, 'proc/device-tree/model', f'{TX2_MODEL}\0')
  _cpus(
    root,
    range(6),
    TX2_POLICIES,
    profiles.TX2_CPU_KHZ,
    'interactive conservative ondemand userspace powersave performance'
    ' schedutil',
  )
  write(root, 'sys/devices/gpu.0/load', 0)
  write(root, 'sys/devices/gpu.0/railgate_enable', 1)
  _devfreq(
    root,
    'sys/devices/gpu.0',
    '17000000.gp10b',
    'gp10b',
    profiles.TX2_GPU_HZ,
    'nvhost_podgov',
    'wmark_active nvhost_podgov userspace performance simple_ondemand',
  )
  # Another devfreq device, which discovery must not take for the GPU.
  _devfreq(
    root,
    'sys/devices/15340000.vic',
    '15340000.vic',
    'vic',
    (115200000, 1036800000),
    'nvhost_podgov',
    'nvhost_podgov',
  )
  i2c = 'sys/devices/3160000.i2c/i2c-0'
  _iio_monitor(
    root,
    i2c,
    '0-0040',
    0,
    [('VDD_SYS_GPU', 19000, 153), ('VDD_SYS_SOC', 19000, 383),
     ('VDD_4V0_WIFI', 4000, 0)],
  )  # fmt: skip
  _iio_monitor(
    root,
    i2c,
    '0-0041',
    1,
    [('VDD_IN', 19000, 1876), ('VDD_SYS_CPU', 19000, 229),
     ('VDD_SYS_DDR', 19000, 134)],
  )  # fmt: skip
  _i2c_device(root, i2c, '0-004c', 'tmp451')  # A temperature sensor.
  emc = 'sys/kernel/debug/bpmp/debug/clk/emc'
  write(root, f'{emc}/rate', 1866000000)
  write(root, f'{emc}/min_rate', profiles.TX2_EMC_HZ[0])
  write(root, f'{emc}/max_rate', profiles.TX2_EMC_HZ[-1])
  write(root, f'{emc}/mrq_rate_locked', 0)
  write(root, discovery.EMC_CAP_PATH, 0)
  return root


def build_orin_tree(
  root: str | os.PathLike[str], jetpack: int = 5
) -> pathlib.Path:
  """An AGX Orin on JetPack 5 (GPU 17000000.ga10b) or 6 (17000000.gpu)."""
  root = pathlib.Path(root)
  write(root, 'proc/device-tree/model', f'{ORIN_MODEL}\0')
  _cpus(
    root,
    range(12),
    ORIN_POLICIES,
    ORIN_CPU_KHZ,
    'userspace ondemand performance schedutil',
  )
  if jetpack >= 6:
    gpu_dir = 'sys/devices/platform/bus@0/17000000.gpu'
    node, of_name = '17000000.gpu', 'gpu'
  else:
    gpu_dir = 'sys/devices/platform/17000000.ga10b'
    node, of_name = '17000000.ga10b', 'ga10b'

  _devfreq(
    root,
    gpu_dir,
    node,
    of_name,
    ORIN_GPU_HZ,
    'nvhost_podgov',
    'nvhost_podgov userspace performance simple_ondemand',
  )
  i2c = 'sys/devices/platform/bus@0/c240000.i2c/i2c-1'
  _hwmon_monitor(
    root, i2c, '1-0040', 3, ['VDD_GPU_SOC', 'VDD_CPU_CV', 'VIN_SYS_5V0']
  )
  _hwmon_monitor(root, i2c, '1-0041', 4, ['VDDQ_VDD2_1V8AO', 'NC', 'NC'])
  return root


def control_files(root: sysfs.SysfsRoot) -> dict[str, str]:
  """Contents of every file a DVFS backend may write, by relative path."""
  patterns = (
    'sys/devices/system/cpu/cpufreq/policy*/scaling_*_freq',
    'sys/devices/system/cpu/cpufreq/policy*/scaling_governor',
    'sys/devices/system/cpu/cpu*/online',
    'sys/class/devfreq/*/*_freq',
    'sys/class/devfreq/*/governor',
    'sys/kernel/debug/bpmp/debug/clk/emc/*',
  )
  out = {}
  for pattern in patterns:
    for rel in root.glob(pattern):
      if not rel.endswith(('cur_freq',)):
        out[rel] = (root.root / rel).read_text().strip()
  return out


class FakeClock:
  """A monotonic clock that moves only when told."""

  def __init__(self, start: float = 100.0):
    self.now = start

  def __call__(self) -> float:
    return self.now

  def advance(self, seconds: float) -> None:
    self.now += seconds


class FakeKernel(sysfs.SysfsRoot):
  """A `SysfsRoot` whose writes behave like the Jetson kernel's.

  Attributes:
    log: accepted writes, in order: (relative path, value).
    denied: relative paths whose writes fail with EACCES.
    throttle_cpu_khz / throttle_gpu_hz: caps on the running clocks (thermal
      throttling); None for none.
    busy: whether the workload runs (active power) or not (idle power).
  """

  def __init__(
    self,
    root: str | os.PathLike[str],
    profile: profiles.DeviceProfile,
    rail_shares: Mapping[str, float],
  ):
    super().__init__(root)
    self.profile = profile
    self.rail_shares = dict(rail_shares)
    self.log: list[tuple[str, str]] = []
    self.denied: set[str] = set()
    self.throttle_cpu_khz: int | None = None
    self.throttle_gpu_hz: int | None = None
    self.busy = False
    self._policies = {
      d: tuple(
        int(c)
        for c in super(FakeKernel, self).read(f'{d}/related_cpus').split()
      )
      for d in self.glob(f'{CPUFREQ}/policy*')
    }
    self._gpu = discovery.find_gpu(self)
    self._channels = discovery.find_power_channels(self)
    self.tick()

  # What the kernel does on reads and writes.

  def _online(self, cpu: int) -> bool:
    path = discovery.online_path(cpu)
    return not self.exists(path) or super().read(path) == '1'

  def _inactive_policy(self, rel: str) -> str | None:
    for d, cpus in self._policies.items():
      if rel.startswith(d + '/') and not any(self._online(c) for c in cpus):
        return d
    return None

  def read(self, rel: str) -> str:
    if self._inactive_policy(rel):
      raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), rel)
    return super().read(rel)

  def _raw_int(self, rel: str) -> int:
    return int(super().read(rel))

  def _set(self, rel: str, value) -> None:
    """Writes a file directly, skipping unchanged ones (writes are slow)."""
    if super().read(rel) != str(value):
      super().write(rel, str(value))

  def write(self, rel: str, value) -> None:
    value = str(value)
    if rel in self.denied:
      raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), rel)
    directory, name = rel.rsplit('/', 1)
    if self._inactive_policy(rel):
      raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), rel)
    limits = {  # A limit, the other limit, whether it is the minimum.
      'scaling_min_freq': ('scaling_max_freq', True),
      'scaling_max_freq': ('scaling_min_freq', False),
      'min_freq': ('max_freq', True),
      'max_freq': ('min_freq', False),
    }
    if name in limits:
      other, is_min = limits[name]
      v = int(value)
      if name.startswith('scaling_'):  # Clamp to the hardware range.
        lo = self._raw_int(f'{directory}/cpuinfo_min_freq')
        hi = self._raw_int(f'{directory}/cpuinfo_max_freq')
        v = min(max(v, lo), hi)
      o = self._raw_int(f'{directory}/{other}')
      if (is_min and v > o) or (not is_min and v < o):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), rel)
      value = str(v)
    elif name in ('scaling_governor', 'governor'):
      available = (
        'scaling_available_governors'
        if name == 'scaling_governor'
        else 'available_governors'
      )
      if value not in super().read(f'{directory}/{available}').split():
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), rel)
    elif name == 'scaling_setspeed':
      if super().read(f'{directory}/scaling_governor') != 'userspace':
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), rel)
    elif name == 'online' and value not in ('0', '1'):
      raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), rel)
    self._set(rel, value)
    self.log.append((rel, value))
    self.tick()

  # The clocks and powers that follow from the files.

  @staticmethod
  def _floor(value: int, table) -> int:
    below = [f for f in table if f <= value]
    return below[-1] if below else min(table)

  def cpu_khz(self) -> dict[str, int]:
    """Running clock of every active policy."""
    out = {}
    for d, cpus in self._policies.items():
      if not any(self._online(c) for c in cpus):
        continue
      table = [
        int(f)
        for f in super().read(f'{d}/scaling_available_frequencies').split()
      ]
      hi = self._raw_int(f'{d}/scaling_max_freq')
      target = hi  # Under load, a load-driven governor runs at the maximum.
      if super().read(f'{d}/scaling_governor') == 'userspace':
        speed = super().read(f'{d}/scaling_setspeed')
        if speed.isdigit():
          lo = self._raw_int(f'{d}/scaling_min_freq')
          target = min(max(int(speed), lo), hi)
      if self.throttle_cpu_khz is not None:
        target = min(target, self.throttle_cpu_khz)
      out[d.rsplit('/', 1)[-1]] = self._floor(target, table)
    return out

  def gpu_hz(self) -> int | None:
    gpu = self._gpu
    if gpu is None:
      return None
    target = self._raw_int(f'{gpu.path}/max_freq')
    if self.throttle_gpu_hz is not None:
      target = min(target, self.throttle_gpu_hz)
    return self._floor(target, gpu.frequencies_hz)

  def config_index(self) -> int:
    """The profile configuration nearest to the running clocks."""
    cpu, gpu = self.cpu_khz(), self.gpu_hz()
    online = {
      c for cpus in self._policies.values() for c in cpus if self._online(c)
    }

    def distance(config: profiles.DvfsConfig) -> float:
      d = 0.0
      for key, khz in config.cpu_khz.items():
        for name in cpu if key == '*' else [key]:
          d += abs(cpu.get(name, 0) - khz) / khz
      if config.gpu_hz is not None and gpu is not None:
        d += abs(gpu - config.gpu_hz) / config.gpu_hz
      if config.online_cpus is not None:
        d += len(online ^ set(config.online_cpus))
      return d

    return min(
      range(len(self.profile.configs)),
      key=lambda k: distance(self.profile.configs[k]),
    )

  def power_w(self) -> float:
    if self.busy:
      return self.profile.p_active_w[self.config_index()]
    return self.profile.p_idle_w

  def tick(self) -> None:
    """Rewrites running clocks and rail powers from the control files."""
    for name, khz in self.cpu_khz().items():
      for f in ('scaling_cur_freq', 'cpuinfo_cur_freq'):
        self._set(f'{CPUFREQ}/{name}/{f}', khz)
    if self._gpu is not None:
      self._set(f'{self._gpu.path}/cur_freq', self.gpu_hz())
    total_mw = self.power_w() * 1000
    for ch in self._channels:
      mw = total_mw * self.rail_shares.get(ch.label, 0.0)
      if ch.power_path is not None:
        self._set(ch.power_path, round(mw))
      if ch.voltage_path is not None and ch.current_path is not None:
        mv = self._raw_int(ch.voltage_path)
        self._set(ch.current_path, round(mw * 1000 / mv))

  def set_busy(self, busy: bool) -> None:
    self.busy = busy
    self.tick()

  def run_workload(self, clock: FakeClock, base_s: float) -> float:
    """Runs work taking `base_s` at config 0: busy, clock moves; the time."""
    self.set_busy(True)
    seconds = base_s / self.profile.speedup[self.config_index()]
    clock.advance(seconds)
    return seconds
