"""Power meter, energy meter and tegrastats parser."""

import time

import pytest

from fedjax_mr.energy import energy_meter
from fedjax_mr.energy import power
from fedjax_mr.energy import sysfs
from fedjax_mr.energy import tegrastats
from tests.energy import fake_sysfs

IIO1 = 'sys/bus/i2c/devices/0-0041/iio:device1'
HWMON3 = 'sys/bus/i2c/devices/1-0040/hwmon/hwmon3'
HWMON4 = 'sys/bus/i2c/devices/1-0041/hwmon/hwmon4'


def set_files(root, files):
  for rel, value in files.items():
    (root / rel).write_text(f'{value}\n')


@pytest.mark.parametrize(
  'rails, total',
  [
    ({'VDD_SYS_CPU': 1000, 'VDD_IN': 5000}, 5000),
    ({'X': 1, 'POM_5V_IN': 4000}, 4000),
    ({'VDD_GPU_SOC': 1000, 'VDD_CPU_CV': 2500}, 3500),
  ],
)
def test_total_power(rails, total):
  assert power.total_power_mw(rails) == total


def test_iio_meter(tmp_path):
  root = sysfs.SysfsRoot(fake_sysfs.build_tx2_tree(tmp_path))
  meter = power.SysfsPowerMeter(root)
  assert meter.read_mw() == {
    'VDD_SYS_GPU': 153.0,
    'VDD_SYS_SOC': 383.0,
    'VDD_4V0_WIFI': 0.0,
    'VDD_IN': 1876.0,
    'VDD_SYS_CPU': 229.0,
    'VDD_SYS_DDR': 134.0,
  }
  assert meter.total_mw() == 1876.0
  assert meter.total_w() == 1.876


def test_rails_by_label_not_index(tmp_path):
  fake_sysfs.build_tx2_tree(tmp_path)
  set_files(  # The channels of 0-0041 in another order.
    tmp_path,
    {
      f'{IIO1}/rail_name_0': 'VDD_SYS_CPU',
      f'{IIO1}/in_power0_input': 229,
      f'{IIO1}/rail_name_1': 'VDD_IN',
      f'{IIO1}/in_power1_input': 1876,
    },
  )
  readings = power.SysfsPowerMeter(sysfs.SysfsRoot(tmp_path)).read_mw()
  assert (readings['VDD_IN'], readings['VDD_SYS_CPU']) == (1876.0, 229.0)
  assert power.total_power_mw(readings) == 1876.0


def test_iio_without_power_file_uses_voltage_times_current(tmp_path):
  fake_sysfs.build_tx2_tree(tmp_path)
  (tmp_path / IIO1 / 'in_power0_input').unlink()
  set_files(
    tmp_path,
    {f'{IIO1}/in_voltage0_input': 19000, f'{IIO1}/in_current0_input': 98},
  )
  meter = power.SysfsPowerMeter(sysfs.SysfsRoot(tmp_path))
  assert meter.read_mw()['VDD_IN'] == 1862.0  # 19000 mV * 98 mA / 1000


def test_hwmon_meter(tmp_path):
  fake_sysfs.build_orin_tree(tmp_path)
  set_files(
    tmp_path,
    {
      f'{HWMON3}/in1_input': 5000,
      f'{HWMON3}/curr1_input': 1200,
      f'{HWMON3}/in2_input': 5000,
      f'{HWMON3}/curr2_input': 300,
      f'{HWMON3}/in3_input': 4800,
      f'{HWMON3}/curr3_input': 250,
      f'{HWMON4}/in1_input': 1800,
      f'{HWMON4}/curr1_input': 500,
      f'{HWMON4}/curr2_input': 999,  # 'NC': ignored.
    },
  )
  meter = power.SysfsPowerMeter(sysfs.SysfsRoot(tmp_path))
  assert meter.rails() == (
    'VDD_GPU_SOC',
    'VDD_CPU_CV',
    'VIN_SYS_5V0',
    'VDDQ_VDD2_1V8AO',
  )
  assert meter.read_mw() == {
    'VDD_GPU_SOC': 6000.0,
    'VDD_CPU_CV': 1500.0,
    'VIN_SYS_5V0': 1200.0,
    'VDDQ_VDD2_1V8AO': 900.0,
  }
  assert meter.total_mw() == 9600.0  # No VDD_IN: the sum.


def test_no_monitor(tmp_path):
  with pytest.raises(sysfs.EnergyError, match='no INA3221'):
    power.SysfsPowerMeter(sysfs.SysfsRoot(tmp_path))


def test_trapezoid():
  # ½(2+4)·1 + ½(4+4)·2 = 3 + 8.
  assert energy_meter.trapezoid_energy([0, 1, 3], [2, 4, 4]) == 11.0
  assert energy_meter.trapezoid_energy([5], [3]) == 0.0
  with pytest.raises(ValueError, match='backwards'):
    energy_meter.trapezoid_energy([0, 2, 1], [1, 1, 1])
  with pytest.raises(ValueError, match='2 times but 1 powers'):
    energy_meter.trapezoid_energy([0, 1], [1])


def test_energy_meter_with_fake_clock(clock):
  watts = [2.0]
  meter = energy_meter.EnergyMeter(
    lambda: watts[0], clock=clock, threaded=False
  )
  meter.start()  # t=100, 2 W
  clock.advance(1.0)
  watts[0] = 4.0
  meter.sample()  # t=101, 4 W
  clock.advance(2.0)
  reading = meter.stop()  # t=103, 4 W
  assert reading == energy_meter.EnergyReading(
    energy_j=11.0, duration_s=3.0, mean_power_w=11.0 / 3.0, num_samples=3
  )


def test_energy_meter_step_change_with_samples_at_the_step(clock):
  watts = [6.0]
  with energy_meter.EnergyMeter(
    lambda: watts[0], clock=clock, threaded=False
  ) as meter:
    clock.advance(4.0)
    meter.sample()  # 6 W until t=104
    watts[0] = 1.5
    meter.sample()  # 1.5 W from t=104: a zero-width step
    clock.advance(2.0)
  assert meter.reading.energy_j == 6.0 * 4 + 1.5 * 2
  assert meter.reading.num_samples == 4


def test_energy_meter_thread_samples_constant_power():
  meter = energy_meter.EnergyMeter(lambda: 5.0, period_s=0.005)
  meter.start()
  time.sleep(0.06)
  reading = meter.stop()
  assert reading.duration_s >= 0.06
  assert reading.num_samples >= 4  # Start, stop and the thread's samples.
  assert reading.energy_j == pytest.approx(5.0 * reading.duration_s, rel=1e-9)
  assert reading.mean_power_w == pytest.approx(5.0, rel=1e-9)


def test_energy_meter_thread_error_surfaces():
  calls = []

  def read():
    calls.append(1)
    if len(calls) > 2:
      raise OSError('sensor gone')
    return 1.0

  meter = energy_meter.EnergyMeter(read, period_s=0.001).start()
  time.sleep(0.05)
  with pytest.raises(OSError, match='sensor gone'):
    meter.stop()


TX2_LINE = (
  'RAM 1004/7852MB (lfb 7x2MB) CPU [0%@350,4%@345,2%@499,1%@341,1%@349,0%@345]'
  ' EMC_FREQ 17%@40 GR3D_FREQ 0%@114 APE 150 MTS fg 0% bg 0% PLL@34C MCPU@34C'
  ' PMIC@100C Tboard@28C GPU@32C BCPU@34C thermal@33.2C Tdiode@30.5C'
  ' VDD_SYS_GPU 153/153 VDD_SYS_SOC 383/383 VDD_4V0_WIFI 0/0 VDD_IN 1876/1876'
  ' VDD_SYS_CPU 229/229 VDD_SYS_DDR 134/134'
)
ORIN_LINE = (
  'RAM 2448/62780MB (lfb 14553x4MB) SWAP 0/31390MB (cached 0MB) CPU'
  ' [12%@729,0%@729,3%@729,1%@729,off,off,off,off] EMC_FREQ 2%@2133'
  ' GR3D_FREQ 10%@1300 VIC_FREQ 729 APE 174 CPU@42.312C GPU@-256C'
  ' tj@42.312C VDD_GPU_SOC 2388mW/2390mW VDD_CPU_CV 398mW/401mW'
  ' VIN_SYS_5V0 2522mW/2520mW NC 0mW/0mW VDDQ_VDD2_1V8AO 300mW/301mW'
)
ORIN_NX_LINE = (
  'RAM 3026/15388MB CPU [5%@1984,2%@1984] GR3D_FREQ 12%@[1300,1299]'
  ' VDD_IN 5139mW/5139mW/6012mW VDD_CPU_GPU_CV 1012mW/1012mW/1100mW'
  ' VDD_SOC 1471mW/1471mW/1500mW'
)


def test_tegrastats_tx2():
  s = tegrastats.parse_line(TX2_LINE)
  assert s.ram_mb == (1004, 7852)
  assert s.swap_mb is None
  assert s.cpus == tuple(
    tegrastats.CoreUse(load, freq)
    for load, freq in [
      (0, 350),
      (4, 345),
      (2, 499),
      (1, 341),
      (1, 349),
      (0, 345),
    ]
  )
  assert s.emc == tegrastats.ClockUse(17, (40,))
  assert s.gpu == tegrastats.ClockUse(0, (114,))
  assert s.temps_c == {
    'PLL': 34.0,
    'MCPU': 34.0,
    'PMIC': 100.0,
    'Tboard': 28.0,
    'GPU': 32.0,
    'BCPU': 34.0,
    'thermal': 33.2,
    'Tdiode': 30.5,
  }
  assert s.rails_mw == {
    'VDD_SYS_GPU': (153, 153),
    'VDD_SYS_SOC': (383, 383),
    'VDD_4V0_WIFI': (0, 0),
    'VDD_IN': (1876, 1876),
    'VDD_SYS_CPU': (229, 229),
    'VDD_SYS_DDR': (134, 134),
  }
  assert s.total_mw() == 1876


def test_tegrastats_orin():
  s = tegrastats.parse_line(ORIN_LINE)
  assert (s.ram_mb, s.swap_mb) == ((2448, 62780), (0, 31390))
  assert s.cpus[:2] == (tegrastats.CoreUse(12, 729), tegrastats.CoreUse(0, 729))
  assert s.cpus[4:] == (None, None, None, None)
  assert (s.emc, s.gpu) == (
    tegrastats.ClockUse(2, (2133,)),
    tegrastats.ClockUse(10, (1300,)),
  )
  assert s.temps_c == {'CPU': 42.312, 'GPU': -256.0, 'tj': 42.312}
  assert s.rails_mw == {
    'VDD_GPU_SOC': (2388, 2390),
    'VDD_CPU_CV': (398, 401),
    'VIN_SYS_5V0': (2522, 2520),
    'VDDQ_VDD2_1V8AO': (300, 301),
  }
  assert s.total_mw() == 2388 + 398 + 2522 + 300  # No VDD_IN: the sum.


def test_tegrastats_per_gpc_clocks_and_three_values():
  s = tegrastats.parse_line(ORIN_NX_LINE)
  assert s.gpu == tegrastats.ClockUse(12, (1300, 1299))
  assert s.emc is None
  assert s.rails_mw['VDD_IN'] == (5139, 5139, 6012)
  assert s.current_mw() == {
    'VDD_IN': 5139,
    'VDD_CPU_GPU_CV': 1012,
    'VDD_SOC': 1471,
  }
  assert s.total_mw() == 5139
