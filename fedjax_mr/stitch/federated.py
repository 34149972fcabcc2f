"""FedStitch federated block selection: client, server, search space.

Clients score every remaining candidate block for the current stitched
network by linear CKA on one local batch and upload their top-k choices
(ε-greedy) and all scores. The server cross-validates each client's choices
against the other clients' scores, rewards or penalises the client's weight
(the RL-weighted aggregator), and picks blocks by weighted voting. Every
selection (one more block for each candidate network) is repeated over
several rounds of sampled clients, then the chosen blocks are stitched on,
and the search-space optimiser shrinks each network's pool.

What the paper leaves open and we chose (all are `Config` fields / flags):
* Rank: a client's choice b is ranked, for every other participant c',
  by the fraction of c''s other candidates that c' scores below b (ties
  count half): 1 = c' rates it best. A client's round rank is the mean over
  its choices and over the other participants (and over the candidate
  networks of the round). No other participant: no update.
* Weights: rank ≥ `threshold` (0.75) multiplies the weight by
  1 + `reward` (0.2), below it by 1 − `penalty` (0.2); then all N weights
  are renormalised to sum 1. Initial weights 1/N.
* Voting: each participant adds its (updated) weight to each block it
  chose; 'uniform' aggregation (the paper's FedAvg-style ablation) adds 1.
  Over a selection's rounds the votes add up; the `num_selections` blocks
  with most votes (ties: higher weighted mean CKA) extend each candidate
  network, and of all unfinished children the `num_selections` with the
  highest path score stay candidates (a beam). The path score is
  StitchNet's: the product of the chosen blocks' (weighted mean) CKA along
  the path; ties go to the larger product of vote shares.
* Start: every pool model's start block begins one candidate network.
* ε-greedy: with probability ε a client uploads k random candidates
  instead of its top k; ε is multiplied by `epsilon_decay` per depth.
* Search space: after a selection, for each pre-trained model, the
  candidate of that model with the highest weighted mean CKA over the
  selection's rounds is found and the model's shallower blocks leave the
  pool of the network's children.
* Stitch fit: the last round's participants upload XᵀX and XᵀY for each
  chosen block on their batch; the server adds them and solves once (see
  `projection`).
* Termination: a network is finished when it ends with an end block; from
  depth `max_depth` − 1 only end blocks are candidates; a network whose
  pool has no candidate left is dropped.

References:
  "Heterogeneity-Aware Coordination for Federated Learning via Stitching
  Pre-trained blocks" (FedStitch), 2024, §III–IV.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from typing import Any
from typing import Callable
from typing import NamedTuple
from typing import Sequence

import jax
import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.core import files
from fedjax_mr.energy import fleet as fleet_lib
from fedjax_mr.stitch import blocks as blocks_lib
from fedjax_mr.stitch import cka
from fedjax_mr.stitch import network as network_lib
from fedjax_mr.stitch import projection

AGGREGATIONS = ('rl', 'uniform')


class Config(NamedTuple):
  """FedStitch hyper-parameters (defaults: the paper's where it gives them).

  Attributes:
    clients_per_round: participants per round (paper: 10 of 100).
    batch_size: examples per client batch for scoring (paper: 64).
    top_k: blocks each client uploads (paper: 3).
    epsilon: exploration probability of a client's upload.
    epsilon_decay: ε is multiplied by this per depth.
    reward: weight factor 1 + reward for a well-ranked client.
    penalty: weight factor 1 − penalty for a badly ranked client.
    threshold: the rank at or above which a client is rewarded.
    aggregation: 'rl' (weighted) or 'uniform' (FedAvg-style ablation).
    num_selections: blocks chosen per candidate network and number of
      candidate networks kept (paper: 3).
    rounds_per_selection: rounds whose votes decide one selection
      (paper: 5).
    max_depth: most blocks in a network.
    prune: run the search-space optimiser.
    view: CKA view ('positions', 'flatten', 'gap').
    debiased: debiased CKA.
    spatial: stitch spatial policy ('match', 'fit_only').
    stitch_bias: affine stitches.
    solver: 'pinv' or 'ridge'.
    seed: seeds client sampling, batches and exploration.
  """

  clients_per_round: int = 10
  batch_size: int = 64
  top_k: int = 3
  epsilon: float = 0.1
  epsilon_decay: float = 1.0
  reward: float = 0.2
  penalty: float = 0.2
  threshold: float = 0.75
  aggregation: str = 'rl'
  num_selections: int = 3
  rounds_per_selection: int = 5
  max_depth: int = 8
  prune: bool = True
  view: str = 'positions'
  debiased: bool = False
  spatial: str = 'match'
  stitch_bias: bool = False
  solver: str = 'pinv'
  seed: int = 0


def check_config(config: Config, num_clients: int) -> None:
  """Raises ConfigError naming the flag of the first bad value."""
  checks = [
    (config.clients_per_round >= 1, '--clients_per_round must be ≥ 1'),
    (config.batch_size >= 2, '--batch_size must be ≥ 2'),
    (config.top_k >= 1, '--top_k must be ≥ 1'),
    (0 <= config.epsilon <= 1, '--epsilon must be in [0, 1]'),
    (0 < config.epsilon_decay <= 1, '--epsilon_decay must be in (0, 1]'),
    (config.reward >= 0, '--reward must be ≥ 0'),
    (0 <= config.penalty < 1, '--penalty must be in [0, 1)'),
    (0 <= config.threshold <= 1, '--threshold must be in [0, 1]'),
    (
      config.aggregation in AGGREGATIONS,
      f'--aggregation must be one of {", ".join(AGGREGATIONS)}',
    ),
    (config.num_selections >= 1, '--num_selections must be ≥ 1'),
    (config.rounds_per_selection >= 1, '--rounds_per_selection must be ≥ 1'),
    (config.max_depth >= 2, '--max_depth must be ≥ 2'),
    (config.view in cka.VIEWS, f'--view must be one of {", ".join(cka.VIEWS)}'),
    (
      config.spatial in projection.SPATIAL_POLICIES,
      f'--spatial must be one of {", ".join(projection.SPATIAL_POLICIES)}',
    ),
    (
      config.solver in projection.SOLVERS,
      f'--stitch_solver must be one of {", ".join(projection.SOLVERS)}',
    ),
    (num_clients >= 1, 'need at least one client'),
  ]
  for ok, message in checks:
    if not ok:
      raise errors.ConfigError(message)


class Pool(NamedTuple):
  """The block pool: every block of every pre-trained model.

  Attributes:
    blocks: all blocks; a block's position here is its pool id.
    models: model ids in order.
  """

  blocks: tuple[blocks_lib.Block, ...]
  models: tuple[str, ...]

  def ids_of(self, model: str) -> list[int]:
    return [i for i, b in enumerate(self.blocks) if b.model == model]

  def starts(self) -> list[int]:
    return [i for i, b in enumerate(self.blocks) if b.kind == 'start']


def make_pool(chains: Sequence[Sequence[blocks_lib.Block]]) -> Pool:
  """A pool from each pre-trained model's blocks (see `blocks.split`)."""
  models = [c[0].model for c in chains]
  if len(set(models)) != len(models):
    raise errors.ConfigError(f'pool model ids must be unique: {models}')
  specs = {tuple(c[0].in_spec) for c in chains}
  if len(specs) != 1:
    raise errors.ConfigError(
      f'pool models take different inputs {sorted(specs)}: all must take '
      "the dataset's examples"
    )
  return Pool(tuple(b for c in chains for b in c), tuple(models))


# --- Client step ------------------------------------------------------------


def compatible(
  pool: Pool, net: network_lib.Network, block_id: int, policy: str
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
  pool: Pool,
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
  pool: Pool, needed: Sequence[int], x: jax.Array
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


# --- Server step ------------------------------------------------------------


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
  pool: Pool, remaining: frozenset[int], scored: dict[int, float]
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


# --- The run ----------------------------------------------------------------


class _Live(NamedTuple):
  net: network_lib.Network
  remaining: frozenset[int]
  votes: np.ndarray  # [pool size] accumulated this selection
  score_sum: np.ndarray  # [pool size] weighted CKA sums
  score_weight: np.ndarray  # [pool size] their weights
  share: float  # product of the vote shares along the path
  path_score: float  # product of the chosen blocks' mean CKA (StitchNet)


class Finished(NamedTuple):
  """A finished stitched network and how it was found."""

  net: network_lib.Network
  round: int
  share: float
  path_score: float


class State(NamedTuple):
  """Everything a run needs to resume after `round` rounds."""

  round: int
  weights: np.ndarray
  live: tuple[_Live, ...]
  finished: tuple[Finished, ...]
  fit_ids: tuple[int, ...]
  log: tuple[dict, ...]


BatchFn = Callable[[int, int], jax.Array]


def init_state(pool: Pool, num_clients: int, starts=None) -> State:
  """Round 0: uniform weights, one candidate network per start block."""
  n = len(pool.blocks)
  start_ids = pool.starts() if starts is None else list(starts)
  live = tuple(
    _Live(
      network_lib.start(pool.blocks[i]),
      frozenset(range(n)),
      np.zeros(n),
      np.zeros(n),
      np.zeros(n),
      1.0,
      1.0,
    )
    for i in start_ids
  )
  return State(0, np.full(num_clients, 1.0 / num_clients), live, (), (), ())


def _fit_stitches(pool, net, block_ids, ids, round_, batch_fn, config):
  """Stitches from `net` to each of `block_ids`, fitted on the summed
  statistics of clients `ids` (one forward of `net` and of each pool model
  per client for all blocks)."""
  totals = {}
  for c in ids:
    x = batch_fn(c, round_)
    out = network_lib.apply(net, x)
    inputs = pool_inputs(pool, block_ids, x)
    for b in block_ids:
      s = projection.stats(
        out, inputs[b], bias=config.stitch_bias, policy=config.spatial
      )
      totals[b] = s if b not in totals else totals[b] + s
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


def run_round(
  pool: Pool,
  state: State,
  batch_fn: BatchFn,
  config: Config,
  *,
  population: Sequence[int],
  energy: fleet_lib.Fleet | None = None,
) -> State:
  """One round: sample clients, client step, server step; at the end of a
  selection, stitch and prune.

  Args:
    pool: the block pool.
    state: the state after `state.round` rounds.
    batch_fn: `(client id, round) → [B, ...]` model-ready batch.
    config: hyper-parameters.
    population: the client ids that can be sampled.
    energy: the clients' energy coordinators (open), or None. Each
      client's scoring runs under its coordinator's configuration as
      `batch size × candidates scored` work units; the round's record
      (`fleet.RoundEnergy.record`) goes to the log entry's 'energy'.
  """
  t_start = time.perf_counter()
  r = state.round
  rng = np.random.default_rng([config.seed, r])
  k = min(config.clients_per_round, len(population))
  ids = sorted(
    int(i) for i in rng.choice(np.asarray(population), k, replace=False)
  )
  depth = max(lv.net.depth for lv in state.live)
  epsilon = config.epsilon * config.epsilon_decay ** (depth - 1)
  cands = [
    candidates(pool, lv.net, lv.remaining, config.max_depth, config.spatial)
    for lv in state.live
  ]
  needed = sorted({i for c in cands for i in c})
  scores = [np.zeros((k, len(c))) for c in cands]
  choices = [[None] * k for _ in cands]
  client_time = []
  num_scored = sum(len(c) for c in cands)
  energy_round = None
  if energy is not None:
    energy_round = energy.start_round(
      [e['energy'] for e in state.log if 'energy' in e],
      depth=depth,
      pool_size=num_scored,
    )
  for p, c in enumerate(ids):
    crng = np.random.default_rng([config.seed, r, c, 1])
    x = batch_fn(c, r)
    with (
      energy_round.client(c, len(x) * num_scored)
      if energy_round is not None
      else contextlib.nullcontext()
    ):
      t0 = time.perf_counter()
      inputs = pool_inputs(pool, needed, x)
      for n, lv in enumerate(state.live):
        if not cands[n]:
          continue
        out = np.asarray(network_lib.apply(lv.net, x))
        scores[n][p] = score(
          out, inputs, cands[n], config.view, config.debiased
        )
        choices[n][p] = select(scores[n][p], config.top_k, epsilon, crng)
      client_time.append(time.perf_counter() - t0)

  # Server: cross-validated ranks → weights → votes.
  ranks = np.full(k, np.nan)
  per_net = [
    cross_validated_ranks(choices[n], scores[n])
    for n in range(len(cands))
    if cands[n]
  ]
  if per_net and k > 1:
    ranks = np.nanmean(np.stack(per_net), axis=0)
  weights = state.weights
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
    voter = np.ones(k)
  live = []
  for n, lv in enumerate(state.live):
    votes, ssum, swt = (
      lv.votes.copy(),
      lv.score_sum.copy(),
      lv.score_weight.copy(),
    )
    if cands[n]:
      idx = np.asarray(cands[n])
      votes[idx] += vote(voter, choices[n], len(idx))
      ssum[idx] += voter @ scores[n]
      swt[idx] += voter.sum()
    live.append(lv._replace(votes=votes, score_sum=ssum, score_weight=swt))

  entry = {
    'round': r,
    'clients': ids,
    'client_time_s': client_time,
    'depth': depth,
    'networks': [lv.net.describe() for lv in state.live],
    'pool_sizes': [len(c) for c in cands],
    'ranks': [None if np.isnan(x) else float(x) for x in ranks],
    'weights': _weight_summary(weights),
    'epsilon': epsilon,
  }
  if energy_round is not None:
    entry['energy'] = energy_round.record()
  state = state._replace(
    round=r + 1, weights=weights, live=tuple(live), fit_ids=tuple(ids)
  )
  if (r + 1) % config.rounds_per_selection == 0:
    state, chosen = _select(pool, state, cands, batch_fn, config)
    entry['selected'] = chosen
  # The whole round on this simulator: clients one after another, the
  # server's selection, stitching and pruning.
  entry['round_time_s'] = time.perf_counter() - t_start
  return state._replace(log=state.log + (entry,))


def _weight_summary(w: np.ndarray) -> dict[str, Any]:
  n = len(w)
  top = np.argsort(-w, kind='stable')[:5]
  entropy = float(-(w * np.log(np.maximum(w, 1e-300))).sum())
  return {
    'min': float(w.min() * n),
    'max': float(w.max() * n),
    'effective_clients': float(np.exp(entropy)),
    'top': [[int(i), float(w[i] * n)] for i in top],
  }


def _select(pool, state, cands, batch_fn, config):
  """End of a selection: vote winners → stitched children; prune; beam."""
  children, finished, chosen = [], list(state.finished), []
  last_round = state.round - 1
  for n, lv in enumerate(state.live):
    if not cands[n]:
      chosen.append({'network': lv.net.describe(), 'dropped': 'no candidates'})
      continue
    idx = np.asarray(cands[n])
    mean = lv.score_sum[idx] / np.maximum(lv.score_weight[idx], 1e-300)
    order = sorted(
      range(len(idx)), key=lambda j: (-lv.votes[idx[j]], -mean[j], idx[j])
    )
    winners = [j for j in order if lv.votes[idx[j]] > 0][
      : config.num_selections
    ]
    total = lv.votes[idx].sum()
    remaining = lv.remaining
    if config.prune:
      remaining = prune(pool, remaining, dict(zip(idx.tolist(), mean)))
    stitches = _fit_stitches(
      pool,
      lv.net,
      [int(idx[j]) for j in winners],
      state.fit_ids,
      last_round,
      batch_fn,
      config,
    )
    for j in winners:
      b = int(idx[j])
      block = pool.blocks[b]
      child = network_lib.extend(lv.net, stitches[b], block)
      share = float(lv.votes[b] / total) * lv.share
      path_score = float(mean[j]) * lv.path_score
      chosen.append(
        {
          'network': lv.net.describe(),
          'block': block.describe(),
          'votes': float(lv.votes[b]),
          'mean_cka': float(mean[j]),
          'share': share,
          'path_score': path_score,
        }
      )
      if child.finished:
        finished.append(Finished(child, state.round, share, path_score))
        continue
      n_pool = len(pool.blocks)
      children.append(
        _Live(
          child,
          frozenset(remaining - {b}),
          np.zeros(n_pool),
          np.zeros(n_pool),
          np.zeros(n_pool),
          share,
          path_score,
        )
      )
  children.sort(key=lambda c: (-c.path_score, -c.share))
  live = tuple(children[: config.num_selections])
  return state._replace(live=live, finished=tuple(finished)), chosen


def to_host(state: State) -> dict:
  """The state as plain Python and numpy (what `save_state` stores)."""

  def stitches(net):
    return [
      None
      if s is None
      else {
        'matrix': None if s.matrix is None else np.asarray(s.matrix),
        'bias': None if s.bias is None else np.asarray(s.bias),
        'pool': s.pool,
        'size': s.size,
      }
      for s in net.stitches
    ]

  return {
    'round': state.round,
    'weights': state.weights,
    'live': [
      {
        'path': list(lv.net.path),
        'stitches': stitches(lv.net),
        'remaining': sorted(lv.remaining),
        'votes': lv.votes,
        'score_sum': lv.score_sum,
        'score_weight': lv.score_weight,
        'share': lv.share,
        'path_score': lv.path_score,
      }
      for lv in state.live
    ],
    'finished': [
      {
        'path': list(f.net.path),
        'stitches': stitches(f.net),
        'round': f.round,
        'share': f.share,
        'path_score': f.path_score,
      }
      for f in state.finished
    ],
    'fit_ids': list(state.fit_ids),
    'log': list(state.log),
  }


def _net_from_host(pool: Pool, path, stitches) -> network_lib.Network:
  by_id = {b.id: b for b in pool.blocks}
  blocks = tuple(by_id[tuple(p)] for p in path)
  sts = tuple(
    None
    if s is None
    else projection.Stitch(
      None if s['matrix'] is None else jax.numpy.asarray(s['matrix']),
      None if s['bias'] is None else jax.numpy.asarray(s['bias']),
      s['pool'],
      None if s['size'] is None else tuple(s['size']),
    )
    for s in stitches
  )
  return network_lib.Network(blocks, sts)


def _from_host(pool: Pool, d: dict) -> State:
  live = tuple(
    _Live(
      _net_from_host(pool, lv['path'], lv['stitches']),
      frozenset(lv['remaining']),
      lv['votes'],
      lv['score_sum'],
      lv['score_weight'],
      lv['share'],
      lv['path_score'],
    )
    for lv in d['live']
  )
  finished = tuple(
    Finished(
      _net_from_host(pool, f['path'], f['stitches']),
      f['round'],
      f['share'],
      f['path_score'],
    )
    for f in d['finished']
  )
  return State(
    d['round'],
    d['weights'],
    live,
    finished,
    tuple(d['fit_ids']),
    tuple(d['log']),
  )


# The state file: one .npz whose entry `STATE_ENTRY` is a JSON document
# (format name and version, the run's identity, the state with each array
# replaced by a reference) and whose other entries are the arrays. Nothing
# is ever unpickled: numpy reads it with allow_pickle=False.
STATE_FORMAT = 'fedjax_mr.fedstitch.state'
STATE_VERSION = 1
STATE_ENTRY = '__document__'


class StateFileError(errors.UserError):
  """A state file that cannot be read, or that holds another run."""


def _encode(value: Any, arrays: dict[str, np.ndarray]) -> Any:
  """JSON-able form of plain Python / numpy data; arrays go to `arrays`."""
  if isinstance(value, (np.ndarray, jax.Array)):
    name = f'a{len(arrays)}'
    arrays[name] = np.asarray(value)
    return {'__array__': name}
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, dict):
    if not all(isinstance(k, str) for k in value):
      raise TypeError(f'state dict keys must be strings: {list(value)[:3]}')
    return {k: _encode(v, arrays) for k, v in value.items()}
  if isinstance(value, tuple):
    return {'__tuple__': [_encode(v, arrays) for v in value]}
  if isinstance(value, list):
    return [_encode(v, arrays) for v in value]
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  raise TypeError(f'cannot store {type(value).__name__} in a state file')


def _decode(value: Any, arrays: Any) -> Any:
  if isinstance(value, dict):
    if set(value) == {'__array__'}:
      return np.asarray(arrays[value['__array__']])
    if set(value) == {'__tuple__'}:
      return tuple(_decode(v, arrays) for v in value['__tuple__'])
    return {k: _decode(v, arrays) for k, v in value.items()}
  if isinstance(value, list):
    return [_decode(v, arrays) for v in value]
  return value


def write_document(path: str, payload: Any, identity: Any = None) -> None:
  """Writes `payload` (plain Python, numpy arrays, tuples) and the run's
  `identity` (JSON-able) as a versioned .npz, atomically (a temporary
  file, then a rename)."""
  arrays: dict[str, np.ndarray] = {}
  doc = {
    'format': STATE_FORMAT,
    'version': STATE_VERSION,
    'identity': identity,
    'payload': _encode(payload, arrays),
  }
  text = json.dumps(doc).encode('utf-8')
  arrays[STATE_ENTRY] = np.frombuffer(text, np.uint8)
  files.write_atomic(path, lambda f: np.savez(f, **arrays), binary=True)


def read_document(path: str) -> tuple[Any, Any]:
  """`(payload, identity)` of a file `write_document` wrote.

  Raises:
    StateFileError: not such a file (damaged, another format or version);
      the message names the file.
  """
  try:
    with open(path, 'rb') as f:
      data = f.read()
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
      arrays = {k: npz[k] for k in npz.files}
    if STATE_ENTRY not in arrays:
      raise StateFileError(f'{path} is not a FedStitch state file')
    doc = json.loads(arrays.pop(STATE_ENTRY).tobytes().decode('utf-8'))
  except StateFileError:
    raise
  except Exception as e:  # noqa: BLE001 (zip, numpy, JSON, unicode, ...)
    raise StateFileError(
      f'{path} is not a readable FedStitch state file '
      f'({type(e).__name__}: {" ".join(str(e).split())[:120]})'
    ) from None
  if not isinstance(doc, dict) or doc.get('format') != STATE_FORMAT:
    raise StateFileError(f'{path} is not a FedStitch state file')
  if doc.get('version') != STATE_VERSION:
    raise StateFileError(
      f'{path} has state format version {doc.get("version")!r}; this '
      f'version of fedjax_mr reads version {STATE_VERSION}'
    )
  try:
    return _decode(doc['payload'], arrays), doc.get('identity')
  except KeyError as e:
    raise StateFileError(f'{path} refers to a missing array {e}') from None


def save_state(path: str, state: State, identity: Any = None) -> None:
  """Writes the state and the run's identity (JSON-able, e.g. its flags)
  to `path` (see `write_document`)."""
  write_document(path, to_host(state), identity)


def load_state(path: str, pool: Pool, identity: Any = None) -> State:
  """The state `save_state` wrote.

  Raises:
    StateFileError: an unreadable file, or (with `identity`) a state saved
      by a run of another identity (the differing keys are named).
  """
  payload, saved = read_document(path)
  if identity is not None and saved != identity:
    if isinstance(saved, dict) and isinstance(identity, dict):
      keys = sorted(set(saved) | set(identity))
      diffs = [
        f'--{k}={saved.get(k)!r} there, {identity.get(k)!r} here'
        for k in keys
        if saved.get(k) != identity.get(k)
      ]
    else:
      diffs = ['another run']
    raise StateFileError(
      f'{path} holds a run of a different config ({"; ".join(diffs)}); '
      'pass another --workdir or the same flags'
    )
  try:
    return _from_host(pool, payload)
  except (KeyError, TypeError, ValueError) as e:
    raise StateFileError(
      f'{path} does not fit this pool ({type(e).__name__}: {e})'
    ) from None


def run(
  pool: Pool,
  batch_fn: BatchFn,
  num_clients: int,
  config: Config = Config(),
  *,
  population: Sequence[int] | None = None,
  starts: Sequence[int] | None = None,
  state_path: str | None = None,
  identity: Any = None,
  on_round: Callable[[State], None] | None = None,
  max_rounds: int = 1000,
  energy: fleet_lib.Fleet | None = None,
) -> State:
  """Runs FedStitch until no candidate network is left.

  Args:
    pool: the block pool.
    batch_fn: `(client id, round) → [B, ...]` model-ready batch of that
      client (the caller seeds it by both).
    num_clients: N (client weights are kept for all of them).
    config: hyper-parameters.
    population: the client ids that take part (default all; one id gives
      the "Local" baseline: a client stitching alone).
    starts: pool ids of the start blocks to begin from (default all).
    state_path: a file the state is saved to after every round and resumed
      from if present (`save_state`; never a pickle).
    identity: JSON-able description of the run (e.g. its flags), saved with
      the state; a state file of another identity is refused
      (`StateFileError`) instead of being resumed.
    on_round: called with the state after every round (logging).
    max_rounds: a safety bound.
    energy: the clients' local energy coordinators and devices (see
      `run_round`); opened for the run, so a sysfs backend's clocks are
      restored when `run` returns or raises. Their records are part of the
      log, so a resumed run continues them exactly.

  Returns:
    The final state; `state.finished` holds the stitched networks.
  """
  check_config(config, num_clients)
  population = (
    list(range(num_clients)) if population is None else list(population)
  )
  if state_path and os.path.exists(state_path):
    state = load_state(state_path, pool, identity)
  else:
    state = init_state(pool, num_clients, starts)
  with energy if energy is not None else contextlib.nullcontext():
    while state.live and state.round < max_rounds:
      state = run_round(
        pool, state, batch_fn, config, population=population, energy=energy
      )
      if state_path:
        save_state(state_path, state, identity)
      if on_round is not None:
        on_round(state)
  return state
