"""Profiles (TX2 Table II, nvpmodel modes, JSON) and measuring one."""

import json

import pytest

from fedjax_mr.core import jsonfile
from fedjax_mr.energy import discovery
from fedjax_mr.energy import dvfs
from fedjax_mr.energy import power
from fedjax_mr.energy import profiles
from fedjax_mr.energy import profiling
from fedjax_mr.energy import sysfs_dvfs
from tests.energy import fake_sysfs

LITERAL = profiles.TX2_TABLE2_LITERAL
CHAINED = profiles.TX2_TABLE2_CHAINED


def test_the_two_readings_of_powerup():
  assert LITERAL.powerup == pytest.approx((1.0, 1.25, 1.14))
  assert LITERAL.p_active_w == pytest.approx((7.5, 9.375, 8.55))
  assert CHAINED.powerup == pytest.approx((1.0, 1.25, 1.425))
  assert CHAINED.p_active_w == pytest.approx((7.5, 9.375, 10.6875))

  def per_task(p):
    return [round(u / s, 3) for u, s in zip(p.powerup, p.speedup)]

  assert per_task(LITERAL) == [1.0, 1.033, 0.826]
  assert per_task(CHAINED) == [1.0, 1.033, 1.033]
  assert LITERAL.fastest == CHAINED.fastest == 2
  assert LITERAL.p_idle_w == CHAINED.p_idle_w == 1.9


def test_table2_configs_are_the_clocks_of_nvpmodel_modes():
  modes = {m.nvpmodel_id: m for m in profiles.TX2_NVPMODEL_MODES}
  assert [c.nvpmodel_id for c in profiles.TX2_TABLE2_CONFIGS] == [1, 2, 0]
  for config in profiles.TX2_TABLE2_CONFIGS:
    mode = modes[config.nvpmodel_id]
    # A cpufreq cap runs the table entry below it, a devfreq cap the one
    # above it.
    assert config.cpu_khz == {
      k: dvfs.snap(v, profiles.TX2_CPU_KHZ, 'floor')
      for k, v in mode.cpu_khz.items()
    }
    assert config.gpu_hz == dvfs.snap(mode.gpu_hz, profiles.TX2_GPU_HZ, 'ceil')
    assert config.online_cpus == mode.online_cpus
  assert [
    (c.cpu_khz['policy0'], c.gpu_hz) for c in profiles.TX2_TABLE2_CONFIGS
  ] == [(1113600, 854250000), (1267200, 1122000000), (2035200, 1300500000)]


def test_nvpmodel_modes():
  names = [(m.nvpmodel_id, m.name) for m in profiles.TX2_NVPMODEL_MODES]
  assert names == [
    (0, 'MAXN'),
    (1, 'MAXQ'),
    (2, 'MAXP_CORE_ALL'),
    (3, 'MAXP_CORE_ARM'),
    (4, 'MAXP_CORE_DENVER'),
  ]
  maxq = profiles.TX2_NVPMODEL_MODES[1]
  assert (maxq.cpu_khz, maxq.gpu_hz, maxq.emc_hz, maxq.online_cpus) == (
    {'policy0': 1200000},
    850000000,
    1331200000,
    (0, 3, 4, 5),
  )


def test_json_round_trip(tmp_path):
  path = tmp_path / 'p.json'
  profiles.save_profile(CHAINED, path)
  assert profiles.load_profile(path) == CHAINED
  assert profiles.get_profile(str(path)) == CHAINED
  assert profiles.get_profile('tx2_literal') is LITERAL
  with pytest.raises(ValueError, match='unknown profile'):
    profiles.get_profile('tx3')


@pytest.mark.parametrize(
  'change,reason',
  [
    ({'speedup': 'fast'}, '"speedup" is the string "fast", not a list'),
    ({'p_idle_w': True}, '"p_idle_w" is true, not an integer or a number'),
    ({'p_idle_w': float('nan')}, '"p_idle_w" is nan, not finite'),
    ({'speedup': [1, '2']}, '"speedup"[1] is the string "2", not an'),
    ({'colour': 1}, 'the profile has an unknown field "colour" (known: name,'),
    ({'configs': [1]}, '"configs"[0] is the number 1, not an object'),
    (
      {'configs': [{'name': 'a', 'gpu_hz': 'x'}]},
      '"configs"[0]["gpu_hz"] is the string "x", not an integer',
    ),
    (
      {'configs': [{'name': 'a', 'cpu_khz': {'policy0': 1.5}}]},
      '"configs"[0]["cpu_khz"]["policy0"] is the number 1.5, not an integer',
    ),
  ],
)
def test_a_malformed_profile_names_the_file_and_field(tmp_path, change, reason):
  path = str(tmp_path / 'p.json')
  with open(path, 'w') as f:
    json.dump({**CHAINED.to_dict(), **change}, f)
  with pytest.raises(jsonfile.JsonFileError) as e:
    profiles.get_profile(path)
  assert str(e.value).startswith(f'{path}: {reason}')


def test_a_profile_path_that_is_not_a_regular_file_says_what_it_is(tmp_path):
  with pytest.raises(jsonfile.JsonFileError, match='is a folder'):
    profiles.get_profile(str(tmp_path))
  with pytest.raises(jsonfile.JsonFileError, match=r'\(a character device\)'):
    profiles.get_profile('/dev/zero')


@pytest.mark.parametrize(
  'kwargs, message',
  [
    (dict(speedup=(1.0,), p_active_w=(1.0, 2.0)), '2 configs but 1'),
    (dict(speedup=(1.0, 0.0), p_active_w=(1.0, 2.0)), 'must be > 0'),
    (dict(speedup=(1.0, 2.0), p_active_w=(1.0, 2.0), ref_hz=1e9), 'both'),
  ],
)
def test_profile_validation(kwargs, message):
  configs = (profiles.DvfsConfig('a'), profiles.DvfsConfig('b'))
  with pytest.raises(ValueError, match=message):
    profiles.DeviceProfile('x', configs, p_idle_w=1.0, **kwargs)


def test_config_validation():
  with pytest.raises(ValueError, match='must be > 0'):
    profiles.DvfsConfig('x', {'policy0': 0})
  assert (
    profiles.DvfsConfig.from_dict(profiles.TX2_NVPMODEL_MODES[4].to_dict())
    == profiles.TX2_NVPMODEL_MODES[4]
  )


def test_sweep_configs(tx2):
  info = discovery.discover(tx2)
  three = profiling.sweep_configs(info, 3)
  assert [(c.name, c.cpu_khz, c.gpu_hz) for c in three] == [
    ('level0', {'policy0': 345600, 'policy1': 345600}, 114750000),
    ('level1', {'policy0': 1267200, 'policy1': 1267200}, 726750000),
    ('level2', {'policy0': 2035200, 'policy1': 2035200}, 1300500000),
  ]
  assert profiling.sweep_configs(info, 1)[0].gpu_hz == 1300500000
  with pytest.raises(ValueError, match='levels must be >= 1'):
    profiling.sweep_configs(info, 0)


def test_measure_profile_recovers_the_emulated_profile(tx2, clock):
  """The emulator runs LITERAL; measuring must give LITERAL's numbers."""
  meter = power.SysfsPowerMeter(tx2)
  with sysfs_dvfs.SysfsDvfs(tx2, settle_s=0) as backend:
    measured = profiling.measure_profile(
      backend,
      meter.total_w,
      profiles.TX2_TABLE2_CONFIGS,
      lambda: tx2.run_workload(clock, 2.0),
      name='measured',
      repeats=2,
      idle_s=1.0,
      clock=clock,
      sleep=clock.advance,
      threaded=False,
    )
  assert measured.p_idle_w == pytest.approx(1.9)
  assert measured.speedup == pytest.approx(LITERAL.speedup)
  assert measured.p_active_w == pytest.approx(LITERAL.p_active_w)
  assert [c.cpu_khz for c in measured.configs] == [
    c.cpu_khz for c in profiles.TX2_TABLE2_CONFIGS
  ]
  assert (
    fake_sysfs.control_files(tx2)['sys/devices/system/cpu/cpu1/online'] == '1'
  )  # Restored after MAXQ took it offline.
