"""The server side of a deployed FedStitch round: the participants' work
on their own nodes (`federated.Clients` over a `server.Transport`).

`DeployedClients` sends each participant's request to the node that
serves it (node i serves clients i, i + N, …; `stitch_node` answers) and
checks every reply against what it asked for and what the server knows
before anything reads it: the scores' and choices' shapes and dtypes,
finite values, CKA scores within CKA's bounds, choices that are distinct
positions of the candidates, the coordinator's figures of that client
within its device's profile (`check_energy`), statistics of the blocks
asked for over the rows of the client's batch with an XᵀX that is
symmetric positive semi-definite (`check_statistics`). A refused reply
is logged and its participant counted as failed, as one that did not
answer by the deadline: the round aggregates those that answered
(`federated.run_round` names the others in the log entry's
'failed_clients'), and the stitches are fitted on the statistics of
those that answered. Answers are taken in the sampled order, so the
scores, the energy records and the statistics' sums are the
simulation's.
"""

from __future__ import annotations

import json
import math
from typing import Any
from typing import Callable
from typing import NamedTuple
from typing import Sequence

import jax
import numpy as np

from fedjax_mr.deploy import codec
from fedjax_mr.deploy import server as server_lib
from fedjax_mr.deploy import stitch_node
from fedjax_mr.energy import profiles
from fedjax_mr.energy import simulation
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


# CKA's three sums of up to 4·10⁶ squares (D² for D ≤ 2048 channels) are
# float64 with a relative error of at most 4·10⁶·2⁻⁵³ ≈ 5·10⁻¹⁰ each, so
# a computed CKA leaves [0, 1] ([-1, 1] debiased) by less than 10⁻⁹;
# 10⁻⁶ is above that and far below any difference the votes rank.
CKA_SLACK = 1e-6
# A measured device's power (energy over time) may leave its profile's
# range, [min(idle, active powers), max active power], by this factor:
# the profile holds the workload's average powers, a meter's window also
# holds the ramp of the clocks and the rails' sampling error.
MEASURED_POWER_SLACK = 0.5


class EnergyModel(NamedTuple):
  """What the server knows of the clients' devices (`energy_model`): the
  model their nodes' coordinators run (`energy_report.make_fleet`).

  Attributes:
    devices: `[N]` each client's device (its profile and speed).
    seconds_per_unit: a work unit's time at configs[0], speed 1.
    measured: the nodes measure time and energy (sysfs, dry run); else
      they are the profile's model of the work (simulated).
  """

  devices: Sequence[simulation.SimClient]
  seconds_per_unit: float
  measured: bool


def energy_model(config: Any) -> EnergyModel:
  """The `EnergyModel` of a FedStitch run's config (`StitchConfig`): the
  devices `energy_mix` draws with the run's seed, or every node a device
  of `energy_profile`."""
  part, n = config.energy, config.partition.num_clients
  if part.backend == 'simulated':
    devices = simulation.assign_profiles(part.mix, n, config.run.seed)
  else:
    profile = profiles.get_profile(part.profile)
    devices = [simulation.SimClient(profile, 1.0, profile.name)] * n
  measured = part.backend != 'simulated'
  return EnergyModel(devices, part.ms_per_score / 1000, measured)


def _finite(value: Any, what: str, low: float = 0.0) -> float:
  """`value`, a number >= `low` (> 0 when `low` is None)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise codec.ReplyError(f'{what} is not a number')
  bad = value <= 0 if low is None else value < low
  if not math.isfinite(value) or bad:
    raise codec.ReplyError(f'{what} is {value}')
  return float(value)


def _energy_entry(work: Any, client: int, units: int) -> tuple[dict, float]:
  """The coordinator's figures of `client`'s work of `units` work units:
  time and energy positive (zero only for no work), the time scale
  positive."""
  entry = json.loads(str(work['energy']))
  if not isinstance(entry, dict) or entry.get('client') != client:
    raise codec.ReplyError(f'energy figures not of client {client}')
  if entry.get('units') != units:
    raise codec.ReplyError(f'energy units are not the {units} of the work')
  for key in ('time_s', 'energy_j', 'base_s'):
    _finite(entry.get(key), f'energy {key}', None if units else 0.0)
  _finite(entry.get('time_scale'), 'energy time_scale', None)
  return entry, _finite(work['p_idle'], 'p_idle')


def read_score(
  reply: Any,
  client: int,
  cands: list[list[int]],
  config: Any,
  energy: bool,
  model: EnergyModel | None = None,
) -> tuple[tuple[list, list, float], tuple[dict, float] | None]:
  """Client `client`'s `score` reply: `(client_scores' answer, (energy
  entry, idle power) or None)`, checked against `config` (the library
  config: `top_k`, `debiased`, `batch_size`) and, with energy, `model`
  (None: the figures are only checked to be positive).

  Raises:
    codec.ReplyError: what is wrong with it.
  """
  try:
    scores_t, choices_t = _scores_shape(cands, config.top_k)
    scores = codec.decode(reply['scores'], scores_t)
    choices = codec.decode(reply['choices'], choices_t)
    seconds = _finite(reply['work']['time_s'], 'time_s', None)
    units = config.batch_size * sum(len(c) for c in cands)
    measured = _energy_entry(reply['work'], client, units) if energy else None
  except (KeyError, TypeError, ValueError) as e:
    if isinstance(e, codec.ReplyError):
      raise
    raise codec.ReplyError(f'a malformed score reply: {e}') from None
  check_scores(scores, config.debiased)
  if measured is not None and model is not None:
    check_energy(model, client, units, *measured)
  for n, chosen in choices.items():
    k = len(cands[int(n)])
    if len(set(chosen.tolist())) != len(chosen) or not all(
      0 <= c < k for c in chosen
    ):
      raise codec.ReplyError(f'choices of network {n} are not positions')
  s = [scores.get(str(n)) for n in range(len(cands))]
  c = [choices.get(str(n)) for n in range(len(cands))]
  return (s, c, seconds), measured


def check_scores(scores: dict[str, np.ndarray], debiased: bool) -> None:
  """Refuses scores outside CKA's bounds: [0, 1], or [-1, 1] debiased (an
  inner product of U-centred matrices over their norms), up to
  `CKA_SLACK`.

  Raises:
    codec.ReplyError: the network whose scores are out of bounds.
  """
  low = -1.0 if debiased else 0.0
  for n, s in scores.items():
    if s.size and (s.min() < low - CKA_SLACK or s.max() > 1 + CKA_SLACK):
      raise codec.ReplyError(
        f'scores of network {n} leave [{low:g}, 1]: {s.min()}..{s.max()}'
      )


def check_energy(
  model: EnergyModel, client: int, units: int, entry: dict, p_idle: float
) -> None:
  """Refuses energy figures that client `client`'s device did not make:
  another device, configuration or idle power, a work time other than
  `units` work units give, a power outside the profile's range (the
  profile's model itself, exactly, on simulated devices), derived
  figures other than the profile derives.

  Raises:
    codec.ReplyError: which figure is wrong.
  """
  device = model.devices[client]
  profile = device.profile
  k = entry.get('config_index')
  if not isinstance(k, int) or not 0 <= k < len(profile.configs):
    raise codec.ReplyError(f'energy config_index {k!r} of no configuration')
  t, e = entry['time_s'], entry['energy_j']
  base = units * model.seconds_per_unit / device.speed
  fast = profile.fastest
  default_s = t * profile.speedup[k] / profile.speedup[fast]
  wrong = {
    'device': entry.get('device') != device.label,
    'config': entry.get('config') != profile.configs[k].name,
    'p_idle': p_idle != profile.p_idle_w,
    'base_s': entry['base_s'] != base,
    'default_time_s': entry.get('default_time_s') != default_s,
    'default_energy_j': entry.get('default_energy_j')
    != profile.p_active_w[fast] * default_s,
  }
  if model.measured:
    low = min(profile.p_idle_w, *profile.p_active_w)
    high = max(profile.p_active_w)
    slack = MEASURED_POWER_SLACK
    wrong['energy_j'] = not low * (1 - slack) <= e / t <= high * (1 + slack)
  else:
    # The simulated backend's figures: t = base / speedup_k, E = P_k t.
    wrong['time_s'] = t != base / profile.speedup[k]
    wrong['energy_j'] = e != profile.p_active_w[k] * t
  bad = [name for name, is_wrong in wrong.items() if is_wrong]
  if bad:
    raise codec.ReplyError(
      f'energy figures not of the device of client {client}: {bad[0]} '
      f'({profile.name}, configuration {k})'
    )


def check_statistics(b: int, s: projection.Stats, rows: int) -> None:
  """Refuses statistics of block `b` not over the `rows` rows of the
  client's batch, or whose XᵀX is not symmetric positive semi-definite.

  A Gram matrix of R rows summed in float64 errs entrywise by at most
  R·u·sqrt(g_ii g_jj) (u = 2⁻⁵³), so its asymmetry and its least
  eigenvalue stay within R·u·tr(G) of 0; its diagonal (sums of squares)
  is never negative.

  Raises:
    codec.ReplyError: which property fails.
  """
  if s.rows != rows:
    raise codec.ReplyError(
      f'statistics of block {b} over {s.rows} rows, the batch has {rows}'
    )
  g = s.g
  diagonal = np.diagonal(g)
  tol = rows * np.finfo(np.float64).eps / 2 * float(np.sum(diagonal))
  if diagonal.min(initial=0.0) < 0 or np.abs(g - g.T).max(initial=0.0) > tol:
    raise codec.ReplyError(f'XᵀX of block {b} is not symmetric PSD')
  if np.linalg.eigvalsh((g + g.T) / 2).min(initial=0.0) < -tol:
    raise codec.ReplyError(f'XᵀX of block {b} is not positive semi-definite')


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


def batch_rows(pool: pool_lib.Pool, block: int, batch_size: int) -> int:
  """The rows of the statistics of a stitch into `block` on a batch of
  `batch_size` examples: one per example and position of the block's
  input (`projection.stats`)."""
  return batch_size * math.prod(pool.blocks[block].in_spec[:-1])


def read_statistics(
  reply: Any, shape: dict[str, dict], rows: dict[str, int]
) -> dict[int, projection.Stats]:
  """A `statistics` reply, checked against `shape` (`statistics_shape`)
  and each block's `rows` (`batch_rows`; `check_statistics`).

  Raises:
    codec.ReplyError: what is wrong with it.
  """
  try:
    got = codec.decode(reply['stats'], shape)
  except (KeyError, TypeError) as e:
    raise codec.ReplyError(f'a malformed statistics reply: {e}') from None
  out = {}
  for b, s in got.items():
    stats = projection.Stats(s['g'], s['b'], int(s['rows']))
    check_statistics(int(b), stats, rows[b])
    out[int(b)] = stats
  return out


class DeployedClients:
  """`federated.Clients` whose participants work on their own nodes.

  Attributes:
    pool: the block pool (the nodes hold the same one).
    transport: how requests reach the nodes (`serverapp.GridTransport`).
    num_nodes: the federation's nodes.
    timeout: seconds a request waits for its reply (None: no deadline).
    log: where refused replies and failed clients are logged.
    energy: the clients' devices (`energy_model`) that the coordinators'
      figures are checked against; None: only checked to be positive.
  """

  def __init__(
    self,
    pool: pool_lib.Pool,
    transport: server_lib.Transport,
    num_nodes: int,
    *,
    timeout: float | None = None,
    log: Callable[[str], None] = print,
    energy: EnergyModel | None = None,
  ):
    self.pool = pool
    self.transport = transport
    self.num_nodes = num_nodes
    self.timeout = timeout
    self.log = log
    self.energy = energy

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
      return read_score(reply, c, cands, config, energy, self.energy)

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
    rows = {
      str(b): batch_rows(self.pool, b, config.batch_size) for b in block_ids
    }
    answers = self._exchange(
      list(ids),
      round_,
      lambda c: stitch_node.statistics_request(c, round_, net, block_ids),
      lambda reply, c: read_statistics(reply, shape, rows),
    )
    if not answers:
      raise federated.NoParticipantError(
        f'round {round_ + 1}: none of the clients {list(ids)} sent the '
        "statistics of the selection's stitches"
      )
    return federated.sum_statistics(
      block_ids, [answers[p] for p in sorted(answers)]
    )
