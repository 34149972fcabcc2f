"""FedStitch's server step by hand: ranks, weights, votes, search space."""

import numpy as np
import pytest

from fedjax_mr.stitch import server
from tests import helpers
from tests.stitch import common


def test_rank_fraction():
  s = np.array([0.1, 0.5, 0.9])
  assert server.rank_fraction(s, 2) == 1.0
  assert server.rank_fraction(s, 0) == 0.0
  assert server.rank_fraction(s, 1) == 0.5
  ties = np.array([0.5, 0.5, 0.1])
  assert server.rank_fraction(ties, 0) == 0.75  # (1 below + ½ tie) / 2
  assert server.rank_fraction(np.array([0.3, 0.3]), 1) == 0.5
  assert server.rank_fraction(np.array([0.2, 0.8, 0.4, 0.6]), 3) == (
    pytest.approx(2 / 3)
  )
  assert server.rank_fraction(np.array([0.7]), 0) == 1.0


def test_cross_validated_ranks_three_clients():
  scores = np.array(
    [
      [0.9, 0.5, 0.1],
      [0.1, 0.5, 0.9],
      [0.9, 0.1, 0.5],
    ]
  )
  choices = [[0], [2], [0, 2]]
  # Client 0's choice 0: worst for client 1 (0), best for client 2 (1).
  # Client 1's choice 2: worst for client 0 (0), middle for client 2 (½).
  # Client 2's choices 0, 2: 1 and 0 for client 0, 0 and 1 for client 1.
  helpers.assert_close(
    server.cross_validated_ranks(choices, scores), [0.5, 0.25, 0.5]
  )


def test_cross_validated_ranks_single_participant_is_nan():
  ranks = server.cross_validated_ranks([[0, 1]], np.array([[0.2, 0.3]]))
  assert ranks.shape == (1,) and np.isnan(ranks[0])


def test_update_weights_by_hand():
  w0 = np.full(4, 0.25)
  new = server.update_weights(
    w0,
    [0, 1, 3],
    np.array([0.75, 0.5, np.nan]),
    reward=0.2,
    penalty=0.5,
    threshold=0.75,
  )
  # 0: rank = threshold → × 1.2; 1: × 0.5; 2 absent, 3 NaN: unchanged.
  raw = np.array([0.3, 0.125, 0.25, 0.25])
  helpers.assert_close(new, raw / raw.sum(), rtol=1e-15)
  assert new.sum() == pytest.approx(1.0)
  np.testing.assert_array_equal(w0, 0.25)  # the input is not modified
  # All NaN: unchanged.
  same = server.update_weights(
    w0, [0, 1], np.array([np.nan, np.nan]), reward=1, penalty=0.5, threshold=0
  )
  helpers.assert_close(same, w0, rtol=1e-15)


def test_update_weights_compounds_over_rounds():
  w = np.full(2, 0.5)
  for _ in range(3):
    w = server.update_weights(
      w, [0, 1], np.array([1.0, 0.0]), reward=0.2, penalty=0.2, threshold=0.5
    )
  ratio = (1.2 / 0.8) ** 3
  helpers.assert_close(w, [ratio / (1 + ratio), 1 / (1 + ratio)])


def test_vote():
  v = server.vote([1.0, 2.0, 0.5], [[0, 1], [1], [2, 0]], 4)
  helpers.assert_close(v, [1.5, 3.0, 0.5, 0.0])
  np.testing.assert_array_equal(server.vote([], [], 2), [0, 0])


def test_prune_by_hand():
  pool = common.fake_pool()
  everything = frozenset(range(9))
  # a: best is a[2] (drops a[0], a[1]); b: best is b[1] (drops b[0]); c is
  # not scored and keeps everything.
  scored = {1: 0.3, 2: 0.8, 4: 0.9, 5: 0.2}
  assert server.prune(pool, everything, scored) == frozenset({2, 4, 5, 6, 7, 8})
  # Only what remains is returned; nothing is added back.
  assert server.prune(pool, frozenset({0, 1, 5}), scored) == {5}
  # Ties go to the shallower block.
  assert server.prune(pool, everything, {1: 0.5, 2: 0.5}) == (everything - {0})
  assert server.prune(pool, everything, {}) == everything
