"""The Flower App's `ServerApp`: `experiments.run`'s host loop with the
deployed round over Flower's grid, or `experiments.stitch`'s run with
its clients' work on the nodes (as the run's config says).

The run config names `spec`, a folder holding the run's config
(`adapter.write_config`, `adapter.write_stitch_config`), whose text goes
to the nodes in every message, and, in a federation with node authentication,
`node-ids`: the Flower node id of node 0, 1, … (their registered keys'
ids), so the server only waits for them to be online. In an insecure
federation (ids unknown in advance) it first asks every node which index
it is (a `query` message). Each round sends one `train` message to each
node that serves a sampled client, holding the requests of all its
clients (`node.pack`), and splits its reply into the clients' replies.
The `ClientApp` is in `clientapp.py`.
"""

from __future__ import annotations

import json
import time
import traceback
from typing import Any
from typing import Iterator
from typing import Sequence

from flwr.app import Context
from flwr.app import Message
from flwr.app import RecordDict
from flwr.serverapp import Grid
from flwr.serverapp import ServerApp

from fedjax_mr.core import errors
from fedjax_mr.core import files
from fedjax_mr.deploy import adapter
from fedjax_mr.deploy import node as node_lib
from fedjax_mr.deploy import server as server_lib
from fedjax_mr.deploy import stitch_server

QUERY, TRAIN = 'query', 'train'
POLL_S = 0.05
DISCOVERY_TIMEOUT_S = 300.0
REJOIN_TIMEOUT_S = 120.0

server_app = ServerApp()


# The server.


class GridTransport:
  """`server.Transport` over Flower's grid: a round's requests as one
  `train` message per node (`node.pack`, with the run's config), replies
  pulled as they arrive and split into the clients' replies.

  A node that went offline fails its requests (Flower answers them with
  an error). A node that comes back with its registered key has its old
  id and simply gets the next round's requests; one that comes back with
  a new id (an insecure federation) is asked its index before a round
  whose nodes are not all online (`identify`).
  """

  def __init__(
    self,
    grid: Grid,
    node_ids: dict[int, int],
    config: str = '',
    kind: str = node_lib.TRAINING,
  ):
    self.grid = grid
    self.node_ids = node_ids
    self.config = config
    self.kind = kind

  def refresh(self) -> None:
    """Maps the indices of offline nodes to new online ids, if any."""
    online = set(self.grid.get_node_ids())
    known = set(self.node_ids.values())
    if online - known and known - online:
      found = identify(
        self.grid, len(self.node_ids), online - known, REJOIN_TIMEOUT_S
      )
      self.node_ids.update(found)

  def exchange(
    self, requests: Sequence[server_lib.Request], timeout: float | None
  ) -> Iterator[tuple[int, Any]]:
    self.refresh()
    by_node: dict[int, dict[int, Any]] = {}
    for r in requests:
      by_node.setdefault(r.node, {})[r.position] = r.content
    messages = [
      Message(
        node_lib.pack(parts, self.config, self.kind),
        dst_node_id=self.node_ids[n],
        message_type=TRAIN,
      )
      for n, parts in sorted(by_node.items())
    ]
    ids = list(self.grid.push_messages(messages))
    waiting = {
      m: list(parts) for m, (_, parts) in zip(ids, sorted(by_node.items()))
    }
    deadline = None if timeout is None else time.monotonic() + timeout
    while waiting and (deadline is None or time.monotonic() < deadline):
      for reply in self.grid.pull_messages(list(waiting)):
        positions = waiting.pop(reply.metadata.reply_to_message_id, None)
        if positions is None:
          continue
        yield from _split(reply, positions)
      if waiting:
        time.sleep(POLL_S)
    for positions in waiting.values():
      for p in positions:
        yield p, None


def _split(reply: Message, positions: list[int]) -> Iterator[tuple[int, Any]]:
  """`(position, the client's reply or None)` for each of `positions` in
  a node's reply (all None when the node failed or the reply does not
  unpack)."""
  parts = {}
  if not reply.has_error():
    try:
      parts = node_lib.unpack(reply.content)
    except node_lib.RequestError:
      parts = {}
  for p in positions:
    yield p, parts.get(p)


def identify(
  grid: Grid, num_nodes: int, node_ids: set[int], timeout: float
) -> dict[int, int]:
  """`{index: id}` of the nodes of `node_ids` that answer a `query`
  message within `timeout` seconds as nodes of a federation of
  `num_nodes`."""
  messages = [
    Message(RecordDict(), dst_node_id=n, message_type=QUERY)
    for n in sorted(node_ids)
  ]
  asked = dict(zip(grid.push_messages(messages), sorted(node_ids)))
  found: dict[int, int] = {}
  deadline = time.monotonic() + timeout
  while asked and time.monotonic() < deadline:
    for reply in grid.pull_messages(list(asked)):
      node_id = asked.pop(reply.metadata.reply_to_message_id, None)
      if node_id is None or reply.has_error():
        continue
      info = reply.content['node']
      if int(info['num-nodes']) == num_nodes:
        found[int(info['index'])] = node_id
    if asked:
      time.sleep(POLL_S)
  return found


def discover(grid: Grid, num_nodes: int, timeout: float) -> dict[int, int]:
  """`{node index: Flower node id}` of the `num_nodes` nodes, each asked
  its index (`identify`) as it comes online (a node starts a process per
  message, which may take a while).

  Raises:
    TimeoutError: not every index answered within `timeout` seconds.
  """
  found: dict[int, int] = {}
  deadline = time.monotonic() + timeout
  while len(found) < num_nodes:
    left = deadline - time.monotonic()
    if left <= 0:
      raise TimeoutError(
        f'{num_nodes - len(found)} of {num_nodes} nodes did not answer in '
        f'{timeout:.0f} s'
      )
    new = set(grid.get_node_ids()) - set(found.values())
    if new:
      found.update(identify(grid, num_nodes, new, left))
    else:
      time.sleep(0.25)
  return found


def wait_online(grid: Grid, node_ids: dict[int, int], timeout: float) -> None:
  """Returns once every node of `node_ids` is online.

  Raises:
    TimeoutError: not every one was within `timeout` seconds.
  """
  deadline = time.monotonic() + timeout
  while True:
    missing = set(node_ids.values()) - set(grid.get_node_ids())
    if not missing:
      return
    if time.monotonic() > deadline:
      raise TimeoutError(
        f'{len(missing)} of {len(node_ids)} nodes were not online in '
        f'{timeout:.0f} s'
      )
    time.sleep(0.25)


def _nodes(grid: Grid, ids: str, num_nodes: int) -> dict[int, int]:
  """`{index: id}`: from `ids` (node 0's id, node 1's, …, comma
  separated) once they are online, or else asked (`discover`)."""
  if not ids:
    return discover(grid, num_nodes, DISCOVERY_TIMEOUT_S)
  found = {i: int(n) for i, n in enumerate(ids.split(','))}
  if len(found) != num_nodes:
    raise ValueError(f'node-ids names {len(found)} nodes, not {num_nodes}')
  wait_online(grid, found, DISCOVERY_TIMEOUT_S)
  return found


def _write_result(path: str, result: dict[str, Any]) -> None:
  files.write_atomic(path, lambda f: f.write(json.dumps(result)))


def _run(grid: Grid, run_config: Any) -> None:
  """The run of the spec: a training run (`experiments.run`'s host loop
  with the deployed round) or a FedStitch run (`experiments.stitch`'s,
  its clients' work on the nodes: `stitch_server.DeployedClients`)."""
  kind, text = adapter.read_spec(str(run_config['spec']))
  config = adapter.config_from_text(kind, text)
  num_nodes = int(run_config['num-nodes'])
  timeout = float(run_config['round-timeout']) or None
  nodes = _nodes(grid, str(run_config.get('node-ids', '')), num_nodes)
  transport = GridTransport(grid, nodes, text, kind)
  if kind == node_lib.STITCH:

    def deployed(setup):
      return stitch_server.DeployedClients(
        setup.pool, transport, num_nodes, timeout=timeout, log=print
      )

    adapter.stitch_and_evaluate(config, deployed, log=print)
    return

  def make_round(experiment, chunk):
    return server_lib.make_round(
      experiment, chunk, transport, num_nodes, timeout=timeout
    )

  adapter.train_and_evaluate(
    config, str(run_config['workdir']), make_round, log=print
  )


@server_app.main()
def main(grid: Grid, context: Context) -> None:
  """Runs the experiment of `spec` (a training or a FedStitch run, as
  its config says) in `workdir` over the federation and writes `result`
  (`{"error": one line}` when it failed)."""
  run_config = context.run_config
  result_path = str(run_config['result'])
  try:
    _run(grid, run_config)
  except (errors.UserError, errors.NonFiniteError, TimeoutError) as e:
    _write_result(result_path, {'error': str(e)})
    return
  except server_lib.NoClientError as e:
    _write_result(result_path, {'error': str(e)})
    return
  except BaseException as e:
    last = traceback.format_exception_only(type(e), e)[-1].strip()
    _write_result(result_path, {'error': f'the server failed: {last}'})
    raise
  _write_result(result_path, {'ok': True})
