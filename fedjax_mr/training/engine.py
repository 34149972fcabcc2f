"""The federated round as one pure, jit-compatible function.

`make_round_fn` closes over an algorithm and the static counts, and
returns `round_fn(state, data, key)`. The experiment jit-compiles it once
(donating `state`) and calls it every round; the round index lives in the
state, so resuming needs no saved RNG state.
"""

from __future__ import annotations

import functools
from typing import Any
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.core import types
from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.training import placement
from fedjax_mr.training import sampling
from fedjax_mr.training import streaming


@flax.struct.dataclass
class RoundState:
  """Everything a run carries from one round to the next.

  Attributes:
    round: int32 scalar, number of rounds completed.
    server: the algorithm's server state (exposes `.params`).
    clients: the algorithm's per-client persistent state, leaves `[N, ...]`
      (`()` for algorithms that keep none).
  """

  round: jax.Array
  server: Any
  clients: Any = ()


def init_state(
  algorithm: types.Algorithm,
  variables: types.Variables,
  num_clients: int | None = None,
  *,
  host_clients: bool = False,
) -> RoundState:
  """The state before round 0, from the initial model variables.

  The state is copied leaf by leaf: the round donates the state, and a
  state that holds one array twice (or the caller's own `variables`) would
  otherwise donate one buffer twice.

  Args:
    algorithm: the algorithm.
    variables: the initial model.
    num_clients: N; required when the algorithm keeps per-client state.
    host_clients: keep the per-client state in host memory, for
      `host_round.make_host_round`, instead of on the default device: read-only
      numpy views of the one initial row, which take no memory until
      `to_host_clients` (or the first round) writes them out, so a run
      that resumes never holds the initial state beside the restored one.
  """
  clients = ()
  if algorithm.init_client_state is not None:
    if num_clients is None or num_clients < 1:
      raise ValueError(
        'num_clients must be given (>= 1) for an algorithm with per-client '
        f'state, got {num_clients}'
      )
    one = jax.device_get(algorithm.init_client_state(variables))
    clients = jax.tree.map(
      lambda x: np.broadcast_to(x, (num_clients, *np.shape(x))), one
    )
  state = RoundState(
    round=jnp.zeros((), jnp.int32),
    server=algorithm.init(variables),
    clients=(),
  )
  state = jax.tree.map(lambda x: jnp.array(x, copy=True), state)
  if not host_clients:
    clients = jax.tree.map(lambda x: jnp.array(x, copy=True), clients)
  return state.replace(clients=clients)


def has_clients(state: RoundState) -> bool:
  """Whether `state` holds per-client state."""
  return bool(jax.tree.leaves(state.clients))


def to_host_clients(state: RoundState) -> RoundState:
  """`state` with its per-client state as writable numpy arrays (copied
  from the devices where it is not numpy already), in C order.

  C order: a copy of `init_state`'s broadcast views in numpy's default
  order ('K') would put the client axis, of stride 0, innermost; each of a
  round's K rows would then be scattered over the whole array, and the
  checkpoint's digest (and orbax's write) would copy the array to read it
  in C order (10^6 SCAFFOLD controls: +2.4 GB each).
  """
  return state.replace(
    clients=jax.tree.map(
      lambda x: x if _writable(x) else np.array(x, copy=True, order='C'),
      state.clients,
    )
  )


def _writable(x: Any) -> bool:
  return isinstance(x, np.ndarray) and x.flags.writeable


def round_keys(key: jax.Array, round_index: jax.Array) -> jax.Array:
  """`[4]` keys of a round: sampling, dispatch, clients, aggregation."""
  return jax.random.split(jax.random.fold_in(key, round_index), 4)


def client_keys(k_clients: jax.Array, clients_per_round: int) -> jax.Array:
  """`[K]` keys of a round's clients from its clients' key (`round_keys`'
  third): client k's is row k, wherever it runs."""
  return jax.random.split(k_clients, clients_per_round)


def next_dispatch(
  algorithm: types.Algorithm,
  state: RoundState,
  data: client_data_lib.ClientData,
  key: jax.Array,
  clients_per_round: int,
) -> types.Dispatch:
  """Exactly what `round_fn(state, data, key)` sends its clients next.

  The same sampling and dispatch keys as the round. For FedMR the
  `per_client` part holds the recombined models, for FedMut each client's
  mutation coefficients (`types.dispatched_models` builds the models);
  diagnostics evaluate them
  (`evaluation.make_evaluate_dispatched`).
  """
  k_sample, k_dispatch, _, _ = round_keys(key, state.round)
  ids = sampling.sampler_of(algorithm, clients_per_round)(
    k_sample, state.round, state.server, data
  )
  return algorithm.dispatch(state.server, ids, state.round, k_dispatch)


# The round's per-client metrics (`[K]` each, in sampling order).
PER_CLIENT_METRICS = (
  'client_ids',
  'client_examples',
  'client_steps',
  'client_loss',
)


def round_metrics(
  outputs: types.ClientOutput | types.Sums, ids: jax.Array
) -> dict[str, jax.Array]:
  """The engine's own metrics of a round (see `make_round_fn`)."""
  n = outputs.num_examples.astype(jnp.float32)
  return {
    'train_loss': jnp.sum(n * outputs.loss) / jnp.sum(n),
    'num_examples': jnp.sum(outputs.num_examples),
    'num_steps': jnp.sum(outputs.num_steps),
    'client_ids': ids,
    'client_examples': outputs.num_examples,
    'client_steps': outputs.num_steps,
    'client_loss': outputs.loss,
  }


def _check_k(algorithm: types.Algorithm, clients_per_round: int) -> int:
  k = int(clients_per_round)
  if algorithm.clients_per_round not in (None, k):
    raise ValueError(
      f'clients_per_round={k}, but the algorithm was built for '
      f'clients_per_round={algorithm.clients_per_round}'
    )
  return k


def _train_clients(
  algorithm: types.Algorithm, summed: bool, client_chunk: int
) -> Callable:
  """`train_clients(shared, per_client, client_state, ids, keys, valid,
  data)`: the K clients' updates, their contributions summed as they
  finish (`streaming.stream_clients`) when `summed`, else stacked
  (`streaming.map_clients`)."""
  update = algorithm.client_update

  def train_clients(shared, per_client, client_state, ids, keys, valid, data):
    def run(p, s, c, ck):
      return update(shared, p, s, data, c, ck)

    xs = (per_client, client_state, ids, keys)
    if summed:
      return streaming.stream_clients(
        run, algorithm.contribution, xs, client_chunk, valid
      )
    return streaming.map_clients(run, xs, client_chunk)

  return train_clients


def _client_training(
  algorithm: types.Algorithm,
  summed: bool,
  client_chunk: int,
  mesh: jax.sharding.Mesh | None,
) -> Callable:
  """`train(sent, client_state, ids, keys, data) -> (outputs,
  client_state)`: the K clients' updates on one device, or with the client
  axis split over the devices of `mesh` (`placement.run_sharded`)."""
  train_clients = _train_clients(algorithm, summed, client_chunk)
  shards = 1 if mesh is None else mesh.devices.size
  if shards == 1:

    def train(sent, client_state, ids, keys, data):
      return train_clients(
        sent.shared, sent.per_client, client_state, ids, keys, None, data
      )

    return train
  sharded_train = placement.shard_clients(train_clients, mesh, summed)
  return functools.partial(placement.run_sharded, sharded_train, shards=shards)


def _rows_round(
  algorithm: types.Algorithm,
  k: int,
  train: Callable,
  aggregate: Callable,
  state: RoundState,
  data: Any,
  key: jax.Array,
  ids: jax.Array,
  client_state: Any,
) -> tuple[RoundState, Any, dict[str, jax.Array]]:
  """The round of the sampled `ids`, given their per-client state rows:
  dispatch, the K client updates (`train`), aggregation (`aggregate`)."""
  _, k_dispatch, k_clients, k_aggregate = round_keys(key, state.round)
  sent = algorithm.dispatch(state.server, ids, state.round, k_dispatch)
  keys = client_keys(k_clients, k)
  outputs, client_state = train(sent, client_state, ids, keys, data)
  server_state, server_metrics = aggregate(
    state.server, outputs, ids, state.round, k_aggregate
  )
  metrics = {**round_metrics(outputs, ids), **server_metrics}
  new_state = state.replace(round=state.round + 1, server=server_state)
  return new_state, client_state, metrics


def _sampled_round(
  sample: types.Sampler,
  rows_round: Callable,
  state: RoundState,
  data: Any,
  key: jax.Array,
) -> tuple[RoundState, dict[str, jax.Array]]:
  """The round of `state`: draws its K ids (`sample`), gathers their rows
  of `state.clients`, runs `rows_round` and scatters the new rows back."""
  k_sample = round_keys(key, state.round)[0]
  ids = sample(k_sample, state.round, state.server, data)
  rows = jax.tree.map(lambda x: x[ids], state.clients)
  new_state, rows, metrics = rows_round(state, data, key, ids, rows)
  clients = jax.tree.map(
    lambda all_, new: all_.at[ids].set(new.astype(all_.dtype)),
    state.clients,
    rows,
  )
  return new_state.replace(clients=clients), metrics


def make_round_fn(
  algorithm: types.Algorithm,
  *,
  clients_per_round: int,
  client_chunk: int = 1,
  mesh: jax.sharding.Mesh | None = None,
  stream: bool = True,
  client_rows: bool = False,
) -> Callable:
  """Builds one federated round.

  The round's keys are `round_keys(key, state.round)`: sampling, dispatch,
  the clients and aggregation. Client k's key does not depend on where it
  runs, so results do not depend on `client_chunk` or on the mesh (up to
  float reassociation). The dispatch's shared part is handed to every
  client as one value (replicated over the mesh, never stacked K times);
  its per-client part and the gathered per-client state travel with the
  client axis.

  An algorithm that declares a `contribution` is streamed: each device
  adds its clients' contributions up as they finish
  (`streaming.stream_clients`), then one sum over the mesh, so the round
  holds O(devices × chunk) trained models rather than K; `aggregate`
  receives the `Sums`.

  Args:
    algorithm: the algorithm.
    clients_per_round: K; must be the algorithm's own when it has one.
    client_chunk: how clients are mapped on each device (see
      `streaming.map_clients`).
    mesh: optional 1-D mesh (any axis name) over which the client axis is
      sharded: each device trains ⌈K / D⌉ clients, chosen by
      `placement.balanced_order` so devices get about equal numbers of
      local steps. When D does not divide K the client axis is filled up
      with empty clients (no examples, so no local steps) whose outputs
      are dropped before aggregation. The mesh may span several processes
      (`jax.distributed`); the data and the state are then replicated.
    stream: False stacks the K outputs and sums them at once
      (`types.aggregate_stacked`) even for an algorithm with a
      `contribution`: the reference the streamed round is tested against.
    client_rows: the per-client state stays outside the round (on the
      host: `host_round.make_host_round`). The round then takes the
      sampled ids (`make_sample_fn`) and their state rows, and returns the
      rows' new values.

  Returns:
    `round_fn(state, data, key) -> (state, metrics)`, or with
    `client_rows` `round_fn(state, data, key, ids, rows) -> (state,
    new_rows, metrics)` (`state.clients` is then `()`; `rows` leaves
    `[K, ...]`). Metrics: `train_loss` (per-example mean over the round's
    local training), `num_examples`, `num_steps`, the per-client
    `client_ids`, `client_examples`, `client_steps` and `client_loss`
    (each `[K]`, in sampling order; see `PER_CLIENT_METRICS`), and the
    algorithm's own metrics.
  """
  k = _check_k(algorithm, clients_per_round)
  summed = stream and algorithm.contribution is not None
  aggregate = algorithm.aggregate
  if not summed:
    aggregate = functools.partial(types.aggregate_stacked, algorithm)
  train = _client_training(algorithm, summed, client_chunk, mesh)
  rows_round = functools.partial(_rows_round, algorithm, k, train, aggregate)
  if client_rows:
    return rows_round
  sample = sampling.sampler_of(algorithm, k)
  return functools.partial(_sampled_round, sample, rows_round)


def make_sample_fn(
  algorithm: types.Algorithm, clients_per_round: int
) -> Callable[[RoundState, Any, jax.Array], jax.Array]:
  """`sample(state, data, key) -> ids [K]`: the clients the round of
  `state` trains, drawn with the round's sampling key as `make_round_fn`
  draws them (for `client_rows` rounds)."""
  sample = sampling.sampler_of(
    algorithm, _check_k(algorithm, clients_per_round)
  )

  def sample_fn(state, data, key):
    k_sample = round_keys(key, state.round)[0]
    return sample(k_sample, state.round, state.server, data)

  return sample_fn
