"""The coordinator (Eqs. 4-7), its feedback and the server deadline."""

import itertools

import pytest

from fedjax_mr.energy import coordinator
from fedjax_mr.energy import profiles

LITERAL = profiles.TX2_TABLE2_LITERAL
CHAINED = profiles.TX2_TABLE2_CHAINED


def test_hand_worked_example_chained():
  # t0 = 10 s, T = 12 s: every config fits (limit 11.4 s).
  c = coordinator.choose_config(CHAINED, 12.0, base_time_s=10.0, margin=0.05)
  assert c.times_s == pytest.approx((10.0, 10 / 1.21, 10 / 1.38))
  assert c.energies_j == pytest.approx(
    (
      7.5 * 10 + 1.9 * 2,  # 78.8 J
      9.375 * 10 / 1.21 + 1.9 * (12 - 10 / 1.21),  # 84.58 J
      10.6875 * 10 / 1.38 + 1.9 * (12 - 10 / 1.38),  # 86.48 J
    )
  )
  assert (c.index, c.feasible, c.config.name) == (0, True, 'table2_1_MAXQ')
  assert c.energy_j == pytest.approx(78.8)


def test_hand_worked_example_literal_races_to_idle():
  c = coordinator.choose_config(LITERAL, 12.0, base_time_s=10.0)
  # 8.55 W · 7.246 s + 1.9 W · 4.754 s = 70.99 J beats 78.8 J at config 0.
  assert c.energies_j[2] == pytest.approx(
    8.55 * 10 / 1.38 + 1.9 * (12 - 10 / 1.38)
  )
  assert c.energies_j[0] == pytest.approx(78.8)
  assert c.index == 2


def test_notes_example_energies():
  # t1 = T = 10 s: literal 75.0 / 80.8 / 67.2 J, chained 75.0 / 80.8 / 82.7 J.
  for profile, expected in (
    (LITERAL, (75.0, 80.8, 67.2)),
    (CHAINED, (75.0, 80.8, 82.7)),
  ):
    times = coordinator.predict_times(profile, 10.0)
    energies = coordinator.predict_energies(profile, times, 10.0)
    assert tuple(round(e, 1) for e in energies) == expected


def test_feasibility_boundary():
  edge = 10.0 / 0.95  # t0 = 10 s meets T exactly at the margin.
  above = coordinator.choose_config(
    CHAINED, edge * (1 + 1e-9), base_time_s=10.0
  )
  below = coordinator.choose_config(
    CHAINED, edge * (1 - 1e-9), base_time_s=10.0
  )
  assert above.index == 0
  assert (
    below.index == 1
  )  # 8.26 s: 9.375·8.26 + 1.9·2.26 < 10.69·7.25 + 1.9·3.28


def test_infeasible_falls_back_to_the_fastest():
  c = coordinator.choose_config(CHAINED, 7.0, base_time_s=10.0)
  assert (c.index, c.feasible) == (2, False)  # 7.25 s > 0.95 · 7 s


def test_argmin_matches_brute_force():
  for profile, deadline, base in itertools.product(
    (LITERAL, CHAINED), (6.0, 8.0, 9.0, 10.0, 11.0, 15.0, 40.0), (5.0, 10.0)
  ):
    c = coordinator.choose_config(profile, deadline, base_time_s=base)
    best = None
    for k in range(3):
      t = base / profile.speedup[k]
      e = profile.p_active_w[k] * t + profile.p_idle_w * max(0, deadline - t)
      if t <= 0.95 * deadline and (best is None or e < best[0]):
        best = (e, k)
    assert c.index == (best[1] if best else 2), (profile.name, deadline, base)


def test_cycle_model_is_eq4():
  assert coordinator.cycle_time_s(2e6, 300, 1e9) == 0.6
  profile = profiles.DeviceProfile(
    'cyc',
    (profiles.DvfsConfig('lo'), profiles.DvfsConfig('hi')),
    speedup=(1.0, 2.0),  # f_hi = 2 f_lo: Eq. 4 exactly.
    p_active_w=(2.0, 5.0),
    p_idle_w=1.0,
    cycles_per_sample=2e6,
    ref_hz=1e9,
  )
  c = coordinator.choose_config(profile, 1.0, num_samples=300)
  assert c.times_s == pytest.approx((0.6, 0.3))  # c·D/f_lo, c·D/f_hi
  assert c.energies_j == pytest.approx((2.0 * 0.6 + 0.4, 5.0 * 0.3 + 0.7))
  assert c.index == 0


def test_work_must_be_given_once():
  with pytest.raises(ValueError, match='exactly one'):
    coordinator.choose_config(CHAINED, 10.0)
  with pytest.raises(ValueError, match='exactly one'):
    coordinator.choose_config(CHAINED, 10.0, base_time_s=1.0, num_samples=3)
  with pytest.raises(ValueError, match='cycles_per_sample'):
    coordinator.choose_config(CHAINED, 10.0, num_samples=3)


def test_feedback_update():
  assert coordinator.update_time_scale(1.0, 10.0, 12.0, alpha=1.0) == 1.2
  # A device 20% slower than its profile, α = 0.5: s ← 0.5·s + 0.6.
  s, seen = 1.0, []
  for _ in range(3):
    predicted = 10.0 * s
    s = coordinator.update_time_scale(s, predicted, 12.0, alpha=0.5)
    seen.append(s)
  assert seen == pytest.approx([1.1, 1.15, 1.175])
  with pytest.raises(ValueError, match=r'alpha must be in \(0, 1\]'):
    coordinator.update_time_scale(1.0, 1.0, 1.0, alpha=0.0)


def test_feedback_moves_the_choice_to_meet_the_deadline():
  true_factor, deadline, s = 1.2, 12.0, 1.0
  first = coordinator.choose_config(CHAINED, deadline, base_time_s=10.0)
  assert first.index == 0 and 10.0 * true_factor > deadline * 0.95
  for _ in range(20):
    c = coordinator.choose_config(
      CHAINED, deadline, base_time_s=10.0, time_scale=s
    )
    measured = 10.0 * true_factor / CHAINED.speedup[c.index]
    s = coordinator.update_time_scale(s, c.time_s, measured)
  assert s == pytest.approx(1.2)
  assert c.index == 1  # 12 / 1.21 = 9.92 s <= 11.4 s
  assert measured <= deadline


def test_server_deadline():
  assert coordinator.server_deadline([3.0, 7.5, 5.0]) == 7.5
  assert coordinator.server_deadline(
    [3.0, 7.5], depth_factor=1.5, pool_factor=0.5
  ) == pytest.approx(5.625)
  assert coordinator.deadline_factors(3, 4, 40, 30) == (4 / 3, 0.75)
  with pytest.raises(ValueError, match='no completion times'):
    coordinator.server_deadline([])
  with pytest.raises(ValueError, match='deadline_s must be finite'):
    coordinator.choose_config(CHAINED, float('inf'), base_time_s=1.0)
