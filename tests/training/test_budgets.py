"""Client memory budgets and measured training memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr import models
from fedjax_mr.core import errors
from fedjax_mr.training import budgets


def test_group_sizes_largest_remainder():
  # 7 · (0.3, 0.3, 0.3, 0.1) = 2.1, 2.1, 2.1, 0.7: floors 2, 2, 2, 0 and the
  # one client left goes to the largest remainder, the last group.
  np.testing.assert_array_equal(
    budgets.group_sizes(7, (0.3, 0.3, 0.3, 0.1)), [2, 2, 2, 1]
  )
  np.testing.assert_array_equal(
    budgets.group_sizes(100, budgets.PAPER_FRACTIONS), [30, 30, 30, 10]
  )


@pytest.mark.parametrize('fractions', [(0.5, 0.6), (1.2, -0.2), ()])
def test_bad_fractions_are_config_errors(fractions):
  with pytest.raises(errors.ConfigError, match='fractions'):
    budgets.group_sizes(10, fractions)


def test_client_budgets_are_the_papers_groups_in_seeded_order():
  b = budgets.client_budgets(100, seed=3)
  values, counts = np.unique(b, return_counts=True)
  np.testing.assert_array_equal(values, np.array([1, 2, 4, 8]) * 2**30)
  np.testing.assert_array_equal(counts, [30, 30, 30, 10])
  np.testing.assert_array_equal(b, budgets.client_budgets(100, seed=3))
  assert not np.array_equal(b, budgets.client_budgets(100, seed=4))
  with pytest.raises(errors.ConfigError, match='2 budgets but 4'):
    budgets.client_budgets(10, 0, budgets_gb=(1, 2))
  with pytest.raises(errors.ConfigError, match='> 0 GB'):
    budgets.client_budgets(10, 0, budgets_gb=(0, 1), fractions=(0.5, 0.5))


def test_largest_fitting():
  needs = [4, 2, 8, 2]  # unordered; the first of equal needs wins
  got = budgets.largest_fitting(np.array([1, 2, 3, 5, 100]), needs)
  np.testing.assert_array_equal(got, [-1, 1, 1, 0, 2])


def test_step_memory_counts_arguments_outputs_and_temporaries():
  f32 = jnp.float32
  # 1000 floats in, 1000 out.
  assert (
    budgets.step_memory_bytes(
      lambda x: 2 * x, jax.ShapeDtypeStruct((1000,), f32)
    )
    == 8000
  )
  # Arguments 4 · (100·200 + 200·300) bytes and a scalar out; the product is
  # fused into the reduction.
  x = jax.ShapeDtypeStruct((100, 200), f32)
  y = jax.ShapeDtypeStruct((200, 300), f32)
  got = budgets.step_memory_bytes(lambda x, y: (x @ y).sum(), x, y)
  assert got >= 4 * (100 * 200 + 200 * 300) + 4


@pytest.mark.slow
def test_training_memory_grows_with_the_batch_and_shrinks_when_frozen():
  model = models.get('cnn_mnist', num_classes=10, input_shape=(28, 28, 1))
  params = jax.eval_shape(model.init, jax.random.key(0))['params']
  param_bytes = sum(4 * p.size for p in jax.tree_util.tree_leaves(params))
  small = budgets.training_memory_bytes(model, 8, None)
  large = budgets.training_memory_bytes(model, 16, None)
  # At least the parameters, their gradients-turned-updates and the batch.
  assert small >= 2 * param_bytes + 4 * 8 * 28 * 28
  assert large > small
  head = budgets.training_memory_bytes(
    model, 16, None, trainable=lambda path: path[0] == 'Dense_1'
  )
  assert 0 < head < large
