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
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fedjax_mr.core import types
from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.models import model as model_lib
from fedjax_mr.training import client


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
      `make_host_round`, instead of on the default device: read-only
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


def uniform_sampler(clients_per_round: int) -> types.Sampler:
  """The default sampler: K distinct clients, uniformly at random."""
  k = int(clients_per_round)

  def sampler(key, round_index, server_state, data):
    del round_index, server_state
    return sample_clients(key, data.num_clients, k)

  return sampler


def sampler_of(
  algorithm: types.Algorithm, clients_per_round: int
) -> types.Sampler:
  """The algorithm's sampler, or the uniform one."""
  return algorithm.sampler or uniform_sampler(clients_per_round)


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
  diagnostics evaluate them (`make_evaluate_dispatched`).
  """
  k_sample, k_dispatch, _, _ = round_keys(key, state.round)
  ids = sampler_of(algorithm, clients_per_round)(
    k_sample, state.round, state.server, data
  )
  return algorithm.dispatch(state.server, ids, state.round, k_dispatch)


# Populations up to this size draw their K clients as every recorded run
# did (`jax.random.choice` without replacement: a random permutation of all
# N, O(N log N)); larger ones with few clients a round draw them by
# rejection (`sample_sparse`, O(K log K)): at N = 10⁶ the permutation cost
# about 0.7 s a round.
DENSE_SAMPLING_MAX = 2**16


def sample_clients(key: jax.Array, num_clients: int, k: int) -> jax.Array:
  """K distinct client ids, uniformly without replacement: `[K]` int32.

  Above `DENSE_SAMPLING_MAX` clients, and at most a quarter of them a
  round, `sample_sparse`; else a random permutation's first K.
  """
  if num_clients > DENSE_SAMPLING_MAX and 4 * k <= num_clients:
    return sample_sparse(key, num_clients, k)
  return jax.random.choice(key, num_clients, (k,), replace=False).astype(
    jnp.int32
  )


def sample_sparse(key: jax.Array, num_clients: int, k: int) -> jax.Array:
  """K distinct ids of `num_clients`, uniformly without replacement, in
  O(K log K): the first K distinct values of 2K independent uniform draws,
  in the order drawn (each is uniform over the ids not drawn before it,
  which is sampling without replacement). When the 2K draws hold fewer
  than K distinct values (likely only when K is near N), a random
  permutation's first K instead; whether that happens depends only on
  which draws repeat, not on their values, so the result stays uniform.
  Returns `[K]` int32."""
  m = 2 * k
  k_draw, k_permute = jax.random.split(key)
  draws = jax.random.randint(k_draw, (m,), 0, num_clients, dtype=jnp.int32)
  order = jnp.argsort(draws, stable=True)
  ordered = draws[order]
  # The stable sort puts each value's earliest draw first among its equals.
  first_sorted = jnp.concatenate(
    [jnp.ones((1,), bool), ordered[1:] != ordered[:-1]]
  )
  first = jnp.zeros((m,), bool).at[order].set(first_sorted)
  (positions,) = jnp.nonzero(first, size=k, fill_value=0)
  return lax.cond(
    jnp.sum(first) >= k,
    lambda: draws[positions],
    lambda: jax.random.choice(
      k_permute, num_clients, (k,), replace=False
    ).astype(jnp.int32),
  )


# The round's per-client metrics (`[K]` each, in sampling order).
PER_CLIENT_METRICS = (
  'client_ids',
  'client_examples',
  'client_steps',
  'client_loss',
)


def map_clients(fn: Callable, xs: Any, chunk: int) -> Any:
  """Maps `fn` over the leading axis of `xs` (a tuple of trees).

  `chunk` = 1 runs the clients one after another (`lax.map`); `chunk` ≥ K
  vmaps all of them; in between, vmapped chunks of `chunk` clients run one
  after another.
  """
  k = jax.tree.leaves(xs)[0].shape[0]
  if chunk >= k:
    return jax.vmap(fn)(*xs)
  return lax.map(lambda a: fn(*a), xs, batch_size=chunk if chunk > 1 else None)


def _add(a: Any, b: Any) -> Any:
  return jax.tree.map(jnp.add, a, b)


def stream_clients(
  fn: Callable,
  contribution: Callable[[types.ClientOutput], Any],
  xs: Any,
  chunk: int,
  valid: jax.Array | None = None,
) -> tuple[types.Sums, Any]:
  """Runs `fn` over the leading axis of `xs` (as `map_clients`) and sums
  the clients' contributions as they finish.

  Clients run in vmapped chunks of `chunk` (1: one after another), the
  chunks one after another (`lax.scan`) with the running sum carried:
  memory holds one chunk of trained models and the sum, never all K.

  Args:
    fn: `fn(*x) -> (ClientOutput, client_state)` for one client.
    contribution: what one client's output adds (`Algorithm.contribution`).
    xs: a tuple of trees with leaves `[K, ...]`.
    chunk: clients vmapped at once (≥ 1).
    valid: optional `[K]` bool; clients where it is False (the engine's
      filling clients) add zeros.

  Returns:
    `(Sums, client_states)`: the sum over the K clients and their scalars
    (`[K]` each, in the order of `xs`), and their new states `[K, ...]`.
  """
  k = jax.tree.leaves(xs)[0].shape[0]
  chunk = max(1, min(int(chunk), k))
  masked = valid is not None
  if not masked:
    valid = jnp.ones((k,), bool)  # carried along, never read

  def one(x, ok):
    out, state = fn(*x)
    part = contribution(out)
    if masked:
      part = jax.tree.map(lambda c: jnp.where(ok, c, jnp.zeros_like(c)), part)
    scalars = (out.num_examples, out.loss, out.num_steps)
    return part, scalars, state

  def group(x, ok):
    if chunk == 1:
      return one(jax.tree.map(lambda a: a[0], x), ok[0])
    part, scalars, state = jax.vmap(one)(x, ok)
    return types.sum_clients(part), scalars, state

  def split(tree, start, stop, rows):
    return jax.tree.map(
      lambda a: a[start:stop].reshape(rows, -1, *a.shape[1:]), tree
    )

  full, rest = divmod(k, chunk)
  shape = jax.eval_shape(
    group, jax.tree.map(lambda a: a[:chunk], xs), valid[:chunk]
  )
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape[0])

  def step(total, args):
    part, scalars, state = group(*args)
    return _add(total, part), (scalars, state)

  total, ys = lax.scan(
    step,
    zeros,
    (split(xs, 0, full * chunk, full), split(valid, 0, full * chunk, full)),
  )
  flat = (lambda a: a.reshape(-1, *a.shape[2:])) if chunk > 1 else None
  if flat is not None:
    ys = jax.tree.map(flat, ys)
  if rest:
    tail = jax.tree.map(lambda a: a[full * chunk :], (xs, valid))
    part, scalars, state = jax.vmap(one)(*tail)
    total = _add(total, types.sum_clients(part))
    ys = jax.tree.map(
      lambda a, b: jnp.concatenate([a, b]), ys, (scalars, state)
    )
  (num_examples, loss, num_steps), states = ys
  return types.Sums(total, num_examples, loss, num_steps), states


def balanced_order(sizes: jax.Array, num_shards: int) -> jax.Array:
  """Orders K clients so that `[num_shards, K / num_shards]` rows balance.

  Clients sorted by size (largest first) are dealt to the shards in snake
  order (0, 1, …, D−1, D−1, …, 0, …), which keeps every shard's total
  number of local steps within one client's worth of the others.

  Args:
    sizes: `[K]` client sizes (local steps are proportional to them).
    num_shards: D, a divisor of K.

  Returns:
    `perm` `[K]` int32: shard `d` runs clients `perm[d*K/D : (d+1)*K/D]`.
  """
  k = sizes.shape[0]
  per = k // num_shards
  order = jnp.argsort(-sizes, stable=True)
  p = jnp.arange(k)
  row, col = p // num_shards, p % num_shards
  shard = jnp.where(row % 2 == 0, col, num_shards - 1 - col)
  return jnp.zeros(k, jnp.int32).at[shard * per + row].set(order)


def _gather(tree: Any, ids: jax.Array) -> Any:
  return jax.tree.map(lambda x: x[ids], tree)


def _shard_clients(
  train_clients: Callable, mesh: jax.sharding.Mesh, summed: bool
):
  """`train_clients(shared, per_client, client_state, ids, keys, valid,
  data)` with the client axis split over the devices of `mesh` (the
  shared part and the data replicated). With `summed`, the first output
  is a `Sums` whose `total` each device holds for its own clients; it is
  summed over the mesh (one `psum`) and comes back replicated."""
  axis = mesh.axis_names[0]
  spec = jax.sharding.PartitionSpec(axis)
  replicated = jax.sharding.PartitionSpec()

  def body(*args):
    out, states = train_clients(*args)
    if summed:
      out = out._replace(total=lax.psum(out.total, axis))
    return out, states

  out_specs = spec
  if summed:
    out_specs = (types.Sums(replicated, spec, spec, spec), spec)
  return jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(replicated, spec, spec, spec, spec, spec, replicated),
    out_specs=out_specs,
    check_vma=False,
  )


def _run_sharded(
  sharded_train: Callable,
  sent: types.Dispatch,
  client_state: Any,
  ids: jax.Array,
  keys: jax.Array,
  data: client_data_lib.ClientData,
  shards: int,
) -> tuple[Any, Any]:
  """The K clients' updates over `shards` devices (`_shard_clients`),
  balanced by `balanced_order`; outputs (stacked `ClientOutput`, or
  `Sums`) and new client states `[K, ...]` in sampling order.

  When D does not divide K the client axis is filled up with empty
  clients, whose outputs are dropped (and add nothing to sums).
  """
  k = ids.shape[0]
  # Empty clients that fill the client axis up to a multiple of D.
  fill = -k % shards
  run_ids, run_data = ids, data
  if fill:
    # Client id N (one past the last) is an empty client: its size is 0.
    # The per-client inputs of the filling entries are copies of client
    # 0's (never used).
    run_ids = jnp.concatenate([ids, jnp.full((fill,), data.num_clients)])
    run_data = data.with_empty_client()
  first = jnp.concatenate([jnp.arange(k), jnp.zeros((fill,), jnp.int32)])
  valid = jnp.arange(k + fill) < k
  perm = balanced_order(run_data.sizes[run_ids], shards)
  outputs, client_state = sharded_train(
    sent.shared,
    _gather(sent.per_client, first[perm]),
    _gather(client_state, first[perm]),
    run_ids[perm],
    keys[first[perm]],
    valid[perm],
    run_data,
  )
  inverse = jnp.argsort(perm)[:k]
  if isinstance(outputs, types.Sums):
    scalars = _gather(outputs[1:], inverse)
    return types.Sums(outputs.total, *scalars), _gather(client_state, inverse)
  return _gather((outputs, client_state), inverse)


def round_metrics(
  outputs: types.ClientOutput | types.Sums, ids: jax.Array
) -> dict[str, jax.Array]:
  """The engine's own metrics of a round (see `make_round_fn`), from its
  K outputs (stacked, or `Sums`) and sampled `ids`."""
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
  finish (`stream_clients`) when `summed`, else stacked (`map_clients`)."""
  update = algorithm.client_update

  def train_clients(shared, per_client, client_state, ids, keys, valid, data):
    def run(p, s, c, ck):
      return update(shared, p, s, data, c, ck)

    xs = (per_client, client_state, ids, keys)
    if summed:
      return stream_clients(
        run, algorithm.contribution, xs, client_chunk, valid
      )
    return map_clients(run, xs, client_chunk)

  return train_clients


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
  adds its clients' contributions up as they finish (`stream_clients`),
  then one sum over the mesh, so the round holds O(devices × chunk)
  trained models rather than K; `aggregate` receives the `Sums`.

  Args:
    algorithm: the algorithm.
    clients_per_round: K; must be the algorithm's own when it has one.
    client_chunk: how clients are mapped on each device (see
      `map_clients`).
    mesh: optional 1-D mesh (any axis name) over which the client axis is
      sharded: each device trains ⌈K / D⌉ clients, chosen by
      `balanced_order` so devices get about equal numbers of local steps.
      When D does not divide K the client axis is filled up with empty
      clients (no examples, so no local steps) whose outputs are dropped
      before aggregation. The mesh may span several processes
      (`jax.distributed`); the data and the state are then replicated.
    stream: False stacks the K outputs and sums them at once
      (`types.aggregate_stacked`) even for an algorithm with a
      `contribution`: the reference the streamed round is tested against.
    client_rows: the per-client state stays outside the round (on the
      host: `make_host_round`). The round then takes the sampled ids
      (`make_sample_fn`) and their state rows, and returns the rows'
      new values.

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
  shards = 1 if mesh is None else mesh.devices.size
  sample = sampler_of(algorithm, k)
  summed = stream and algorithm.contribution is not None
  _aggregate_stacked = functools.partial(types.aggregate_stacked, algorithm)
  train_clients = _train_clients(algorithm, summed, client_chunk)
  if shards > 1:
    sharded_train = _shard_clients(train_clients, mesh, summed)

  def rows_round(state, data, key, ids, client_state):
    _, k_dispatch, k_clients, k_aggregate = round_keys(key, state.round)
    sent = algorithm.dispatch(state.server, ids, state.round, k_dispatch)
    keys = jax.random.split(k_clients, k)
    if shards == 1:
      outputs, client_state = train_clients(
        sent.shared, sent.per_client, client_state, ids, keys, None, data
      )
    else:
      outputs, client_state = _run_sharded(
        sharded_train, sent, client_state, ids, keys, data, shards
      )
    aggregate = algorithm.aggregate if summed else _aggregate_stacked
    server_state, server_metrics = aggregate(
      state.server, outputs, ids, state.round, k_aggregate
    )
    metrics = {**round_metrics(outputs, ids), **server_metrics}
    new_state = state.replace(round=state.round + 1, server=server_state)
    return new_state, client_state, metrics

  if client_rows:
    return rows_round

  def round_fn(state, data, key):
    k_sample = round_keys(key, state.round)[0]
    ids = sample(k_sample, state.round, state.server, data)
    new_state, rows, metrics = rows_round(
      state, data, key, ids, _gather(state.clients, ids)
    )
    clients = jax.tree.map(
      lambda all_, new: all_.at[ids].set(new.astype(all_.dtype)),
      state.clients,
      rows,
    )
    return new_state.replace(clients=clients), metrics

  return round_fn


def make_sample_fn(
  algorithm: types.Algorithm, clients_per_round: int
) -> Callable[[RoundState, Any, jax.Array], jax.Array]:
  """`sample(state, data, key) -> ids [K]`: the clients the round of
  `state` trains, drawn with the round's sampling key as `make_round_fn`
  draws them (for `client_rows` rounds)."""
  sample = sampler_of(algorithm, _check_k(algorithm, clients_per_round))

  def sample_fn(state, data, key):
    k_sample = round_keys(key, state.round)[0]
    return sample(k_sample, state.round, state.server, data)

  return sample_fn


class HostData(NamedTuple):
  """Training data kept in host memory (`host_data`): each round trains on
  the view of its sampled clients (`client_data.gather_round`).

  Attributes:
    data: the whole training set, numpy fields.
    capacity: rows of every round's view (static, so the round compiles
      once): the most examples K distinct clients hold.
    meta: on the devices, what samplers and dispatch read (the clients'
      sizes; no examples).
  """

  data: client_data_lib.ClientData
  capacity: int
  meta: client_data_lib.ClientData


def host_data(
  data: client_data_lib.ClientData, clients_per_round: int
) -> HostData:
  """`data` kept in host memory for rounds of `clients_per_round`
  clients (`make_host_round`)."""
  on_host = client_data_lib.to_host(data)
  meta = on_host.replace(
    x=np.zeros((0, *on_host.x.shape[1:]), on_host.x.dtype),
    y=np.zeros((0,), on_host.y.dtype),
    flat=np.zeros((on_host.max_size,), np.int32),
  )
  return HostData(
    data=on_host,
    capacity=client_data_lib.round_capacity(on_host.sizes, clients_per_round),
    meta=jax.tree.map(jnp.asarray, meta),
  )


def round_data(data: Any) -> Any:
  """What samplers and dispatch read of a run's data: `data` itself, or
  the `meta` of `HostData`."""
  return data.meta if isinstance(data, HostData) else data


def draws_ahead(algorithm: types.Algorithm) -> bool:
  """Whether a round's clients can be drawn before the round before it
  ends: with the uniform sampler (`sampler=None`), which reads the round's
  key, its index and the clients' sizes, never the server state. An
  algorithm's own sampler may read the previous round's result
  (CluSamp's clusters the clients' last updates), so its rounds are drawn
  after it (`make_host_round`'s `prefetch` must then stay off)."""
  return algorithm.sampler is None


def _key_bits(key: jax.Array) -> np.ndarray:
  """The bits of a run key (typed or raw), on the host."""
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  return np.asarray(jax.device_get(key))


class _Ahead(NamedTuple):
  """A round drawn and gathered before it ran (`make_host_round`)."""

  round: int
  key: np.ndarray  # `_key_bits`
  data: HostData
  ids: jax.Array
  at: np.ndarray
  view: Any

  def is_for(self, round_index: int, key: jax.Array, data: HostData) -> bool:
    """Whether this is round `round_index` of the run of `key` (by value)
    on `data` (the same object)."""
    return (
      self.round == round_index
      and self.data is data
      and np.array_equal(self.key, _key_bits(key))
    )


def make_host_round(
  sample_fn: Callable,
  rows_round: Callable,
  *,
  prefetch: bool = False,
  sharding: jax.sharding.Sharding | None = None,
) -> Callable[[RoundState, Any, jax.Array], tuple[RoundState, Any]]:
  """A round driven from the host: per-client state in host memory, and
  training data on the devices or in host memory (`HostData`).

  `state.clients` holds numpy arrays `[N, ...]` (`init_state(...,
  host_clients=True)`, `to_host_clients`). Each call draws the round's
  ids (`sample_fn`, from `make_sample_fn`), gathers their K rows on the
  host, runs `rows_round` (`make_round_fn(..., client_rows=True)`, both
  usually jit-compiled) and writes the new rows back into the same numpy
  arrays, so only K rows ever reach the devices. The results are those of
  the device-resident round (the gather and the scatter are exact).

  With `HostData` the round gets the view of its own clients' examples
  (`client_data.gather_round`, `capacity` rows) instead of the whole
  training set; the results are the same (each sampled client reads the
  same examples; reads past its size are masked either way).

  With `prefetch` (and `HostData`), each call also draws the next round's
  ids before starting its own round, and once the round is running
  (asynchronously) gathers the next round's view and starts its transfer
  (`jax.device_put`), which the next call uses when it is called for that
  round with the same `data` object and a key of the same value
  (otherwise it draws afresh). Only
  for a sampler that does not read the server state (`draws_ahead`): the
  next round's ids are drawn from this round's state. The results are
  those without it, bit for bit (the same ids, the same view); the
  per-client rows are still gathered after the previous round wrote them
  back. The devices hold two views at once, and the last round gathers
  one that no round uses.

  Args:
    sample_fn: `sample_fn(state, data, key) -> ids [K]`.
    rows_round: `rows_round(state, data, key, ids, rows) -> (state,
      new_rows, metrics)`.
    prefetch: gather the next round's view while this one runs.
    sharding: where each view of `HostData` is put (`jax.device_put`);
      None passes the numpy view to `rows_round`.

  Returns:
    `step(state, data, key) -> (state, metrics)`, like `make_round_fn`'s
    round; `state.clients` of the result are the updated arrays (the
    argument's own, written in place, once they are writable: read-only
    ones are copied first). With `prefetch`, `step` keeps the next
    round's draw between calls.
  """
  ahead: list[_Ahead] = []  # the next round's draw, at most one

  def view_of(data, at):
    if not isinstance(data, HostData):
      return data
    view = client_data_lib.gather_round(data.data, at, data.capacity)
    return view if sharding is None else jax.device_put(view, sharding)

  def step(state, data, key):
    clients = to_host_clients(state).clients
    device_state = state.replace(clients=())
    meta = round_data(data)
    early = prefetch and isinstance(data, HostData)
    r = int(jax.device_get(device_state.round)) if early else None
    drawn = ahead.pop() if ahead else None
    if drawn is not None and drawn.is_for(r, key, data):
      ids, at, view = drawn.ids, drawn.at, drawn.view
    else:
      ids = sample_fn(device_state, meta, key)
      at = np.asarray(jax.device_get(ids))
      view = view_of(data, at)
    if early:
      # Before the round donates `device_state`; the sampler reads no
      # server state, so this round's stands in for the next one's.
      following = device_state.replace(round=device_state.round + 1)
      next_ids = sample_fn(following, meta, key)
    rows = jax.tree.map(lambda a: a[at], clients)
    device_state, new_rows, metrics = rows_round(
      device_state, view, key, ids, rows
    )
    if early:
      next_at = np.asarray(jax.device_get(next_ids))
      next_view = view_of(data, next_at)
      ahead.append(
        _Ahead(r + 1, _key_bits(key), data, next_ids, next_at, next_view)
      )
    for a, new in zip(
      jax.tree.leaves(clients), jax.tree.leaves(jax.device_get(new_rows))
    ):
      a[at] = new.astype(a.dtype)
    return device_state.replace(clients=clients), metrics

  return step


def make_evaluate(
  model: model_lib.Model,
  mesh: jax.sharding.Mesh | None = None,
) -> Callable[
  [types.Variables, client_data_lib.EvalData], dict[str, jax.Array]
]:
  """Builds `evaluate(variables, eval_data) -> {'accuracy', 'loss'}`.

  Inference mode (BatchNorm running statistics, no dropout); batches run
  one after another with `lax.map`; padded examples are masked out. With
  a `mesh` of D devices the batches are split over them (D must divide
  the number of batches: `client_data.eval_data(..., num_shards=D)`), each
  device evaluating its share of every model; the per-batch sums come
  back in batch order and are added as on one device, so the results are
  those of the unsharded evaluation.
  """

  def batch(variables, data, args):
    x, y, mask = args
    logits = model.apply_eval(
      variables, client_data_lib.normalize(x, data.scale, data.shift)
    )
    correct = jnp.sum((jnp.argmax(logits, -1) == y) * mask)
    _, loss_sum = client.masked_cross_entropy(logits, y, mask)
    return correct, loss_sum

  def per_batch(variables, data):
    return lax.map(
      functools.partial(batch, variables, data), (data.x, data.y, data.mask)
    )

  shards = 1 if mesh is None else mesh.devices.size
  if shards > 1:
    spec = jax.sharding.PartitionSpec(mesh.axis_names[0])
    per_batch = jax.shard_map(
      per_batch,
      mesh=mesh,
      in_specs=(jax.sharding.PartitionSpec(), spec),
      out_specs=spec,
      check_vma=False,
    )

  def evaluate(variables, data):
    if data.x.shape[0] % shards:
      raise ValueError(
        f'{data.x.shape[0]} test batches do not split over {shards} '
        'devices; build them with eval_data(..., num_shards=...)'
      )
    correct, loss_sum = per_batch(variables, data)
    count = jnp.sum(data.mask)
    return {
      'accuracy': jnp.sum(correct) / count,
      'loss': jnp.sum(loss_sum) / count,
    }

  return evaluate


def make_evaluate_many(
  model: model_lib.Model,
  mesh: jax.sharding.Mesh | None = None,
) -> Callable[
  [types.Variables, client_data_lib.EvalData], dict[str, jax.Array]
]:
  """Like `make_evaluate`, for K stacked models (leaves `[K, ...]`).

  The models run one after another (`lax.map`), so memory stays that of
  one evaluation; with a `mesh` each is split over its devices as in
  `make_evaluate`. Returns `{'accuracy': [K], 'loss': [K]}`.
  """
  evaluate = make_evaluate(model, mesh)
  return lambda stacked, data: lax.map(lambda v: evaluate(v, data), stacked)


def make_evaluate_dispatched(
  model: model_lib.Model,
  algorithm: types.Algorithm,
  mesh: jax.sharding.Mesh | None = None,
) -> Callable[[types.Dispatch, client_data_lib.EvalData], dict[str, jax.Array]]:
  """Like `make_evaluate_many`, for the K models a dispatch starts its
  clients from (`types.dispatched_models`): each is built (FedMut's from
  the coefficients) and evaluated in its turn, so memory stays that of one
  model. Returns `{'accuracy': [K], 'loss': [K]}`."""
  evaluate = make_evaluate(model, mesh)
  model_of = algorithm.client_model or (lambda shared, row: row)

  def evaluate_dispatched(sent, data):
    return lax.map(
      lambda row: evaluate(model_of(sent.shared, row), data), sent.per_client
    )

  return evaluate_dispatched
