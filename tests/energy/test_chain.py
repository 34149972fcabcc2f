"""discover → coordinate → apply → measure → feedback → restore, end to end."""

import pytest

from fedjax_mr.energy import coordinator
from fedjax_mr.energy import discovery
from fedjax_mr.energy import energy_meter
from fedjax_mr.energy import power
from fedjax_mr.energy import profiles
from fedjax_mr.energy import sysfs_dvfs
from tests.energy import fake_sysfs


def run_round(kernel, profile, deadline_s, base_s, clock):
  """One client round on the fake device; returns (choice, reading, time)."""
  info = discovery.discover(kernel)
  meter = power.SysfsPowerMeter(kernel, info.power_channels)
  choice = coordinator.choose_config(profile, deadline_s, base_time_s=base_s)
  with sysfs_dvfs.SysfsDvfs(kernel, info, settle_s=0) as backend:
    result = backend.apply(choice.config)
    assert not result.throttled
    kernel.set_busy(True)
    window = energy_meter.EnergyMeter(
      meter.total_w, clock=clock, threaded=False
    ).start()
    seconds = kernel.run_workload(clock, base_s)
    window.sample()
    kernel.set_busy(False)  # Done: wait for the deadline at idle power.
    window.sample()
    clock.advance(deadline_s - seconds)
    reading = window.stop()
  return choice, reading, seconds


@pytest.mark.parametrize(
  'profile, deadline, expected',
  [
    (profiles.TX2_TABLE2_LITERAL, 12.0, 2),
    (profiles.TX2_TABLE2_CHAINED, 12.0, 0),
    (profiles.TX2_TABLE2_CHAINED, 10.0, 1),
  ],
)
def test_tx2_round(tmp_path, clock, profile, deadline, expected):
  fake_sysfs.build_tx2_tree(tmp_path)
  kernel = fake_sysfs.FakeKernel(tmp_path, profile, fake_sysfs.TX2_RAIL_SHARES)
  before = fake_sysfs.control_files(kernel)
  choice, reading, seconds = run_round(kernel, profile, deadline, 10.0, clock)
  assert choice.index == expected
  assert seconds == pytest.approx(10.0 / profile.speedup[expected])
  # The measured energy is Eq. 5 for the chosen configuration.
  t = 10.0 / profile.speedup[expected]
  p = profile.p_active_w[expected]
  assert reading.energy_j == pytest.approx(p * t + 1.9 * (deadline - t))
  assert reading.energy_j == pytest.approx(choice.energy_j)
  assert reading.duration_s == pytest.approx(deadline)
  # Feedback: the model was right, so the scale stays 1.
  assert coordinator.update_time_scale(1.0, choice.time_s, seconds) == (
    pytest.approx(1.0)
  )
  assert fake_sysfs.control_files(kernel) == before


def test_orin_round(orin, clock):
  profile = fake_sysfs.ORIN_TEST_PROFILE
  before = fake_sysfs.control_files(orin)
  choice, reading, seconds = run_round(orin, profile, 25.0, 10.0, clock)
  # slow: 10 W · 10 s + 5 W · 15 s = 175 J; fast: 20 W · 5 s + 5 W · 20 s.
  assert choice.energies_j == (175.0, 200.0)
  assert (choice.index, seconds) == (0, 10.0)
  assert reading.energy_j == pytest.approx(175.0)
  assert fake_sysfs.control_files(orin) == before


def test_orin_throttled_round_and_feedback(orin, clock, caplog):
  profile = fake_sysfs.ORIN_TEST_PROFILE
  orin.throttle_cpu_khz = 1036800
  orin.throttle_gpu_hz = 612000000
  with sysfs_dvfs.SysfsDvfs(orin, settle_s=0) as backend:
    result = backend.apply(profile.configs[1])
    assert result.mismatches == tuple(
      f'{p} asked 2201600 kHz, runs 1036800 kHz'
      for p in ('policy0', 'policy4', 'policy8')
    ) + ('gpu asked 1300500000 Hz, runs 612000000 Hz',)
    # Throttled to the 'slow' clocks: the round takes 10 s, not 5.
    seconds = orin.run_workload(clock, 10.0)
  assert 'thermal throttling' in caplog.text
  assert seconds == 10.0
  scale = coordinator.update_time_scale(1.0, 5.0, seconds, alpha=1.0)
  assert scale == 2.0
  nxt = coordinator.choose_config(
    profile, 12.0, base_time_s=10.0, time_scale=scale
  )
  assert nxt.times_s == (20.0, 10.0)
  assert (nxt.index, nxt.feasible) == (1, True)


def test_exception_mid_round_restores(tx2, clock):
  before = fake_sysfs.control_files(tx2)
  with pytest.raises(ZeroDivisionError):
    with sysfs_dvfs.SysfsDvfs(tx2, settle_s=0) as backend:
      backend.apply(profiles.TX2_TABLE2_CONFIGS[0])
      tx2.run_workload(clock, 1.0)
      1 / 0
  assert fake_sysfs.control_files(tx2) == before
