"""FedStitch's server step: RL-weighted aggregation and the search space.

The server cross-validates each participant's choices against the other
participants' scores (`cross_validated_ranks`), rewards or penalises the
participant's weight (`update_weights`, the RL-weighted aggregator) and
adds the weighted votes up over a selection's rounds (`aggregate`). At the
end of a selection (`finish_selection`) the blocks with most votes are
stitched on (the stitches fitted on the participants' summed statistics),
the search-space optimiser shrinks each child's pool (`prune`) and a beam
keeps the best children. The choices left open by the paper are listed in
`config`.

The paper adjusts ε and the reward and penalty factors "to suit different
stages" of stitching but gives neither values nor a rule, so here they
are fixed for the whole run: ε = 0.1, reward = penalty = 0.2 and the
threshold 0.75 (`config.Config`'s defaults, which every recorded run
uses). The one stage rule offered is `epsilon_decay` (ε multiplied by it
per depth; 1, off, by default); the reward and penalty never change.

References:
  "Heterogeneity-Aware Coordination for Federated Learning via Stitching
  Pre-trained blocks" (FedStitch), 2024, §III–IV.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Sequence

import jax
import numpy as np

from fedjax_mr.stitch import config as config_lib
from fedjax_mr.stitch import network as network_lib
from fedjax_mr.stitch import pool as pool_lib
from fedjax_mr.stitch import projection
from fedjax_mr.stitch import state as state_lib

BatchFn = Callable[[int, int], jax.Array]
# `(net, block ids, client ids, round, config)` → per block the clients'
# summed stitch statistics (`federated.Clients.statistics`).
Statistics = Callable[..., dict[int, projection.Stats]]


def rank_fraction(scores: np.ndarray, j: int) -> float:
  """Where candidate j stands in one client's scores: 1 best, 0 worst."""
  n = len(scores)
  if n < 2:
    return 1.0
  below = np.sum(scores < scores[j])
  ties = np.sum(scores == scores[j]) - 1
  return float((below + 0.5 * ties) / (n - 1))


def cross_validated_ranks(
  choices: Sequence[Sequence[int]], scores: np.ndarray
) -> np.ndarray:
  """Each participant's mean rank of its choices in the others' scores.

  Args:
    choices: per participant, the candidate positions it uploaded.
    scores: `[P, n]` every participant's scores of the n candidates.

  Returns:
    `[P]` ranks in [0, 1]; NaN when there is no other participant.
  """
  p = len(choices)
  out = np.full(p, np.nan)
  if p < 2:
    return out
  for c in range(p):
    vals = [
      rank_fraction(scores[o], j)
      for j in choices[c]
      for o in range(p)
      if o != c
    ]
    out[c] = np.mean(vals)
  return out


def update_weights(
  weights: np.ndarray,
  ids: Sequence[int],
  ranks: np.ndarray,
  *,
  reward: float,
  penalty: float,
  threshold: float,
) -> np.ndarray:
  """Rewards (× (1 + reward)) or penalises (× (1 − penalty)) participants.

  Args:
    weights: `[N]` all clients' weights (sum 1).
    ids: the participants' client ids.
    ranks: `[len(ids)]` their cross-validated ranks (NaN: unchanged).
    reward: see `Config`.
    penalty: see `Config`.
    threshold: see `Config`.

  Returns:
    New `[N]` weights, renormalised to sum 1.
  """
  w = np.array(weights, np.float64)
  for i, r in zip(ids, ranks):
    if np.isnan(r):
      continue
    w[i] *= (1 + reward) if r >= threshold else (1 - penalty)
  return w / w.sum()


def vote(
  voter_weights: Sequence[float],
  choices: Sequence[Sequence[int]],
  num_candidates: int,
) -> np.ndarray:
  """Votes per candidate: each participant adds its weight to its choices."""
  v = np.zeros(num_candidates)
  for w, chosen in zip(voter_weights, choices):
    v[np.asarray(chosen, int)] += w
  return v


def prune(
  pool: pool_lib.Pool, remaining: frozenset[int], scored: dict[int, float]
) -> frozenset[int]:
  """Search-space optimiser: drop blocks shallower than each model's best.

  Args:
    pool: the pool.
    remaining: the network's pool ids.
    scored: pool id → aggregated CKA of the candidates scored this
      selection.

  Returns:
    `remaining` without, for every model with a scored block, its blocks
    shallower than its best-scoring one.
  """
  drop = set()
  for model in pool.models:
    mine = {i: s for i, s in scored.items() if pool.blocks[i].model == model}
    if not mine:
      continue
    best = max(mine, key=lambda i: (mine[i], -i))
    depth = pool.blocks[best].index
    drop |= {
      i
      for i in remaining
      if pool.blocks[i].model == model and pool.blocks[i].index < depth
    }
  return frozenset(remaining - drop)


def round_ranks(
  choices: Sequence[Sequence[Sequence[int] | None]],
  scores: Sequence[np.ndarray],
  cands: Sequence[Sequence[int]],
  k: int,
) -> np.ndarray:
  """Each participant's rank in a round: its `cross_validated_ranks`,
  averaged over the candidate networks that had candidates.

  Args:
    choices: per network, per participant, the positions it uploaded.
    scores: per network, `[k, len(cands[n])]` every participant's scores.
    cands: per network, its candidates' pool ids.
    k: the number of participants.

  Returns:
    `[k]` ranks; NaN without another participant or candidate.
  """
  ranks = np.full(k, np.nan)
  per_net = [
    cross_validated_ranks(choices[n], scores[n])
    for n in range(len(cands))
    if cands[n]
  ]
  if per_net and k > 1:
    ranks = np.nanmean(np.stack(per_net), axis=0)
  return ranks


def _add_votes(
  live: state_lib.Live,
  cand: Sequence[int],
  voter: np.ndarray,
  choices: Sequence[Sequence[int]],
  scores: np.ndarray,
) -> state_lib.Live:
  """`live` with the round's votes and voter-weighted CKA sums added."""
  votes, ssum, swt = (
    live.votes.copy(),
    live.score_sum.copy(),
    live.score_weight.copy(),
  )
  if cand:
    idx = np.asarray(cand)
    votes[idx] += vote(voter, choices, len(idx))
    ssum[idx] += voter @ scores
    swt[idx] += voter.sum()
  return live._replace(votes=votes, score_sum=ssum, score_weight=swt)


def aggregate(
  weights: np.ndarray,
  live: Sequence[state_lib.Live],
  ids: Sequence[int],
  cands: Sequence[Sequence[int]],
  scores: Sequence[np.ndarray],
  choices: Sequence[Sequence[Sequence[int] | None]],
  config: config_lib.Config,
) -> tuple[np.ndarray, np.ndarray, tuple[state_lib.Live, ...]]:
  """The server step of a round: cross-validated ranks → weights → votes.

  Args:
    weights: `[N]` all clients' weights before the round.
    live: the candidate networks.
    ids: the participants' client ids.
    cands: per network, its candidates' pool ids.
    scores: per network, `[len(ids), len(cands[n])]` the participants'
      scores.
    choices: per network, per participant, the positions it uploaded.
    config: `aggregation`, `reward`, `penalty` and `threshold` are read.

  Returns:
    `(ranks [len(ids)], new weights [N], live with the votes added)`. With
    'rl' aggregation a participant votes with its new weight × N (mean 1
    per client), with 'uniform' with 1.
  """
  ranks = round_ranks(choices, scores, cands, len(ids))
  if config.aggregation == 'rl':
    weights = update_weights(
      weights,
      ids,
      ranks,
      reward=config.reward,
      penalty=config.penalty,
      threshold=config.threshold,
    )
    voter = weights[ids] * len(weights)  # mean weight 1 per client
  else:
    voter = np.ones(len(ids))
  live = tuple(
    _add_votes(lv, cands[n], voter, choices[n], scores[n])
    for n, lv in enumerate(live)
  )
  return ranks, weights, live


def fit_stitches(
  pool: pool_lib.Pool,
  net: network_lib.Network,
  block_ids: Sequence[int],
  totals: dict[int, projection.Stats],
  config: config_lib.Config,
) -> dict[int, projection.Stitch]:
  """Stitches from `net` to each of `block_ids`, fitted on the clients'
  summed statistics `totals` (`client.stitch_statistics`); `config.solver`
  solves."""
  return {
    b: projection.make_stitch(
      projection.solve(totals[b], solver=config.solver),
      net.out_spec,
      pool.blocks[b].in_spec,
      bias=config.stitch_bias,
      policy=config.spatial,
    )
    for b in block_ids
  }


def _winners(
  live: state_lib.Live, idx: np.ndarray, mean: np.ndarray, k: int
) -> list[int]:
  """Positions into `idx` of the (at most k) blocks with most votes (ties:
  higher mean CKA, then the lower pool id); blocks without a vote never."""
  order = sorted(
    range(len(idx)), key=lambda j: (-live.votes[idx[j]], -mean[j], idx[j])
  )
  return [j for j in order if live.votes[idx[j]] > 0][:k]


def _children(
  pool: pool_lib.Pool,
  state: state_lib.State,
  lv: state_lib.Live,
  cands: Sequence[int],
  statistics: Statistics,
  config: config_lib.Config,
) -> list[tuple[state_lib.Live, dict[str, Any]]]:
  """Network `lv`'s children of the selection (its winners stitched on,
  with the pruned pool left to them) and each one's record."""
  idx = np.asarray(cands)
  mean = lv.score_sum[idx] / np.maximum(lv.score_weight[idx], 1e-300)
  winners = _winners(lv, idx, mean, config.num_selections)
  total = lv.votes[idx].sum()
  remaining = lv.remaining
  if config.prune:
    remaining = prune(pool, remaining, dict(zip(idx.tolist(), mean)))
  block_ids = [int(idx[j]) for j in winners]
  totals = {}
  if block_ids:
    fit_ids = list(state.fit_ids)
    totals = statistics(lv.net, block_ids, fit_ids, state.round - 1, config)
  stitches = fit_stitches(pool, lv.net, block_ids, totals, config)
  n_pool = len(pool.blocks)
  out = []
  for j in winners:
    b = int(idx[j])
    block = pool.blocks[b]
    share = float(lv.votes[b] / total) * lv.share
    path_score = float(mean[j]) * lv.path_score
    child = state_lib.Live(
      network_lib.extend(lv.net, stitches[b], block),
      frozenset(remaining - {b}),
      np.zeros(n_pool),
      np.zeros(n_pool),
      np.zeros(n_pool),
      share,
      path_score,
    )
    record = {
      'network': lv.net.describe(),
      'block': block.describe(),
      'votes': float(lv.votes[b]),
      'mean_cka': float(mean[j]),
      'share': share,
      'path_score': path_score,
    }
    out.append((child, record))
  return out


def finish_selection(
  pool: pool_lib.Pool,
  state: state_lib.State,
  cands: Sequence[Sequence[int]],
  statistics: Statistics,
  config: config_lib.Config,
) -> tuple[state_lib.State, list[dict[str, Any]]]:
  """End of a selection: vote winners → stitched children; prune; beam.

  Args:
    pool: the block pool.
    state: the state after the selection's last round (`state.fit_ids`
      are its participants, who fit the stitches).
    cands: per candidate network, its candidates' pool ids.
    statistics: `(net, block ids, client ids, round, config)` → per
      block, the statistics of the stitches from `net` to it summed over
      those clients on their batches of that round
      (`federated.Clients.statistics`).
    config: `num_selections`, `prune` and the stitch fit's fields.

  Returns:
    The state with the new candidate networks (the `num_selections`
    unfinished children of highest path score) and the finished ones
    added, and one record per chosen block (or dropped network).
  """
  children, finished, chosen = [], list(state.finished), []
  for n, lv in enumerate(state.live):
    if not cands[n]:
      chosen.append({'network': lv.net.describe(), 'dropped': 'no candidates'})
      continue
    made = _children(pool, state, lv, cands[n], statistics, config)
    for child, record in made:
      chosen.append(record)
      if child.net.finished:
        finished.append(
          state_lib.Finished(
            child.net, state.round, child.share, child.path_score
          )
        )
      else:
        children.append(child)
  children.sort(key=lambda c: (-c.path_score, -c.share))
  live = tuple(children[: config.num_selections])
  return state._replace(live=live, finished=tuple(finished)), chosen
