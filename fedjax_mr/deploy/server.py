"""The server side of a deployed round: the engine's round with its
clients on other machines.

`make_round(experiment, chunk, transport)` returns `step(state, data,
key) -> (state, metrics)`, the round `experiments.run`'s host loop calls
(`adapter.train_and_evaluate`), computed with the algorithm's own pure
functions and the engine's keys, in the engine's order:

1. `engine.make_sample_fn`: the K ids; `engine.round_keys`: the dispatch,
   client and aggregation keys; `engine.client_keys`: client k's key;
2. `algorithm.dispatch`; request k holds the shared part, row k of the
   per-client part, the client's id and key and where the simulated
   round trains it (`fold.Layout.lane`: alone, or in lane l of a vmapped
   group of w), and goes to the node that serves the client (`node_of`);
3. each reply is decoded against the `ClientOutput` that the client's
   update returns (`codec.decode`: tree, shapes, dtypes, size, finite
   values) before anything reads it, and its weights against what the
   server knows (`check_weights`: the client's size, its steps); a
   refused reply is logged and its client counted as failed;
4. an algorithm with a `contribution` is summed by the engine's fold
   (`training/fold.py`), in the order the simulated round of the same
   config sums it on this machine: its devices (the experiment's mesh),
   their slots and groups of `chunk` clients. A reply waits until its
   group is complete; the server holds the devices' running sums and
   those replies, never K models. A failed client adds nothing (masked,
   as the engine's filling clients). Other algorithms (the FedMR family)
   need the K models: a failed client's slot holds the model it was sent,
   as if it trained zero steps on zero examples (so the round completes,
   and its loss and examples count for nothing);
5. `algorithm.aggregate` (`types.aggregate_stacked` for stacked
   outputs), then `engine.round_metrics`, plus `failed_clients` (ids, in
   sampled order) when any failed.
"""

from __future__ import annotations

import functools
from typing import Any
from typing import Callable
from typing import Iterator
from typing import NamedTuple
from typing import Protocol
from typing import Sequence

import jax
import numpy as np

from fedjax_mr.core import types
from fedjax_mr.deploy import codec
from fedjax_mr.deploy import node as node_lib
from fedjax_mr.training import engine
from fedjax_mr.training import fold
from fedjax_mr.training import host_round


class Request(NamedTuple):
  """One client's work of a round.

  Attributes:
    position: k, the client's place in the sampled order.
    client: its id.
    node: the index of the node that serves it.
    content: what is sent (`node.request_content`).
  """

  position: int
  client: int
  node: int
  content: Any


class Transport(Protocol):
  """How requests reach nodes and replies come back (Flower's grid in a
  deployment, a function in tests)."""

  def exchange(
    self, requests: Sequence[Request], timeout: float | None
  ) -> Iterator[tuple[int, Any]]:
    """Sends `requests`; yields `(position, reply)` as replies arrive, and
    `(position, None)` for each request without a reply after `timeout`
    seconds (None: no deadline) or whose node failed."""


class NoClientError(RuntimeError):
  """No client of a round replied: there is nothing to aggregate."""


def node_of(client: int, num_nodes: int) -> int:
  """The node that serves `client`: node i serves clients i, i + N, …"""
  return int(client) % num_nodes


class Weights(NamedTuple):
  """What the server knows of every client's reply weights
  (`weights_of`), as the engine's local training computes them
  (`client.train_steps`): client c reports n_c = `sizes[c]` examples and
  one pass of E epochs of ceil(n_c / b) steps; a FeDepth client makes
  one pass per block of layers it trains, a number the server does not
  hold: at most one per leaf of the model (a block trains at least one
  layer, a layer at least one leaf).

  Attributes:
    sizes: `[N]` every client's number of training examples (the
      partition is the server's).
    epochs: E, the local epochs.
    batch: b, the batch size no client exceeds: min(B, largest client).
    max_passes: the most local passes a client makes.
  """

  sizes: Sequence[int]
  epochs: int
  batch: int
  max_passes: int


# The algorithms whose clients train in several passes (`Weights`).
MULTI_PASS = ('fedepth',)


def weights_of(experiment: Any, template: Any) -> Weights:
  """The `Weights` of `experiment`'s clients; `template` is the shape of
  a client's output (`node.output_shape`)."""
  data = experiment.data
  if isinstance(data, host_round.HostData):
    data = data.data
  config = experiment.config
  passes = 1
  if config.algorithm.name in MULTI_PASS:
    passes = len(jax.tree.leaves(template.variables))
  return Weights(
    [int(n) for n in experiment.client_sizes],
    int(config.local.local_epochs),
    min(int(config.local.batch_size), int(data.max_size)),
    passes,
  )


def check_weights(
  weights: Weights, client: int, output: types.ClientOutput
) -> None:
  """Refuses a reply whose weights are not client `client`'s: its example
  count, its steps (a positive multiple of one pass's, at most
  `max_passes` of them) and its loss (a mean cross-entropy, >= 0).

  Raises:
    codec.ReplyError: which count is wrong, and what it should be.
  """
  n = weights.sizes[client]
  got = int(output.num_examples)
  if got != n:
    raise codec.ReplyError(f'num_examples is {got}, the client holds {n}')
  one_pass = weights.epochs * -(-n // weights.batch)
  steps = int(output.num_steps)
  if one_pass == 0:
    ok = steps == 0
  else:
    ok = steps % one_pass == 0 and 1 <= steps // one_pass <= weights.max_passes
  if not ok:
    raise codec.ReplyError(
      f'num_steps is {steps}, not a pass of {one_pass} steps '
      f'(at most {weights.max_passes} passes)'
    )
  if not float(output.loss) >= 0:
    raise codec.ReplyError(f'loss is {float(output.loss)}, below 0')


def _zeros_like(tree: Any) -> Any:
  return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), tree)


def _stack(outputs: list[Any]) -> Any:
  return jax.tree.map(
    lambda *xs: np.stack([np.asarray(x) for x in xs]), *outputs
  )


def make_round(
  experiment: Any,
  chunk: int,
  transport: Transport,
  num_nodes: int,
  *,
  timeout: float | None = None,
  log: Callable[[str], None] = print,
  collect: Callable | None = None,
) -> Callable:
  """The deployed round of `experiment` (see the module docstring);
  `chunk` is the simulation's `client_chunk` (with the experiment's mesh,
  the order of the sums). A secure run (`secure_aggregation`) takes its
  sum from `collect(requests, round, template, weights) -> (Sums, failed
  client ids)` (`secure_round.make_collect`) instead of the replies in
  the clear.

  Raises:
    ValueError: a secure run without `collect`.
  """
  if experiment.config.privacy.secure.enabled and collect is None:
    raise ValueError(
      'collect: the run aggregates securely; its sum comes from the '
      'secure protocol, never from the clients in the clear'
    )
  algorithm = experiment.algorithm
  summed = algorithm.contribution is not None
  jitted = _programs(experiment)

  def step(state, data, key):
    device_state = state.replace(clients=())
    round_data = host_round.round_data(data)
    ids = jitted.sample(device_state, round_data, key)
    _, k_dispatch, k_clients, k_aggregate = jitted.keys(key, state.round)
    sent = jitted.dispatch(state.server, ids, state.round, k_dispatch)
    client_keys = jitted.split(k_clients)
    at = [int(i) for i in np.asarray(jax.device_get(ids))]
    r = int(jax.device_get(state.round))
    template = node_lib.output_shape(experiment, sent, state)
    read = _reader(template, weights_of(experiment, template))
    sizes = round_data.sizes[ids]
    if summed:
      sums = fold.Fold(jitted.folds, template, sizes, chunk)
      layout = sums.layout
    else:
      layout = jitted.place(sizes, chunk, False)
    requests = [
      Request(
        p,
        c,
        node_of(c, num_nodes),
        node_lib.request_content(sent, p, c, client_keys[p], r, layout.lane(p)),
      )
      for p, c in enumerate(at)
    ]
    if collect is not None:
      weights = weights_of(experiment, template)
      outputs, failed = collect(requests, r, template, weights)
    elif summed:
      replies = _replies(transport, requests, read, timeout, log, r)
      outputs, failed = _collect_sums(replies, requests, r, sums)
    else:
      replies = _replies(transport, requests, read, timeout, log, r)
      stacked, failed = _collect(replies, requests, r)
      outputs = _stacked_outputs(algorithm, sent, stacked, template)
    server_state, server_metrics = jitted.aggregate(
      state.server, outputs, ids, state.round, k_aggregate
    )
    metrics = {**jitted.metrics(outputs, ids), **server_metrics}
    if failed:
      metrics['failed_clients'] = np.asarray(failed, np.int32)
    new_state = state.replace(round=state.round + 1, server=server_state)
    return new_state, metrics

  return step


class _Programs(NamedTuple):
  """A run's programs of the deployed round, compiled once a run."""

  sample: Callable
  dispatch: Callable
  keys: Callable
  split: Callable
  folds: Any  # the fold's programs (summing algorithms), else None
  place: Any  # the placer of the [K] stack (the others), else None
  aggregate: Callable
  metrics: Callable


def _programs(experiment: Any) -> _Programs:
  algorithm = experiment.algorithm
  k = experiment.config.server.clients_per_round
  summed = algorithm.contribution is not None
  return _Programs(
    jax.jit(engine.make_sample_fn(algorithm, k)),
    jax.jit(algorithm.dispatch),
    jax.jit(engine.round_keys),
    jax.jit(functools.partial(engine.client_keys, clients_per_round=k)),
    fold.programs(algorithm.contribution, experiment.mesh) if summed else None,
    None if summed else fold.placer(experiment.mesh),
    jax.jit(
      algorithm.aggregate
      if summed
      else functools.partial(types.aggregate_stacked, algorithm)
    ),
    jax.jit(engine.round_metrics),
  )


def _reader(template: Any, weights: Weights) -> Callable:
  """`read(reply, client) -> ClientOutput`: the reply decoded against
  `template` (`node.read_reply`) and its weights checked
  (`check_weights`); raises `codec.ReplyError`."""

  def read(reply: Any, client: int) -> types.ClientOutput:
    output = node_lib.read_reply(reply, template)
    check_weights(weights, client, output)
    return output

  return read


def _replies(
  transport: Transport,
  requests: Sequence[Request],
  read: Callable[[Any, int], types.ClientOutput],
  timeout: float | None,
  log: Callable[[str], None],
  round_index: int,
) -> Iterator[tuple[int, Any | None]]:
  """`(position, checked output or None)` as replies arrive: a reply
  `read` refuses is logged, one line naming the client and the check,
  and counts as a failed client's."""
  for position, reply in transport.exchange(requests, timeout):
    client = requests[position].client
    if reply is None:
      log(f'round {round_index + 1}: client {client} failed (no reply)')
      yield position, None
      continue
    try:
      yield position, read(reply, client)
    except codec.ReplyError as e:
      log(f'round {round_index + 1}: client {client} refused: {e}')
      yield position, None


def _collect_sums(
  replies, requests, round_index, sums: fold.Fold
) -> tuple[types.Sums, list[int]]:
  k = len(requests)
  scalars = {
    'num_examples': np.zeros(k, np.int32),
    'loss': np.zeros(k, np.float32),
    'num_steps': np.zeros(k, np.int32),
  }
  failed = []
  for position, output in replies:
    sums.put(position, output)
    if output is None:
      failed.append(position)
      continue
    for name in scalars:
      scalars[name][position] = np.asarray(getattr(output, name))
  if len(failed) == k:
    raise NoClientError(f'no client replied in round {round_index + 1}')
  return types.Sums(sums.total(), **scalars), [
    requests[p].client for p in sorted(failed)
  ]


def _collect(replies, requests, round_index) -> tuple[list[Any], list[int]]:
  outputs: list[Any] = [None] * len(requests)
  for position, output in replies:
    outputs[position] = output
  failed = [r.client for r, o in zip(requests, outputs) if o is None]
  if len(failed) == len(requests):
    raise NoClientError(f'no client replied in round {round_index + 1}')
  return outputs, failed


def _stacked_outputs(algorithm, sent, outputs, template) -> Any:
  """The K outputs stacked; a failed client's slot holds the model it was
  sent, zero examples, steps and loss, and zero extra uploads."""
  filled = []
  for p, output in enumerate(outputs):
    if output is None:
      row = jax.tree.map(lambda x: x[p], sent.per_client)
      model = (
        row
        if algorithm.client_model is None
        else algorithm.client_model(sent.shared, row)
      )
      zeros = _zeros_like(template)
      output = zeros._replace(
        variables=jax.tree.map(
          lambda m, z: np.asarray(m, z.dtype), model, zeros.variables
        )
      )
    filled.append(output)
  return _stack(filled)
