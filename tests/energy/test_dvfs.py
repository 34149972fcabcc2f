"""SysfsDvfs and NvpmodelDvfs against the fake kernel and a fake runner."""

import errno
import logging
import os
import signal
import time

import pytest

from fedjax_mr.energy import discovery
from fedjax_mr.energy import dvfs
from fedjax_mr.energy import nvpmodel
from fedjax_mr.energy import profiles
from fedjax_mr.energy import sysfs
from fedjax_mr.energy import sysfs_dvfs
from tests.energy import fake_sysfs

P0 = 'sys/devices/system/cpu/cpufreq/policy0'
P1 = 'sys/devices/system/cpu/cpufreq/policy1'
GPU = fake_sysfs.TX2_GPU
EMC = 'sys/kernel/debug/bpmp/debug/clk/emc'
MAXQ, MAXP, MAXN = profiles.TX2_TABLE2_CONFIGS


def backend(kernel, **kwargs):
  return sysfs_dvfs.SysfsDvfs(kernel, settle_s=0, **kwargs)


@pytest.mark.parametrize(
  'value, table, rule, expected',
  [
    (1200000, profiles.TX2_CPU_KHZ, 'floor', 1113600),
    (1200000, profiles.TX2_CPU_KHZ, 'ceil', 1267200),
    (1200000, profiles.TX2_CPU_KHZ, 'nearest', 1267200),
    (850000000, profiles.TX2_GPU_HZ, 'floor', 726750000),
    (850000000, profiles.TX2_GPU_HZ, 'nearest', 854250000),
    (100, profiles.TX2_CPU_KHZ, 'floor', 345600),  # Below: the lowest.
    (3000000, profiles.TX2_CPU_KHZ, 'ceil', 2035200),  # Above: the highest.
    (150, (200, 100), 'nearest', 100),  # A tie goes down; any order.
    (1234, (), 'floor', 1234),  # No table: as asked.
  ],
)
def test_snap(value, table, rule, expected):
  assert dvfs.snap(value, table, rule) == expected


def test_snap_rejects_unknown_rule():
  with pytest.raises(ValueError, match='snap rule'):
    dvfs.snap(1, (1,), 'up')


def test_kernel_rejects_min_above_max(tx2):
  tx2.write(f'{P0}/scaling_max_freq', 1113600)
  with pytest.raises(OSError) as e:
    tx2.write(f'{P0}/scaling_min_freq', 2035200)
  assert e.value.errno == errno.EINVAL


def test_limits_are_written_in_a_safe_order(tx2):
  d = backend(tx2)
  d.apply(profiles.DvfsConfig('low', {'policy0': 1113600}))
  # Lowering: the minimum first (it is below the current maximum).
  assert tx2.log == [
    (f'{P0}/scaling_min_freq', '1113600'),
    (f'{P0}/scaling_max_freq', '1113600'),
  ]
  tx2.log.clear()
  d.apply(profiles.DvfsConfig('high', {'policy0': 2035200}))
  # Raising above the current maximum: the maximum first.
  assert tx2.log == [
    (f'{P0}/scaling_max_freq', '2035200'),
    (f'{P0}/scaling_min_freq', '2035200'),
  ]


def test_apply_pins_cpu_and_gpu_and_reads_back(tx2):
  d = backend(tx2)
  result = d.apply(
    profiles.DvfsConfig('cfg', {'policy1': 1200000}, gpu_hz=850000000)
  )
  assert result.requested.cpu_khz == {'policy1': 1113600}
  assert result.requested.gpu_hz == 726750000
  assert result.effective.cpu_khz == {'policy1': 1113600}
  assert result.effective.gpu_hz == 726750000
  assert not result.throttled
  assert (
    tx2.read(f'{GPU}/min_freq') == tx2.read(f'{GPU}/max_freq') == ('726750000')
  )
  assert tx2.read(f'{P0}/scaling_max_freq') == '2035200'  # Untouched.


def test_nearest_rule(tx2):
  result = backend(tx2, snap_rule='nearest').apply(
    profiles.DvfsConfig('cfg', gpu_hz=850000000)
  )
  assert result.effective.gpu_hz == 854250000


def test_star_sets_every_policy(orin):
  result = backend(orin).apply(profiles.DvfsConfig('all', {'*': 1344000}))
  assert result.effective.cpu_khz == {
    'policy0': 1344000,
    'policy4': 1344000,
    'policy8': 1344000,
  }


def test_userspace_method(tx2):
  d = backend(tx2, cpu_method='userspace')
  result = d.apply(profiles.DvfsConfig('us', {'policy0': 960000}))
  assert tx2.log == [
    (f'{P0}/scaling_governor', 'userspace'),
    (f'{P0}/scaling_setspeed', '960000'),
  ]
  assert result.effective.cpu_khz == {'policy0': 960000}
  d.restore()
  assert tx2.read(f'{P0}/scaling_governor') == 'schedutil'


def test_userspace_respects_a_cap_and_warns(tx2, caplog):
  tx2.write(f'{P0}/scaling_max_freq', 1113600)  # An nvpmodel cap.
  with caplog.at_level(logging.WARNING):
    result = backend(tx2, cpu_method='userspace').apply(
      profiles.DvfsConfig('us', {'policy0': 2035200})
    )
  assert result.effective.cpu_khz == {'policy0': 1113600}
  assert result.mismatches == ('policy0 asked 2035200 kHz, runs 1113600 kHz',)
  assert 'power-mode cap' in caplog.text


def test_throttled_read_back_warns(tx2, caplog):
  tx2.throttle_gpu_hz = 1032750000
  with caplog.at_level(logging.WARNING):
    result = backend(tx2).apply(MAXN)
  assert result.throttled
  assert result.effective.gpu_hz == 1032750000
  assert result.mismatches == ('gpu asked 1300500000 Hz, runs 1032750000 Hz',)
  assert 'thermal throttling' in caplog.text


def test_online_cores_follow_the_config(tx2):
  d = backend(tx2)
  d.apply(MAXQ)
  assert tx2.read('sys/devices/system/cpu/cpu1/online') == '0'
  assert tx2.read('sys/devices/system/cpu/cpu2/online') == '0'
  assert tx2.read('sys/devices/system/cpu/cpu3/online') == '1'
  tx2.log.clear()
  result = d.apply(MAXN)
  # Cores come online before their policy is written.
  assert tx2.log[:2] == [
    ('sys/devices/system/cpu/cpu1/online', '1'),
    ('sys/devices/system/cpu/cpu2/online', '1'),
  ]
  assert result.effective.cpu_khz == {'policy0': 2035200, 'policy1': 2035200}
  assert result.effective.online_cpus == (0, 1, 2, 3, 4, 5)


def test_snapshot_restored_on_exit(tx2):
  before = fake_sysfs.control_files(tx2)
  with backend(tx2) as d:
    d.apply(MAXQ)
    d.apply(MAXP)
    assert fake_sysfs.control_files(tx2) != before
  assert fake_sysfs.control_files(tx2) == before
  assert d.saved_state is None


def test_restored_after_an_exception(tx2):
  before = fake_sysfs.control_files(tx2)
  with pytest.raises(RuntimeError, match='boom'):
    with backend(tx2) as d:
      d.apply(MAXQ)
      raise RuntimeError('boom')
  assert fake_sysfs.control_files(tx2) == before


@pytest.mark.parametrize(
  'signum, exception',
  [(signal.SIGTERM, SystemExit), (signal.SIGINT, KeyboardInterrupt)],
)
def test_restored_on_signal(tx2, signum, exception):
  before = fake_sysfs.control_files(tx2)
  previous = signal.getsignal(signum)
  with pytest.raises(exception):
    with backend(tx2) as d:
      d.apply(MAXQ)
      # Our handler is installed (else the signal would end the test run).
      assert signal.getsignal(signum) == d._on_signal
      os.kill(os.getpid(), signum)
      time.sleep(5)  # Interrupted by the signal.
  assert fake_sysfs.control_files(tx2) == before
  assert signal.getsignal(signum) is previous


def test_permission_error_is_clear_and_restores(tx2):
  before = fake_sysfs.control_files(tx2)
  tx2.denied.add(f'{GPU}/max_freq')
  with pytest.raises(dvfs.DvfsPermissionError) as e:
    with backend(tx2) as d:
      d.apply(MAXP)  # CPU writes succeed, then the GPU write fails.
  assert isinstance(e.value, PermissionError)
  assert 'needs root' in str(e.value)
  assert str(tx2.path(f'{GPU}/max_freq')) in str(e.value)
  assert (f'{P0}/scaling_min_freq', '1267200') in tx2.log
  assert fake_sysfs.control_files(tx2) == before


@pytest.mark.skipif(os.geteuid() == 0, reason='root may write read-only files')
def test_read_only_file_gives_permission_error(tmp_path):
  root = sysfs.SysfsRoot(fake_sysfs.build_tx2_tree(tmp_path))
  os.chmod(tmp_path / P0 / 'scaling_min_freq', 0o444)
  with pytest.raises(dvfs.DvfsPermissionError, match='needs root'):
    sysfs_dvfs.SysfsDvfs(root, settle_s=0).apply(MAXQ)


def test_restore_failure_is_reported(tx2):
  d = backend(tx2)
  d.apply(MAXQ)
  tx2.denied.add(f'{P0}/scaling_max_freq')
  with pytest.raises(dvfs.DvfsPermissionError, match='could not restore'):
    d.restore()
  # Everything else was still restored.
  assert tx2.read('sys/devices/system/cpu/cpu1/online') == '1'
  assert tx2.read(f'{GPU}/max_freq') == '1300500000'


def test_kernel_rejection_is_a_dvfs_error(tx2):
  with pytest.raises(dvfs.DvfsError, match='rejected bogus .*EINVAL'):
    backend(tx2, gpu_governor='bogus').apply(MAXQ)


def test_dry_run_writes_nothing(tx2):
  before = fake_sysfs.control_files(tx2)
  with backend(tx2, dry_run=True) as d:
    first = d.apply(MAXQ)
    d.apply(MAXN)
  assert tx2.log == []
  assert fake_sysfs.control_files(tx2) == before
  assert first.effective == first.requested
  assert d.writes == [
    (f'{P0}/scaling_min_freq', '1113600'),
    (f'{P0}/scaling_max_freq', '1113600'),
    (f'{GPU}/min_freq', '854250000'),
    (f'{GPU}/max_freq', '854250000'),
    ('sys/devices/system/cpu/cpu1/online', '0'),
    ('sys/devices/system/cpu/cpu2/online', '0'),
    # Planned on top of the planned state: raising, so max first.
    ('sys/devices/system/cpu/cpu1/online', '1'),
    ('sys/devices/system/cpu/cpu2/online', '1'),
    (f'{P0}/scaling_max_freq', '2035200'),
    (f'{P0}/scaling_min_freq', '2035200'),
    (f'{P1}/scaling_min_freq', '2035200'),
    (f'{GPU}/max_freq', '1300500000'),
    (f'{GPU}/min_freq', '1300500000'),
  ]


def test_emc_is_read_only_by_default(tx2):
  backend(tx2).apply(MAXQ)
  assert not [w for w in tx2.log if w[0].startswith(EMC)]
  assert tx2.read(f'{EMC}/rate') == '1866000000'


def test_emc_when_allowed(tx2):
  with backend(tx2, allow_emc=True) as d:
    result = d.apply(MAXQ)
    assert [w for w in tx2.log if w[0].startswith(EMC)] == [
      (f'{EMC}/mrq_rate_locked', '1'),
      (f'{EMC}/rate', '1331200000'),
    ]
    assert result.effective.emc_hz == 1331200000
  assert tx2.read(f'{EMC}/rate') == '1866000000'
  assert tx2.read(f'{EMC}/mrq_rate_locked') == '0'


@pytest.mark.parametrize(
  'config, message',
  [
    (profiles.DvfsConfig('x', {'policy9': 1}), 'no CPU policy'),
    (
      profiles.DvfsConfig('x', {'policy1': 960000}, online_cpus=(0, 3)),
      'all its cores are offline',
    ),
    (profiles.DvfsConfig('x', online_cpus=(1, 2, 3)), 'cpu0 cannot go offline'),
    (profiles.DvfsConfig('x', online_cpus=(0, 7)), 'no such cores'),
  ],
)
def test_configs_that_do_not_fit(tx2, config, message):
  with pytest.raises(dvfs.DvfsError, match=message):
    backend(tx2).apply(config)
  assert tx2.log == []


def test_policy_of_offline_cores(tx2):
  d = backend(tx2)
  d.apply(MAXQ)  # Denver (policy1) goes offline.
  # '*' skips the offline policy; naming it is an error.
  result = d.apply(profiles.DvfsConfig('all', {'*': 960000}))
  assert result.effective.cpu_khz == {'policy0': 960000}
  with pytest.raises(dvfs.DvfsError, match='policy1 but all its cores'):
    d.apply(profiles.DvfsConfig('x', {'policy1': 960000}))


def test_userspace_needs_the_governor(tmp_path):
  fake_sysfs.build_orin_tree(tmp_path)
  (tmp_path / P0 / 'scaling_available_governors').write_text('schedutil\n')
  root = sysfs.SysfsRoot(tmp_path)
  with pytest.raises(dvfs.DvfsError, match='no userspace governor'):
    sysfs_dvfs.SysfsDvfs(root, cpu_method='userspace', settle_s=0).apply(
      profiles.DvfsConfig('x', {'policy0': 1344000})
    )


def test_read_clocks(tx2):
  backend(tx2).apply(MAXQ)
  now = dvfs.read_clocks(tx2, discovery.discover(tx2))
  # policy1 is offline (EBUSY) and left out.
  assert now.cpu_khz == {'policy0': 1113600}
  assert (now.gpu_hz, now.emc_hz) == (854250000, 1866000000)
  assert now.online_cpus == (0, 3, 4, 5)


class FakeNvpmodel:
  """Answers `nvpmodel -q` and `-m`; records the commands."""

  def __init__(self, mode=0, refuse=None, stuck=False):
    self.mode = mode
    self.refuse = refuse
    self.stuck = stuck
    self.commands = []

  def __call__(self, args):
    self.commands.append(tuple(args))
    if args[1] == '-q':
      return nvpmodel.CommandResult(
        0, f'NV Power Mode: MODE{self.mode}\n{self.mode}\n'
      )
    if self.refuse:
      return nvpmodel.CommandResult(255, self.refuse)
    if not self.stuck:
      self.mode = int(args[2])
    return nvpmodel.CommandResult(0, '')


def test_nvpmodel_switches_and_restores():
  runner = FakeNvpmodel(mode=0)
  with nvpmodel.NvpmodelDvfs(runner) as n:
    result = n.apply(MAXQ)
    assert runner.mode == 1
    assert result.effective == MAXQ
  assert runner.mode == 0
  assert runner.commands == [
    ('nvpmodel', '-q'),
    ('nvpmodel', '-m', '1'),
    ('nvpmodel', '-q'),
    ('nvpmodel', '-q'),
    ('nvpmodel', '-m', '0'),
    ('nvpmodel', '-q'),
  ]


def test_nvpmodel_reads_clocks_back(tx2):
  runner = FakeNvpmodel(mode=0)
  result = nvpmodel.NvpmodelDvfs(runner, root=tx2).apply(MAXN)
  assert result.effective.cpu_khz == {'policy0': 2035200, 'policy1': 2035200}
  assert result.effective.gpu_hz == 1300500000


def test_nvpmodel_permission_denied():
  runner = FakeNvpmodel(refuse='NVPM ERROR: failed to open: Permission denied')
  with pytest.raises(dvfs.DvfsPermissionError, match='sudo'):
    nvpmodel.NvpmodelDvfs(runner).apply(MAXQ)


def test_nvpmodel_mode_that_needs_a_reboot():
  with pytest.raises(dvfs.DvfsError, match='reboot'):
    nvpmodel.NvpmodelDvfs(FakeNvpmodel(stuck=True)).apply(MAXQ)


def test_nvpmodel_dry_run_and_missing_id():
  runner = FakeNvpmodel()
  n = nvpmodel.NvpmodelDvfs(runner, dry_run=True)
  n.apply(MAXP)
  assert runner.commands == []
  assert n.commands == [('nvpmodel', '-m', '2')]
  with pytest.raises(dvfs.DvfsError, match='not an nvpmodel mode'):
    n.apply(profiles.DvfsConfig('x', gpu_hz=1))


def test_parse_nvpmodel_query():
  assert (
    nvpmodel.parse_nvpmodel_query('NV Fan Mode:quiet\nNV Power Mode: MAXQ\n1\n')
    == 1
  )
  with pytest.raises(dvfs.DvfsError):
    nvpmodel.parse_nvpmodel_query('garbage')
