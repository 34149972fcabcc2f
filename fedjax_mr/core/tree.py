"""Small pytree helpers shared by the server transforms."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fedjax_mr.core import types


def broadcast(tree: types.PyTree, k: int) -> types.PyTree:
  """Stacks `k` copies of `tree`: leaves `[...]` become `[k, ...]`."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (k, *x.shape)), tree)


def weighted_mean(
  client_tree: types.PyTree, weights: jax.Array | None = None
) -> types.PyTree:
  """Mean over the leading client axis.

  Args:
    client_tree: leaves `[K, ...]`.
    weights: `[K]` non-negative weights, or None for the plain mean.

  Returns:
    A tree with leaves `[...]`, in each leaf's dtype.
  """
  if weights is None:
    return jax.tree.map(
      lambda x: jnp.mean(x, axis=0).astype(x.dtype), client_tree
    )
  w = weights.astype(jnp.float32)
  w = w / jnp.sum(w)

  def mean(x):
    wx = jnp.tensordot(w, x.astype(jnp.float32), axes=1)
    return wx.astype(x.dtype)

  return jax.tree.map(mean, client_tree)


def num_parameters(tree: types.PyTree) -> int:
  """Total number of scalars in a tree."""
  return sum(int(x.size) for x in jax.tree.leaves(tree))


def nbytes(tree: types.PyTree) -> int:
  """Total bytes of a tree's leaves (shapes and dtypes only)."""
  return sum(
    int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
    for x in jax.tree.leaves(tree)
  )
