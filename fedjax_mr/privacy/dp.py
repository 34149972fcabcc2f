"""User-level differential privacy of a round's sum: every client's update
clipped, the sum noised.

DP-FedAvg: client i's update Δ_i (its trained model minus the model it
was sent) is scaled to L2 norm at most C (`clip`), the server adds
Gaussian noise of standard deviation z·C to the sum of the clipped updates
(`noise`) and divides by the round's fixed expected weight, never by the
noisy count. Adaptive clipping moves C toward a quantile γ of the updates'
norms: each client also reports whether its norm was at most C, the
server adds noise of standard deviation σ_b to the count of those
(`noised_fraction`) and takes a geometric step (`next_clip_norm`); the
update's noise multiplier is then `update_noise_multiplier(z, σ_b)`, so
that the two Gaussians together cost what one of multiplier z costs
(`accounting.Accountant` accounts for z).

Pure functions of arrays and keys, for any summing algorithm: the clip
belongs to a client's contribution, the noise to the sum
(../shared/STYLE.md, "The round").

References:
  McMahan, Ramage, Talwar, Zhang. "Learning Differentially Private
  Recurrent Language Models". ICLR 2018.
  Andrew, Thakkar, McMahan, Ramaswamy. "Differentially Private Learning
  with Adaptive Clipping". NeurIPS 2021.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_mr.core import types


def _floats(tree: types.PyTree) -> list[jax.Array]:
  return [
    x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)
  ]


def global_norm(tree: types.PyTree) -> jax.Array:
  """The L2 norm of every floating leaf of `tree` together, in float32."""
  leaves = _floats(tree)
  if not leaves:
    return jnp.zeros((), jnp.float32)
  return jnp.sqrt(
    sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)
  )


def _check_clip(clip_norm: Any) -> None:
  if isinstance(clip_norm, (int, float)) and not clip_norm > 0:
    raise ValueError(f'clip_norm must be > 0, got {clip_norm}')


def clip(
  update: types.PyTree, clip_norm: float | jax.Array, per_layer: bool = False
) -> tuple[types.PyTree, jax.Array]:
  """`update` scaled to L2 norm at most `clip_norm`, and its norm before.

  Args:
    update: a client's update (floating leaves are clipped; others kept).
    clip_norm: C > 0 (`jnp.inf`: nothing is clipped).
    per_layer: clip each floating leaf to C / sqrt(L) of its own (L
      floating leaves), so that the whole stays within C, instead of the
      whole update to C.

  Returns:
    `(clipped, norm)`: the clipped update, each leaf in its dtype, and
    the update's `global_norm` (float32) before clipping.
  """
  _check_clip(clip_norm)
  norm = global_norm(update)
  leaves = _floats(update)
  if not leaves:
    return update, norm
  bound = jnp.asarray(clip_norm, jnp.float32)

  def scaled(x, n, c):
    # min(1, c / n), 1 for a zero update: never 0 / 0.
    factor = jnp.where(n > c, c / jnp.maximum(n, 1e-30), 1.0)
    return (x.astype(jnp.float32) * factor).astype(x.dtype)

  if per_layer:
    each = bound / math.sqrt(len(leaves))
    clipped = jax.tree.map(
      lambda x: (
        scaled(x, global_norm(x), each)
        if jnp.issubdtype(x.dtype, jnp.floating)
        else x
      ),
      update,
    )
    return clipped, norm
  clipped = jax.tree.map(
    lambda x: (
      scaled(x, norm, bound) if jnp.issubdtype(x.dtype, jnp.floating) else x
    ),
    update,
  )
  return clipped, norm


def noise(
  tree: types.PyTree, key: jax.Array, stddev: float | jax.Array
) -> types.PyTree:
  """`tree` plus independent N(0, stddev²) on every element of its floating
  leaves (drawn in float32, added in float32, cast back to each leaf's
  dtype); leaf i's draw uses `fold_in(key, i)`, i its place among the
  leaves, so a leaf's noise does not depend on the others' shapes.
  `stddev` 0 returns the values unchanged."""
  if isinstance(stddev, (int, float)) and not stddev >= 0:
    raise ValueError(f'stddev must be >= 0, got {stddev}')
  leaves, treedef = jax.tree.flatten(tree)
  out = []
  for i, x in enumerate(leaves):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      out.append(x)
      continue
    draw = jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32)
    out.append((x.astype(jnp.float32) + stddev * draw).astype(x.dtype))
  return jax.tree.unflatten(treedef, out)


def update_noise_multiplier(
  noise_multiplier: float, count_stddev: float
) -> float:
  """z_Δ, the noise multiplier of the updates' sum when the count of
  clipped clients is noised with standard deviation σ_b (adaptive
  clipping): z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2), so that the two Gaussians
  together are the one of multiplier z (Andrew et al., 2021, Theorem 1).

  Raises:
    ValueError: `count_stddev` too small to leave any noise for the
      updates (2σ_b <= z), or a multiplier <= 0.
  """
  z, s = float(noise_multiplier), float(count_stddev)
  if not z > 0:
    raise ValueError(f'noise_multiplier must be > 0, got {z}')
  if not 2 * s > z:
    raise ValueError(
      f'count_stddev must be above noise_multiplier / 2 = {z / 2}, got {s}'
    )
  return (z**-2 - (2 * s) ** -2) ** -0.5


def noised_fraction(
  below: jax.Array,
  expected_clients: float,
  key: jax.Array,
  count_stddev: float | jax.Array,
) -> jax.Array:
  """The noised fraction of a round's clients whose update norm was at
  most the clip norm: (Σ b_i + N(0, σ_b²)) / m, `below` the sum Σ b_i of
  the reports b_i ∈ {0, 1} and m = `expected_clients` (fixed, never the
  noisy count)."""
  draw = jax.random.normal(key, (), jnp.float32)
  total = jnp.asarray(below, jnp.float32) + count_stddev * draw
  return total / expected_clients


def next_clip_norm(
  clip_norm: jax.Array,
  fraction: jax.Array,
  quantile: float,
  learning_rate: float,
) -> jax.Array:
  """The geometric step of the clip norm toward the `quantile` γ of the
  norms: C · exp(−η (b̄ − γ)), b̄ the (noised) fraction of clients at
  most C and η = `learning_rate`."""
  if not 0 <= quantile <= 1:
    raise ValueError(f'quantile must be in [0, 1], got {quantile}')
  step = jnp.exp(-learning_rate * (fraction - quantile))
  return jnp.asarray(clip_norm, jnp.float32) * step
