"""FedStitch federated block selection: the rounds and the run.

Clients score every remaining candidate block for the current stitched
network by linear CKA on one local batch and upload their top-k choices
(ε-greedy) and all scores (`client`). The server cross-validates each
client's choices against the other clients' scores, rewards or penalises
the client's weight (the RL-weighted aggregator), and picks blocks by
weighted voting (`server`). Every selection (one more block for each
candidate network) is repeated over several rounds of sampled clients,
then the chosen blocks are stitched on, and the search-space optimiser
shrinks each network's pool. `run` repeats `run_round` until no candidate
network is left, saving the state (`state`) after every round so that a
stopped run resumes exactly. The choices the paper leaves open are
`config.Config`'s fields.

References:
  "Heterogeneity-Aware Coordination for Federated Learning via Stitching
  Pre-trained blocks" (FedStitch), 2024, §III–IV.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any
from typing import Callable
from typing import NamedTuple
from typing import Protocol
from typing import Sequence

import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.energy import fleet as fleet_lib
from fedjax_mr.stitch import client
from fedjax_mr.stitch import config as config_lib
from fedjax_mr.stitch import network as network_lib
from fedjax_mr.stitch import pool as pool_lib
from fedjax_mr.stitch import projection
from fedjax_mr.stitch import server
from fedjax_mr.stitch import state as state_lib

BatchFn = server.BatchFn

# `run`'s safety bound on the rounds of a run.
MAX_ROUNDS = 1000


def sample_clients(
  config: config_lib.Config, round_: int, population: Sequence[int]
) -> list[int]:
  """The participants of round `round_`, sorted: `clients_per_round` (at
  most all) of `population`, drawn by `(seed, round)`."""
  rng = np.random.default_rng([config.seed, round_])
  k = min(config.clients_per_round, len(population))
  return sorted(
    int(i) for i in rng.choice(np.asarray(population), k, replace=False)
  )


class Scored(NamedTuple):
  """The participants' uploads of a round (`Clients.score`).

  Attributes:
    ids: the participants that answered, in sampled order.
    scores: per network, `[len(ids), len(cands[n])]` float64 CKA.
    choices: per network, per answering participant the positions it
      uploaded (None for a network without candidates).
    client_time: per answering participant, the seconds of its work.
    failed: the participants without an answer, in sampled order.
  """

  ids: list[int]
  scores: list[np.ndarray]
  choices: list[list[Any]]
  client_time: list[float]
  failed: list[int]


class NoParticipantError(errors.UserError):
  """No participant of a round answered: there is nothing to aggregate."""


class Clients(Protocol):
  """Where the participants' work runs: on this host, one after another
  (`LocalClients`, the simulation), or on the clients' own machines
  (`fedjax_mr.deploy`)."""

  def score(
    self,
    ids: list[int],
    nets: Sequence[network_lib.Network],
    cands: list[list[int]],
    round_: int,
    epsilon: float,
    config: config_lib.Config,
    energy_round: Any = None,
  ) -> Scored:
    """Participants `ids` score `cands` for `nets` on their batches of
    round `round_` (`client_scores`), each under its energy coordinator
    (`energy_round`, a `fleet.RoundEnergy`, or None)."""

  def statistics(
    self,
    net: network_lib.Network,
    block_ids: Sequence[int],
    ids: Sequence[int],
    round_: int,
    config: config_lib.Config,
  ) -> dict[int, projection.Stats]:
    """Per block, the statistics of the stitches from `net` to it summed
    over the participants `ids` that answer, in their order, on their
    batches of round `round_` (`client.stitch_statistics`).

    Raises:
      NoParticipantError: none of them answered.
    """


def client_scores(
  pool: pool_lib.Pool,
  nets: Sequence[network_lib.Network],
  cands: list[list[int]],
  x: Any,
  config: config_lib.Config,
  *,
  client_id: int,
  round_: int,
  epsilon: float,
  energy_round: Any = None,
) -> tuple[list[Any], list[Any], float]:
  """One participant's `client.client_step` on its batch `x`, under its
  energy coordinator (`energy_round`, or None) as `batch size × candidates
  scored` work units, its ε-greedy draws seeded by `(seed, round, client)`.

  Returns:
    `(scores, choices, seconds)`: `client_step`'s answer and its time.
  """
  crng = np.random.default_rng([config.seed, round_, client_id, 1])
  num_scored = sum(len(c) for c in cands)
  with (
    energy_round.client(client_id, len(x) * num_scored)
    if energy_round is not None
    else contextlib.nullcontext()
  ):
    t0 = time.perf_counter()
    s, chosen = client.client_step(
      pool, nets, cands, x, config, epsilon=epsilon, rng=crng
    )
    seconds = time.perf_counter() - t0
  return s, chosen, seconds


def collect(
  cands: list[list[int]],
  answers: Sequence[tuple[int, tuple[list[Any], list[Any], float]]],
  failed: Sequence[int] = (),
) -> Scored:
  """`Scored` from `(client, client_scores' answer)` of each answering
  participant, in sampled order."""
  k = len(answers)
  scores = [np.zeros((k, len(c))) for c in cands]
  choices = [[None] * k for _ in cands]
  for p, (_, (s, chosen, _)) in enumerate(answers):
    for n in range(len(cands)):
      if cands[n]:
        scores[n][p] = s[n]
        choices[n][p] = chosen[n]
  return Scored(
    [int(c) for c, _ in answers],
    scores,
    choices,
    [float(a[2]) for _, a in answers],
    [int(c) for c in failed],
  )


def sum_statistics(
  block_ids: Sequence[int],
  uploads: Sequence[dict[int, projection.Stats]],
) -> dict[int, projection.Stats]:
  """Per block, the participants' statistics added in their order."""
  totals = {}
  for stats in uploads:
    for b in block_ids:
      totals[b] = stats[b] if b not in totals else totals[b] + stats[b]
  return totals


class LocalClients:
  """Every participant's work on this host, one after another: the
  simulation's `Clients`.

  Attributes:
    pool: the block pool.
    batch_fn: `(client id, round) → [B, ...]` model-ready batch.
  """

  def __init__(self, pool: pool_lib.Pool, batch_fn: BatchFn):
    self.pool = pool
    self.batch_fn = batch_fn

  def score(self, ids, nets, cands, round_, epsilon, config, energy_round=None):
    answers = [
      (
        c,
        client_scores(
          self.pool,
          nets,
          cands,
          self.batch_fn(c, round_),
          config,
          client_id=c,
          round_=round_,
          epsilon=epsilon,
          energy_round=energy_round,
        ),
      )
      for c in ids
    ]
    return collect(cands, answers)

  def statistics(self, net, block_ids, ids, round_, config):
    return sum_statistics(
      block_ids,
      [
        client.stitch_statistics(
          self.pool, net, block_ids, self.batch_fn(c, round_), config
        )
        for c in ids
      ],
    )


def round_candidates(
  pool: pool_lib.Pool, state: state_lib.State, config: config_lib.Config
) -> list[list[int]]:
  """Per candidate network of `state`, the pool ids its participants
  score (`client.candidates`)."""
  return [
    client.candidates(
      pool, lv.net, lv.remaining, config.max_depth, config.spatial
    )
    for lv in state.live
  ]


def run_round(
  pool: pool_lib.Pool,
  state: state_lib.State,
  clients: Clients,
  config: config_lib.Config,
  *,
  population: Sequence[int],
  energy: fleet_lib.Fleet | None = None,
) -> state_lib.State:
  """One round: sample clients, client step, server step; at the end of a
  selection, stitch and prune.

  Args:
    pool: the block pool.
    state: the state after `state.round` rounds.
    clients: where the participants' work runs (`LocalClients`).
    config: hyper-parameters.
    population: the client ids that can be sampled.
    energy: the clients' energy coordinators (open), or None. Each
      client's scoring runs under its coordinator's configuration as
      `batch size × candidates scored` work units; the round's record
      (`fleet.RoundEnergy.record`) goes to the log entry's 'energy'.

  Participants that do not answer (a deployed client that failed) take
  no part: the entry's 'clients' answered, 'failed_clients' did not.

  Raises:
    NoParticipantError: none answered.
  """
  t_start = time.perf_counter()
  r = state.round
  ids = sample_clients(config, r, population)
  depth = max(lv.net.depth for lv in state.live)
  epsilon = config.epsilon * config.epsilon_decay ** (depth - 1)
  cands = round_candidates(pool, state, config)
  energy_round = None
  if energy is not None:
    energy_round = energy.start_round(
      [e['energy'] for e in state.log if 'energy' in e],
      depth=depth,
      pool_size=sum(len(c) for c in cands),
    )
  nets = [lv.net for lv in state.live]
  scored = clients.score(ids, nets, cands, r, epsilon, config, energy_round)
  if not scored.ids:
    raise NoParticipantError(
      f'round {r + 1}: none of the sampled clients {ids} answered'
    )
  ids = scored.ids
  ranks, weights, live = server.aggregate(
    state.weights, state.live, ids, cands, scored.scores, scored.choices, config
  )
  entry = {
    'round': r,
    'clients': ids,
    'client_time_s': scored.client_time,
    'depth': depth,
    'networks': [lv.net.describe() for lv in state.live],
    'pool_sizes': [len(c) for c in cands],
    'ranks': [None if np.isnan(x) else float(x) for x in ranks],
    'weights': _weight_summary(weights),
    'epsilon': epsilon,
  }
  if scored.failed:
    entry['failed_clients'] = scored.failed
  if energy_round is not None:
    entry['energy'] = energy_round.record()
  state = state._replace(
    round=r + 1, weights=weights, live=live, fit_ids=tuple(ids)
  )
  if (r + 1) % config.rounds_per_selection == 0:
    state, chosen = server.finish_selection(
      pool, state, cands, clients.statistics, config
    )
    entry['selected'] = chosen
  # The whole round: the clients' work (one after another on this
  # simulator), the server's selection, stitching and pruning.
  entry['round_time_s'] = time.perf_counter() - t_start
  return state._replace(log=state.log + (entry,))


def _weight_summary(w: np.ndarray) -> dict[str, Any]:
  """The clients' weights in a log entry: relative to 1/N (min, max, the
  five largest) and the effective number of clients (exp entropy)."""
  n = len(w)
  top = np.argsort(-w, kind='stable')[:5]
  entropy = float(-(w * np.log(np.maximum(w, 1e-300))).sum())
  return {
    'min': float(w.min() * n),
    'max': float(w.max() * n),
    'effective_clients': float(np.exp(entropy)),
    'top': [[int(i), float(w[i] * n)] for i in top],
  }


def round_limit(config: config_lib.Config, max_rounds: int = MAX_ROUNDS) -> int:
  """The most rounds `run` can take: (max_depth − 1) × rounds_per_selection,
  and at most `max_rounds`.

  Every candidate network starts as one start block, and each selection
  (`rounds_per_selection` rounds) extends it by exactly one block or drops
  it, so the networks of the s-th selection have depth s. From depth
  `max_depth` − 1 only end blocks are candidates: after the
  (max_depth − 1)-th selection every network is finished or dropped, and
  the run ends. It ends sooner when every network finishes (an end block
  chosen) or is dropped before.
  """
  return min((config.max_depth - 1) * config.rounds_per_selection, max_rounds)


def run(
  pool: pool_lib.Pool,
  batch_fn: BatchFn | None,
  num_clients: int,
  config: config_lib.Config = config_lib.Config(),
  *,
  population: Sequence[int] | None = None,
  starts: Sequence[int] | None = None,
  state_path: str | None = None,
  identity: Any = None,
  on_round: Callable[[state_lib.State], None] | None = None,
  max_rounds: int = MAX_ROUNDS,
  energy: fleet_lib.Fleet | None = None,
  clients: Clients | None = None,
) -> state_lib.State:
  """Runs FedStitch until no candidate network is left.

  Args:
    pool: the block pool.
    batch_fn: `(client id, round) → [B, ...]` model-ready batch of that
      client (the caller seeds it by both); None with `clients`.
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
    max_rounds: a safety bound (`round_limit` gives the most rounds a
      run can take).
    energy: the clients' local energy coordinators and devices (see
      `run_round`); opened for the run, so a sysfs backend's clocks are
      restored when `run` returns or raises. Their records are part of the
      log, so a resumed run continues them exactly.
    clients: where the participants' work runs (default: on this host,
      `LocalClients(pool, batch_fn)`).

  Returns:
    The final state; `state.finished` holds the stitched networks.
  """
  config_lib.check_config(config, num_clients)
  if clients is None:
    if batch_fn is None:
      raise ValueError('batch_fn is needed without clients')
    clients = LocalClients(pool, batch_fn)
  population = (
    list(range(num_clients)) if population is None else list(population)
  )
  if state_path and os.path.exists(state_path):
    state = state_lib.load_state(state_path, pool, identity)
  else:
    state = state_lib.init_state(pool, num_clients, starts)
  with energy if energy is not None else contextlib.nullcontext():
    while state.live and state.round < max_rounds:
      state = run_round(
        pool, state, clients, config, population=population, energy=energy
      )
      if state_path:
        state_lib.save_state(state_path, state, identity)
      if on_round is not None:
        on_round(state)
  return state
