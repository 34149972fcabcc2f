"""FedMR's secure recombination (fedjax_mr/algorithms/fedmr_secure.py)."""

import functools

import chex
import jax
import numpy as np
import pytest

from fedjax_mr.algorithms import fedmr_secure
from tests.algorithms import stacks

K = stacks.K

SECURE = dict(repeats=3, min_sent=1, max_sent=3)
plan_fn = jax.jit(
  functools.partial(
    fedmr_secure.secure_plan, num_models=K, num_layers=4, **SECURE
  )
)


def test_secure_recombine_matches_the_jit_plan():
  for seed in range(3):
    key = jax.random.key(seed)
    x = stacks.stack()
    y, rec = fedmr_secure.secure_recombine(key, x, **SECURE)
    plan = plan_fn(key)
    chex.assert_trees_all_equal(y, fedmr_secure.apply_secure_plan(x, plan))
    np.testing.assert_array_equal(
      stacks.sources(y, stacks.SECURE_ORDER), plan.permutation
    )
    assert len(rec.sender) == int(plan.num_transfers)
    # Stage-1 messages are exactly the plan's sends.
    s1 = rec.stage == 1
    sent = np.zeros((3, K, 4), bool)
    sent[rec.repeat[s1], rec.sender[s1], rec.layer[s1]] = True
    np.testing.assert_array_equal(sent, plan.sent)
    np.testing.assert_array_equal(
      rec.receiver[s1],
      np.asarray(plan.receiver)[rec.repeat[s1], rec.sender[s1], rec.layer[s1]],
    )
    assert rec.layer_names == stacks.SECURE_ORDER
    assert [layer.name for layer in fedmr_secure.secure_layers(x)] == list(
      stacks.SECURE_ORDER
    )


def test_secure_recombine_protocol_invariants():
  for seed in range(3):
    x = stacks.stack()
    y, rec = fedmr_secure.secure_recombine(
      jax.random.key(10 + seed), x, repeats=4, min_sent=2, max_sent=3
    )
    chex.assert_tree_shape_prefix(y, (K,))
    chex.assert_trees_all_equal(stacks.sorted_rows(y), stacks.sorted_rows(x))
    # Only clients talk, never to themselves.
    assert np.all((rec.sender >= 0) & (rec.sender < K))
    assert np.all((rec.receiver >= 0) & (rec.receiver < K))
    assert np.all(rec.sender != rec.receiver)
    assert set(np.unique(rec.stage)) <= {1, 3}
    # Replay the record: after every repeat each client holds one tensor
    # per layer, and the end state is the output.
    holding = np.tile(np.arange(K), (4, 1))  # [layer, client] -> origin
    for r in range(4):
      s1 = (rec.repeat == r) & (rec.stage == 1)
      s3 = (rec.repeat == r) & (rec.stage == 3)
      counts = np.bincount(rec.sender[s1], minlength=K)
      assert np.all((counts >= 2) & (counts <= 3)), counts
      sends = list(zip(rec.sender[s1], rec.receiver[s1], rec.layer[s1]))
      assert len({(c, j) for c, _, j in sends}) == len(sends)  # once each
      # Each send is answered by one return of that layer from its receiver.
      returns = zip(rec.receiver[s3], rec.sender[s3], rec.layer[s3])
      assert sorted(returns) == sorted(sends)
      # A client sends the tensor it holds.
      np.testing.assert_array_equal(
        rec.origin[s1], holding[rec.layer[s1], rec.sender[s1]]
      )
      buffers = {(j, c): [holding[j, c]] for j in range(4) for c in range(K)}
      for stage in (s1, s3):
        for a, b, j, t in zip(
          rec.sender[stage],
          rec.receiver[stage],
          rec.layer[stage],
          rec.origin[stage],
        ):
          buffers[(j, a)].remove(t)
          buffers[(j, b)].append(t)
      for (j, c), buf in buffers.items():
        assert len(buf) == 1
        holding[j, c] = buf[0]
    np.testing.assert_array_equal(holding, stacks.sources(y, rec.layer_names))


def test_secure_recombine_privacy_bound_determinism_and_errors():
  # Only stage 1 of the first repeat tells a receiver whose tensor it got;
  # a client exposes at most max_sent layers that way.
  key = jax.random.key(20)
  args = SECURE | {'max_sent': 2}
  y, rec = fedmr_secure.secure_recombine(key, stacks.stack(), **args)
  first = (rec.repeat == 0) & (rec.stage == 1)
  np.testing.assert_array_equal(rec.origin[first], rec.sender[first])
  assert np.bincount(rec.sender[first], minlength=K).max() <= 2
  y2, rec2 = fedmr_secure.secure_recombine(key, stacks.stack(), **args)
  chex.assert_trees_all_equal(y, y2)
  for a, b in zip(rec[:-1], rec2[:-1]):
    np.testing.assert_array_equal(a, b)
  # Sending nothing changes nothing.
  y0, rec0 = fedmr_secure.secure_recombine(
    key, stacks.stack(), repeats=2, min_sent=0, max_sent=0
  )
  chex.assert_trees_all_equal(y0, stacks.stack())
  assert len(rec0.sender) == 0
  with pytest.raises(ValueError, match='max_sent <= number of layers'):
    fedmr_secure.secure_recombine(
      key, stacks.stack(), **(SECURE | {'max_sent': 5})
    )
  with pytest.raises(ValueError, match='needs 2 clients'):
    fedmr_secure.secure_plan(key, 1, 4, **SECURE)


def test_secure_volume_matches_eq_27():
  sizes = np.array([16.0, 8.0, 4.0, 36.0])  # unequal layers, 64 bytes
  args = dict(repeats=2, min_sent=1, max_sent=3)
  n = 2000
  transfers = stacks.many(
    lambda k: fedmr_secure.secure_plan(k, K, 4, **args).layer_transfers,
    n,
    30,
  )
  volume = np.asarray(transfers, np.float64) @ sizes
  count = np.asarray(transfers).sum(1)
  # Eq. 27 times r_s: r_s K (n_l + n_u) size(w) / len(w) = 2*4*4*64/4.
  expected = fedmr_secure.expected_secure_bytes(sizes, K, **args)
  assert expected == 512.0
  assert abs(volume.mean() - expected) < 4 * volume.std() / np.sqrt(n)
  # Layer transfers: r_s K (n_l + n_u) = 32 on average, 16..48 always.
  assert abs(count.mean() - 32) < 4 * count.std() / np.sqrt(n)
  assert count.min() >= 16 and count.max() <= 48


def test_secure_upload_is_the_plan_applied_and_its_bytes():
  key = jax.random.key(40)
  args = dict(repeats=2, min_sent=1, max_sent=2)
  mixed, client_bytes = jax.jit(
    functools.partial(fedmr_secure.secure_upload, **args)
  )(key, stacks.stack())
  plan = fedmr_secure.secure_plan(key, K, 4, **args)
  chex.assert_trees_all_equal(
    mixed, fedmr_secure.apply_secure_plan(stacks.stack(), plan)
  )
  expect = np.asarray(plan.layer_transfers) @ stacks.SECURE_SIZES
  assert client_bytes.dtype == np.float32
  assert float(client_bytes) == expect
  # Without max_sent every layer may be sent.
  _, plan_bytes = fedmr_secure.secure_upload(
    key, stacks.stack(), repeats=2, min_sent=1
  )
  all_layers = fedmr_secure.secure_plan(
    key, K, 4, repeats=2, min_sent=1, max_sent=4
  )
  assert float(plan_bytes) == (
    np.asarray(all_layers.layer_transfers) @ stacks.SECURE_SIZES
  )
