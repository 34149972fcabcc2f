"""FedStitch's client step: scoring candidate blocks by CKA on local data.

A participant scores every remaining candidate block of each candidate
network by linear CKA (the network's output against the block's input in
its own pre-trained model) on one local batch and uploads its top-k
choices (ε-greedy) and all scores; at the end of a selection it uploads
the statistics XᵀX, XᵀY of the chosen blocks' stitches (`projection`).

References:
  "Heterogeneity-Aware Coordination for Federated Learning via Stitching
  Pre-trained blocks" (FedStitch), 2024, §III–IV.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from fedjax_mr.stitch import cka
from fedjax_mr.stitch import config as config_lib
from fedjax_mr.stitch import network as network_lib
from fedjax_mr.stitch import pool as pool_lib
from fedjax_mr.stitch import projection


def compatible(
  pool: pool_lib.Pool, net: network_lib.Network, block_id: int, policy: str
) -> bool:
  """Whether `net` can be stitched to pool block `block_id` at all."""
  block = pool.blocks[block_id]
  x_spec, y_spec = net.out_spec, block.in_spec
  if projection.check_compatible(x_spec, y_spec, policy) is not None:
    return False
  if policy == 'fit_only' and len(y_spec) > 1 and x_spec[:-1] != y_spec[:-1]:
    # The block must run at the incoming spatial size.
    shape = (1, *x_spec[:-1], y_spec[-1])
    try:
      jax.eval_shape(block.apply, jax.ShapeDtypeStruct(shape, np.float32))
    except Exception:  # noqa: BLE001 — any failure means it cannot run
      return False
  return True


def candidates(
  pool: pool_lib.Pool,
  net: network_lib.Network,
  remaining: frozenset[int],
  max_depth: int,
  policy: str = 'match',
) -> list[int]:
  """The pool ids a client scores for `net`, in pool order.

  Start blocks, blocks already in the network and incompatible blocks are
  never candidates; at depth `max_depth` − 1 only end blocks are.
  """
  path = set(net.path)
  only_end = net.depth + 1 >= max_depth
  out = []
  for i in sorted(remaining):
    b = pool.blocks[i]
    if b.kind == 'start' or b.id in path:
      continue
    if only_end and b.kind != 'end':
      continue
    if compatible(pool, net, i, policy):
      out.append(i)
  return out


def pool_inputs(
  pool: pool_lib.Pool, needed: Sequence[int], x: jax.Array
) -> dict[int, np.ndarray]:
  """Each needed block's input in its own network, on batch `x`.

  One forward pass per pre-trained model, up to its deepest needed block.

  Returns:
    pool id → the input that block sees, `[N, *in_spec]`.
  """
  needed = set(needed)
  out = {}
  for model in pool.models:
    ids = pool.ids_of(model)
    want = [i for i in ids if i in needed]
    if not want:
      continue
    h = x
    for i in ids:
      if i in needed:
        out[i] = np.asarray(h)
      if i == want[-1]:
        break
      h = pool.blocks[i].apply(h)
  return out


def score(
  x_net: np.ndarray,
  inputs: dict[int, np.ndarray],
  cand: Sequence[int],
  view: str = 'positions',
  debiased: bool = False,
) -> np.ndarray:
  """CKA of the network's output with each candidate's input, `[len(cand)]`."""
  return np.array(
    [cka.linear_cka(x_net, inputs[i], view, debiased) for i in cand]
  )


def select(
  scores: np.ndarray, k: int, epsilon: float, rng: np.random.Generator
) -> np.ndarray:
  """ε-greedy top-k: positions into `scores` a client uploads.

  With probability ε, k distinct random positions; otherwise the k best
  (ties to the lower position).
  """
  k = min(k, len(scores))
  if rng.random() < epsilon:
    return np.sort(rng.choice(len(scores), k, replace=False))
  return np.argsort(-scores, kind='stable')[:k]


def client_step(
  pool: pool_lib.Pool,
  nets: Sequence[network_lib.Network],
  cands: Sequence[Sequence[int]],
  x: jax.Array,
  config: config_lib.Config,
  *,
  epsilon: float,
  rng: np.random.Generator,
) -> tuple[list[np.ndarray | None], list[np.ndarray | None]]:
  """One participant's upload for every candidate network of the round.

  Args:
    pool: the block pool.
    nets: the candidate networks.
    cands: per network, its candidates' pool ids (`candidates`).
    x: the client's batch, `[B, ...]`.
    config: `view`, `debiased` and `top_k` are read.
    epsilon: this depth's exploration probability.
    rng: the client's generator of the round (its ε-greedy draws, one
      network after another).

  Returns:
    `(scores, choices)`: per network, the float64 CKA of each candidate
    `[len(cands[n])]` and the positions uploaded (`select`); None for a
    network without candidates.
  """
  inputs = pool_inputs(pool, sorted({i for c in cands for i in c}), x)
  scores, choices = [], []
  for net, cand in zip(nets, cands):
    if not cand:
      scores.append(None)
      choices.append(None)
      continue
    out = np.asarray(network_lib.apply(net, x))
    s = np.asarray(
      score(out, inputs, cand, config.view, config.debiased), np.float64
    )
    scores.append(s)
    choices.append(select(s, config.top_k, epsilon, rng))
  return scores, choices


def stitch_statistics(
  pool: pool_lib.Pool,
  net: network_lib.Network,
  block_ids: Sequence[int],
  x: jax.Array,
  config: config_lib.Config,
) -> dict[int, projection.Stats]:
  """A participant's upload for the stitches from `net` to `block_ids`:
  per block, XᵀX and XᵀY on its batch `x` (one forward of `net` and of each
  pool model for all blocks; `config.stitch_bias`, `config.spatial`)."""
  out = network_lib.apply(net, x)
  inputs = pool_inputs(pool, block_ids, x)
  return {
    b: projection.stats(
      out, inputs[b], bias=config.stitch_bias, policy=config.spatial
    )
    for b in block_ids
  }
