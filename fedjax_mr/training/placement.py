"""The client axis of a round split over the devices of a mesh: balanced
by local steps (`balanced_order`), filled up with empty clients when the
devices do not divide K, one sum over the mesh for streamed rounds.
"""

from __future__ import annotations

from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from fedjax_mr.core import types
from fedjax_mr.data import client_data as client_data_lib


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


def slots(sizes: jax.Array, num_shards: int) -> jax.Array:
  """Where a round's K clients run over D = `num_shards` devices: the
  client axis filled up with empty clients (size 0) to a multiple K' of
  D, in `balanced_order`.

  Args:
    sizes: `[K]` the sampled clients' sizes, in sampling order.
    num_shards: D.

  Returns:
    `perm` `[K']` int32: slot j (device j // (K' / D), its client
    j mod (K' / D)) runs the client at sampling position `perm[j]`, or an
    empty client where `perm[j]` >= K.
  """
  k = sizes.shape[0]
  fill = -k % num_shards
  sizes = jnp.concatenate([sizes, jnp.zeros((fill,), sizes.dtype)])
  return balanced_order(sizes, num_shards)


def _gather(tree: Any, ids: jax.Array) -> Any:
  return jax.tree.map(lambda x: x[ids], tree)


def shard_clients(
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


def sum_over_devices(mesh: jax.sharding.Mesh) -> Callable[[Any], Any]:
  """`across(totals)`: the devices' sums (leaves `[D, ...]`, row d device
  d's) added over `mesh` by the collective a streamed round ends with
  (`shard_clients`), so in its order; the sum comes back replicated."""
  axis = mesh.axis_names[0]
  spec = jax.sharding.PartitionSpec(axis)
  summed = jax.jit(
    jax.shard_map(
      lambda t: jax.tree.map(lambda x: lax.psum(x[0], axis), t),
      mesh=mesh,
      in_specs=spec,
      out_specs=jax.sharding.PartitionSpec(),
      check_vma=False,
    )
  )
  sharding = jax.sharding.NamedSharding(mesh, spec)

  def across(totals: Any) -> Any:
    return summed(jax.device_put(totals, sharding))

  return across


def run_sharded(
  sharded_train: Callable,
  sent: types.Dispatch,
  client_state: Any,
  ids: jax.Array,
  keys: jax.Array,
  data: client_data_lib.ClientData,
  shards: int,
) -> tuple[Any, Any]:
  """The K clients' updates over `shards` devices (`shard_clients`),
  balanced by `balanced_order`; outputs (stacked `ClientOutput`, or
  `Sums`) and new client states `[K, ...]` in sampling order.

  When D does not divide K the client axis is filled up with empty
  clients, whose outputs are dropped (and add nothing to sums).
  """
  k = ids.shape[0]
  # Empty clients fill the client axis up to a multiple of D: client id N
  # (one past the last), whose size is 0; their per-client inputs are
  # copies of client 0's (never used).
  fill = -k % shards
  run_data = data.with_empty_client() if fill else data
  perm = slots(data.sizes[ids], shards)
  valid = perm < k
  first = jnp.where(valid, perm, 0)
  outputs, client_state = sharded_train(
    sent.shared,
    _gather(sent.per_client, first),
    _gather(client_state, first),
    jnp.where(valid, ids[first], data.num_clients),
    keys[first],
    valid,
    run_data,
  )
  inverse = jnp.argsort(perm)[:k]
  if isinstance(outputs, types.Sums):
    scalars = _gather(outputs[1:], inverse)
    return types.Sums(outputs.total, *scalars), _gather(client_state, inverse)
  return _gather((outputs, client_state), inverse)
