"""The clients' coordinators in the round loop: simulated, sysfs, dry run."""

import json

import numpy as np
import pytest

from fedjax_mr.energy import discovery
from fedjax_mr.energy import fleet
from fedjax_mr.energy import power
from fedjax_mr.energy import profiles
from fedjax_mr.energy import simulation
from fedjax_mr.energy import sysfs_dvfs
from tests.energy import fake_sysfs

CHAINED = profiles.TX2_TABLE2_CHAINED  # P = 7.5, 9.375, 10.6875 W; idle 1.9
SPEEDUP = CHAINED.speedup  # 1, 1.21, 1.38


def _previous_round(times, scales, depth, pool_size):
  """A hand-made record of a round (only what the next round reads)."""
  return {
    'depth': depth,
    'pool_size': pool_size,
    'clients': [
      {'client': c, 'time_s': t, 'time_scale': s}
      for c, (t, s) in enumerate(zip(times, scales))
    ],
  }


def _simulated(speeds, seconds_per_unit=0.01):
  devices = [simulation.SimClient(CHAINED, s, f'@{s}') for s in speeds]
  return fleet.Fleet(
    fleet.SimulatedBackend(devices), seconds_per_unit=seconds_per_unit
  )


def test_one_simulated_round_by_hand():
  # Client 0: speed 1; client 1: speed 0.5. Last round they took 5 s and
  # 8 s at depth 2 over 10 candidates; client 0's time model was 25 % slow.
  coordinators = _simulated([1.0, 0.5])
  history = [_previous_round([5.0, 8.0], [1.25, 1.0], 2, 10)]
  rnd = coordinators.start_round(history, depth=3, pool_size=5)
  # T = 8 s × (3 / 2) × (5 / 10) = 6 s; feasible means t <= 5.7 s.
  assert (rnd.deadline_s, rnd.depth_factor, rnd.pool_factor) == (6.0, 1.5, 0.5)
  work = []
  with rnd.client(0, 400):  # 4 s at config 1.
    work.append(0)
  with rnd.client(1, 300):  # 3 s at config 1, at half speed 6 s.
    work.append(1)
  assert work == [0, 1]  # The work itself ran.
  record = rnd.record()
  c0, c1 = record['clients']
  # Client 0 predicts 4 × 1.25 = 5 s at config 1: E = 7.5·5 + 1.9·1 = 39.4 J,
  # vs 9.375·4.132 + 1.9·1.868 = 42.3 J at config 2: config 1. It runs 4 s
  # (30 J), so its scale moves halfway to 1.25 · 4 / 5 = 1: 1.125.
  assert (c0['config_index'], c0['config']) == (0, 'table2_1_MAXQ')
  assert c0['predicted_s'] == pytest.approx(5.0)
  assert c0['time_s'] == pytest.approx(4.0)
  assert c0['energy_j'] == pytest.approx(30.0)
  assert c0['time_scale'] == pytest.approx(1.125)
  # Client 1: 6 s at config 1 misses 5.7 s; config 2 takes 6 / 1.21 =
  # 4.959 s for 46.49 + 1.98 = 48.47 J, config 3 4.348 s for 46.47 +
  # 3.14 = 49.61 J: config 2.
  t1 = 6.0 / 1.21
  assert c1['config_index'] == 1 and c1['feasible'] is True
  assert c1['time_s'] == pytest.approx(t1)
  assert c1['energy_j'] == pytest.approx(9.375 * t1)
  assert c1['time_scale'] == pytest.approx(1.0)
  assert c0['met'] is True and c1['met'] is True
  # Client 0 waits at 1.9 W until client 1 is done.
  assert record['round_time_s'] == pytest.approx(t1)
  assert c0['wait_j'] == pytest.approx(1.9 * (t1 - 4.0))
  assert c1['wait_j'] == 0
  assert record['energy_j'] == pytest.approx(30 + 1.9 * (t1 - 4) + 9.375 * t1)
  # At the highest frequency: 4 / 1.38 and 6 / 1.38 s at 10.6875 W; client
  # 0 waits for client 1.
  d0, d1 = 4.0 / 1.38, 6.0 / 1.38
  assert c0['default_time_s'] == pytest.approx(d0)
  assert record['default_round_time_s'] == pytest.approx(d1)
  assert c0['default_energy_j'] == pytest.approx(10.6875 * d0 + 1.9 * (d1 - d0))
  assert record['default_energy_j'] == pytest.approx(
    10.6875 * (d0 + d1) + 1.9 * (d1 - d0)
  )
  assert 'writes' not in c0  # Simulated: nothing to write.
  assert json.loads(json.dumps(record)) == record


def test_the_first_round_runs_at_the_highest_frequency():
  rnd = _simulated([1.0]).start_round([], depth=1, pool_size=4)
  with rnd.client(0, 138):
    pass
  (c,) = rnd.record()['clients']
  assert rnd.deadline_s is None and c['met'] is None and c['feasible'] is None
  assert c['config'] == 'table2_3_MAXN' and c['time_s'] == pytest.approx(1.0)
  assert c['energy_j'] == pytest.approx(c['default_energy_j'])


def test_a_failing_client_is_not_recorded():
  rnd = _simulated([1.0]).start_round([], depth=1, pool_size=4)
  with pytest.raises(RuntimeError, match='^scoring failed$'):
    with rnd.client(0, 10):
      raise RuntimeError('scoring failed')
  assert rnd.record()['clients'] == []


def test_rounds_match_the_simulator():
  # The fleet's rounds, totals and choices are simulation.simulate's on the
  # same devices, participants, work and deadline factors.
  rng = np.random.default_rng(0)
  mix = 'tx2_chained@1:0.4,tx2_chained@0.6:0.3,tx2_literal@0.4:0.3'
  devices = simulation.assign_profiles(mix, 8)
  coordinators = fleet.Fleet(
    fleet.SimulatedBackend(devices), seconds_per_unit=0.002
  )
  history, ids, work, factors = [], [], [], []
  for r in range(6):
    clients = sorted(rng.choice(8, 3, replace=False).tolist())
    units = rng.integers(1000, 5000, size=3).tolist()
    depth, pool_size = 1 + r // 2, int(rng.integers(4, 12))
    rnd = coordinators.start_round(history, depth=depth, pool_size=pool_size)
    for c, u in zip(clients, units):
      with rnd.client(c, u):
        pass
    history.append(rnd.record())
    ids.append(clients)
    work.append([u * 0.002 for u in units])
    factors.append(rnd.depth_factor * rnd.pool_factor)
  report = simulation.simulate(
    work, devices, client_ids=ids, deadline_factors=factors
  )
  totals = fleet.summarize(history)
  for key in (
    'coordinated_time_s',
    'coordinated_energy_j',
    'default_time_s',
    'default_energy_j',
    'energy_saving',
    'time_change',
  ):
    assert totals[key] == pytest.approx(getattr(report, key)), key
  assert totals['missed'] == report.missed and totals['rounds'] == 6
  for rec, rep in zip(history, report.rounds):
    assert [c['config_index'] for c in rec['clients']] == list(rep.configs)
    if rep.deadline_s is None:
      assert rec['deadline_s'] is None
    else:
      assert rec['deadline_s'] == pytest.approx(rep.deadline_s)


def _tx2(tmp_path):
  fake_sysfs.build_tx2_tree(tmp_path)
  kernel = fake_sysfs.FakeKernel(tmp_path, CHAINED, fake_sysfs.TX2_RAIL_SHARES)
  kernel.set_busy(True)  # The power of the configuration that runs.
  return kernel


def _sysfs_fleet(kernel, clock, dry_run=False):
  info = discovery.discover(kernel)
  meter = power.SysfsPowerMeter(kernel, info.power_channels)
  backend = fleet.SysfsBackend(
    sysfs_dvfs.SysfsDvfs(kernel, info, settle_s=0, dry_run=dry_run),
    CHAINED,
    meter.total_w,
    clock=clock,
    threaded=False,
  )
  return fleet.Fleet(backend, seconds_per_unit=0.01)


def _two_rounds(coordinators, kernel, clock):
  """Round 0: clients 0, 1 (no deadline); round 1: client 1 (deadline)."""
  history = []
  for clients in ([0, 1], [1]):
    rnd = coordinators.start_round(history, depth=2, pool_size=5)
    for c in clients:
      with rnd.client(c, 1000):  # 10 s at config 1.
        kernel.run_workload(clock, 10.0)
    history.append(rnd.record())
  return history


def test_sysfs_rounds_write_measure_and_restore(tmp_path, clock):
  kernel = _tx2(tmp_path)
  before = fake_sysfs.control_files(kernel)
  with _sysfs_fleet(kernel, clock) as coordinators:
    history = _two_rounds(coordinators, kernel, clock)
    restore_from = len(kernel.log)
  (a, b), (c,) = (r['clients'] for r in history)
  # Round 0 runs MAXN, written once for both clients; the wall clock and
  # the rails give t = 10 / 1.38 s at 10.6875 W (VDD_IN in whole mW).
  assert (a['config'], b['config']) == ('table2_3_MAXN',) * 2
  assert a['writes'] == [list(w) for w in kernel.log[: len(a['writes'])]]
  assert ['sys/class/devfreq/17000000.gp10b/min_freq', '1300500000'] in (
    a['writes']
  )
  assert b['writes'] == []
  assert a['time_s'] == pytest.approx(10 / 1.38)
  assert a['energy_j'] == pytest.approx(10.6875 * 10 / 1.38, rel=1e-4)
  # Round 1: T = 10 / 1.38 = 7.25 s; MAXQ needs 10 s, MAXP_CORE_ALL 8.26 s,
  # MAXN 7.25 s: none fits with the 5 % margin, so the fastest, MAXN, which
  # is already set: nothing written.
  assert history[1]['deadline_s'] == pytest.approx(10 / 1.38)
  assert c['config'] == 'table2_3_MAXN' and c['feasible'] is False
  assert c['writes'] == []
  # Every write made is in the records, then the state is put back.
  written = [w for r in history for e in r['clients'] for w in e['writes']]
  assert [list(w) for w in kernel.log[:restore_from]] == written
  assert len(kernel.log) > restore_from
  assert fake_sysfs.control_files(kernel) == before


def test_sysfs_lower_configuration_written_when_the_deadline_allows(
  tmp_path, clock
):
  kernel = _tx2(tmp_path)
  before = fake_sysfs.control_files(kernel)
  history = [_previous_round([12.0, 12.0], [1.0, 1.0], 2, 5)]
  with _sysfs_fleet(kernel, clock) as coordinators:
    rnd = coordinators.start_round(history, depth=2, pool_size=5)
    with rnd.client(0, 1000):
      kernel.run_workload(clock, 10.0)
    (e,) = rnd.record()['clients']
    # T = 12 s: MAXQ (10 s, 75 + 3.8 J) is the cheapest; its clocks and
    # cores are written.
    assert e['config'] == 'table2_1_MAXQ' and e['time_s'] == 10.0
    assert e['energy_j'] == pytest.approx(75.0)
    assert ['sys/devices/system/cpu/cpu1/online', '0'] in e['writes']
    assert kernel.cpu_khz() == {'policy0': 1113600}
  assert fake_sysfs.control_files(kernel) == before


def test_sysfs_clocks_restored_after_an_exception_mid_run(tmp_path, clock):
  kernel = _tx2(tmp_path)
  before = fake_sysfs.control_files(kernel)
  with pytest.raises(ZeroDivisionError):
    with _sysfs_fleet(kernel, clock) as coordinators:
      history = _two_rounds(coordinators, kernel, clock)
      rnd = coordinators.start_round(history, depth=3, pool_size=2)
      with rnd.client(0, 10):
        1 / 0
  assert kernel.log  # Clocks were changed, then put back.
  assert fake_sysfs.control_files(kernel) == before


def test_dry_run_writes_nothing(tmp_path, clock):
  kernel = _tx2(tmp_path)
  before = fake_sysfs.control_files(kernel)
  history = [_previous_round([12.0], [1.0], 2, 5)]
  with _sysfs_fleet(kernel, clock, dry_run=True) as coordinators:
    for clients in ([0], [0]):
      rnd = coordinators.start_round(history, depth=2, pool_size=5)
      for c in clients:
        with rnd.client(c, 1000):
          kernel.run_workload(clock, 10.0)
      history.append(rnd.record())
  assert [r['backend'] for r in history[1:]] == ['dry_run'] * 2
  planned = history[1]['clients'][0]
  assert planned['config'] == 'table2_1_MAXQ'
  assert ['sys/devices/system/cpu/cpu1/online', '0'] in planned['writes']
  assert kernel.log == [] and fake_sysfs.control_files(kernel) == before
  # Measured at the clocks that really run (MAXN: untouched).
  assert planned['time_s'] == pytest.approx(10 / 1.38)


def test_summarize_counts_missed_deadlines():
  records = [
    {
      'round_time_s': 2.0,
      'energy_j': 10.0,
      'default_round_time_s': 1.0,
      'default_energy_j': 8.0,
      'clients': [{'met': None}, {'met': False}, {'met': True}],
    }
  ]
  assert fleet.summarize(records) == {
    'rounds': 1,
    'coordinated_time_s': 2.0,
    'coordinated_energy_j': 10.0,
    'default_time_s': 1.0,
    'default_energy_j': 8.0,
    'missed': 1,
    'energy_saving': pytest.approx(-0.25),
    'time_change': 1.0,
  }
  assert fleet.summarize([])['energy_saving'] == 0.0


def test_bad_fleet_arguments():
  with pytest.raises(ValueError, match='seconds_per_unit must be > 0'):
    _simulated([1.0], seconds_per_unit=0)
  with pytest.raises(ValueError, match='no simulated devices'):
    fleet.SimulatedBackend([])
