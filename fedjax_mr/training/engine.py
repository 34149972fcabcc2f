"""The federated round as one pure, jit-compatible function.

`make_round_fn` closes over a server transform, a client update and the
static counts, and returns `round_fn(state, data, key)`. The experiment
jit-compiles it once (donating `state`) and calls it every round; the round
index lives in the state, so resuming needs no saved RNG state.
"""

from __future__ import annotations

from typing import Any
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
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
    server: the server transform's state (exposes `.params`).
  """

  round: jax.Array
  server: Any


def init_state(
  server: types.ServerTransform, variables: types.Variables
) -> RoundState:
  """The state before round 0, from the initial model variables.

  The server state is copied leaf by leaf: the round donates the state, and
  a transform whose state holds one array twice (or the caller's own
  `variables`) would otherwise donate one buffer twice.
  """
  server_state = jax.tree.map(
    lambda x: jnp.array(x, copy=True), server.init(variables)
  )
  return RoundState(round=jnp.zeros((), jnp.int32), server=server_state)


def round_keys(key: jax.Array, round_index: jax.Array) -> jax.Array:
  """`[4]` keys of a round: sampling, dispatch, clients, aggregation."""
  return jax.random.split(jax.random.fold_in(key, round_index), 4)


def next_models(
  server: types.ServerTransform, state: RoundState, key: jax.Array
) -> Any:
  """The K models the next round will dispatch (leaves `[K, ...]`).

  Exactly what `round_fn(state, data, key)` sends its clients: the same
  dispatch key. For FedMR the recombined models, for FedMut the mutated
  ones; diagnostics evaluate them.
  """
  return server.dispatch(
    state.server, state.round, round_keys(key, state.round)[1]
  )


def sample_clients(key: jax.Array, num_clients: int, k: int) -> jax.Array:
  """K distinct client ids, uniformly without replacement: `[K]` int32."""
  return jax.random.choice(key, num_clients, (k,), replace=False).astype(
    jnp.int32
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


def make_round_fn(
  server: types.ServerTransform,
  client_update: types.ClientUpdate,
  *,
  clients_per_round: int,
  client_chunk: int = 1,
  mesh: jax.sharding.Mesh | None = None,
) -> Callable[
  [RoundState, client_data_lib.ClientData, jax.Array],
  tuple[RoundState, dict[str, jax.Array]],
]:
  """Builds one federated round.

  The round's keys are `round_keys(key, state.round)`: sampling, dispatch,
  the clients and aggregation. Client k's key does not
  depend on where it runs, so results do not depend on `client_chunk` or
  on the mesh (up to float reassociation).

  Args:
    server: the server transform.
    client_update: local training of one client.
    clients_per_round: K.
    client_chunk: how clients are mapped on each device (see
      `map_clients`).
    mesh: optional 1-D mesh (any axis name) over which the client axis is
      sharded: each device trains K / D clients, chosen by
      `balanced_order` so devices get about equal numbers of local steps.
      K must be a multiple of D. The mesh may span several processes
      (`jax.distributed`); the data and the state are then replicated.

  Returns:
    `round_fn(state, data, key) -> (state, metrics)`; metrics: `train_loss`
    (per-example mean over the round's local training), `num_examples`,
    `num_steps`, `client_ids` `[K]`, and the server's own metrics.
  """
  k = int(clients_per_round)
  shards = 1 if mesh is None else mesh.devices.size
  if k % shards:
    raise ValueError(
      f'clients_per_round={k} must be a multiple of the number of devices '
      f'({shards}) the client axis is sharded over'
    )

  shared = server.shared_dispatch is not None

  def train_clients(inputs, ids, keys, data):
    if shared:  # one model for all: closed over, never stacked K times
      return map_clients(
        lambda c, ck: client_update(inputs, data, c, ck),
        (ids, keys),
        client_chunk,
      )
    return map_clients(
      lambda v, c, ck: client_update(v, data, c, ck),
      (inputs, ids, keys),
      client_chunk,
    )

  if shards > 1:
    axis = mesh.axis_names[0]
    spec = jax.sharding.PartitionSpec(axis)
    replicated = jax.sharding.PartitionSpec()
    sharded_train = jax.shard_map(
      train_clients,
      mesh=mesh,
      in_specs=(replicated if shared else spec, spec, spec, replicated),
      out_specs=spec,
      check_vma=False,
    )

  def round_fn(state, data, key):
    k_sample, k_dispatch, k_clients, k_aggregate = round_keys(key, state.round)
    ids = sample_clients(k_sample, data.num_clients, k)
    dispatch = server.shared_dispatch if shared else server.dispatch
    inputs = dispatch(state.server, state.round, k_dispatch)
    keys = jax.random.split(k_clients, k)
    if shards == 1:
      outputs = train_clients(inputs, ids, keys, data)
    else:
      perm = balanced_order(data.sizes[ids], shards)
      if not shared:
        inputs = jax.tree.map(lambda x: x[perm], inputs)
      outputs = sharded_train(inputs, ids[perm], keys[perm], data)
      inverse = jnp.argsort(perm)
      outputs = jax.tree.map(lambda x: x[inverse], outputs)
    server_state, server_metrics = server.aggregate(
      state.server, outputs, state.round, k_aggregate
    )
    n = outputs.num_examples.astype(jnp.float32)
    metrics = {
      'train_loss': jnp.sum(n * outputs.loss) / jnp.sum(n),
      'num_examples': jnp.sum(outputs.num_examples),
      'num_steps': jnp.sum(outputs.num_steps),
      'client_ids': ids,
      **server_metrics,
    }
    return RoundState(round=state.round + 1, server=server_state), metrics

  return round_fn


def make_evaluate(
  model: model_lib.Model,
) -> Callable[
  [types.Variables, client_data_lib.EvalData], dict[str, jax.Array]
]:
  """Builds `evaluate(variables, eval_data) -> {'accuracy', 'loss'}`.

  Inference mode (BatchNorm running statistics, no dropout); batches run
  one after another with `lax.map`; padded examples are masked out.
  """

  def evaluate(variables, data):
    def batch(args):
      x, y, mask = args
      logits = model.apply_eval(
        variables, client_data_lib.normalize(x, data.scale, data.shift)
      )
      correct = jnp.sum((jnp.argmax(logits, -1) == y) * mask)
      _, loss_sum = client.masked_cross_entropy(logits, y, mask)
      return correct, loss_sum

    correct, loss_sum = lax.map(batch, (data.x, data.y, data.mask))
    count = jnp.sum(data.mask)
    return {
      'accuracy': jnp.sum(correct) / count,
      'loss': jnp.sum(loss_sum) / count,
    }

  return evaluate


def make_evaluate_many(
  model: model_lib.Model,
) -> Callable[
  [types.Variables, client_data_lib.EvalData], dict[str, jax.Array]
]:
  """Like `make_evaluate`, for K stacked models (leaves `[K, ...]`).

  The models run one after another (`lax.map`), so memory stays that of
  one evaluation. Returns `{'accuracy': [K], 'loss': [K]}`.
  """
  evaluate = make_evaluate(model)
  return lambda stacked, data: lax.map(lambda v: evaluate(v, data), stacked)
