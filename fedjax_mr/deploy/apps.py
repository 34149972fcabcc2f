"""The Flower App: a `ServerApp` that runs `experiments.run`'s host loop
with the deployed round, and a `ClientApp` that serves its clients.

The federation's config travels by file: the run config names `spec`, a
folder holding the run's config.json (`adapter.write_config`), and each
SuperNode's node config names its own copy, its index and the number of
nodes. The server first asks every node which index it is (a `query`
message), then sends each round's requests (`train` messages) to the
node serving each client (`server.node_of`).
"""

from __future__ import annotations

import json
import time
import traceback
from typing import Any
from typing import Iterator
from typing import Sequence

from flwr.app import ConfigRecord
from flwr.app import Context
from flwr.app import Message
from flwr.app import RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp import ServerApp

from fedjax_mr.core import errors
from fedjax_mr.core import files
from fedjax_mr.deploy import adapter
from fedjax_mr.deploy import node as node_lib
from fedjax_mr.deploy import server as server_lib

QUERY, TRAIN = 'query', 'train'
POLL_S = 0.05
DISCOVERY_TIMEOUT_S = 300.0
REJOIN_TIMEOUT_S = 120.0

server_app = ServerApp()
client_app = ClientApp()


# The node.


def _node_of(context: Context) -> tuple[int, int, str]:
  config = context.node_config
  return int(config['node-index']), int(config['num-nodes']), config['spec']


def _state_folder(context: Context) -> str | None:
  """Where the node keeps its clients' state (its `state` config)."""
  folder = context.node_config.get('state')
  return str(folder) if folder else None


@client_app.query()
def answer_index(message: Message, context: Context) -> Message:
  """Replies this node's index."""
  index, num_nodes, _ = _node_of(context)
  content = RecordDict(
    {'node': ConfigRecord({'index': index, 'num-nodes': num_nodes})}
  )
  return Message(content, reply_to=message)


@client_app.train()
def train(message: Message, context: Context) -> Message:
  """Serves one client's request (`node.train`)."""
  index, num_nodes, spec = _node_of(context)
  experiment = adapter.setup(adapter.read_config(spec))
  reply = node_lib.train(
    experiment, message.content, index, num_nodes, _state_folder(context)
  )
  return Message(reply, reply_to=message)


# The server.


class GridTransport:
  """`server.Transport` over Flower's grid: requests as `train` messages
  to the nodes' ids, replies pulled as they arrive.

  A node that went offline fails its requests (Flower answers them with
  an error). A node that comes back with its registered key has its old
  id and simply gets the next round's requests; one that comes back with
  a new id (an insecure federation) is asked its index before a round
  whose nodes are not all online (`identify`).
  """

  def __init__(self, grid: Grid, node_ids: dict[int, int]):
    self.grid = grid
    self.node_ids = node_ids

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
    messages = [
      Message(r.content, dst_node_id=self.node_ids[r.node], message_type=TRAIN)
      for r in requests
    ]
    ids = list(self.grid.push_messages(messages))
    position = {m: r.position for m, r in zip(ids, requests)}
    deadline = None if timeout is None else time.monotonic() + timeout
    while position and (deadline is None or time.monotonic() < deadline):
      for reply in self.grid.pull_messages(list(position)):
        p = position.pop(reply.metadata.reply_to_message_id, None)
        if p is None:
          continue
        yield p, None if reply.has_error() else reply.content
      if position:
        time.sleep(POLL_S)
    for p in position.values():
      yield p, None


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


def _write_result(path: str, result: dict[str, Any]) -> None:
  files.write_atomic(path, lambda f: f.write(json.dumps(result)))


@server_app.main()
def main(grid: Grid, context: Context) -> None:
  """Runs the experiment of `spec` in `workdir` over the federation and
  writes `result` (`{"error": one line}` when it failed)."""
  run_config = context.run_config
  result_path = str(run_config['result'])
  try:
    config = adapter.read_config(str(run_config['spec']))
    num_nodes = int(run_config['num-nodes'])
    timeout = float(run_config['round-timeout']) or None
    nodes = discover(grid, num_nodes, DISCOVERY_TIMEOUT_S)
    transport = GridTransport(grid, nodes)

    def make_round(experiment, chunk):
      return server_lib.make_round(
        experiment, chunk, transport, num_nodes, timeout=timeout
      )

    adapter.train_and_evaluate(
      config, str(run_config['workdir']), make_round, log=print
    )
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
