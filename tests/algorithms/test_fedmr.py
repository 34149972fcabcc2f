import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import fedmr
from fedjax_mr.core import grouping
from fedjax_mr.core import tree
from fedjax_mr.core import types
from tests import helpers
from tests.algorithms import contract

K = 4
IDS = jnp.arange(K, dtype=jnp.int32)


def stack():
  """K models whose every value tells its row: round(value / 100) == row."""
  rows = jnp.arange(K, dtype=jnp.float32) * 100
  return {
    'params': {
      'Dense_0': {
        'kernel': rows[:, None, None] + jnp.arange(6.0).reshape(2, 3),
        'bias': rows[:, None] + 10 + jnp.arange(3.0),
      },
      'Dense_1': {
        'kernel': rows[:, None] + 20 + jnp.arange(3.0),
        'bias': rows + 30,
      },
    }
  }


# Model order of `stack()` (as written; jax's sorted order differs).
ORDER = grouping.model_order(stack())
# Secure recombination's layers (jax order) and their bytes.
SECURE_ORDER = (
  'params/Dense_0/bias',
  'params/Dense_0/kernel',
  'params/Dense_1/bias',
  'params/Dense_1/kernel',
)
SECURE_SIZES = np.array([12.0, 24.0, 4.0, 12.0])


BN_VARIABLES = contract.bn_variables()
BN_ORDER = grouping.model_order(BN_VARIABLES)


def bn_stack():
  """K copies of the BN model, row r shifted by 100 r (keys re-sorted)."""
  return jax.tree.map(
    lambda x: jnp.stack([x + 100.0 * r for r in range(K)]), BN_VARIABLES
  )


def sources(ys, layer_order, *, base=None, batch=False):
  """Input row of every output row: `[num_leaves, K]` (`[N, ...]` if batch).

  Args:
    ys: a stack `[K, ...]`, or with `batch` a batch of stacks `[N, K, ...]`.
    layer_order: model order of the leaves.
    base: the model whose copy shifted by 100 r is input row r (None: 0).

  Fails if a row mixes several input rows.
  """
  flat = jax.tree.leaves(ys)
  flat_base = None if base is None else jax.tree.leaves(base)
  out = []
  for leaf in grouping.leaves(ys, layer_order):
    x = np.asarray(flat[leaf.index], np.float64)
    if flat_base is not None:
      x = x - np.asarray(flat_base[leaf.index], np.float64)
    x = x if batch else x[None]
    x = x.reshape(x.shape[0], K, -1)
    src = np.round(x / 100)
    np.testing.assert_array_equal(src, np.broadcast_to(src[..., :1], src.shape))
    out.append(src[..., 0].astype(int))
  result = np.stack(out, axis=1)
  return result if batch else result[0]


def many(fn, n, seed):
  """`fn(key)` for n keys, vmapped and jitted: leaves `[n, ...]`."""
  return jax.jit(jax.vmap(fn))(jax.random.split(jax.random.key(seed), n))


def sorted_rows(client_params, axis=0):
  return jax.tree.map(
    lambda x: np.sort(np.asarray(x), axis=axis), client_params
  )


# --------------------------------------------------------------------------
# recombine


@functools.cache
def recombined():
  """Sources of recombined `stack()`s for 480 keys, one compile for all."""
  x = stack()
  resorted = jax.tree.map(lambda a: a, x)  # jax order: bias before kernel

  def variants(k):
    return {
      'leaf': fedmr.recombine(k, x),
      'module': fedmr.recombine(k, x, grouping='module'),
      'seg2': fedmr.recombine(k, resorted, num_segments=2, layer_order=ORDER),
      # Without layer_order the fresh dict's own order is model order.
      'seg3': fedmr.recombine(k, x, num_segments=3),
      'seg1': fedmr.recombine(k, x, num_segments=1),
    }

  ys = many(variants, 480, 1)
  srcs = {name: sources(y, ORDER, batch=True) for name, y in ys.items()}
  return ys['leaf'], srcs


def test_recombine_keeps_each_layers_rows():
  x = stack()
  y = fedmr.recombine(jax.random.key(0), x)
  chex.assert_tree_shape_prefix(y, (K,))
  chex.assert_trees_all_equal_shapes_and_dtypes(y, x)
  ys, srcs = recombined()
  # Per layer the multiset of the K rows is kept...
  chex.assert_trees_all_equal(
    sorted_rows(ys, axis=1),
    jax.tree.map(lambda a: np.broadcast_to(a, (480, *a.shape)), sorted_rows(x)),
  )
  # ... and each output row is one whole input row (`sources` checks).
  for src in srcs.values():
    np.testing.assert_array_equal(
      np.sort(src, -1), np.broadcast_to(np.arange(K), src.shape)
    )


def test_recombine_draws_independent_permutations_per_layer():
  srcs = recombined()[1]['leaf']
  # Two layers share a permutation with probability 1/4! = 1/24.
  for a, b in [(0, 1), (1, 2), (2, 3)]:
    same = np.mean(np.all(srcs[:, a] == srcs[:, b], axis=1))
    assert 0.0 < same < 0.1, same
  # Every model position gets every source about equally often.
  counts = np.stack([np.bincount(srcs[:, 0, i], minlength=K) for i in range(K)])
  assert counts.min() > 480 / K / 2


def test_module_grouping_keeps_kernel_and_bias_together():
  srcs = recombined()[1]['module']
  np.testing.assert_array_equal(srcs[:, 0], srcs[:, 1])  # Dense_0
  np.testing.assert_array_equal(srcs[:, 2], srcs[:, 3])  # Dense_1
  assert np.any(srcs[:, 0] != srcs[:, 2])


def test_segments_are_contiguous_in_model_order():
  srcs = recombined()[1]['seg2']
  # Segments [Dense_0/kernel, Dense_0/bias], [Dense_1/kernel, Dense_1/bias].
  np.testing.assert_array_equal(srcs[:, 0], srcs[:, 1])
  np.testing.assert_array_equal(srcs[:, 2], srcs[:, 3])
  assert np.any(srcs[:, 1] != srcs[:, 2])
  # 3 segments of 4 layers: [kernel, bias], [Dense_1/kernel], [Dense_1/bias].
  srcs = recombined()[1]['seg3']
  np.testing.assert_array_equal(srcs[:, 0], srcs[:, 1])
  assert np.any(srcs[:, 1] != srcs[:, 2])
  assert np.any(srcs[:, 2] != srcs[:, 3])


def test_one_segment_permutes_whole_models_only():
  srcs = recombined()[1]['seg1']
  np.testing.assert_array_equal(srcs, np.repeat(srcs[:, :1], 4, axis=1))
  assert np.any(srcs[:, 0] != np.arange(K))


def test_identity_permutation_is_no_mix():
  x = stack()
  eye = jnp.tile(jnp.arange(K), (4, 1))
  chex.assert_trees_all_equal(fedmr.permute(x, eye), x)
  swap = eye.at[1].set(jnp.array([1, 0, 2, 3]))  # 2nd layer in model order
  np.testing.assert_array_equal(
    sources(fedmr.permute(x, swap), ORDER),
    [[0, 1, 2, 3], [1, 0, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]],
  )
  with pytest.raises(ValueError):
    fedmr.permute(x, eye[:3])


def test_recombine_is_deterministic_jittable_and_dict_order_free():
  x = bn_stack()
  key = jax.random.key(5)
  y = fedmr.recombine(key, x)
  chex.assert_trees_all_equal(y, fedmr.recombine(key, x))
  chex.assert_trees_all_equal(jax.jit(fedmr.recombine)(key, x), y)
  # A fresh (creation-ordered) dict gives the same as its re-sorted copy.
  fresh = stack()
  chex.assert_trees_all_equal(
    fedmr.recombine(key, fresh),
    fedmr.recombine(key, jax.tree.map(lambda a: a, fresh)),
  )
  other = fedmr.recombine(jax.random.key(6), x)
  assert any(
    not np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(y))
  )


def test_batch_stats_are_recombined_like_params():
  x = bn_stack()

  def variants(k):
    return (
      fedmr.recombine(k, x),
      fedmr.recombine(k, x, grouping='module'),
      fedmr.recombine(k, x, num_segments=3, layer_order=BN_ORDER),
    )

  leaf, module, segments = many(variants, 10, 7)
  srcs = sources(leaf, BN_ORDER, base=BN_VARIABLES, batch=True)
  np.testing.assert_array_equal(
    np.sort(srcs, -1), np.broadcast_to(np.arange(K), srcs.shape)
  )
  # Every leaf moved at least once, BatchNorm mean and variance included.
  assert np.all(np.any(srcs != np.arange(K), axis=(0, 2)))
  assert BN_ORDER[4:6] == (
    'batch_stats/BatchNorm_0/mean',
    'batch_stats/BatchNorm_0/var',
  )
  # Module grouping: Conv (2 leaves), BatchNorm (4 leaves), Dense (2).
  # Segments of the 8 leaves in model order: 3, 3, 2.
  for ys, cuts in [(module, (0, 2, 6, 8)), (segments, (0, 3, 6, 8))]:
    srcs = sources(ys, BN_ORDER, base=BN_VARIABLES, batch=True)
    for lo, hi in zip(cuts[:-1], cuts[1:]):
      np.testing.assert_array_equal(
        srcs[:, lo:hi], np.repeat(srcs[:, lo : lo + 1], hi - lo, axis=1)
      )
    assert np.any(srcs[:, 0] != srcs[:, -1])


# --------------------------------------------------------------------------
# secure recombination

SECURE = dict(repeats=3, min_sent=1, max_sent=3)
plan_fn = jax.jit(
  functools.partial(fedmr.secure_plan, num_models=K, num_layers=4, **SECURE)
)


def test_secure_recombine_matches_the_jit_plan():
  for seed in range(3):
    key = jax.random.key(seed)
    x = stack()
    y, rec = fedmr.secure_recombine(key, x, **SECURE)
    plan = plan_fn(key)
    chex.assert_trees_all_equal(y, fedmr.apply_secure_plan(x, plan))
    np.testing.assert_array_equal(sources(y, SECURE_ORDER), plan.permutation)
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
    assert rec.layer_names == SECURE_ORDER
    assert [layer.name for layer in fedmr.secure_layers(x)] == list(
      SECURE_ORDER
    )


def test_secure_recombine_protocol_invariants():
  for seed in range(3):
    x = stack()
    y, rec = fedmr.secure_recombine(
      jax.random.key(10 + seed), x, repeats=4, min_sent=2, max_sent=3
    )
    chex.assert_tree_shape_prefix(y, (K,))
    chex.assert_trees_all_equal(sorted_rows(y), sorted_rows(x))
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
    np.testing.assert_array_equal(holding, sources(y, rec.layer_names))


def test_secure_recombine_privacy_bound_determinism_and_errors():
  # Only stage 1 of the first repeat tells a receiver whose tensor it got;
  # a client exposes at most max_sent layers that way.
  key = jax.random.key(20)
  args = SECURE | {'max_sent': 2}
  y, rec = fedmr.secure_recombine(key, stack(), **args)
  first = (rec.repeat == 0) & (rec.stage == 1)
  np.testing.assert_array_equal(rec.origin[first], rec.sender[first])
  assert np.bincount(rec.sender[first], minlength=K).max() <= 2
  y2, rec2 = fedmr.secure_recombine(key, stack(), **args)
  chex.assert_trees_all_equal(y, y2)
  for a, b in zip(rec[:-1], rec2[:-1]):
    np.testing.assert_array_equal(a, b)
  # Sending nothing changes nothing.
  y0, rec0 = fedmr.secure_recombine(
    key, stack(), repeats=2, min_sent=0, max_sent=0
  )
  chex.assert_trees_all_equal(y0, stack())
  assert len(rec0.sender) == 0
  with pytest.raises(ValueError):
    fedmr.secure_recombine(key, stack(), **(SECURE | {'max_sent': 5}))
  with pytest.raises(ValueError):
    fedmr.secure_plan(key, 1, 4, **SECURE)


def test_secure_volume_matches_eq_27():
  sizes = np.array([16.0, 8.0, 4.0, 36.0])  # unequal layers, 64 bytes
  args = dict(repeats=2, min_sent=1, max_sent=3)
  n = 2000
  transfers = many(
    lambda k: fedmr.secure_plan(k, K, 4, **args).layer_transfers, n, 30
  )
  volume = np.asarray(transfers, np.float64) @ sizes
  count = np.asarray(transfers).sum(1)
  # Eq. 27 times r_s: r_s K (n_l + n_u) size(w) / len(w) = 2*4*4*64/4.
  expected = fedmr.expected_secure_bytes(sizes, K, **args)
  assert expected == 512.0
  assert abs(volume.mean() - expected) < 4 * volume.std() / np.sqrt(n)
  # Layer transfers: r_s K (n_l + n_u) = 32 on average, 16..48 always.
  assert abs(count.mean() - 32) < 4 * count.std() / np.sqrt(n)
  assert count.min() >= 16 and count.max() <= 48


# --------------------------------------------------------------------------
# the server transform


def test_first_stage_covering_all_rounds_is_unweighted_fedavg():
  contract.assert_same_runs(
    fedmr.fedmr(contract.LOCAL, K, first_stage_bound=3),
    fedavg.fedavg(contract.LOCAL, K, weighted=False),
    K,
  )


def test_two_stage_recombines_from_the_end_of_round_bound():
  server = fedmr.fedmr(contract.LOCAL, K, first_stage_bound=2)
  dispatched, states = contract.run_by_hand(
    server, contract.tiny_variables(), 4, K
  )
  for r in (0, 1, 2):  # After rounds 0 and 1: K copies of the mean.
    chex.assert_trees_all_equal(
      dispatched[r], tree.broadcast(states[r].params, K)
    )
  # The aggregate of round 2 recombines: the K models differ.
  kernel = dispatched[3]['params']['Dense_0']['kernel']
  assert not np.allclose(kernel[0], kernel[1])


def one_model():
  return jax.tree.map(lambda x: x[0], stack())


def outputs_of(variables, num_examples=(1, 1, 1, 1)):
  return types.ClientOutput(
    variables, jnp.array(num_examples), jnp.zeros(K), jnp.ones(K, jnp.int32)
  )


def test_global_is_the_mean_and_recombination_keeps_uploaded_rows():
  server = fedmr.fedmr(contract.LOCAL, K)
  state = server.init(one_model())
  outputs = outputs_of(stack(), (1, 1, 1, 5))
  new, metrics = server.aggregate(state, outputs, IDS, 0, jax.random.key(0))
  # Mean of rows 0, 100, 200, 300 (+ 30).
  np.testing.assert_array_equal(new.params['params']['Dense_1']['bias'], 180)
  chex.assert_trees_all_equal(
    sorted_rows(new.client_models), sorted_rows(stack())
  )
  chex.assert_trees_all_equal(
    server.dispatch(new, IDS, 1, jax.random.key(1)).per_client,
    new.client_models,
  )
  # 13 float32 per model, K down + K up: 2 * 4 * 52 bytes.
  assert metrics['bytes_communicated'] == 416.0
  assert metrics['bytes_communicated'].dtype == jnp.float32
  helpers.assert_close(
    metrics['pairwise_cosine'], tree.pairwise_cosine(stack())
  )
  weighted = fedmr.fedmr(contract.LOCAL, K, weighted_global=True)
  new_w, _ = weighted.aggregate(state, outputs, IDS, 0, jax.random.key(0))
  # (0 + 100 + 200 + 5 * 300) / 8 + 30.
  helpers.assert_close(new_w.params['params']['Dense_1']['bias'], 255)


def test_indep_redispatches_whole_trained_models():
  server = fedmr.fedmr(contract.LOCAL, K, num_segments=1)
  dispatch, aggregate = jax.jit(server.dispatch), jax.jit(server.aggregate)
  state = server.init(one_model())

  def rows(tree):
    return sorted(
      tuple(np.concatenate([np.ravel(x[i]) for x in jax.tree.leaves(tree)]))
      for i in range(K)
    )

  for r in range(3):
    client = dispatch(state, IDS, r, jax.random.key(r)).per_client
    outputs = contract.fake_outputs(client, jax.random.key(10 + r))
    state, _ = aggregate(state, outputs, IDS, r, jax.random.key(20 + r))
    assert rows(state.client_models) == rows(outputs.variables)


def test_secure_transform_sees_only_the_mixed_stack_and_counts_bytes():
  server = fedmr.fedmr(contract.LOCAL, K, secure_repeats=2, secure_max_sent=2)
  state = server.init(one_model())
  key = jax.random.key(3)
  new, metrics = jax.jit(server.aggregate)(
    state, outputs_of(stack()), IDS, 0, key
  )
  k_secure, k_mix = jax.random.split(key)
  plan = fedmr.secure_plan(k_secure, K, 4, repeats=2, min_sent=1, max_sent=2)
  mixed = fedmr.apply_secure_plan(stack(), plan)
  chex.assert_trees_all_equal(new.client_models, fedmr.recombine(k_mix, mixed))
  helpers.assert_close(
    metrics['pairwise_cosine'], tree.pairwise_cosine(mixed), rtol=1e-6
  )
  expect = 416.0 + np.asarray(plan.layer_transfers) @ SECURE_SIZES
  assert float(metrics['bytes_communicated']) == expect
  with pytest.raises(ValueError):
    fedmr.fedmr(contract.LOCAL, K, secure_repeats=1, weighted_global=True)


def test_segments_need_a_layer_order():
  with pytest.raises(ValueError, match='layer_order'):
    fedmr.fedmr(contract.LOCAL, K, num_segments=2)
  fedmr.fedmr(contract.LOCAL, K, num_segments=1)


@pytest.mark.parametrize(
  'options',
  [
    {},
    {'first_stage_bound': 1, 'weighted_global': True},
    {'grouping': 'module'},
    {'secure_repeats': 2},
  ],
)
def test_fedmr_meets_the_contract(options):
  history = contract.check_server_side(
    fedmr.fedmr(contract.LOCAL, K, **options), K
  )
  assert set(history[0]) == {'pairwise_cosine', 'bytes_communicated'}


def test_fedmr_segments_on_a_real_model_meet_the_contract():
  server = fedmr.fedmr(contract.LOCAL, 3, num_segments=3, layer_order=BN_ORDER)
  contract.check_server_side(server, 3, BN_VARIABLES)


def test_fedavg_meets_the_contract():
  contract.check_server_side(fedavg.fedavg(contract.LOCAL, K), K)
