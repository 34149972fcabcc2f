import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.algorithms import fedavg
from fedjax_mr.algorithms import fedmr
from fedjax_mr.algorithms import fedmr_secure
from fedjax_mr.core import grouping
from fedjax_mr.core import tree
from fedjax_mr.core import types
from tests import helpers
from tests.algorithms import contract
from tests.algorithms import stacks

K = stacks.K

IDS = jnp.arange(K, dtype=jnp.int32)


BN_VARIABLES = contract.bn_variables()
BN_ORDER = grouping.model_order(BN_VARIABLES)


def bn_stack():
  """K copies of the BN model, row r shifted by 100 r (keys re-sorted)."""
  return jax.tree.map(
    lambda x: jnp.stack([x + 100.0 * r for r in range(K)]), BN_VARIABLES
  )


# --------------------------------------------------------------------------
# recombine


@functools.cache
def recombined():
  """Sources of recombined `stack()`s for 480 keys, one compile for all."""
  x = stacks.stack()
  resorted = jax.tree.map(lambda a: a, x)  # jax order: bias before kernel

  def variants(k):
    return {
      'leaf': fedmr.recombine(k, x),
      'module': fedmr.recombine(k, x, grouping='module'),
      'seg2': fedmr.recombine(
        k, resorted, num_segments=2, layer_order=stacks.ORDER
      ),
      # Without layer_order the fresh dict's own order is model order.
      'seg3': fedmr.recombine(k, x, num_segments=3),
      'seg1': fedmr.recombine(k, x, num_segments=1),
    }

  ys = stacks.many(variants, 480, 1)
  srcs = {
    name: stacks.sources(y, stacks.ORDER, batch=True) for name, y in ys.items()
  }
  return ys['leaf'], srcs


def test_recombine_keeps_each_layers_rows():
  x = stacks.stack()
  y = fedmr.recombine(jax.random.key(0), x)
  chex.assert_tree_shape_prefix(y, (K,))
  chex.assert_trees_all_equal_shapes_and_dtypes(y, x)
  ys, srcs = recombined()
  # Per layer the multiset of the K rows is kept...
  chex.assert_trees_all_equal(
    stacks.sorted_rows(ys, axis=1),
    jax.tree.map(
      lambda a: np.broadcast_to(a, (480, *a.shape)), stacks.sorted_rows(x)
    ),
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
  x = stacks.stack()
  eye = jnp.tile(jnp.arange(K), (4, 1))
  chex.assert_trees_all_equal(fedmr.permute(x, eye), x)
  swap = eye.at[1].set(jnp.array([1, 0, 2, 3]))  # 2nd layer in model order
  np.testing.assert_array_equal(
    stacks.sources(fedmr.permute(x, swap), stacks.ORDER),
    [[0, 1, 2, 3], [1, 0, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]],
  )
  with pytest.raises(ValueError, match='3 permutations for 4 units'):
    fedmr.permute(x, eye[:3])


def test_recombine_is_deterministic_jittable_and_dict_order_free():
  x = bn_stack()
  key = jax.random.key(5)
  y = fedmr.recombine(key, x)
  chex.assert_trees_all_equal(y, fedmr.recombine(key, x))
  chex.assert_trees_all_equal(jax.jit(fedmr.recombine)(key, x), y)
  # A fresh (creation-ordered) dict gives the same as its re-sorted copy.
  fresh = stacks.stack()
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

  leaf, module, segments = stacks.many(variants, 10, 7)
  srcs = stacks.sources(leaf, BN_ORDER, base=BN_VARIABLES, batch=True)
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
    srcs = stacks.sources(ys, BN_ORDER, base=BN_VARIABLES, batch=True)
    for lo, hi in zip(cuts[:-1], cuts[1:]):
      np.testing.assert_array_equal(
        srcs[:, lo:hi], np.repeat(srcs[:, lo : lo + 1], hi - lo, axis=1)
      )
    assert np.any(srcs[:, 0] != srcs[:, -1])


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
  return jax.tree.map(lambda x: x[0], stacks.stack())


def outputs_of(variables, num_examples=(1, 1, 1, 1)):
  return types.ClientOutput(
    variables,
    jnp.array(num_examples),
    jnp.zeros(K),
    jnp.ones(K, jnp.int32),
  )


def test_global_is_the_mean_and_recombination_keeps_uploaded_rows():
  server = fedmr.fedmr(contract.LOCAL, K)
  state = server.init(one_model())
  outputs = outputs_of(stacks.stack(), (1, 1, 1, 5))
  new, metrics = server.aggregate(state, outputs, IDS, 0, jax.random.key(0))
  # Mean of rows 0, 100, 200, 300 (+ 30).
  np.testing.assert_array_equal(new.params['params']['Dense_1']['bias'], 180)
  chex.assert_trees_all_equal(
    stacks.sorted_rows(new.client_models), stacks.sorted_rows(stacks.stack())
  )
  chex.assert_trees_all_equal(
    server.dispatch(new, IDS, 1, jax.random.key(1)).per_client,
    new.client_models,
  )
  # 13 float32 per model, K down + K up: 2 * 4 * 52 bytes.
  assert metrics['bytes_communicated'] == 416.0
  assert metrics['bytes_communicated'].dtype == jnp.float32
  helpers.assert_close(
    metrics['pairwise_cosine'], tree.pairwise_cosine(stacks.stack())
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
    state, outputs_of(stacks.stack()), IDS, 0, key
  )
  k_secure, k_mix = jax.random.split(key)
  plan = fedmr_secure.secure_plan(
    k_secure, K, 4, repeats=2, min_sent=1, max_sent=2
  )
  mixed = fedmr_secure.apply_secure_plan(stacks.stack(), plan)
  chex.assert_trees_all_equal(new.client_models, fedmr.recombine(k_mix, mixed))
  helpers.assert_close(
    metrics['pairwise_cosine'], tree.pairwise_cosine(mixed), rtol=1e-6
  )
  expect = 416.0 + np.asarray(plan.layer_transfers) @ stacks.SECURE_SIZES
  assert float(metrics['bytes_communicated']) == expect
  with pytest.raises(ValueError, match='weighted_global is not available'):
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
