import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_mr.core import tree
from fedjax_mr.core import types
from tests import helpers
from tests import xla_flags


def test_pairwise_cosine_hand_values():
  two = {'a': jnp.array([[1.0, 0.0], [1.0, 1.0]])}
  helpers.assert_close(tree.pairwise_cosine(two), 1 / np.sqrt(2))
  # Split across leaves: the models are [1,0 | 0], [0,1 | 0], [1,0 | 1].
  three = {
    'a': jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]),
    'b': jnp.array([[0.0], [0.0], [1.0]]),
  }
  # Pairs: (0,1) 0, (0,2) 1/sqrt(2), (1,2) 0.
  helpers.assert_close(
    tree.pairwise_cosine(three), (1 / np.sqrt(2)) / 3, rtol=1e-6
  )
  same = tree.broadcast({'a': jnp.array([3.0, -1.0])}, 5)
  helpers.assert_close(tree.pairwise_cosine(same), 1.0, rtol=1e-6)
  assert tree.pairwise_cosine({'a': jnp.ones((1, 3))}) == 1.0
  assert tree.pairwise_cosine(three).dtype == jnp.float32
  # A zero model: cosine 0 with the others, (0,1) = -1 stays.
  opposite = {'a': jnp.array([[1.0, 2.0], [-1.0, -2.0], [0.0, 0.0]])}
  helpers.assert_close(tree.pairwise_cosine(opposite), -1 / 3)


def test_pairwise_cosine_of_updates_subtracts_the_reference():
  # Models [2,1], [1,2], [2,2] around w0 = [1,1]: updates [1,0], [0,1],
  # [1,1]; pairs 0, 1/sqrt(2), 1/sqrt(2).
  models = {'w': jnp.array([[2.0, 1.0], [1.0, 2.0], [2.0, 2.0]])}
  w0 = {'w': jnp.array([1.0, 1.0])}
  expect = 2 / np.sqrt(2) / 3
  helpers.assert_close(tree.pairwise_cosine(models, w0), expect, rtol=1e-6)
  # A reference per row ([K, ...]) is subtracted row by row.
  helpers.assert_close(
    tree.pairwise_cosine(models, tree.broadcast(w0, 3)), expect, rtol=1e-6
  )
  # Against a plain numpy loop over pairs i < j on random stacks.
  rng = np.random.default_rng(0)
  stack = {'a': rng.normal(size=(4, 3, 2)), 'b': rng.normal(size=(4, 5))}
  ref = {'a': rng.normal(size=(3, 2)), 'b': rng.normal(size=(5,))}
  v = np.concatenate(
    [(stack['a'] - ref['a']).reshape(4, -1), stack['b'] - ref['b']], axis=1
  )
  pairs = [
    v[i] @ v[j] / np.linalg.norm(v[i]) / np.linalg.norm(v[j])
    for i in range(4)
    for j in range(i + 1, 4)
  ]
  got = jax.jit(tree.pairwise_cosine)(
    jax.tree.map(jnp.float32, stack), jax.tree.map(jnp.float32, ref)
  )
  helpers.assert_close(got, np.mean(pairs), rtol=1e-5)


def test_pairwise_cosine_of_nothing_is_an_error():
  with pytest.raises(ValueError, match='no leaves'):
    tree.pairwise_cosine({})


def test_masked_mean_hand_values():
  clients = {
    'a': jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
    'b': jnp.array([1.0, 2.0, 3.0], jnp.bfloat16),
  }
  fallback = {'a': jnp.array([9.0, 9.0]), 'b': jnp.array(7.0, jnp.bfloat16)}
  masks = {
    'a': jnp.array([True, False, True]),
    'b': jnp.array([False, False, False]),
  }
  got = tree.masked_mean(clients, fallback, masks, jnp.array([1, 5, 3]))
  # a: clients 0 and 2 with weights 1 and 3: (1·[1, 2] + 3·[5, 6]) / 4.
  helpers.assert_close(got['a'], [4.0, 5.0])
  # b: no client selected → the fallback, in its dtype.
  assert got['b'] == 7.0 and got['b'].dtype == jnp.bfloat16
  equal = tree.masked_mean(clients, fallback, masks)
  helpers.assert_close(equal['a'], [3.0, 4.0])


def test_sum_rows_adds_row_after_row():
  # Row 0 first, then each next row, exactly as a Python loop adds them
  # (the engine's order for clients that finish one at a time). Rows of
  # magnitudes 1e-4 to 1e4 make the order show in float32: XLA's own
  # `sum(axis=0)` of these differs from the loop in some bits.
  scale = jnp.logspace(-4, 4, 64)[:, None, None]
  m = jax.random.normal(jax.random.key(0), (64, 7, 3)) * scale
  tree = {'m': m, 'v': m[:, 0, 0]}
  got = jax.jit(types.sum_rows)(tree)
  expected = {'m': m[0], 'v': m[0, 0, 0]}
  for i in range(1, 64):
    expected = {'m': expected['m'] + m[i], 'v': expected['v'] + m[i, 0, 0]}
  np.testing.assert_array_equal(got['m'], expected['m'])
  np.testing.assert_array_equal(got['v'], expected['v'])
  # One row: that row.
  np.testing.assert_array_equal(types.sum_rows({'v': m[:1]})['v'], m[0])


def test_sum_clients_adds_rows_on_the_cpu_and_reduces_elsewhere(monkeypatch):
  m = (
    jax.random.normal(jax.random.key(0), (64, 7))
    * jnp.logspace(-4, 4, 64)[:, None]
  )
  np.testing.assert_array_equal(types.sum_clients(m), types.sum_rows(m))
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  np.testing.assert_array_equal(types.sum_clients(m), m.sum(axis=0))


def test_unfused_changes_no_bit():
  x = jnp.array(
    [0.0, -0.0, 1.5, -3.25e-39, jnp.inf, -jnp.inf, jnp.nan], jnp.float32
  )
  tree_in = {
    'f32': x,
    'bf16': x.astype(jnp.bfloat16),
    'f16': x.astype(jnp.float16),
    'i32': jnp.array([-5, 0, 7], jnp.int32),
    'b': jnp.array([True, False]),
  }
  got = jax.jit(types.unfused)(tree_in, jnp.int32(12))
  for name, leaf in tree_in.items():
    assert got[name].dtype == leaf.dtype, name
    np.testing.assert_array_equal(
      np.asarray(got[name]).view(np.uint8),
      np.asarray(leaf).view(np.uint8),
      err_msg=name,
    )


def test_unfused_products_are_rounded_before_a_program_adds_them():
  # t + n * w rounded twice, as numpy does, where XLA:CPU at a program's
  # optimization level (not the suite's -O0) may fuse the two into one
  # multiply-add rounded once: 3 * fl(1/3) - 1 is 0 in two roundings and
  # 2^-25-ish in one. Each lane a slightly different w.
  t = -jnp.ones(64, jnp.float32)
  n = jnp.full(64, 3.0, jnp.float32)
  w = np.float32(1 / 3) * (1 + np.arange(64, dtype=np.float32) * 1e-7)
  want = np.float32(3.0) * w + np.float32(-1.0)

  def add(t, n, w, count):
    return t + types.unfused(n * w, count)

  compiled = jax.jit(
    add,
    compiler_options={
      'xla_backend_optimization_level': 3,
      **xla_flags.PROGRAM_EMITTERS,
    },
  )
  np.testing.assert_array_equal(compiled(t, n, w, jnp.int32(9)), want)
