"""Stacks of K small models whose values tell their row, for the tests of
FedMR's recombinations (test_fedmr.py, test_fedmr_secure.py)."""

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.core import grouping

K = 4


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
