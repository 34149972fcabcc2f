"""The Flower App's `ServerApp`: `experiments.run`'s host loop with the
deployed round over Flower's grid, or `experiments.stitch`'s run with
its clients' work on the nodes (as the run's config says).

The run config names `spec`, a folder holding the run's config
(`adapter.write_config`, `adapter.write_stitch_config`), whose text goes
to the nodes in every message, and, in a federation with node
authentication, `node-ids`: the Flower node id of node 0, 1, … (their
registered keys' ids). Those ids are the slots for the whole run: node i
is that id and only that id; a node not named is never sent a message
and its answers are never read; a named node that is offline fails its
clients until it is back under its own key. Only an insecure federation
(no node keys, so no identity: anyone who reaches the SuperLink can join
and claim an index, as the launcher warns) leaves `node-ids` empty;
there the server asks every node which index it is (a `query` message,
`discover`) and believes the answer.

Each round sends one `train` message to each node that serves a sampled
client, holding the requests of all its clients (`node.pack`), and
splits its reply into the clients' replies.
The `ClientApp` is in `clientapp.py`.
"""

from __future__ import annotations

import json
import time
import traceback
from typing import Any
from typing import Callable
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
from fedjax_mr.deploy import secure_round
from fedjax_mr.deploy import server as server_lib
from fedjax_mr.deploy import stitch_server
from fedjax_mr.deploy.flower import commands

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

  The slot map `node_ids` is fixed: a node that went offline fails its
  requests (Flower answers them with an error; one line says so per
  outage) and, back with its registered key, has its old id and simply
  gets the next round's requests. Only with `insecure` (ids found by
  asking, `discover`) is an offline node's index given to a new online id
  that claims it (`identify`), since there no identity exists to bind.
  """

  def __init__(
    self,
    grid: Grid,
    node_ids: dict[int, int],
    config: str = '',
    kind: str = node_lib.TRAINING,
    *,
    insecure: bool = False,
    log: Callable[[str], None] = print,
  ):
    self.grid = grid
    self.node_ids = node_ids
    self.config = config
    self.kind = kind
    self.insecure = insecure
    self.log = log
    self.down: set[int] = set()  # Indices reported offline, not yet back.

  def refresh(self) -> set[int]:
    """The indices of the nodes offline now; in an insecure federation,
    first maps the indices of offline nodes to new online ids, if any."""
    online = set(self.grid.get_node_ids())
    known = set(self.node_ids.values())
    if self.insecure and online - known and known - online:
      found = identify(
        self.grid, len(self.node_ids), online - known, REJOIN_TIMEOUT_S
      )
      self.node_ids.update(found)
    return {i for i, n in self.node_ids.items() if n not in online}

  def _report(self, offline: set[int], asked: set[int]) -> None:
    """One line when a node with requests is offline, one when it is
    back."""
    for i in sorted(self.down - offline):
      self.log(f'node {i} (id {self.node_ids[i]}) is back online')
    for i in sorted((offline & asked) - self.down):
      self.log(
        f'node {i} (id {self.node_ids[i]}) is offline: its clients fail '
        'until it is back'
      )
    self.down = (self.down | (offline & asked)) & offline

  def exchange(
    self, requests: Sequence[server_lib.Request], timeout: float | None
  ) -> Iterator[tuple[int, Any]]:
    offline = self.refresh()
    by_node: dict[int, dict[int, Any]] = {}
    for r in requests:
      by_node.setdefault(r.node, {})[r.position] = r.content
    self._report(offline, set(by_node))
    nodes = sorted(by_node)
    messages = [
      Message(
        node_lib.pack(by_node[n], self.config, self.kind),
        dst_node_id=self.node_ids[n],
        message_type=TRAIN,
      )
      for n in nodes
    ]
    ids = list(self.grid.push_messages(messages))
    waiting = {
      m: (self.node_ids[n], list(by_node[n])) for m, n in zip(ids, nodes)
    }
    deadline = None if timeout is None else time.monotonic() + timeout
    while waiting and (deadline is None or time.monotonic() < deadline):
      for reply in self.grid.pull_messages(list(waiting)):
        sent = waiting.pop(reply.metadata.reply_to_message_id, None)
        if sent is None:
          continue
        yield from _split(reply, *sent)
      if waiting:
        time.sleep(POLL_S)
    for _, positions in waiting.values():
      for p in positions:
        yield p, None


def _split(
  reply: Message, node_id: int, positions: list[int]
) -> Iterator[tuple[int, Any]]:
  """`(position, the client's reply or None)` for each of `positions` in
  the reply of node `node_id` (all None when the node failed, the reply
  comes from another node or does not unpack)."""
  parts = {}
  if not reply.has_error() and reply.metadata.src_node_id == node_id:
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
  `num_nodes`. Their answers are believed: only for an insecure
  federation, where no node has an identity (`GridTransport`)."""
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
  message, which may take a while): an insecure federation's only way to
  know its nodes.

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


def connect(
  grid: Grid,
  run_config: Any,
  config: str = '',
  kind: str = node_lib.TRAINING,
) -> GridTransport:
  """The transport to the run's `num-nodes` nodes: node i is the i-th id
  of `node-ids` (comma separated; named in every federation with node
  authentication), for the whole run, once they are all online; or else,
  in an insecure federation, whichever node answers index i (`discover`).

  Raises:
    ValueError: `node-ids` does not name `num-nodes` ids.
  """
  num_nodes = int(run_config['num-nodes'])
  ids = str(run_config.get('node-ids', ''))
  if not ids:
    nodes = discover(grid, num_nodes, DISCOVERY_TIMEOUT_S)
    return GridTransport(grid, nodes, config, kind, insecure=True)
  nodes = {i: int(n) for i, n in enumerate(ids.split(','))}
  if len(nodes) != num_nodes:
    raise ValueError(f'node-ids names {len(nodes)} nodes, not {num_nodes}')
  wait_online(grid, nodes, DISCOVERY_TIMEOUT_S)
  return GridTransport(grid, nodes, config, kind)


def _write_result(path: str, result: dict[str, Any]) -> None:
  """Writes `result` to `path`, or, where it cannot be written (a full
  disk), prints it as a line the launcher reads from the run's stream."""
  try:
    files.write_atomic(path, lambda f: f.write(json.dumps(result)))
  except OSError:
    print(commands.result_line(result), flush=True)


def _run(grid: Grid, run_config: Any) -> None:
  """The run of the spec: a training run (`experiments.run`'s host loop
  with the deployed round) or a FedStitch run (`experiments.stitch`'s,
  its clients' work on the nodes: `stitch_server.DeployedClients`)."""
  kind, text = adapter.read_spec(str(run_config['spec']))
  config = adapter.config_from_text(kind, text)
  num_nodes = int(run_config['num-nodes'])
  timeout = float(run_config['round-timeout']) or None
  transport = connect(grid, run_config, text, kind)
  if kind == node_lib.STITCH:

    def deployed(setup):
      return stitch_server.DeployedClients(
        setup.pool,
        transport,
        num_nodes,
        timeout=timeout,
        log=print,
        energy=stitch_server.energy_model(setup.config),
      )

    adapter.stitch_and_evaluate(config, deployed, log=print)
    return

  def make_round(experiment, chunk):
    collect = None
    if experiment.config.privacy.secure.enabled:
      collect = secure_round.make_collect(experiment, transport, timeout)
    return server_lib.make_round(
      experiment, chunk, transport, num_nodes, timeout=timeout, collect=collect
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
