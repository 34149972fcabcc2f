"""A round driven from the host: per-client state and, optionally, the
training set in host memory; only the K sampled rows and the round's view
of the data reach the devices (`make_host_round`).
"""

from __future__ import annotations

import functools
from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.core import types
from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.training import engine


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
) -> Callable[
  [engine.RoundState, Any, jax.Array], tuple[engine.RoundState, Any]
]:
  """A round driven from the host: per-client state in host memory, and
  training data on the devices or in host memory (`HostData`).

  `state.clients` holds numpy arrays `[N, ...]` (`engine.init_state(...,
  host_clients=True)`, `engine.to_host_clients`). Each call draws the
  round's ids (`sample_fn`, from `engine.make_sample_fn`), gathers their K
  rows on the host, runs `rows_round` (`engine.make_round_fn(...,
  client_rows=True)`, both
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
  return functools.partial(
    _host_step, sample_fn, rows_round, prefetch, sharding, ahead
  )


def _host_step(
  sample_fn: Callable,
  rows_round: Callable,
  prefetch: bool,
  sharding: jax.sharding.Sharding | None,
  ahead: list[_Ahead],
  state: engine.RoundState,
  data: Any,
  key: jax.Array,
) -> tuple[engine.RoundState, Any]:
  """One round of `make_host_round`: its draw (`ahead`'s, when it was
  drawn there), the rows gathered, the round, the next round drawn while it
  runs (with `prefetch`), the new rows written back."""
  clients = engine.to_host_clients(state).clients
  device_state = state.replace(clients=())
  early = prefetch and isinstance(data, HostData)
  r = int(jax.device_get(device_state.round)) if early else None
  drawn = ahead.pop() if ahead else None
  if drawn is not None and drawn.is_for(r, key, data):
    ids, at, view = drawn.ids, drawn.at, drawn.view
  else:
    ids, at, view = _draw(sample_fn, device_state, data, key, sharding)
  if early:
    # Before the round donates `device_state`; the sampler reads no
    # server state, so this round's stands in for the next one's.
    following = device_state.replace(round=device_state.round + 1)
    next_ids = sample_fn(following, round_data(data), key)
  device_state, new_rows, metrics = rows_round(
    device_state, view, key, ids, jax.tree.map(lambda a: a[at], clients)
  )
  if early:  # while the round runs
    ahead.append(_draw_ahead(r + 1, key, data, next_ids, sharding))
  _write_rows(clients, at, new_rows)
  return device_state.replace(clients=clients), metrics


def _draw_ahead(
  round_index: int,
  key: jax.Array,
  data: HostData,
  ids: jax.Array,
  sharding: jax.sharding.Sharding | None,
) -> _Ahead:
  """Round `round_index`'s draw `ids`, with its view of `data` gathered
  and its transfer started."""
  at = np.asarray(jax.device_get(ids))
  view = _view_of(data, at, sharding)
  return _Ahead(round_index, _key_bits(key), data, ids, at, view)


def _view_of(
  data: Any, at: np.ndarray, sharding: jax.sharding.Sharding | None
) -> Any:
  """The training data a round of clients `at` reads: `data` itself, or
  the view of `HostData` (put where `sharding` says)."""
  if not isinstance(data, HostData):
    return data
  view = client_data_lib.gather_round(data.data, at, data.capacity)
  return view if sharding is None else jax.device_put(view, sharding)


def _draw(
  sample_fn: Callable,
  state: engine.RoundState,
  data: Any,
  key: jax.Array,
  sharding: jax.sharding.Sharding | None,
) -> tuple[jax.Array, np.ndarray, Any]:
  """The round of `state`'s ids (on the devices and on the host) and its
  view of `data`."""
  ids = sample_fn(state, round_data(data), key)
  at = np.asarray(jax.device_get(ids))
  return ids, at, _view_of(data, at, sharding)


def _write_rows(clients: Any, at: np.ndarray, new_rows: Any) -> None:
  """Writes the round's new per-client rows into the host arrays."""
  for a, new in zip(
    jax.tree.leaves(clients), jax.tree.leaves(jax.device_get(new_rows))
  ):
    a[at] = new.astype(a.dtype)
