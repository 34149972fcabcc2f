"""The node side of a deployed round: one client's update, checked in and
out.

A request (`request_content`) holds the dispatch's shared part, the
client's row of its per-client part, the client's key and, as config, its
id, the round and the width and lane of its group. A node gets one message
a round holding the requests of all its clients of the round (`pack`: each
request's records under its position in the sampled order, plus the run's
config), and replies one message holding each client's reply under the
same position (`serve`).
The node rebuilds the run's experiment from its config
(the same `setup` as `experiments.run`: its data, partition, model and
algorithm), decodes the request against the algorithm's dispatch shapes,
runs `algorithm.client_update` jit-compiled on its own copy of the data,
in the program the simulated round runs the client in (alone, or in its
lane of a vmapped group of copies of it: `_update`), and replies the
`ClientOutput` (`train`). The server decodes the reply
against the output's shape (`read_reply`).

Per-client state (SCAFFOLD's control variate c_i) lives on the node that
serves the client, as in a real deployment: after round r it writes the
client's new state to `<state>/client<c>.round<r>.npz` (`np.savez`, read
back with `allow_pickle=False` and checked against the algorithm's state
shapes), and a request of round r reads the newest file of an earlier
round. So a server that resumes from the checkpoint of round R, after a
crash or a SIGKILL, and asks again for round R + 1 gets every node's
state of round R: files of rounds after it are never read, and are
overwritten as the rounds are trained again.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from typing import Any
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import ConfigRecord
from flwr.app import RecordDict

from fedjax_mr.core import files
from fedjax_mr.core import types
from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.deploy import adapter
from fedjax_mr.deploy import codec
from fedjax_mr.training import engine
from fedjax_mr.training import host_round


class RequestError(ValueError):
  """A request this node cannot serve (not its client, a malformed
  model); the message says which."""


def client_view(data: Any, client: int) -> Any:
  """What client `client`'s update reads: `data`, or for a training set
  kept on the host (`host_round.HostData`) the view of that client alone, as
  the engine's round gathers it (the same examples)."""
  if isinstance(data, host_round.HostData):
    return client_data_lib.gather_round(
      data.data, np.asarray([client]), data.capacity
    )
  return data


def _client_state_row(state: engine.RoundState) -> Any:
  if not engine.has_clients(state):
    return ()
  return jax.tree.map(lambda x: np.zeros(x.shape[1:], x.dtype), state.clients)


def _state_file(folder: str, client: int, r: int) -> str:
  return os.path.join(folder, f'client{client}.round{r}.npz')


def load_client_state(folder: str, client: int, r: int, template: Any) -> Any:
  """Client `client`'s state for round `r` (0-based): the newest file of
  a round before `r` in `folder`, else `template` (the initial state).

  Raises:
    RequestError: a file that does not hold `template`'s leaves.
  """
  pattern = re.compile(rf'client{client}\.round(\d+)\.npz')
  rounds = []
  if os.path.isdir(folder):
    for name in os.listdir(folder):
      found = pattern.fullmatch(name)
      if found and int(found.group(1)) < r:
        rounds.append(int(found.group(1)))
  if not rounds:
    return template
  path = _state_file(folder, client, max(rounds))
  leaves, treedef = jax.tree.flatten(template)
  with np.load(path, allow_pickle=False) as saved:
    values = [saved[f'arr_{i}'] for i in range(len(saved.files))]
  if len(values) != len(leaves) or any(
    v.shape != np.shape(t) or v.dtype != np.asarray(t).dtype
    for v, t in zip(values, leaves)
  ):
    raise RequestError(f'{path} does not hold the client state it should')
  return jax.tree.unflatten(treedef, values)


def save_client_state(folder: str, client: int, r: int, state: Any) -> None:
  """Writes client `client`'s state after round `r` (atomically) in
  `folder`, which is made its owner's alone (0700)."""
  os.makedirs(folder, mode=0o700, exist_ok=True)
  os.chmod(folder, 0o700)
  leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]
  files.write_atomic(
    _state_file(folder, client, r),
    lambda f: np.savez(f, *leaves),
    binary=True,
  )


def _initial_row(state: engine.RoundState) -> Any:
  """The initial per-client state (every row of `init_state`'s is it)."""
  return jax.tree.map(lambda x: np.array(x[0]), state.clients)


def output_shape(experiment: Any, sent: types.Dispatch, state: Any) -> Any:
  """The shape of one client's `ClientOutput` for dispatch `sent` (a tree
  of `jax.ShapeDtypeStruct`)."""
  row = jax.tree.map(lambda x: x[0], sent.per_client)
  out, _ = jax.eval_shape(
    experiment.algorithm.client_update,
    sent.shared,
    row,
    _client_state_row(state),
    client_view(experiment.data, 0),
    jnp.int32(0),
    jax.random.key(0),
  )
  return out


def request_content(
  sent: types.Dispatch,
  position: int,
  client: int,
  key: jax.Array,
  r: int,
  lane: tuple[int, int] = (0, 0),
) -> RecordDict:
  """Request k of a round: the shared part, row `position` of the
  per-client part, the client's key (its data), its id and round, and
  where the simulated round would train it (`fold.Layout.lane`: the
  width of its vmapped group and its place there, `(0, 0)` alone)."""
  row = jax.tree.map(lambda x: x[position], sent.per_client)
  width, place = lane
  return RecordDict(
    {
      'shared': codec.encode(sent.shared),
      'row': codec.encode(row),
      'key': codec.encode(jax.random.key_data(key)),
      'meta': ConfigRecord(
        {
          'client': int(client),
          'round': int(r),
          'width': int(width),
          'lane': int(place),
        }
      ),
    }
  )


def read_reply(reply: RecordDict, template: Any) -> types.ClientOutput:
  """The `ClientOutput` a reply holds, checked against `template`.

  Raises:
    codec.ReplyError: it holds no output, or not one of `template`'s
      tree, shapes and dtypes, or too large, or non-finite.
  """
  if not isinstance(reply, RecordDict) or 'output' not in reply:
    raise codec.ReplyError('reply holds no output record')
  return codec.decode(reply['output'], template)


def _dispatch_shape(experiment: Any) -> types.Dispatch:
  k = experiment.config.server.clients_per_round
  return jax.eval_shape(
    experiment.algorithm.dispatch,
    experiment.state.server,
    jnp.zeros((k,), jnp.int32),
    jnp.int32(0),
    jax.random.key(0),
  )


def train(
  experiment: Any,
  content: RecordDict,
  node: int,
  num_nodes: int,
  state_folder: str | None = None,
) -> RecordDict:
  """Serves one request on node `node` of `num_nodes`: decodes it against
  the algorithm's dispatch, runs the client's update and returns the
  reply (`client_output`, encoded).

  Raises:
    RequestError: see `output`.
  """
  return RecordDict(
    {
      'output': codec.encode(
        client_output(experiment, content, node, num_nodes, state_folder)
      )
    }
  )


def client_output(
  experiment: Any,
  content: RecordDict,
  node: int,
  num_nodes: int,
  state_folder: str | None = None,
) -> types.ClientOutput:
  """The `ClientOutput` of one request on node `node` of `num_nodes`
  (`train`). An algorithm's per-client state is read from and written to
  `state_folder` (see the module docstring).

  Raises:
    RequestError: the client is not this node's, or the request does not
      match the dispatch (its message names the part).
  """
  meta = content['meta']
  client, r = int(meta['client']), int(meta['round'])
  if not 0 <= client < len(experiment.client_sizes):
    raise RequestError(f'client {client} does not exist')
  if client % num_nodes != node:
    raise RequestError(f'client {client} is not served by node {node}')
  shape = _dispatch_shape(experiment)
  row_shape = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), shape.per_client
  )
  key_shape = jax.eval_shape(jax.random.key_data, jax.random.key(0))
  try:
    shared = codec.decode(content['shared'], shape.shared)
    row = codec.decode(content['row'], row_shape)
    key_data = codec.decode(content['key'], key_shape)
  except codec.ReplyError as e:
    raise RequestError(f'request of round {r + 1}: {e}') from None
  client_state = _client_state_row(experiment.state)
  if engine.has_clients(experiment.state):
    if state_folder is None:
      raise RequestError(
        'a node of an algorithm with client state needs a state folder'
      )
    client_state = load_client_state(
      state_folder, client, r, _initial_row(experiment.state)
    )
  width, lane = _lane(meta, experiment.config.server.clients_per_round)
  result, new_state = _update(experiment.algorithm.client_update, width)(
    shared,
    row,
    client_state,
    client_view(experiment.data, client),
    jnp.int32(client),
    jax.random.wrap_key_data(key_data),
  )
  if width:  # the client's lane of its group's outputs
    result, new_state = jax.tree.map(lambda x: x[lane], (result, new_state))
  if engine.has_clients(experiment.state):
    save_client_state(state_folder, client, r, new_state)
  return result


def _lane(meta: Any, clients_per_round: int) -> tuple[int, int]:
  """A request's `(width, lane)`: 0 <= width <= K, 0 <= lane < width
  (lane 0 where width is 0)."""
  width, lane = int(meta.get('width', 0)), int(meta.get('lane', 0))
  if not (0 <= width <= clients_per_round and 0 <= lane < max(width, 1)):
    raise RequestError(
      f'a request to train in lane {lane} of a group of {width} '
      f'(a round has {clients_per_round} clients)'
    )
  return width, lane


@functools.lru_cache(maxsize=8)
def _update(client_update: Any, width: int) -> Any:
  """`update(shared, row, state, data, client, key)`, jit-compiled: the
  client's update alone (`width` 0), or a vmapped group of `width`
  copies of it (outputs `[width, ...]`), the program the simulated round
  runs it in (`streaming.groups`): a vmapped program rounds its own way,
  and each lane's numbers depend on its own inputs only. (The lane is
  taken from the outputs after the program: a slice inside it could be
  moved into the training by XLA.)"""
  if width == 0:
    return jax.jit(client_update)

  def grouped(shared, row, state, data, client, key):
    def copies(x):
      return jnp.broadcast_to(x, (width, *jnp.shape(x)))

    rows, states, clients, keys = jax.tree.map(
      copies, (row, state, client, key)
    )
    out = jax.vmap(lambda p, s, c, k: client_update(shared, p, s, data, c, k))(
      rows, states, clients, keys
    )
    return out

  return jax.jit(grouped)


RUN = 'run'  # the record of a packed message that names the run
# The record that names a secure round's stage (`secure_node`).
SECURE_STAGE = 'secagg'
TRAINING, STITCH = adapter.TRAINING, adapter.STITCH  # the kinds of run


def pack(
  parts: Mapping[int, RecordDict], config: str = '', kind: str = TRAINING
) -> RecordDict:
  """One message's content holding `parts` (position -> a request's or a
  reply's records), each record keyed `<position>/<name>`, and, when
  `config` is given, the run: its config's text (`adapter.read_spec`: a
  node needs no file of the server's) and its `kind`."""
  content = RecordDict()
  if config:
    content[RUN] = ConfigRecord({'config': config, 'kind': kind})
  for position, part in parts.items():
    for name, record in part.items():
      content[f'{int(position)}/{name}'] = record
  return content


def unpack(content: RecordDict) -> dict[int, RecordDict]:
  """`pack`'s parts: position -> its records (a malformed key raises
  `RequestError`)."""
  parts: dict[int, RecordDict] = {}
  for key, record in content.items():
    if key == RUN:
      continue
    position, _, name = key.partition('/')
    if not position.isdigit() or not name:
      raise RequestError(f'a message record named {key!r}')
    parts.setdefault(int(position), RecordDict())[name] = record
  return parts


def run_folder(state_root: str | None, config: str) -> str | None:
  """The folder where a node keeps the client state of the run whose
  config text is `config` (one per run, so that runs on one federation
  never mix their states; the same for a run and its resumption)."""
  if not state_root:
    return None
  digest = hashlib.sha256(config.encode()).hexdigest()[:16]
  return os.path.join(state_root, f'run-{digest}')


def serve(
  experiment: Any,
  content: RecordDict,
  node: int,
  num_nodes: int,
  state_folder: str | None = None,
) -> RecordDict:
  """Serves a packed message (`pack`): each client's request with
  `train`, replied under its position.

  Raises:
    RequestError: a request this node cannot serve.
  """
  parts = unpack(content)
  if any(SECURE_STAGE in part for part in parts.values()):
    raise RequestError(
      'a secure aggregation stage in a run without secure aggregation'
    )
  return pack(
    {
      p: train(experiment, part, node, num_nodes, state_folder)
      for p, part in sorted(parts.items())
    }
  )


def run_of(content: RecordDict) -> tuple[str, str]:
  """The run a packed message names: its config's text and its kind.

  Raises:
    RequestError: none, or an unknown kind.
  """
  if RUN not in content or 'config' not in content[RUN]:
    raise RequestError('the message names no run')
  kind = str(content[RUN].get('kind', TRAINING))
  if kind not in (TRAINING, STITCH):
    raise RequestError(f'a run of unknown kind {kind!r}')
  return str(content[RUN]['config']), kind
