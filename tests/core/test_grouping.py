import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from fedjax_mr.core import grouping


class ConvBNDense(nn.Module):
  """Conv -> BatchNorm -> Dense: params and batch_stats, creation order not
  alphabetical."""

  @nn.compact
  def __call__(self, x, train=False):
    x = nn.Conv(2, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


def init_variables():
  return ConvBNDense().init(jax.random.key(0), jnp.zeros((1, 4, 4, 1)))


MODEL_ORDER = (
  'params/Conv_0/kernel',
  'params/Conv_0/bias',
  'params/BatchNorm_0/scale',
  'params/BatchNorm_0/bias',
  'batch_stats/BatchNorm_0/mean',
  'batch_stats/BatchNorm_0/var',
  'params/Dense_0/kernel',
  'params/Dense_0/bias',
)


def names(tree, layers):
  """Leaf names of each unit."""
  by_index = {leaf.index: leaf.name for leaf in grouping.leaves(tree)}
  return [[by_index[i] for i in layer.leaves] for layer in layers]


def test_model_order_is_creation_order_with_batch_stats_in_place():
  assert grouping.model_order(init_variables()) == MODEL_ORDER


def test_jax_resorts_keys_and_layer_order_restores_model_order():
  sorted_tree = jax.tree.map(lambda x: x, init_variables())
  assert grouping.model_order(sorted_tree) != MODEL_ORDER
  ordered = grouping.leaves(sorted_tree, layer_order=MODEL_ORDER)
  assert tuple(leaf.name for leaf in ordered) == MODEL_ORDER
  # Indices point at the right leaves of the sorted flatten.
  flat = jax.tree.leaves(sorted_tree)
  assert flat[ordered[0].index].shape == (3, 3, 1, 2)
  assert flat[ordered[4].index].shape == (2,)
  assert ordered[4].collection == 'batch_stats'
  assert ordered[4].module == 'BatchNorm_0'


def test_layer_order_must_name_every_leaf():
  with pytest.raises(ValueError, match='missing'):
    grouping.leaves(init_variables(), layer_order=MODEL_ORDER[:-1])


def test_leaf_grouping_one_layer_per_leaf():
  v = init_variables()
  layers = grouping.layer_groups(v)
  assert names(v, layers) == [[n] for n in MODEL_ORDER]
  assert [layer.name for layer in layers] == list(MODEL_ORDER)


def test_module_grouping_keeps_a_modules_leaves_together():
  v = init_variables()
  layers = grouping.layer_groups(v, grouping='module')
  assert [layer.name for layer in layers] == [
    'Conv_0',
    'BatchNorm_0',
    'Dense_0',
  ]
  assert names(v, layers) == [
    list(MODEL_ORDER[:2]),
    list(MODEL_ORDER[2:6]),
    list(MODEL_ORDER[6:]),
  ]


def test_segments_are_contiguous_in_model_order():
  v = init_variables()
  # 8 leaves in 3 segments: 3, 3, 2.
  layers = grouping.layer_groups(v, num_segments=3)
  assert names(v, layers) == [
    list(MODEL_ORDER[:3]),
    list(MODEL_ORDER[3:6]),
    list(MODEL_ORDER[6:]),
  ]
  assert layers[0].name == 'params/Conv_0/kernel..params/BatchNorm_0/scale'
  # The same on a re-sorted stack, given the order.
  stack = jax.tree.map(lambda x: jnp.stack([x, x]), v)
  assert names(
    stack, grouping.layer_groups(stack, num_segments=3, layer_order=MODEL_ORDER)
  ) == names(v, layers)
  # Modules in 2 segments: [Conv_0, BatchNorm_0], [Dense_0].
  assert names(
    v, grouping.layer_groups(v, grouping='module', num_segments=2)
  ) == [
    list(MODEL_ORDER[:6]),
    list(MODEL_ORDER[6:]),
  ]


def test_one_segment_is_the_whole_model_and_too_many_is_one_per_layer():
  v = init_variables()
  assert names(v, grouping.layer_groups(v, num_segments=1)) == [
    list(MODEL_ORDER)
  ]
  assert names(v, grouping.layer_groups(v, num_segments=20)) == [
    [n] for n in MODEL_ORDER
  ]
  with pytest.raises(ValueError, match='num_segments must be >= 1'):
    grouping.layer_groups(v, num_segments=0)
  with pytest.raises(ValueError, match='grouping must be one of'):
    grouping.layer_groups(v, grouping='layer')


def test_plain_tree_and_module_found_only_in_batch_stats():
  plain = {'b': {'w': 1.0, 'a': 2.0}, 'a': 3.0}
  assert grouping.model_order(plain) == ('b/w', 'b/a', 'a')
  assert [
    layer.name for layer in grouping.layer_groups(plain, grouping='module')
  ] == ['b', '']
  # A module with statistics but no params (BatchNorm without scale/bias)
  # goes after the module that precedes it among the statistics.
  v = {
    'params': {'A': {'w': 1.0}, 'C': {'w': 1.0}, 'D': {'w': 1.0}},
    'batch_stats': {'C': {'m': 1.0}, 'B': {'m': 1.0}},
  }
  assert grouping.model_order(v) == (
    'params/A/w',
    'params/C/w',
    'batch_stats/C/m',
    'batch_stats/B/m',
    'params/D/w',
  )


def test_works_under_jit_and_layer_sizes():
  v = init_variables()

  @jax.jit
  def count(tree):
    layers = grouping.layer_groups(tree, grouping='module')
    return jnp.float32(len(layers))

  assert count(v) == 3
  layers = grouping.layer_groups(v, layer_order=MODEL_ORDER)
  # float32: conv 3*3*1*2, biases/BN 2 each, dense 32*3 and 3.
  assert grouping.layer_sizes(v, layers) == (72, 8, 8, 8, 8, 8, 384, 12)
  stack = jax.tree.map(lambda x: jnp.stack([x] * 4), v)
  assert grouping.layer_sizes(stack, layers, leading=1)[0] == 72


def test_layer_keys_follow_names_and_unit_permutations():
  v = init_variables()
  key = jax.random.key(0)
  fresh = grouping.layer_groups(v)
  resorted = grouping.layer_groups(jax.tree.map(lambda x: x, v))
  by_name = dict(zip([x.name for x in fresh], grouping.layer_keys(key, fresh)))
  for layer, k in zip(resorted, grouping.layer_keys(key, resorted)):
    assert jnp.array_equal(
      jax.random.key_data(k), jax.random.key_data(by_name[layer.name])
    )
  perms = grouping.unit_permutations(grouping.layer_keys(key, fresh), 5)
  assert perms.shape == (8, 5) and perms.dtype == jnp.int32
  assert (jnp.sort(perms, axis=1) == jnp.arange(5)).all()
  assert len({tuple(p) for p in perms.tolist()}) > 1
  assert grouping.unit_permutations(jax.random.split(key, 0), 3).shape == (0, 3)
