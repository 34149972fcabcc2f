"""The node side of a deployed FedStitch round: a participant's uploads,
computed on the node's own data and block pool.

A node holds the pool and its clients' examples itself (the paper's
Jetsons hold the pre-trained blocks); it loads them from the run's config
with the same `load` as `experiments.stitch` (`adapter.stitch_node`).
Two requests, each made by the server (`score_request`,
`statistics_request`) and answered here (`answer`):

- `score`: the round's candidate networks (each as its blocks' pool ids
  and its stitches' arrays) and candidates; the node scores them on the
  client's batch of the round under the client's own energy coordinator
  (`federated.client_scores`; the round's deadline and the client's time
  scale come with the request, `fleet.RoundEnergy.terms`) and replies the
  scores, the uploaded choices, the work's seconds and the coordinator's
  figures;
- `statistics`: a network and the blocks chosen for it; the node replies
  the client's XᵀX and XᵀY of each stitch (`client.stitch_statistics`).

Networks travel as their blocks' ids (JSON) and their stitches' arrays (a
Flower array record, checked against the shapes the blocks give before
anything runs); the server checks each reply against what it asked for
(`stitch_server`).
"""

from __future__ import annotations

import json
from typing import Any
from typing import Sequence

import jax
import numpy as np
from flwr.app import ConfigRecord
from flwr.app import RecordDict

from fedjax_mr.deploy import codec
from fedjax_mr.deploy import node as node_lib
from fedjax_mr.energy import fleet as fleet_lib
from fedjax_mr.stitch import client as client_lib
from fedjax_mr.stitch import federated
from fedjax_mr.stitch import network as network_lib
from fedjax_mr.stitch import pool as pool_lib
from fedjax_mr.stitch import projection

SCORE, STATISTICS = 'score', 'statistics'
RequestError = node_lib.RequestError


def _stitch_shape(x_spec, y_spec, bias: bool) -> dict[str, Any]:
  """The arrays of a stitch from `x_spec` to `y_spec` (`make_stitch`)."""
  shape = {'matrix': jax.ShapeDtypeStruct((x_spec[-1], y_spec[-1]), np.float32)}
  if bias:
    shape['bias'] = jax.ShapeDtypeStruct((y_spec[-1],), np.float32)
  return shape


def _stitch_arrays(net: network_lib.Network) -> list[dict[str, Any]]:
  out = []
  for s in net.stitches[1:]:
    if s is None or s.matrix is None:
      raise ValueError(f'{net.describe()} has a stitch without a matrix')
    arrays = {'matrix': s.matrix}
    if s.bias is not None:
      arrays['bias'] = s.bias
    out.append(arrays)
  return out


def networks_content(nets: Sequence[network_lib.Network]) -> RecordDict:
  """`nets` as request records: their paths and their stitches."""
  return RecordDict(
    {
      'paths': ConfigRecord(
        {'paths': json.dumps([[list(b) for b in n.path] for n in nets])}
      ),
      'stitches': codec.encode([_stitch_arrays(n) for n in nets]),
    }
  )


def read_networks(
  content: RecordDict, pool: pool_lib.Pool, bias: bool, policy: str
) -> list[network_lib.Network]:
  """The networks `networks_content` wrote, rebuilt on this node's pool.

  Raises:
    RequestError: a block this pool does not hold, or stitches that are
      not the arrays the blocks give.
  """
  try:
    paths = json.loads(str(content['paths']['paths']))
    by_id = {b.id: b for b in pool.blocks}
    blocks = [[by_id[(str(m), int(i))] for m, i in path] for path in paths]
  except (KeyError, TypeError, ValueError) as e:
    raise RequestError(f'a network the pool does not hold: {e}') from None
  if any(not path for path in blocks):
    raise RequestError('an empty network')
  shape = [
    [_stitch_shape(a.out_spec, b.in_spec, bias) for a, b in zip(path, path[1:])]
    for path in blocks
  ]
  try:
    arrays = codec.decode(content['stitches'], shape)
  except (KeyError, codec.ReplyError) as e:
    raise RequestError(f'stitches: {e}') from None
  nets = []
  for path, stitches in zip(blocks, arrays):
    made = [None]
    for a, b, s in zip(path, path[1:], stitches):
      pool_, size = projection.layout(a.out_spec, b.in_spec, policy)
      made.append(
        projection.Stitch(
          jax.numpy.asarray(s['matrix']),
          None if 'bias' not in s else jax.numpy.asarray(s['bias']),
          pool_,
          size,
        )
      )
    nets.append(network_lib.Network(tuple(path), tuple(made)))
  return nets


def score_request(
  client: int,
  round_: int,
  nets: Sequence[network_lib.Network],
  cands: list[list[int]],
  epsilon: float,
  terms: dict[str, Any] | None,
) -> RecordDict:
  """Client `client`'s `score` request of round `round_` (0-based), with
  its coordinator's terms (`RoundEnergy.terms`; None: no coordinators)."""
  content = networks_content(nets)
  content['meta'] = ConfigRecord(
    {
      'op': SCORE,
      'client': int(client),
      'round': int(round_),
      'epsilon': float(epsilon),
      'cands': json.dumps(cands),
      'energy': json.dumps(terms),
    }
  )
  return content


def statistics_request(
  client: int,
  round_: int,
  net: network_lib.Network,
  block_ids: Sequence[int],
) -> RecordDict:
  """Client `client`'s `statistics` request for the stitches from `net`
  to `block_ids`, on its batch of round `round_`."""
  content = networks_content([net])
  content['meta'] = ConfigRecord(
    {
      'op': STATISTICS,
      'client': int(client),
      'round': int(round_),
      'blocks': json.dumps([int(b) for b in block_ids]),
    }
  )
  return content


def _ids(values: Any, pool: pool_lib.Pool, what: str) -> list[int]:
  """Pool ids from a request, each one the pool holds."""
  try:
    ids = [int(b) for b in values]
  except (TypeError, ValueError) as e:
    raise RequestError(f'{what}: {e}') from None
  if any(not 0 <= b < len(pool.blocks) for b in ids):
    raise RequestError(f'{what}: a block the pool does not hold')
  return ids


def _score(setup: Any, meta, nets, client: int, r: int) -> RecordDict:
  try:
    cands = [
      _ids(c, setup.pool, 'cands') for c in json.loads(str(meta['cands']))
    ]
    terms = json.loads(str(meta['energy']))
  except (TypeError, ValueError) as e:
    raise RequestError(f'a score request: {e}') from None
  if len(cands) != len(nets):
    raise RequestError('a score request: one candidate list per network')
  rnd = None
  if terms is not None:
    rnd = fleet_lib.RoundEnergy.for_client(setup.coordinators, client, terms)
  scores, choices, seconds = federated.client_scores(
    setup.pool,
    nets,
    cands,
    setup.batch_fn(client, r),
    setup.library_config,
    client_id=client,
    round_=r,
    epsilon=float(meta['epsilon']),
    energy_round=rnd,
  )
  live = [n for n, c in enumerate(cands) if c]
  work = {'time_s': float(seconds)}
  if rnd is not None:
    ((entry, p_idle),) = rnd.entries()
    work.update(energy=json.dumps(entry), p_idle=float(p_idle))
  return RecordDict(
    {
      'scores': codec.encode({str(n): scores[n] for n in live}),
      'choices': codec.encode(
        {str(n): np.asarray(choices[n], np.int64) for n in live}
      ),
      'work': ConfigRecord(work),
    }
  )


def _statistics(setup: Any, meta, nets, client: int, r: int) -> RecordDict:
  (net,) = nets
  try:
    blocks = _ids(json.loads(str(meta['blocks'])), setup.pool, 'blocks')
  except ValueError as e:
    raise RequestError(f'a statistics request: {e}') from None
  stats = client_lib.stitch_statistics(
    setup.pool, net, blocks, setup.batch_fn(client, r), setup.library_config
  )
  return RecordDict(
    {
      'stats': codec.encode(
        {
          str(b): {'g': s.g, 'b': s.b, 'rows': np.int64(s.rows)}
          for b, s in stats.items()
        }
      )
    }
  )


def answer(
  setup: Any, content: RecordDict, node: int, num_nodes: int
) -> RecordDict:
  """Answers one client's request on node `node` of `num_nodes`.

  Args:
    setup: the node's run (`adapter.StitchNode`): its pool, library
      config, clients' batches and coordinators, number of clients.
    content: the request (`score_request`, `statistics_request`).
    node: this node's index.
    num_nodes: the federation's nodes.

  Raises:
    RequestError: not this node's client, or a malformed request.
  """
  try:
    meta = content['meta']
    op, client, r = str(meta['op']), int(meta['client']), int(meta['round'])
  except (KeyError, TypeError, ValueError) as e:
    raise RequestError(f'a request without its meta record: {e}') from None
  if not 0 <= client < setup.num_clients:
    raise RequestError(f'client {client} does not exist')
  if client % num_nodes != node:
    raise RequestError(f'client {client} is not served by node {node}')
  config = setup.library_config
  nets = read_networks(content, setup.pool, config.stitch_bias, config.spatial)
  if op == SCORE:
    return _score(setup, meta, nets, client, r)
  if op == STATISTICS and len(nets) == 1:
    return _statistics(setup, meta, nets, client, r)
  raise RequestError(f'a request of kind {op!r} with {len(nets)} networks')


def serve(
  setup: Any, content: RecordDict, node: int, num_nodes: int
) -> RecordDict:
  """Serves a packed message (`node.pack`): each client's request with
  `answer`, replied under its position, its coordinators open for the
  message (a sysfs backend's clocks are restored when it is served)."""
  with setup.coordinators:
    return node_lib.pack(
      {
        p: answer(setup, part, node, num_nodes)
        for p, part in sorted(node_lib.unpack(content).items())
      }
    )
