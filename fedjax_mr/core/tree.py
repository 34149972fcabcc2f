"""Small pytree helpers shared by the server transforms."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from fedjax_mr.core import types


def broadcast(tree: types.PyTree, k: int) -> types.PyTree:
  """Stacks `k` copies of `tree`: leaves `[...]` become `[k, ...]`."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (k, *x.shape)), tree)


def weighted_mean(
  client_tree: types.PyTree, weights: jax.Array | None = None
) -> types.PyTree:
  """Mean over the leading client axis, Σ_k w_k x_k / Σ_k w_k, summed as
  the engine sums clients (`types.sum_clients`: one client after another
  on the CPU), the products kept apart from the additions by
  `types.unfused`: the same bits in every program that computes it, a
  round's or a deployed server's.

  Args:
    client_tree: leaves `[K, ...]`.
    weights: `[K]` non-negative integer weights (numbers of examples), or
      None for the plain mean.

  Returns:
    A tree with leaves `[...]`, in each leaf's dtype.
  """
  k = jax.tree.leaves(client_tree)[0].shape[0]
  if weights is None:
    return jax.tree.map(
      lambda x: (types.sum_clients(x.astype(jnp.float32)) / k).astype(x.dtype),
      client_tree,
    )
  if not jnp.issubdtype(weights.dtype, jnp.integer):
    raise ValueError(f'weights must be integers, got {weights.dtype}')
  w = weights.astype(jnp.float32)
  total = jnp.sum(weights).astype(jnp.float32)

  def mean(x):
    shaped = w.reshape((-1,) + (1,) * (x.ndim - 1))
    parts = types.unfused(shaped * x.astype(jnp.float32), weights[0])
    return (types.sum_clients(parts) / total).astype(x.dtype)

  return jax.tree.map(mean, client_tree)


def masked_mean(
  client_tree: types.PyTree,
  fallback: types.PyTree,
  masks: types.PyTree,
  weights: jax.Array | None = None,
) -> types.PyTree:
  """Each leaf's (weighted) mean over the clients its mask selects.

  Args:
    client_tree: leaves `[K, ...]`.
    fallback: leaves `[...]`, kept where a leaf's mask selects no client.
    masks: per leaf of `fallback`, a `[K]` bool: the clients that count.
    weights: `[K]` non-negative weights, or None (equal).

  Returns:
    A tree with leaves `[...]`, in each `fallback` leaf's dtype.
  """
  k = jax.tree.leaves(masks)[0].shape[0]
  w = jnp.ones((k,), jnp.float32) if weights is None else weights
  w = w.astype(jnp.float32)

  def one(x, g, mask):
    # Σ share·x / Σ share, as FedAvg's mean (`algorithms.fedavg.mean_of`),
    # so that every client holding every leaf gives FedAvg's bits.
    share = w * mask
    total = jnp.sum(share)
    shaped = share.reshape((-1,) + (1,) * (x.ndim - 1))
    summed = types.sum_clients(shaped * x.astype(jnp.float32))
    mean = summed / jnp.maximum(total, 1e-30)
    return jnp.where(total > 0, mean, g).astype(g.dtype)

  return jax.tree.map(one, client_tree, fallback, masks)


def num_parameters(tree: types.PyTree) -> int:
  """Total number of scalars in a tree."""
  return sum(int(x.size) for x in jax.tree.leaves(tree))


def nbytes(tree: types.PyTree) -> int:
  """Total bytes of a tree's leaves (shapes and dtypes only)."""
  return sum(
    int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
    for x in jax.tree.leaves(tree)
  )


def pairwise_cosine(
  client_tree: types.PyTree, reference: types.PyTree | None = None
) -> jax.Array:
  """Mean pairwise cosine similarity of K stacked models (or updates).

  Row k of every leaf, flattened and concatenated over the leaves (params
  and BatchNorm statistics alike), is one vector v_k; with `reference`,
  v_k is row k minus `reference` (the updates w_k - w_0). The result is
  the mean of cos(v_i, v_j) over the K(K-1)/2 pairs i < j (the cosine is
  symmetric, so also over the ordered pairs i != j). A zero vector has
  cosine 0 with every other.

  Args:
    client_tree: leaves `[K, ...]`.
    reference: optional, leaves `[...]` (one model, subtracted from every
      row) or `[K, ...]` (row by row).

  Returns:
    float32 scalar; 1 for K = 1.

  References:
    Hu et al., "Is Aggregation the Only Choice? Federated Learning via
    Layer-wise Model Recombination", KDD 2024, Fig. 6 (the average cosine
    similarity of the K local models over rounds).
  """
  flat = jax.tree.leaves(client_tree)
  if not flat:
    raise ValueError('client_tree has no leaves')
  if reference is not None:
    flat = [x - r for x, r in zip(flat, jax.tree.leaves(reference))]
  k = int(flat[0].shape[0])
  if k == 1:
    return jnp.ones((), jnp.float32)
  gram = jnp.zeros((k, k), jnp.float32)
  for x in flat:
    m = x.reshape(k, -1).astype(jnp.float32)
    gram = gram + jnp.dot(m, m.T, precision=lax.Precision.HIGHEST)
  norms = jnp.sqrt(jnp.diag(gram))
  cos = gram / jnp.maximum(norms[:, None] * norms[None, :], 1e-30)
  off = jnp.sum(cos) - jnp.trace(cos)
  return (off / (k * (k - 1))).astype(jnp.float32)
