"""The server side of a deployed FedStitch round: the participants' work
on their own nodes (`federated.Clients` over a `server.Transport`).

`DeployedClients` sends each participant's request to the node that
serves it (node i serves clients i, i + N, …; `stitch_node` answers) and
checks every reply against what it asked for before anything reads it:
the scores' and choices' shapes and dtypes, finite values, choices that
are distinct positions of the candidates, the coordinator's figures of
that client, statistics of the blocks asked for with finite values. A
refused reply is logged and its participant counted as failed, as one
that did not answer by the deadline: the round aggregates those that
answered (`federated.run_round` names the others in the log entry's
'failed_clients'), and the stitches are fitted on the statistics of those
that answered. Answers are taken in the sampled order, so the scores, the
energy records and the statistics' sums are the simulation's.
"""

from __future__ import annotations

import json
import math
from typing import Any
from typing import Callable
from typing import Sequence

import jax
import numpy as np

from fedjax_mr.deploy import codec
from fedjax_mr.deploy import server as server_lib
from fedjax_mr.deploy import stitch_node
from fedjax_mr.stitch import federated
from fedjax_mr.stitch import network as network_lib
from fedjax_mr.stitch import pool as pool_lib
from fedjax_mr.stitch import projection


def _scores_shape(cands: list[list[int]], top_k: int) -> tuple[dict, dict]:
  live = [n for n, c in enumerate(cands) if c]
  scores = {
    str(n): jax.ShapeDtypeStruct((len(cands[n]),), np.float64) for n in live
  }
  choices = {
    str(n): jax.ShapeDtypeStruct((min(top_k, len(cands[n])),), np.int64)
    for n in live
  }
  return scores, choices


def _finite(value: Any, what: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise codec.ReplyError(f'{what} is not a number')
  if not math.isfinite(value) or value < 0:
    raise codec.ReplyError(f'{what} is {value}')
  return float(value)


def read_score(
  reply: Any, client: int, cands: list[list[int]], top_k: int, energy: bool
) -> tuple[tuple[list, list, float], tuple[dict, float] | None]:
  """Client `client`'s `score` reply: `(client_scores' answer, (energy
  entry, idle power) or None)`, checked.

  Raises:
    codec.ReplyError: what is wrong with it.
  """
  try:
    scores_t, choices_t = _scores_shape(cands, top_k)
    scores = codec.decode(reply['scores'], scores_t)
    choices = codec.decode(reply['choices'], choices_t)
    work = reply['work']
    seconds = _finite(work['time_s'], 'time_s')
    measured = None
    if energy:
      entry = json.loads(str(work['energy']))
      if not isinstance(entry, dict) or entry.get('client') != client:
        raise codec.ReplyError(f'energy figures not of client {client}')
      for key in ('time_s', 'energy_j', 'time_scale', 'base_s'):
        _finite(entry.get(key), f'energy {key}')
      measured = entry, _finite(work['p_idle'], 'p_idle')
  except (KeyError, TypeError, ValueError) as e:
    if isinstance(e, codec.ReplyError):
      raise
    raise codec.ReplyError(f'a malformed score reply: {e}') from None
  for n, chosen in choices.items():
    k = len(cands[int(n)])
    if len(set(chosen.tolist())) != len(chosen) or not all(
      0 <= c < k for c in chosen
    ):
      raise codec.ReplyError(f'choices of network {n} are not positions')
  s = [scores.get(str(n)) for n in range(len(cands))]
  c = [choices.get(str(n)) for n in range(len(cands))]
  return (s, c, seconds), measured


def statistics_shape(
  pool: pool_lib.Pool,
  net: network_lib.Network,
  block_ids: Sequence[int],
  bias: bool,
) -> dict[str, dict]:
  """The shape of a `statistics` reply (`client.stitch_statistics`): per
  block XᵀX `[D, D]` and XᵀY `[D, C_Y]` float64 and the rows, D being the
  network's output channels (plus one with a bias)."""
  d = net.out_spec[-1] + (1 if bias else 0)
  return {
    str(b): {
      'g': jax.ShapeDtypeStruct((d, d), np.float64),
      'b': jax.ShapeDtypeStruct((d, pool.blocks[b].in_spec[-1]), np.float64),
      'rows': jax.ShapeDtypeStruct((), np.int64),
    }
    for b in block_ids
  }


def read_statistics(
  reply: Any, shape: dict[str, dict]
) -> dict[int, projection.Stats]:
  """A `statistics` reply, checked against `shape` (`statistics_shape`).

  Raises:
    codec.ReplyError: what is wrong with it.
  """
  try:
    got = codec.decode(reply['stats'], shape)
  except (KeyError, TypeError) as e:
    raise codec.ReplyError(f'a malformed statistics reply: {e}') from None
  out = {}
  for b, s in got.items():
    if int(s['rows']) <= 0:
      raise codec.ReplyError(f'statistics of block {b} over no rows')
    out[int(b)] = projection.Stats(s['g'], s['b'], int(s['rows']))
  return out


class DeployedClients:
  """`federated.Clients` whose participants work on their own nodes.

  Attributes:
    pool: the block pool (the nodes hold the same one).
    transport: how requests reach the nodes (`serverapp.GridTransport`).
    num_nodes: the federation's nodes.
    timeout: seconds a request waits for its reply (None: no deadline).
    log: where refused replies and failed clients are logged.
  """

  def __init__(
    self,
    pool: pool_lib.Pool,
    transport: server_lib.Transport,
    num_nodes: int,
    *,
    timeout: float | None = None,
    log: Callable[[str], None] = print,
  ):
    self.pool = pool
    self.transport = transport
    self.num_nodes = num_nodes
    self.timeout = timeout
    self.log = log

  def _exchange(self, ids, round_, make, read) -> dict[int, Any]:
    """`{position: read(reply, client)}` of the participants that answered
    with a reply `read` accepts (the others are logged)."""
    requests = [
      server_lib.Request(p, c, server_lib.node_of(c, self.num_nodes), make(c))
      for p, c in enumerate(ids)
    ]
    answers = {}
    for p, reply in self.transport.exchange(requests, self.timeout):
      c = ids[p]
      if reply is None:
        self.log(f'round {round_ + 1}: client {c} failed (no reply)')
        continue
      try:
        answers[p] = read(reply, c)
      except codec.ReplyError as e:
        self.log(f'round {round_ + 1}: client {c} refused: {e}')
    return answers

  def score(self, ids, nets, cands, round_, epsilon, config, energy_round=None):
    energy = energy_round is not None

    def make(c):
      terms = energy_round.terms(c) if energy else None
      return stitch_node.score_request(c, round_, nets, cands, epsilon, terms)

    def read(reply, c):
      return read_score(reply, c, cands, config.top_k, energy)

    answers = self._exchange(ids, round_, make, read)
    done = sorted(answers)
    if energy:
      for p in done:
        energy_round.add(*answers[p][1])
    return federated.collect(
      cands,
      [(ids[p], answers[p][0]) for p in done],
      [c for p, c in enumerate(ids) if p not in answers],
    )

  def statistics(self, net, block_ids, ids, round_, config):
    shape = statistics_shape(self.pool, net, block_ids, config.stitch_bias)
    answers = self._exchange(
      list(ids),
      round_,
      lambda c: stitch_node.statistics_request(c, round_, net, block_ids),
      lambda reply, c: read_statistics(reply, shape),
    )
    if not answers:
      raise federated.NoParticipantError(
        f'round {round_ + 1}: none of the clients {list(ids)} sent the '
        "statistics of the selection's stitches"
      )
    return federated.sum_statistics(
      block_ids, [answers[p] for p in sorted(answers)]
    )
