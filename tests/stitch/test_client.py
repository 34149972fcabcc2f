"""FedStitch's client step: candidates, CKA scores, ε-greedy uploads."""

import numpy as np
import pytest

from fedjax_mr.stitch import cka
from fedjax_mr.stitch import client
from fedjax_mr.stitch import network
from fedjax_mr.stitch import pool as pool_lib
from tests import helpers
from tests.stitch import common


def test_select_greedy_is_top_k():
  scores = np.array([0.2, 0.9, 0.5, 0.9, 0.1])
  rng = np.random.default_rng(0)
  for _ in range(20):
    assert client.select(scores, 2, 0.0, rng).tolist() == [1, 3]
  assert client.select(scores, 3, 0.0, rng).tolist() == [1, 3, 2]
  assert sorted(client.select(scores, 9, 0.0, rng).tolist()) == list(range(5))


def test_select_explores_with_epsilon_one():
  scores = np.arange(10.0)
  seen = set()
  for seed in range(20):
    pos = client.select(scores, 3, 1.0, np.random.default_rng(seed))
    assert len(pos) == 3 and len(set(pos.tolist())) == 3
    assert np.all((pos >= 0) & (pos < 10))
    assert pos.tolist() == sorted(pos.tolist())
    seen.add(tuple(pos.tolist()))
  assert len(seen) > 5  # random, not the top 3 (7, 8, 9) every time
  # Deterministic given a seeded generator.
  a = [client.select(scores, 3, 0.5, np.random.default_rng(7)).tolist()]
  b = [client.select(scores, 3, 0.5, np.random.default_rng(7)).tolist()]
  assert a == b
  rng1, rng2 = np.random.default_rng(8), np.random.default_rng(8)
  seq1 = [client.select(scores, 2, 0.5, rng1).tolist() for _ in range(10)]
  seq2 = [client.select(scores, 2, 0.5, rng2).tolist() for _ in range(10)]
  assert seq1 == seq2
  assert [9, 8] in seq1 and any(s != [9, 8] for s in seq1)  # both kinds


def test_candidates():
  pool = common.fake_pool()
  everything = frozenset(range(9))
  net = network.start(pool.blocks[0])  # a[0] → (8, 8, 4)
  # Start blocks never; every other block (spatial output: all compatible).
  assert client.candidates(pool, net, everything, 5) == [1, 2, 4, 5, 7, 8]
  assert client.candidates(pool, net, frozenset({2, 3, 4}), 5) == [2, 4]
  # At depth max_depth − 1 only end blocks.
  assert client.candidates(pool, net, everything, 2) == [2, 5, 8]
  net = network.extend(net, None, pool.blocks[4])  # → b[1]
  assert client.candidates(pool, net, everything, 5) == [1, 2, 5, 7, 8]
  assert client.candidates(pool, net, everything, 3) == [2, 5, 8]
  # After c[1] (a vector): no spatial block can follow.
  net = network.extend(network.start(pool.blocks[3]), None, pool.blocks[7])
  assert client.candidates(pool, net, everything, 5) == [8]


_ZOO = ('cnn_mnist', 'cnn_femnist', 'cnn_cifar')


def _pool():
  return pool_lib.make_pool([common.chain(n) for n in _ZOO])


def test_pool_inputs_and_score():
  pool = _pool()
  x = common.inputs(common.IMAGE, n=4)
  got = client.pool_inputs(pool, [1, 2, 7], x)
  assert sorted(got) == [1, 2, 7]
  mnist = common.chain('cnn_mnist')
  h1 = mnist[0].apply(x)
  helpers.assert_close(got[1], h1, rtol=1e-6)
  helpers.assert_close(got[2], mnist[1].apply(h1), rtol=1e-6)
  cifar = common.chain('cnn_cifar')
  helpers.assert_close(got[7], cifar[0].apply(x), rtol=1e-6)
  out = np.asarray(mnist[0].apply(x))
  s = client.score(out, got, [1, 2, 7])
  expected = [cka.linear_cka(out, got[i]) for i in (1, 2, 7)]
  helpers.assert_close(s, expected)
  assert s[0] == pytest.approx(1.0)  # its own next input


def test_compatible_fit_only_needs_a_block_that_runs():
  pool = pool_lib.make_pool(
    [common.chain('cnn_mnist'), common.chain('cnn_fedavg')]
  )
  net = network.start(pool.blocks[0])  # → (12, 12, 20)
  conv_same, head = 4, 5  # cnn_fedavg[1] (14, 14, 32), [2] (7, 7, 64)
  assert client.compatible(pool, net, conv_same, 'match')
  assert client.compatible(pool, net, head, 'match')
  assert client.compatible(pool, net, conv_same, 'fit_only')
  # Its flatten → dense head needs exactly 7 × 7 inputs.
  assert not client.compatible(pool, net, head, 'fit_only')
