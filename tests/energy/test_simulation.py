"""Simulated rounds: coordinator vs default governor."""

import json

import pytest

from fedjax_mr.energy import profiles
from fedjax_mr.energy import simulation

CHAINED = profiles.TX2_TABLE2_CHAINED
LITERAL = profiles.TX2_TABLE2_LITERAL


def test_parse_mix():
  assert simulation.parse_mix('tx2_literal:0.5,tx2_chained:0.5') == [
    ('tx2_literal', 1.0, 0.5),
    ('tx2_chained', 1.0, 0.5),
  ]
  assert simulation.parse_mix('tx2_chained@0.5:3, tx2_chained') == [
    ('tx2_chained', 0.5, 3.0),
    ('tx2_chained', 1.0, 1.0),
  ]
  for bad in ('x:abc', '@2:1', 'x:-1', 'x@0:1', ''):
    with pytest.raises(ValueError, match='mix'):  # bad entry, or empty
      simulation.parse_mix(bad)


def test_assign_profiles_counts_and_seed():
  clients = simulation.assign_profiles('tx2_literal:0.5,tx2_chained:0.5', 10)
  assert (
    sorted(c.profile.name for c in clients)
    == ['tx2_chained'] * 5 + ['tx2_literal'] * 5
  )
  # 10/3 each: the remainder goes to the first entry.
  three = simulation.assign_profiles(
    'tx2_chained@1:1,tx2_chained@0.5:1,tx2_literal:1', 10, seed=3
  )
  labels = [c.label for c in three]
  assert (
    labels.count('tx2_chained'),
    labels.count('tx2_chained@0.5'),
    labels.count('tx2_literal'),
  ) == (4, 3, 3)
  assert [c.speed for c in three if c.label == 'tx2_chained@0.5'] == [0.5] * 3
  again = simulation.assign_profiles(
    'tx2_chained@1:1,tx2_chained@0.5:1,tx2_literal:1', 10, seed=3
  )
  other = simulation.assign_profiles(
    'tx2_chained@1:1,tx2_chained@0.5:1,tx2_literal:1', 10, seed=4
  )
  assert [c.label for c in again] == labels
  assert [c.label for c in other] != labels


def test_two_clients_two_rounds_by_hand():
  fast = simulation.SimClient(CHAINED, 1.0, 'fast')
  slow = simulation.SimClient(CHAINED, 0.5, 'slow')
  report = simulation.simulate([[10.0, 10.0], [10.0, 10.0]], [fast, slow])
  t_fast, t_slow = 10 / 1.38, 20 / 1.38  # Both at the highest frequency.
  p_max, p_idle = 10.6875, 1.9
  default = p_max * t_fast + p_idle * (t_slow - t_fast) + p_max * t_slow
  r0, r1 = report.rounds
  # Round 0 has no deadline yet: the highest frequency, as the default.
  assert (r0.deadline_s, r0.configs) == (None, (2, 2))
  assert r0.default_energy_j == pytest.approx(default)
  assert r0.coordinated_energy_j == pytest.approx(default)
  # Round 1: T = 14.49 s. The fast client fits config 0 (10 s <= 13.77 s);
  # the slow one fits nothing and runs at the highest frequency.
  assert r1.deadline_s == pytest.approx(t_slow)
  assert r1.configs == (0, 2)
  assert r1.missed == 0
  coordinated = 7.5 * 10 + p_idle * (t_slow - 10) + p_max * t_slow
  assert r1.coordinated_energy_j == pytest.approx(coordinated)
  assert r1.coordinated_time_s == r1.default_time_s == pytest.approx(t_slow)
  assert report.default_energy_j == pytest.approx(2 * default)
  assert report.coordinated_energy_j == pytest.approx(default + coordinated)
  assert report.energy_saving == pytest.approx(
    1 - (default + coordinated) / (2 * default)
  )
  assert report.time_change == pytest.approx(0.0)


def test_feedback_learns_a_slower_device():
  fast = simulation.SimClient(CHAINED, 1.0, 'fast')
  slow = simulation.SimClient(CHAINED, 0.5, 'slow')
  work = [[10.0, 10.0], [10.0, 10.0]]
  # Client 0 is really 1.5x slower than its profile says.
  learnt = simulation.simulate(
    work, [fast, slow], time_factors=(1.5, 1.0), alpha=1.0
  )
  # Round 0 measured 15/1.38 s: the model now predicts 15 s at config 0,
  # which misses T = 14.49 s; config 1 (12.4 s) is chosen and fits.
  assert learnt.rounds[1].configs == (1, 2)
  assert learnt.rounds[1].missed == 0
  unlearnt = simulation.simulate(
    work, [fast, slow], time_factors=(1.5, 1.0), alpha=1e-9
  )
  assert unlearnt.rounds[1].configs == (0, 2)
  assert unlearnt.rounds[1].missed == 1


def test_literal_reading_never_saves():
  clients = simulation.assign_profiles('tx2_literal@1:1,tx2_literal@0.5:1', 20)
  ids, work = simulation.sample_rounds(20, 5, 6, seed=1)
  report = simulation.simulate(work, clients, client_ids=ids)
  # Racing to idle is the least energy: the coordinator runs config 2 too.
  assert all(set(r.configs) == {2} for r in report.rounds)
  assert report.energy_saving == pytest.approx(0.0, abs=1e-12)


def test_oracle_deadline_keeps_round_times():
  clients = simulation.assign_profiles('tx2_chained@1:1,tx2_chained@0.5:1', 20)
  ids, work = simulation.sample_rounds(20, 5, 6, seed=1)
  report = simulation.simulate(
    work, clients, client_ids=ids, deadline_mode='oracle'
  )
  assert report.coordinated_time_s == pytest.approx(report.default_time_s)
  assert report.energy_saving > 0
  assert all(r.missed == 0 for r in report.rounds)


def test_samples_work_unit_and_deadline_factors():
  profile = profiles.DeviceProfile(
    'cyc',
    (profiles.DvfsConfig('lo'), profiles.DvfsConfig('hi')),
    speedup=(1.0, 2.0),
    p_active_w=(2.0, 5.0),
    p_idle_w=1.0,
    cycles_per_sample=1e7,
    ref_hz=1e9,
  )
  clients = [simulation.SimClient(profile), simulation.SimClient(profile)]
  # 100 and 300 samples: 1 s and 3 s at 'lo', 0.5 s and 1.5 s at 'hi'.
  report = simulation.simulate(
    [[100, 300], [100, 300]],
    clients,
    work_unit='samples',
    deadline_factors=[1.0, 2.0],
  )
  r1 = report.rounds[1]
  assert r1.deadline_s == pytest.approx(1.5 * 2.0)
  assert r1.configs == (0, 1)  # 1 s fits 2.85 s; 3 s does not.


def test_report_to_dict_is_json():
  report = simulation.simulate(
    [[10.0]], [simulation.SimClient(CHAINED, 1.0, 'a')]
  )
  d = json.loads(json.dumps(report.to_dict()))
  assert d['client_labels'] == ['a']
  assert d['rounds'][0]['configs'] == [2]
  assert d['energy_saving'] == 0.0
  assert set(d) >= {
    'default_time_s',
    'default_energy_j',
    'coordinated_time_s',
    'coordinated_energy_j',
    'time_change',
  }


def test_bad_arguments():
  c = [simulation.SimClient(CHAINED)]
  with pytest.raises(ValueError, match='work_unit'):
    simulation.simulate([[1.0]], c, work_unit='flops')
  with pytest.raises(ValueError, match='deadline_mode'):
    simulation.simulate([[1.0]], c, deadline_mode='never')
  with pytest.raises(ValueError, match='2 clients, 1 workloads'):
    simulation.simulate([[1.0]], c * 2, client_ids=[[0, 1]])
  with pytest.raises(ValueError, match='cycles_per_sample'):
    simulation.simulate([[1.0]], c, work_unit='samples')


def docs_scenario(reading: str, deadline_mode: str):
  """The scenario of docs/energy.md."""
  mix = (
    f'{reading}@1:0.3,{reading}@0.75:0.3,{reading}@0.5:0.3,{reading}@0.25:0.1'
  )
  clients = simulation.assign_profiles(mix, 100, seed=0)
  ids, work = simulation.sample_rounds(100, 10, 30, seed=0)
  return simulation.simulate(
    work, clients, client_ids=ids, deadline_mode=deadline_mode
  )


@pytest.mark.parametrize(
  'reading, deadline_mode, saving, time_change',
  [
    ('tx2_literal', 'previous', 0.0, 0.0),
    ('tx2_literal', 'oracle', 0.0, 0.0),
    ('tx2_chained', 'previous', 2.4, 9.4),
    ('tx2_chained', 'oracle', 5.1, 0.0),
  ],
)
def test_docs_figures(reading, deadline_mode, saving, time_change):
  report = docs_scenario(reading, deadline_mode)
  assert round(100 * report.energy_saving, 1) == saving
  assert round(100 * report.time_change, 1) == time_change


def test_training_workloads_are_epochs_times_examples():
  work = simulation.training_workloads([[2, 0], [1]], [10, 20, 30], 3, 0.5)
  assert work == [[45.0, 15.0], [30.0]]
  with pytest.raises(ValueError, match=r'client ids \[3\] outside the 3'):
    simulation.training_workloads([[3]], [10, 20, 30], 1, 1.0)
  with pytest.raises(ValueError, match='seconds_per_sample'):
    simulation.training_workloads([[0]], [10], 1, 0.0)


def test_summary_counts_missed_deadlines():
  clients = simulation.assign_profiles('tx2_chained', 2)
  # Client 1 is 3x slower than its time model: round 1's deadline is its
  # own round-0 time, client 0 slows down to fit it and client 1, whose
  # feedback has only moved halfway, misses it.
  report = simulation.simulate(
    [[10.0, 10.0], [10.0, 10.0]], clients, time_factors=[1.0, 3.0]
  )
  s = report.summary()
  assert [r.missed for r in report.rounds] == [0, 1]
  assert s['missed'] == report.missed == 1
  assert 'client_labels' not in s and len(s['rounds']) == 2
  json.dumps(s)
