"""Tolerances follow the dtype compared, and every one goes through
`helpers.assert_close`."""

import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

from tests import helpers

TESTS = pathlib.Path(__file__).parent

# Comparisons that take a tolerance without knowing the compared dtype.
RAW = re.compile(r'assert_allclose\(|assert_trees_all_close\(|tree_allclose\(')


def test_one_bfloat16_ulp_passes_a_float32_tolerance():
  # The case CI met on an Intel Sapphire Rapids machine: SCAFFOLD's
  # bfloat16 controls on 1 and 2 devices, one ULP (2^-8 relative) apart.
  a = jnp.array([0.0052490234375], jnp.bfloat16)
  b = jnp.array([0.005218505859375], jnp.bfloat16)
  assert np.float64(a[0]) != np.float64(b[0])
  helpers.assert_close(a, b, rtol=1e-4, atol=1e-5)
  # The same two numbers in float32 are 0.58 % apart: a real difference.
  with pytest.raises(AssertionError):
    helpers.assert_close(
      a.astype(jnp.float32), b.astype(jnp.float32), rtol=1e-4, atol=1e-5
    )


def test_a_real_difference_in_bfloat16_still_fails():
  a = jnp.array([1.0, 2.0], jnp.bfloat16)
  # 1 + 8 ULPs at 1.0 (eps = 2^-7 in bfloat16): beyond `helpers.ULPS`.
  b = jnp.array([1.0 + 8 * 2.0**-7, 2.0], jnp.bfloat16)
  with pytest.raises(AssertionError):
    helpers.assert_close(a, b, rtol=1e-4)


def test_the_floor_is_ulps_of_the_coarsest_dtype():
  eps16 = float(jnp.finfo(jnp.bfloat16).eps)
  eps32 = float(jnp.finfo(jnp.float32).eps)
  f32 = np.zeros(1, np.float32)
  b16 = np.zeros(1, jnp.bfloat16)
  assert helpers.dtype_rtol(1e-4, f32) == 1e-4
  assert helpers.dtype_rtol(1e-9, f32) == helpers.ULPS * eps32
  assert helpers.dtype_rtol(1e-4, b16) == helpers.ULPS * eps16
  assert helpers.dtype_rtol(1e-4, f32, b16) == helpers.ULPS * eps16
  assert helpers.dtype_rtol(1e-12, np.zeros(1)) == 1e-12  # float64
  assert helpers.dtype_rtol(0.0, np.zeros(1, np.int32)) == 0.0


def test_float32_keeps_the_tolerance_asked_for():
  x = np.float32(1.0)
  helpers.assert_close(x, x * np.float32(1 + 1e-6), rtol=2e-6)
  with pytest.raises(AssertionError):
    helpers.assert_close(x, x * np.float32(1 + 1e-5), rtol=2e-6)


def test_trees_are_compared_leaf_by_leaf_with_lists_as_values():
  a = {'w': jnp.array([1.0, 2.0]), 'b': jnp.array(3.0, jnp.bfloat16)}
  helpers.assert_close(a, {'w': [1.0, 2.0], 'b': 3.0})
  with pytest.raises(AssertionError):
    helpers.assert_close(a, {'w': [1.0, 2.5], 'b': 3.0})
  helpers.assert_close(np.arange(3.0), [0.0, 1.0, 2.0])


def test_no_test_compares_with_a_tolerance_blind_to_the_dtype():
  found = []
  for path in sorted(TESTS.rglob('*.py')):
    if path.name in ('helpers.py', 'test_tolerances.py'):
      continue
    for number, line in enumerate(path.read_text().splitlines(), 1):
      if RAW.search(line):
        found.append(f'{path.relative_to(TESTS)}:{number}: {line.strip()}')
  assert not found, 'use helpers.assert_close:\n' + '\n'.join(found)


def test_precision_carries_a_coarser_dtype_into_float32_leaves():
  # A float32 mean of bfloat16-stored values: one bfloat16 ULP of a stored
  # value (2^-12 at 0.06) divided by N = 6 clients.
  a = np.array([0.083903, -0.02539063, -0.0584259], np.float32)
  b = a.copy()
  b[2] += np.float32(2.0**-12 / 6)
  with pytest.raises(AssertionError):
    helpers.assert_close(a, b, rtol=1e-4, atol=1e-5)
  helpers.assert_close(a, b, rtol=1e-4, atol=1e-5, precision=jnp.bfloat16)
  # Still a real difference: 10 % of the leaf's scale.
  b[2] += np.float32(0.0084)
  with pytest.raises(AssertionError):
    helpers.assert_close(a, b, rtol=1e-4, atol=1e-5, precision=jnp.bfloat16)
  tree = {'c': np.zeros(2, np.float32), 'ci': np.zeros(2, jnp.bfloat16)}
  assert helpers.coarsest_float_dtype(tree) == jnp.bfloat16
