"""Discovery on fake TX2 (JetPack 4) and AGX Orin (JetPack 5/6) trees."""

import os
import shutil

from fedjax_mr.energy import discovery
from fedjax_mr.energy import profiles
from fedjax_mr.energy import sysfs
from tests.energy import fake_sysfs


def test_tx2(tx2):
  info = discovery.discover(tx2)
  assert info.model == 'NVIDIA Jetson TX2'
  assert info.is_jetson
  assert info.cpus == (0, 1, 2, 3, 4, 5)
  assert [(p.name, p.cpus) for p in info.cpu_policies] == [
    ('policy0', (0, 3, 4, 5)),
    ('policy1', (1, 2)),
  ]
  a57 = info.policy('policy0')
  assert a57.path == 'sys/devices/system/cpu/cpufreq/policy0'
  assert a57.frequencies_khz == profiles.TX2_CPU_KHZ
  assert 'userspace' in a57.governors
  assert (a57.min_khz, a57.max_khz) == (345600, 2035200)
  # The GPU, not the other devfreq device (vic).
  assert info.gpu == discovery.GpuDevfreq(
    name='17000000.gp10b',
    path='sys/class/devfreq/17000000.gp10b',
    kind='gp10b',
    frequencies_hz=profiles.TX2_GPU_HZ,
    governors=(
      'wmark_active',
      'nvhost_podgov',
      'userspace',
      'performance',
      'simple_ondemand',
    ),
  )
  assert [(c.label, c.layout, c.device) for c in info.power_channels] == [
    ('VDD_SYS_GPU', 'iio', '0-0040'),
    ('VDD_SYS_SOC', 'iio', '0-0040'),
    ('VDD_4V0_WIFI', 'iio', '0-0040'),
    ('VDD_IN', 'iio', '0-0041'),
    ('VDD_SYS_CPU', 'iio', '0-0041'),
    ('VDD_SYS_DDR', 'iio', '0-0041'),
  ]
  vdd_in = info.power_channels[3]
  assert vdd_in.power_path == (
    'sys/bus/i2c/devices/0-0041/iio:device1/in_power0_input'
  )
  assert info.emc == discovery.EmcClock(
    rate_path='sys/kernel/debug/bpmp/debug/clk/emc/rate',
    lock_path='sys/kernel/debug/bpmp/debug/clk/emc/mrq_rate_locked',
    cap_path='sys/kernel/nvpmodel_emc_cap/emc_iso_cap',
  )


def test_orin_jetpack5(orin):
  info = discovery.discover(orin)
  assert info.model == 'NVIDIA Jetson AGX Orin Developer Kit'
  assert [(p.name, p.cpus) for p in info.cpu_policies] == [
    ('policy0', (0, 1, 2, 3)),
    ('policy4', (4, 5, 6, 7)),
    ('policy8', (8, 9, 10, 11)),
  ]
  assert (info.gpu.name, info.gpu.kind) == ('17000000.ga10b', 'ga10b')
  assert info.gpu.frequencies_hz == fake_sysfs.ORIN_GPU_HZ
  # 'NC' channels and the sum-of-shunts channel (in7) are skipped.
  assert [(c.label, c.layout, c.device) for c in info.power_channels] == [
    ('VDD_GPU_SOC', 'hwmon', '1-0040'),
    ('VDD_CPU_CV', 'hwmon', '1-0040'),
    ('VIN_SYS_5V0', 'hwmon', '1-0040'),
    ('VDDQ_VDD2_1V8AO', 'hwmon', '1-0041'),
  ]
  ch = info.power_channels[1]
  assert ch.power_path is None
  assert ch.voltage_path == 'sys/bus/i2c/devices/1-0040/hwmon/hwmon3/in2_input'
  assert ch.current_path == (
    'sys/bus/i2c/devices/1-0040/hwmon/hwmon3/curr2_input'
  )
  assert info.emc is None


def test_orin_jetpack6_gpu_node(tmp_path):
  root = sysfs.SysfsRoot(fake_sysfs.build_orin_tree(tmp_path, jetpack=6))
  gpu = discovery.find_gpu(root)
  assert (gpu.name, gpu.kind, gpu.path) == (
    '17000000.gpu',
    'gpu',
    'sys/class/devfreq/17000000.gpu',
  )


def test_gpu_by_node_name_without_of_node(tmp_path):
  fake_sysfs.build_tx2_tree(tmp_path)
  os.remove(tmp_path / 'sys/devices/gpu.0/of_node/name')
  gpu = discovery.find_gpu(sysfs.SysfsRoot(tmp_path))
  assert (gpu.name, gpu.kind) == ('17000000.gp10b', 'gp10b')


def test_per_core_cpufreq_dirs_without_policy_dirs(tmp_path):
  fake_sysfs.build_tx2_tree(tmp_path)
  cpu_dir = tmp_path / 'sys/devices/system/cpu'
  for c in range(6):
    link = cpu_dir / f'cpu{c}/cpufreq'
    target = link.resolve()
    link.unlink()
    shutil.copytree(target, link)
  shutil.rmtree(cpu_dir / 'cpufreq')
  policies = discovery.find_cpu_policies(sysfs.SysfsRoot(tmp_path))
  assert [(p.name, p.path, p.cpus) for p in policies] == [
    ('policy0', 'sys/devices/system/cpu/cpu0/cpufreq', (0, 3, 4, 5)),
    ('policy1', 'sys/devices/system/cpu/cpu1/cpufreq', (1, 2)),
  ]


def test_policy_with_all_cores_offline_reads_ebusy(tx2):
  for c in (1, 2):
    tx2.write(discovery.online_path(c), 0)
  denver = discovery.discover(tx2).cpu_policies[1]
  # The kernel answers EBUSY: the policy is kept, named after its directory.
  assert (denver.name, denver.cpus, denver.frequencies_khz) == (
    'policy1',
    (1,),
    (),
  )


def test_empty_tree(tmp_path):
  info = discovery.discover(sysfs.SysfsRoot(tmp_path))
  assert info == discovery.DeviceInfo(
    model=None, cpus=(), cpu_policies=(), gpu=None, power_channels=(), emc=None
  )
  assert not info.is_jetson
  text = discovery.describe(sysfs.SysfsRoot(tmp_path), info)
  assert 'cpufreq: no policies found' in text
  assert 'power: no INA3221 monitor found' in text


def test_duplicate_labels_get_the_device(tmp_path):
  fake_sysfs.build_tx2_tree(tmp_path)
  (tmp_path / 'sys/bus/i2c/devices/0-0040/iio:device0/rail_name_1').write_text(
    'VDD_IN\n'
  )
  labels = [
    c.label for c in discovery.find_power_channels(sysfs.SysfsRoot(tmp_path))
  ]
  assert labels.count('VDD_IN') == 1
  assert 'VDD_IN@0-0041' in labels


def test_describe_lists_current_state(tx2):
  text = discovery.describe(tx2, discovery.discover(tx2))
  assert 'board: NVIDIA Jetson TX2' in text
  assert (
    'cpu policy1: cores 1,2; table 345600..2035200 (12 values) kHz;'
    ' governor schedutil; limits 345600..2035200 kHz; now 2035200 kHz'
  ) in text
  assert 'power rail VDD_IN: iio 0-0041' in text
  assert 'emc: 1866000000 Hz (cap 0; read-only by default)' in text
