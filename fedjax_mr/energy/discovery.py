"""Finds a Jetson's DVFS knobs and power monitors below a `SysfsRoot`.

Discovery only reads. It looks for:

* the board model (`proc/device-tree/model`);
* cpufreq policies and their cores (`sys/devices/system/cpu/cpufreq/policyK`,
  or per-core `cpuN/cpufreq` directories grouped by `related_cpus`);
* the GPU devfreq node, by its device-tree name (gp10b on TX2, gv11b on
  Xavier, ga10b on Orin, or gpu): `sys/class/devfreq/*/device/of_node/name`;
* INA3221 power monitors in both layouts: JetPack 4 IIO (`rail_name_N`,
  `in_powerN_input`) and JetPack 5+ hwmon (`inN_label`, `inN_input`,
  `currN_input`); channels are kept by label, 'NC' and the hwmon sum channel
  are skipped;
* the EMC (memory) clock through BPMP debugfs, when readable.
"""

import re
from typing import NamedTuple

from fedjax_mr.energy import sysfs

# Device-tree names of the integrated GPU, in the order they are preferred.
GPU_NODE_NAMES = ('gp10b', 'gv11b', 'ga10b', 'gpu')
INA3221_NAMES = ('ina3221x', 'ina3221')

CPU_DIR = 'sys/devices/system/cpu'
MODEL_PATHS = ('proc/device-tree/model', 'sys/firmware/devicetree/base/model')
# (directory, rate file, lock file) of the EMC clock, most recent kernels first.
EMC_DIRS = (
  ('sys/kernel/debug/bpmp/debug/clk/emc', 'rate', 'mrq_rate_locked'),
  ('sys/kernel/debug/clk/override.emc', 'clk_rate', 'clk_state'),
)
EMC_CAP_PATH = 'sys/kernel/nvpmodel_emc_cap/emc_iso_cap'


class CpuPolicy(NamedTuple):
  """One cpufreq policy: a cluster of cores sharing a clock.

  Attributes:
    name: 'policyK', K being the policy's first core.
    path: directory with the `scaling_*` files, relative to the root.
    cpus: the cores of the policy (`related_cpus`, online or not).
    frequencies_khz: ascending `scaling_available_frequencies` (kHz); empty
      when the driver does not list them.
    governors: `scaling_available_governors`.
    min_khz: `cpuinfo_min_freq`, the hardware lower bound.
    max_khz: `cpuinfo_max_freq`, the hardware upper bound.
  """

  name: str
  path: str
  cpus: tuple[int, ...]
  frequencies_khz: tuple[int, ...]
  governors: tuple[str, ...]
  min_khz: int
  max_khz: int


class GpuDevfreq(NamedTuple):
  """The GPU's devfreq node.

  Attributes:
    name: the node's name, e.g. '17000000.gp10b'.
    path: its directory (`sys/class/devfreq/<name>`), relative to the root.
    kind: the device-tree name that identified it ('gp10b', 'ga10b', ...).
    frequencies_hz: ascending `available_frequencies` (Hz).
    governors: `available_governors`.
  """

  name: str
  path: str
  kind: str
  frequencies_hz: tuple[int, ...]
  governors: tuple[str, ...]


class PowerChannel(NamedTuple):
  """One INA3221 channel, identified by its rail label.

  Attributes:
    label: rail name, e.g. 'VDD_IN'.
    layout: 'iio' (JetPack 4) or 'hwmon' (JetPack 5+).
    device: the i2c device, e.g. '0-0041'.
    power_path: a file giving mW directly (iio `in_powerN_input`), or None.
    voltage_path: bus voltage in mV, or None.
    current_path: current in mA, or None.
  """

  label: str
  layout: str
  device: str
  power_path: str | None
  voltage_path: str | None
  current_path: str | None


class EmcClock(NamedTuple):
  """The memory clock's debugfs files (root only; optional).

  Attributes:
    rate_path: current rate in Hz.
    lock_path: the file that locks the rate against the governor, or None.
    cap_path: the nvpmodel EMC cap in Hz (0 = none), or None.
  """

  rate_path: str
  lock_path: str | None
  cap_path: str | None


class DeviceInfo(NamedTuple):
  """Everything discovery found; empty fields where nothing was found."""

  model: str | None
  cpus: tuple[int, ...]
  cpu_policies: tuple[CpuPolicy, ...]
  gpu: GpuDevfreq | None
  power_channels: tuple[PowerChannel, ...]
  emc: EmcClock | None

  @property
  def is_jetson(self) -> bool:
    """True for a board that names itself a Jetson or has a Tegra GPU."""
    named = self.model is not None and 'jetson' in self.model.lower()
    return named or self.gpu is not None

  def policy(self, name: str) -> CpuPolicy:
    """The CPU policy called `name`; KeyError listing the known ones."""
    for p in self.cpu_policies:
      if p.name == name:
        return p
    known = ', '.join(p.name for p in self.cpu_policies) or 'none'
    raise KeyError(f'no CPU policy {name!r} (found: {known})')


def online_path(cpu: int) -> str:
  """The hotplug file of a core (cpu0 usually has none)."""
  return f'{CPU_DIR}/cpu{cpu}/online'


def _number(path: str) -> int:
  """The last integer in a path: numeric order ('policy10' > 'policy4')."""
  return int(re.findall(r'\d+', path)[-1])


def _ints_or_empty(root: sysfs.SysfsRoot, rel: str) -> tuple[int, ...]:
  text = root.try_read(rel)
  return tuple(sorted(int(w) for w in text.split())) if text else ()


def _words_or_empty(root: sysfs.SysfsRoot, rel: str) -> tuple[str, ...]:
  text = root.try_read(rel)
  return tuple(text.split()) if text else ()


def find_model(root: sysfs.SysfsRoot) -> str | None:
  for rel in MODEL_PATHS:
    text = root.try_read(rel)
    if text:
      return text
  return None


def find_cpus(root: sysfs.SysfsRoot) -> tuple[int, ...]:
  dirs = root.glob(f'{CPU_DIR}/cpu[0-9]*')
  return tuple(sorted(_number(d) for d in dirs if root.is_dir(d)))


def _int_or_zero(root: sysfs.SysfsRoot, rel: str) -> int:
  text = root.try_read(rel)
  return int(text) if text and text.isdigit() else 0


def _read_policy(root: sysfs.SysfsRoot, path: str) -> CpuPolicy:
  """Reads one policy directory.

  A policy whose cores are all offline answers EBUSY to every read; it is
  kept with its first core (from its name) and empty tables, and is read
  again once its cores are back online.
  """
  cpus_text = root.try_read(sysfs.join(path, 'related_cpus')) or root.try_read(
    sysfs.join(path, 'affected_cpus')
  )
  if cpus_text:
    cpus = tuple(sorted(int(c) for c in cpus_text.split()))
  else:
    cpus = (_number(path),)
  return CpuPolicy(
    name=f'policy{cpus[0]}',
    path=path,
    cpus=cpus,
    frequencies_khz=_ints_or_empty(
      root, sysfs.join(path, 'scaling_available_frequencies')
    ),
    governors=_words_or_empty(
      root, sysfs.join(path, 'scaling_available_governors')
    ),
    min_khz=_int_or_zero(root, sysfs.join(path, 'cpuinfo_min_freq')),
    max_khz=_int_or_zero(root, sysfs.join(path, 'cpuinfo_max_freq')),
  )


def find_cpu_policies(root: sysfs.SysfsRoot) -> tuple[CpuPolicy, ...]:
  """cpufreq policies, from `cpufreq/policyK` or else per-core directories."""
  paths = root.glob(f'{CPU_DIR}/cpufreq/policy[0-9]*')
  if not paths:
    paths = [
      f'{CPU_DIR}/cpu{c}/cpufreq'
      for c in find_cpus(root)
      if root.exists(f'{CPU_DIR}/cpu{c}/cpufreq/scaling_max_freq')
    ]
  policies = {}
  for path in sorted(paths, key=_number):
    policy = _read_policy(root, path)
    policies.setdefault(policy.name, policy)  # Per-core dirs repeat a policy.
  return tuple(sorted(policies.values(), key=lambda p: p.cpus[0]))


def find_gpu(root: sysfs.SysfsRoot) -> GpuDevfreq | None:
  """The GPU devfreq node, by `device/of_node/name`, else by node name."""
  found = {}
  for node in root.glob('sys/class/devfreq/*'):
    name = node.rsplit('/', 1)[-1]
    kind = root.try_read(sysfs.join(node, 'device/of_node/name'))
    if kind not in GPU_NODE_NAMES:
      kind = name.rsplit('.', 1)[-1]
    if kind in GPU_NODE_NAMES and root.exists(
      sysfs.join(node, 'available_frequencies')
    ):
      found.setdefault(kind, (name, node))
  for kind in GPU_NODE_NAMES:
    if kind in found:
      name, node = found[kind]
      return GpuDevfreq(
        name=name,
        path=node,
        kind=kind,
        frequencies_hz=_ints_or_empty(
          root, sysfs.join(node, 'available_frequencies')
        ),
        governors=_words_or_empty(
          root, sysfs.join(node, 'available_governors')
        ),
      )
  return None


def _is_unconnected(label: str) -> bool:
  return label.upper() == 'NC' or not label


def _existing(root: sysfs.SysfsRoot, *parts: str) -> str | None:
  path = sysfs.join(*parts)
  return path if root.exists(path) else None


def _iio_channels(
  root: sysfs.SysfsRoot, device: str, dev_dir: str
) -> list[PowerChannel]:
  channels = []
  for iio in root.glob(sysfs.join(dev_dir, 'iio:device*')):
    for name_file in sorted(
      root.glob(sysfs.join(iio, 'rail_name_*')), key=_number
    ):
      n = _number(name_file)
      label = root.read(name_file)
      if _is_unconnected(label):
        continue
      channels.append(
        PowerChannel(
          label=label,
          layout='iio',
          device=device,
          power_path=_existing(root, iio, f'in_power{n}_input'),
          voltage_path=_existing(root, iio, f'in_voltage{n}_input'),
          current_path=_existing(root, iio, f'in_current{n}_input'),
        )
      )
  return channels


def _hwmon_channels(
  root: sysfs.SysfsRoot, device: str, dev_dir: str
) -> list[PowerChannel]:
  channels = []
  for hwmon in root.glob(sysfs.join(dev_dir, 'hwmon/hwmon*')):
    for label_file in sorted(
      root.glob(sysfs.join(hwmon, 'in*_label')), key=_number
    ):
      n = _number(label_file)
      label = root.read(label_file)
      current = sysfs.join(hwmon, f'curr{n}_input')
      # The sum-of-shunts channel (in7) has a label but no current file.
      if _is_unconnected(label) or not root.exists(current):
        continue
      channels.append(
        PowerChannel(
          label=label,
          layout='hwmon',
          device=device,
          power_path=None,
          voltage_path=sysfs.join(hwmon, f'in{n}_input'),
          current_path=current,
        )
      )
  return channels


def find_power_channels(root: sysfs.SysfsRoot) -> tuple[PowerChannel, ...]:
  """INA3221 channels of every monitor on the i2c buses, by label."""
  channels = []
  for name_file in root.glob('sys/bus/i2c/devices/*/name'):
    if root.try_read(name_file) not in INA3221_NAMES:
      continue
    dev_dir = name_file.rsplit('/', 1)[0]
    device = dev_dir.rsplit('/', 1)[-1]
    channels += _iio_channels(root, device, dev_dir)
    channels += _hwmon_channels(root, device, dev_dir)
  seen = set()
  unique = []
  for ch in channels:
    if ch.label in seen:  # Two monitors with one label: tell them apart.
      ch = ch._replace(label=f'{ch.label}@{ch.device}')
    seen.add(ch.label)
    unique.append(ch)
  return tuple(unique)


def find_emc(root: sysfs.SysfsRoot) -> EmcClock | None:
  """The EMC clock files, if they exist and are readable (debugfs: root)."""
  for directory, rate, lock in EMC_DIRS:
    rate_path = sysfs.join(directory, rate)
    if root.try_read(rate_path) is None:
      continue
    lock_path = sysfs.join(directory, lock)
    return EmcClock(
      rate_path=rate_path,
      lock_path=lock_path if root.exists(lock_path) else None,
      cap_path=EMC_CAP_PATH if root.exists(EMC_CAP_PATH) else None,
    )
  return None


def discover(root: sysfs.SysfsRoot) -> DeviceInfo:
  """Finds the board's DVFS knobs and power monitors (reads only)."""
  return DeviceInfo(
    model=find_model(root),
    cpus=find_cpus(root),
    cpu_policies=find_cpu_policies(root),
    gpu=find_gpu(root),
    power_channels=find_power_channels(root),
    emc=find_emc(root),
  )


def describe(root: sysfs.SysfsRoot, info: DeviceInfo) -> str:
  """A human-readable listing of `info` with the current clocks."""
  lines = [f'sysfs root: {root.root}', f'board: {info.model or "unknown"}']
  offline = [
    c
    for c in info.cpus
    if root.try_read(online_path(c)) == '0'  # Missing file: always online.
  ]
  lines.append(
    f'cpus: {",".join(map(str, info.cpus)) or "none"}'
    f' (offline: {",".join(map(str, offline)) or "none"})'
  )
  if not info.cpu_policies:
    lines.append('cpufreq: no policies found')
  for p in info.cpu_policies:
    cur = root.try_read(sysfs.join(p.path, 'scaling_cur_freq'))
    lo = root.try_read(sysfs.join(p.path, 'scaling_min_freq'))
    hi = root.try_read(sysfs.join(p.path, 'scaling_max_freq'))
    gov = root.try_read(sysfs.join(p.path, 'scaling_governor'))
    lines.append(
      f'cpu {p.name}: cores {",".join(map(str, p.cpus))};'
      f' table {sysfs.format_list(p.frequencies_khz) or "none"} kHz;'
      f' governor {gov}; limits {lo}..{hi} kHz; now {cur} kHz'
    )
  if info.gpu is None:
    lines.append('gpu: no devfreq node found')
  else:
    g = info.gpu
    cur = root.try_read(sysfs.join(g.path, 'cur_freq'))
    lo = root.try_read(sysfs.join(g.path, 'min_freq'))
    hi = root.try_read(sysfs.join(g.path, 'max_freq'))
    gov = root.try_read(sysfs.join(g.path, 'governor'))
    lines.append(
      f'gpu {g.name} ({g.kind}) at {g.path}:'
      f' table {sysfs.format_list(g.frequencies_hz) or "none"} Hz;'
      f' governor {gov}; limits {lo}..{hi} Hz; now {cur} Hz'
    )
  if not info.power_channels:
    lines.append('power: no INA3221 monitor found')
  for ch in info.power_channels:
    lines.append(f'power rail {ch.label}: {ch.layout} {ch.device}')
  if info.emc is None:
    lines.append('emc: not readable (debugfs needs root) or absent')
  else:
    rate = root.try_read(info.emc.rate_path)
    cap = root.try_read(info.emc.cap_path) if info.emc.cap_path else None
    lines.append(f'emc: {rate} Hz (cap {cap or "none"}; read-only by default)')
  return '\n'.join(lines)
