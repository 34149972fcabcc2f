"""FedMR's secure recombination: the clients recombine among themselves.

Before upload the K clients of a round swap random layers with one
another, so the server, which only relays, receives an already recombined
stack and cannot tell which client a layer came from (paper 002, Appendix
B, Algorithm 2). One repeat: every client sends n ~ U{n_l..n_u} random
layers to random other clients; each receiver returns, for every layer it
got, a random tensor of that layer from what it then holds. The protocol
runs `repeats` times.

Two forms give the same result for the same key: `secure_recombine`
simulates the protocol message by message on the host (and records every
message, `SecureTransfers`); `secure_plan` computes its outcome with
vectorised index arithmetic inside jit (`SecurePlan`), and
`apply_secure_plan` moves the tensors. FedMR (`fedjax_mr.algorithms.fedmr`)
runs the jit form in its aggregation; `expected_secure_bytes` is the
protocol's expected traffic (Eq. 27).

Also here, shared with FedMR's own recombination: `permute_layers`, which
moves whole rows of each layer of a stack of K models by given
permutations.

References:
  Hu et al., "FedMR: Federated Learning via Model Recombination",
  Appendix B (Algorithm 2; Eqs. 26-27).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.core import grouping as grouping_lib
from fedjax_mr.core import types


def stack_size(client_params: types.PyTree) -> int:
  """K, the leading size of a stack of models (leaves `[K, ...]`)."""
  flat = jax.tree.leaves(client_params)
  if not flat:
    raise ValueError('client_params has no leaves')
  return int(flat[0].shape[0])


def permute_layers(
  client_params: types.PyTree,
  permutations: jax.Array,
  layers: Sequence[grouping_lib.Layer],
) -> types.PyTree:
  """Moves whole rows of each layer of a stack of K models.

  Args:
    client_params: leaves `[K, ...]`.
    permutations: `[G, K]` integers, one row per entry of `layers`.
    layers: the G units (`grouping.layer_groups`), each a set of leaves.

  Returns:
    The same structure: row i of unit g is row `permutations[g, i]` of
    `client_params`; leaves in no unit are kept.
  """
  flat, treedef = jax.tree.flatten(client_params)
  out = list(flat)
  for g, layer in enumerate(layers):
    for i in layer.leaves:
      out[i] = jnp.take(flat[i], permutations[g], axis=0)
  return jax.tree.unflatten(treedef, out)


def secure_layers(
  client_params: types.PyTree, grouping: grouping_lib.Grouping = 'leaf'
) -> tuple[grouping_lib.Layer, ...]:
  """The layers secure recombination exchanges, indexed as in its plans.

  Layers (see `grouping.layer_groups`) in jax's flatten order, not model
  order: the protocol picks layers uniformly, so order has no meaning
  there, and this order does not depend on the dicts' insertion order
  (eager and jitted calls agree).
  """
  layers = grouping_lib.layer_groups(client_params, grouping=grouping)
  return tuple(sorted(layers, key=lambda layer: min(layer.leaves)))


class SecurePlan(NamedTuple):
  """The outcome of the client-to-client secure recombination protocol.

  R = repeats, K = clients, L = layers.

  Layers are indexed as `secure_layers` lists them.

  Attributes:
    sent: `[R, K, L]` bool, client k sends (its current tensor of) layer l
      in stage 1 of repeat r.
    receiver: `[R, K, L]` int32, to whom (meaningful where `sent`); the
      same client returns one layer-l tensor to k in stage 3.
    origins: `[R + 1, L, K]` int32: `origins[r, l, k]` is the input row
      whose layer-l tensor client k holds before repeat r (`origins[0]` is
      the identity, `origins[R]` the result).
  """

  sent: jax.Array
  receiver: jax.Array
  origins: jax.Array

  @property
  def permutation(self) -> jax.Array:
    """`[L, K]` int32: the final permutation of the K rows per layer."""
    return self.origins[-1]

  @property
  def layer_transfers(self) -> jax.Array:
    """`[L]` int32: transfers of each layer, stage-1 sends plus returns."""
    return 2 * jnp.sum(self.sent, axis=(0, 1), dtype=jnp.int32)

  @property
  def num_transfers(self) -> jax.Array:
    """int32 scalar: number of client-to-client layer transfers."""
    return jnp.sum(self.layer_transfers)


class _Draws(NamedTuple):
  """All randomness of the protocol; shared by the jit and host versions.

  Attributes:
    num_sent: `[R, K]`, n of each client in each repeat (Alg. 2 line 2).
    select: `[R, K, L]`, a random permutation of range(L) per (r, k): the
      client sends the n layers with the smallest values, in that order
      (line 5).
    offset: `[R, K, L]` in [1, K-1]: receiver = (k + offset) mod K, a
      uniformly random other client (line 7).
    pick: `[R, K, L]`, a random permutation of range(K) per (r, l): the
      priority, in stage 3, of the tensor client k holds at the start of
      repeat r. A client returning layer l picks the remaining tensor of
      least priority, a uniformly random one (line 16).
  """

  num_sent: jax.Array
  select: jax.Array
  offset: jax.Array
  pick: jax.Array


def _check_secure(k: int, num_layers: int, repeats: int, lo: int, hi: int):
  if repeats < 0:
    raise ValueError(f'repeats must be >= 0, got {repeats}')
  if not 0 <= lo <= hi <= num_layers:
    raise ValueError(
      f'need 0 <= min_sent <= max_sent <= number of layers ({num_layers}), '
      f'got min_sent={lo}, max_sent={hi}'
    )
  if repeats and (k < 2 or num_layers < 1):
    raise ValueError('secure recombination needs 2 clients and 1 layer')


def _ranks(bits: jax.Array, axis: int) -> jax.Array:
  """Random permutations of `range(bits.shape[axis])` along `axis`."""
  return jnp.argsort(jnp.argsort(bits, axis=axis), axis=axis).astype(jnp.int32)


def _draw(
  key: jax.Array, k: int, num_layers: int, repeats: int, lo: int, hi: int
) -> _Draws:
  # One draw of random bits, sliced (modulo bias < 2^-27 for K, n < 32).
  shape = (4, repeats, k, num_layers)
  bits = jax.random.bits(key, (int(np.prod(shape)),), jnp.uint32)
  bits = bits.reshape(shape)
  num_sent = lo + bits[0, :, :, 0] % jnp.uint32(hi - lo + 1)
  offset = 1 + bits[1] % jnp.uint32(max(k - 1, 1))
  return _Draws(
    num_sent=num_sent.astype(jnp.int32),
    select=_ranks(bits[2], axis=2),
    offset=offset.astype(jnp.int32),
    pick=_ranks(bits[3], axis=1),
  )


def _one_repeat(num_sent, select, offset, pick):
  """Who ends up with whose tensor after one repeat, vectorised.

  For layer l, a client that sends l joins the group of its receiver; a
  client that keeps l heads its own group. Stage 3 hands the tensors of a
  group (the members' current ones) back to its members: senders in
  ascending order each get the remaining tensor of least `pick`, the head
  keeps the last one. Sorting members by (group, head last, index) and
  tensors by (group, pick) and matching the two orders position by
  position reproduces exactly that.

  Args:
    num_sent: `[K]`.
    select, offset, pick: `[K, L]`.

  Returns:
    `(sent [K, L] bool, receiver [K, L] int32, src [L, K] int32)`: after the
    repeat, client k holds for layer l the tensor client `src[l, k]` held
    before it.
  """
  k = select.shape[0]
  idx = jnp.arange(k, dtype=jnp.int32)[:, None]
  sent = select < num_sent[:, None]
  receiver = (idx + offset) % k
  group = jnp.where(sent, receiver, idx)
  head = (~sent).astype(jnp.int32)
  slot_order = jnp.argsort(group * (2 * k) + head * k + idx, axis=0)
  item_order = jnp.argsort(group * k + pick, axis=0)
  src = jnp.take_along_axis(item_order, jnp.argsort(slot_order, axis=0), axis=0)
  return sent, receiver.astype(jnp.int32), src.T.astype(jnp.int32)


def secure_plan(
  key: jax.Array,
  num_models: int,
  num_layers: int,
  *,
  repeats: int,
  min_sent: int,
  max_sent: int,
) -> SecurePlan:
  """Runs the secure recombination protocol's bookkeeping; jit-compatible.

  Vectorised form of `secure_recombine`: for the same key both give the
  same transfers and the same result (tests check it). Only indices are
  computed here; move the tensors with `apply_secure_plan`.

  Args:
    key: PRNG key.
    num_models: K, the clients taking part (Python int).
    num_layers: L, the layers of a model (Python int).
    repeats: r_s, times the protocol runs (Python int).
    min_sent: n_l, least number of layers a client sends per repeat.
    max_sent: n_u, most layers a client sends per repeat (n is uniform on
      [n_l, n_u], a fresh draw per client and repeat).

  Returns:
    A `SecurePlan`.

  References:
    Hu et al., "FedMR: Federated Learning via Model Recombination",
    Appendix B, Algorithm 2.
  """
  k, num_layers, repeats = int(num_models), int(num_layers), int(repeats)
  lo, hi = int(min_sent), int(max_sent)
  _check_secure(k, num_layers, repeats, lo, hi)
  draws = _draw(key, k, num_layers, repeats, lo, hi)
  origin = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (num_layers, k))
  origins, sents, receivers = [origin], [], []
  for r in range(repeats):
    sent, receiver, src = _one_repeat(*(d[r] for d in draws))
    origin = jnp.take_along_axis(origin, src, axis=1)
    origins.append(origin)
    sents.append(sent)
    receivers.append(receiver)
  shape = (repeats, k, num_layers)
  return SecurePlan(
    sent=jnp.stack(sents) if repeats else jnp.zeros(shape, bool),
    receiver=(jnp.stack(receivers) if repeats else jnp.zeros(shape, jnp.int32)),
    origins=jnp.stack(origins),
  )


def apply_secure_plan(
  client_params: types.PyTree,
  plan: SecurePlan,
  grouping: grouping_lib.Grouping = 'leaf',
) -> types.PyTree:
  """The stack the server receives after the protocol of `plan`.

  Args:
    client_params: the K clients' models, leaves `[K, ...]`.
    plan: from `secure_plan` with L = `len(secure_layers(client_params,
      grouping))`.
    grouping: as for `secure_layers`.

  Returns:
    The same structure; client k's layer l is input row
    `plan.permutation[l, k]`.
  """
  layers = secure_layers(client_params, grouping)
  if plan.permutation.shape[0] != len(layers):
    raise ValueError(
      f'plan for {plan.permutation.shape[0]} layers, tree has {len(layers)}'
    )
  return permute_layers(client_params, plan.permutation, layers)


def secure_upload(
  key: jax.Array,
  client_params: types.PyTree,
  *,
  repeats: int,
  min_sent: int,
  max_sent: int | None = None,
  grouping: grouping_lib.Grouping = 'leaf',
) -> tuple[types.PyTree, jax.Array]:
  """What the server receives when the K clients recombine before upload.

  The protocol's outcome (`secure_plan`) applied to the clients' models
  (`apply_secure_plan`); jit-compatible.

  Args:
    key: PRNG key of the protocol.
    client_params: the K clients' models, leaves `[K, ...]`.
    repeats: r_s.
    min_sent: n_l.
    max_sent: n_u; None: the number of layers.
    grouping: what a layer is, as for `secure_layers`.

  Returns:
    `(mixed, client_bytes)`: the stack the server receives (same structure)
    and the bytes of all client-to-client transfers, a float32 scalar.
  """
  layers = secure_layers(client_params, grouping)
  hi = len(layers) if max_sent is None else max_sent
  plan = secure_plan(
    key,
    stack_size(client_params),
    len(layers),
    repeats=repeats,
    min_sent=min_sent,
    max_sent=hi,
  )
  mixed = apply_secure_plan(client_params, plan, grouping)
  sizes = grouping_lib.layer_sizes(mixed, layers, leading=1)
  client_bytes = jnp.sum(
    plan.layer_transfers.astype(jnp.float32) * jnp.asarray(sizes, jnp.float32)
  )
  return mixed, client_bytes


class SecureTransfers(NamedTuple):
  """Every client-to-client message of a secure recombination, `[T]` each.

  Attributes:
    repeat: which repeat (0-based).
    stage: 1 for a stage-1 send, 3 for a stage-3 return.
    sender: client index in [0, K).
    receiver: client index in [0, K), never the sender.
    layer: index into `layer_names` (the order of `secure_layers`).
    origin: the input row whose tensor travels. Simulation bookkeeping only:
      in the protocol the tensor is encrypted and its origin unknown to
      everyone but, in stage 1 of the first repeat, its receiver.
    layer_names: the layers' names.
  """

  repeat: np.ndarray
  stage: np.ndarray
  sender: np.ndarray
  receiver: np.ndarray
  layer: np.ndarray
  origin: np.ndarray
  layer_names: tuple[str, ...]


def secure_recombine(
  key: jax.Array,
  client_params: types.PyTree,
  *,
  repeats: int,
  min_sent: int,
  max_sent: int,
  grouping: grouping_lib.Grouping = 'leaf',
) -> tuple[types.PyTree, SecureTransfers]:
  """Simulates the clients' secure recombination step by step, on the host.

  Each of the K clients holds one model. One repeat of Algorithm 2:
  1. every client draws n uniformly from [n_l, n_u], picks n distinct layers
     at random and sends each to a uniformly random *other* client,
     removing it from its per-layer buffers;
  2. received layers go into the receiver's per-layer buffers, and
     (sender, layer) into its list of senders, in order of arrival (by
     sender index);
  3. for every (sender, layer) in that list, the receiver returns a
     uniformly random tensor from its buffer for that layer (possibly the
     one it just got) and removes it;
  4. the returned layers fill the senders' buffers again; every buffer then
     holds exactly one tensor, which forms the client's new model.
  This is repeated `repeats` times. The protocol bookkeeping (buffers,
  messages) is plain Python/numpy; the randomness comes from `key` and the
  tensors are moved once at the end with `jnp` indexing. Not jit-compatible
  (inside jit use `secure_plan`, which gives the same result for the same
  key).

  Args:
    key: PRNG key.
    client_params: the K clients' models, leaves `[K, ...]`.
    repeats: r_s.
    min_sent: n_l.
    max_sent: n_u (at most the number of layers).
    grouping: what a layer is, see `grouping.layer_groups`; layers are
      indexed as `secure_layers` lists them.

  Returns:
    `(recombined, transfers)`: the stack the server receives (same
    structure, `[K, ...]`) and the record of every message.

  References:
    Hu et al., "FedMR: Federated Learning via Model Recombination",
    Appendix B, Algorithm 2.
  """
  layers = secure_layers(client_params, grouping)
  k, num_layers = stack_size(client_params), len(layers)
  repeats, lo, hi = int(repeats), int(min_sent), int(max_sent)
  _check_secure(k, num_layers, repeats, lo, hi)
  draws = jax.device_get(_draw(key, k, num_layers, repeats, lo, hi))
  holding = [[c] * num_layers for c in range(k)]  # holding[c][j] = origin
  log = []
  for r in range(repeats):
    _simulate_repeat(draws, r, holding, log)
  perm = np.array(holding, np.int32).T.reshape(num_layers, k)
  record = np.array(log, np.int64).reshape(-1, 6)
  transfers = SecureTransfers(
    *(record[:, j] for j in range(6)),
    layer_names=tuple(layer.name for layer in layers),
  )
  return permute_layers(client_params, jnp.asarray(perm), layers), transfers


# One repeat of Algorithm 2, message by message (`secure_recombine`):
# `holding[c][j]` is the origin of client c's layer j, updated in place;
# `buffers[c][j]` the tensors client c holds for layer j; every message is
# appended to `log` as (repeat, stage, from, to, layer, tensor).


def _simulate_repeat(
  draws: _Draws, r: int, holding: list[list[int]], log: list[tuple]
) -> None:
  """Repeat `r`: stages 1 to 4, from the buffers of line 3 (one per layer,
  holding the client's own tensor)."""
  k, num_layers = len(holding), len(holding[0])
  priority = {
    (j, holding[c][j]): int(draws.pick[r, c, j])
    for c in range(k)
    for j in range(num_layers)
  }
  buffers = [[[holding[c][j]] for j in range(num_layers)] for c in range(k)]
  inbox = _send_layers(draws, r, holding, buffers, log)
  senders = _receive_layers(inbox, buffers)
  returns = _return_layers(senders, buffers, priority, r, log)
  _receive_returns(returns, buffers, holding)


def _send_layers(draws, r, holding, buffers, log) -> list[list[tuple]]:
  """Stage 1: every client sends n random layers to random other clients;
  returns each client's inbox of (sender, layer, tensor)."""
  k = len(holding)
  inbox = [[] for _ in range(k)]
  for c in range(k):
    chosen = np.argsort(draws.select[r, c])[: int(draws.num_sent[r, c])]
    for j in chosen.tolist():
      to = (c + int(draws.offset[r, c, j])) % k
      tensor = holding[c][j]
      buffers[c][j].remove(tensor)
      inbox[to].append((c, j, tensor))
      log.append((r, 1, c, to, j, tensor))
  return inbox


def _receive_layers(inbox, buffers) -> list[list[tuple[int, int]]]:
  """Stage 2: received layers go into the layer buffers; returns each
  receiver's senders, (sender, layer) in order of arrival."""
  senders = [[] for _ in inbox]
  for m, messages in enumerate(inbox):
    for c, j, tensor in messages:
      buffers[m][j].append(tensor)
      senders[m].append((c, j))
  return senders


def _return_layers(
  senders, buffers, priority, r, log
) -> list[list[tuple[int, int]]]:
  """Stage 3: every receiver returns a random tensor of the same layer to
  every sender; returns each sender's (layer, tensor) returns."""
  returns = [[] for _ in senders]
  for m, received in enumerate(senders):
    for c, j in received:
      tensor = min(buffers[m][j], key=lambda t, j=j: priority[(j, t)])
      buffers[m][j].remove(tensor)
      returns[c].append((j, tensor))
      log.append((r, 3, m, c, j, tensor))
  return returns


def _receive_returns(returns, buffers, holding) -> None:
  """Stage 4: the returns fill the senders' buffers again; every buffer
  then holds one tensor, which forms the client's new model."""
  for c, returned in enumerate(returns):
    for j, tensor in returned:
      buffers[c][j].append(tensor)
    for j in range(len(holding[c])):
      if len(buffers[c][j]) != 1:
        raise RuntimeError('secure recombination lost a layer (a bug)')
      holding[c][j] = buffers[c][j][0]


def expected_secure_bytes(
  layer_bytes: Sequence[int],
  num_models: int,
  *,
  repeats: int,
  min_sent: int,
  max_sent: int,
) -> float:
  """Expected client-to-client traffic of secure recombination (Eq. 27).

  Per repeat each of the K clients sends n ~ U{n_l..n_u} distinct random
  layers and gets as many back, so 2 E[n] = n_l + n_u layer transfers each
  of expected size size(w) / len(w): in all
  r_s K (n_l + n_u) size(w) / len(w).

  Args:
    layer_bytes: bytes of each layer of one model.
    num_models: K.
    repeats: r_s.
    min_sent: n_l.
    max_sent: n_u.

  Returns:
    Expected bytes over all repeats.

  References:
    Hu et al., "FedMR: Federated Learning via Model Recombination",
    Appendix B.2.2, Eq. 27.
  """
  size, length = float(sum(layer_bytes)), len(layer_bytes)
  return repeats * num_models * (min_sent + max_sent) * size / length
