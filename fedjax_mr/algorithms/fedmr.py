"""FedMR: federated learning by layer-wise model recombination.

The server keeps K models instead of one. Every round model i trains on the
i-th sampled client; the server then shuffles every layer of the K trained
models independently among them (one random permutation of the K models per
layer) and dispatches the K recombined models. The global model, used only
for evaluation, is the (unweighted) mean of the K trained models.

Variants:
- Two-stage training: for the first `first_stage_bound` rounds the K models
  are reset to the global mean after training (FedAvg with an unweighted
  mean); recombination starts at the end of round `first_stage_bound`
  (rounds counted from 0).
- FedMR-p: the layers, in model order, are cut into `num_segments`
  contiguous segments and one permutation is drawn per segment;
  `num_segments=1` is "Indep": whole models are re-dispatched at random and
  never mixed.
- Secure recombination (paper 002, Appendix B, Algorithm 2): before upload
  the clients swap random layers among themselves, so the server only sees
  an already recombined stack (see `secure_plan`, `secure_recombine`).

A layer is every leaf of the variables, params and BatchNorm statistics
alike (as in the authors' code), or every module with `grouping='module'`;
see `fedjax_mr.core.grouping`.

References:
  Hu et al., "FedMR: Federated Learning via Model Recombination" (Algorithm
  1; Appendix B, Algorithm 2 and Eqs. 26-27 for secure recombination), and
  "Is Aggregation the Only Choice? Federated Learning via Layer-wise Model
  Recombination", KDD 2024 (two-stage training, FedMR-p, Fig. 6 cosine).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fedjax_mr.core import errors
from fedjax_mr.core import grouping as grouping_lib
from fedjax_mr.core import tree
from fedjax_mr.core import types
from fedjax_mr.training import client


def _num_models(client_params: types.PyTree) -> int:
  flat = jax.tree.leaves(client_params)
  if not flat:
    raise ValueError('client_params has no leaves')
  return int(flat[0].shape[0])


def _permute(
  client_params: types.PyTree,
  permutations: jax.Array,
  layers: Sequence[grouping_lib.Layer],
) -> types.PyTree:
  """Row i of unit g of the output is row `permutations[g, i]` of the input."""
  flat, treedef = jax.tree.flatten(client_params)
  out = list(flat)
  for g, layer in enumerate(layers):
    for i in layer.leaves:
      out[i] = jnp.take(flat[i], permutations[g], axis=0)
  return jax.tree.unflatten(treedef, out)


def permute(
  client_params: types.PyTree,
  permutations: jax.Array,
  *,
  grouping: grouping_lib.Grouping = 'leaf',
  num_segments: int | None = None,
  layer_order: Sequence[str] | None = None,
) -> types.PyTree:
  """Recombines K models with given permutations, one per unit.

  Args:
    client_params: leaves `[K, ...]`.
    permutations: `[G, K]` integers, a permutation of `range(K)` per unit,
      the units (layers or segments) in model order as
      `grouping.layer_groups` lists them.
    grouping: see `grouping.layer_groups`.
    num_segments: see `grouping.layer_groups`.
    layer_order: see `grouping.leaves`.

  Returns:
    The same structure; row i of unit g is row `permutations[g, i]` of
    `client_params`. Identity permutations return `client_params`.
  """
  layers = grouping_lib.layer_groups(
    client_params,
    grouping=grouping,
    num_segments=num_segments,
    layer_order=layer_order,
  )
  if permutations.shape[0] != len(layers):
    raise ValueError(
      f'{permutations.shape[0]} permutations for {len(layers)} units'
    )
  return _permute(client_params, permutations, layers)


def recombine(
  key: jax.Array,
  client_params: types.PyTree,
  *,
  grouping: grouping_lib.Grouping = 'leaf',
  num_segments: int | None = None,
  layer_order: Sequence[str] | None = None,
) -> types.PyTree:
  """Shuffles each layer (or segment) of K models among them.

  Every unit, a layer (`grouping` 'leaf': each leaf; 'module': all leaves of
  one module) or, with `num_segments`, a contiguous segment of layers in
  model order, gets its own uniformly random permutation of the K models,
  drawn from a key derived from the unit's name (`grouping.layer_keys`).
  Params and BatchNorm statistics are treated alike. Jit-compatible.

  Args:
    key: PRNG key.
    client_params: the K models, leaves `[K, ...]`.
    grouping: 'leaf' or 'module', see `grouping.layer_groups`.
    num_segments: None (one permutation per layer) or the number of
      contiguous segments (FedMR-p); 1 permutes whole models only (Indep).
    layer_order: leaf names in model order (`grouping.model_order` of fresh
      variables); only segments depend on it.

  Returns:
    The recombined models, same structure and shapes `[K, ...]`: each row
    of each unit is one row of the input, and every input row of a unit is
    used exactly once.

  References:
    Hu et al., "FedMR: Federated Learning via Model Recombination",
    Algorithm 1 (ModelRecombine); FedMR-p in the KDD 2024 version.
  """
  layers = grouping_lib.layer_groups(
    client_params,
    grouping=grouping,
    num_segments=num_segments,
    layer_order=layer_order,
  )
  k = _num_models(client_params)
  keys = grouping_lib.layer_keys(key, layers)
  return _permute(
    client_params, grouping_lib.unit_permutations(keys, k), layers
  )


# ---------------------------------------------------------------------------
# Secure recombination (paper 002, Appendix B, Algorithm 2).


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
  return _permute(client_params, plan.permutation, layers)


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
  k, num_layers = _num_models(client_params), len(layers)
  repeats, lo, hi = int(repeats), int(min_sent), int(max_sent)
  _check_secure(k, num_layers, repeats, lo, hi)
  draws = jax.device_get(_draw(key, k, num_layers, repeats, lo, hi))
  holding = [[c] * num_layers for c in range(k)]  # holding[c][j] = origin
  log = []
  for r in range(repeats):
    priority = {
      (j, holding[c][j]): int(draws.pick[r, c, j])
      for c in range(k)
      for j in range(num_layers)
    }
    # Line 3: one buffer per layer, holding the client's own tensor.
    buffers = [[[holding[c][j]] for j in range(num_layers)] for c in range(k)]
    # Stage 1: send n random layers to random other clients.
    inbox = [[] for _ in range(k)]
    for c in range(k):
      chosen = np.argsort(draws.select[r, c])[: int(draws.num_sent[r, c])]
      for j in chosen.tolist():
        to = (c + int(draws.offset[r, c, j])) % k
        tensor = holding[c][j]
        buffers[c][j].remove(tensor)
        inbox[to].append((c, j, tensor))
        log.append((r, 1, c, to, j, tensor))
    # Stage 2: receive into the layer buffers, remember the senders.
    senders = [[] for _ in range(k)]
    for m in range(k):
      for c, j, tensor in inbox[m]:
        buffers[m][j].append(tensor)
        senders[m].append((c, j))
    # Stage 3: return a random tensor of the same layer to every sender.
    returns = [[] for _ in range(k)]
    for m in range(k):
      for c, j in senders[m]:
        tensor = min(buffers[m][j], key=lambda t, j=j: priority[(j, t)])
        buffers[m][j].remove(tensor)
        returns[c].append((j, tensor))
        log.append((r, 3, m, c, j, tensor))
    # Stage 4: receive the returns; every buffer now holds one tensor.
    for c in range(k):
      for j, tensor in returns[c]:
        buffers[c][j].append(tensor)
      for j in range(num_layers):
        if len(buffers[c][j]) != 1:
          raise RuntimeError('secure recombination lost a layer (a bug)')
        holding[c][j] = buffers[c][j][0]
  perm = np.array(holding, np.int32).T.reshape(num_layers, k)
  record = np.array(log, np.int64).reshape(-1, 6)
  transfers = SecureTransfers(
    *(record[:, j] for j in range(6)),
    layer_names=tuple(layer.name for layer in layers),
  )
  return _permute(client_params, jnp.asarray(perm), layers), transfers


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


# ---------------------------------------------------------------------------
# The algorithm.


class FedMRState(NamedTuple):
  """Attributes:
  params: the global model (mean of the K trained models, params and
    BatchNorm statistics alike), for evaluation only.
  client_models: the K models to dispatch next, leaves `[K, ...]`.
  """

  params: types.Variables
  client_models: types.Variables


def fedmr(
  local: client.LocalTraining,
  clients_per_round: int,
  first_stage_bound: int = 0,
  grouping: grouping_lib.Grouping = 'leaf',
  num_segments: int | None = None,
  secure_repeats: int = 0,
  weighted_global: bool = False,
  *,
  secure_min_sent: int = 1,
  secure_max_sent: int | None = None,
  layer_order: Sequence[str] | None = None,
) -> types.Algorithm:
  """Builds FedMR.

  Round r (counted from 0): model i of `client_models` trains on the i-th
  sampled client; then
  1. with `secure_repeats > 0`, the clients run secure recombination among
     themselves before upload, so the server only ever sees the mixed stack
     (simulated with `secure_plan`);
  2. the global model is the mean of the uploaded models;
  3. if r < `first_stage_bound` every model is reset to the global model
     (two-stage training; first_stage_bound >= the number of rounds is
     unweighted FedAvg), else the uploaded models are recombined.
  The server's own recombination also runs after secure recombination: a
  uniform permutation composed with an independent one is uniform, so the
  dispatched models have the same distribution either way.

  Args:
    local: how clients train (model, optimizer, E, B); client k trains
      model k of the dispatch's per-client part.
    clients_per_round: K, the number of models.
    first_stage_bound: rounds of the aggregation stage (0: recombine from
      round 0).
    grouping: 'leaf' (default, as the reference) or 'module'.
    num_segments: None, or the number of contiguous segments (FedMR-p);
      1 is Indep.
    secure_repeats: r_s, 0 for no secure recombination.
    weighted_global: weight the global model (and the first-stage reset) by
      the clients' numbers of examples instead of the papers' plain mean.
      Not available with secure recombination (the server cannot match
      tensors to clients).
    secure_min_sent: n_l of secure recombination.
    secure_max_sent: n_u of secure recombination; None: the number of
      layers.
    layer_order: leaf names in model order, `grouping.model_order` of the
      variables `module.init` returns; required for `num_segments` > 1,
      since jax re-sorts dict keys.

  Returns:
    An `Algorithm` whose server state is a `FedMRState`. Metrics:
    'pairwise_cosine' (`tree.pairwise_cosine` of the uploaded models) and
    'bytes_communicated' (K models down, K up, plus secure recombination's
    client-to-client traffic), float32 scalars.

  Raises:
    ValueError: inconsistent options.

  References:
    Hu et al., "FedMR: Federated Learning via Model Recombination",
    Algorithms 1 and 2; KDD 2024 version for two-stage training and FedMR-p.
  """
  k = int(clients_per_round)
  bound = int(first_stage_bound)
  repeats = int(secure_repeats)
  if k < 1:
    raise ValueError(f'clients_per_round must be >= 1, got {k}')
  if bound < 0:
    raise ValueError(f'first_stage_bound must be >= 0, got {bound}')
  if grouping not in grouping_lib.GROUPINGS:
    raise ValueError(f'grouping must be one of {grouping_lib.GROUPINGS}')
  if num_segments is not None and int(num_segments) < 1:
    raise ValueError(f'num_segments must be >= 1, got {num_segments}')
  if num_segments not in (None, 1) and layer_order is None:
    raise ValueError(
      'num_segments > 1 cuts the model into contiguous segments and needs '
      'layer_order=grouping.model_order(model.init(key)): inside jax the '
      'variables dicts have sorted keys, not model order'
    )
  if repeats < 0:
    raise ValueError(f'secure_repeats must be >= 0, got {repeats}')
  if repeats and weighted_global:
    raise ValueError('weighted_global is not available with secure_repeats')
  if repeats and k < 2:
    raise ValueError('secure recombination needs clients_per_round >= 2')

  def init(variables):
    return FedMRState(
      params=variables, client_models=tree.broadcast(variables, k)
    )

  def dispatch(state, client_ids, round_index, key):
    del client_ids, round_index, key
    return types.Dispatch(per_client=state.client_models)

  def aggregate(state, outputs, client_ids, round_index, key):
    del state, client_ids
    k_secure, k_mix = jax.random.split(key)
    uploaded = outputs.variables
    model_bytes = tree.nbytes(outputs.variables) // k
    client_bytes = jnp.zeros((), jnp.float32)
    if repeats:
      layers = secure_layers(uploaded, grouping)
      hi = len(layers) if secure_max_sent is None else secure_max_sent
      plan = secure_plan(
        k_secure,
        k,
        len(layers),
        repeats=repeats,
        min_sent=secure_min_sent,
        max_sent=hi,
      )
      # From here on the server only sees `uploaded`.
      uploaded = apply_secure_plan(uploaded, plan, grouping)
      sizes = grouping_lib.layer_sizes(uploaded, layers, leading=1)
      client_bytes = jnp.sum(
        plan.layer_transfers.astype(jnp.float32)
        * jnp.asarray(sizes, jnp.float32)
      )
    weights = outputs.num_examples if weighted_global else None
    global_params = tree.weighted_mean(uploaded, weights)

    def reset():
      return tree.broadcast(global_params, k)

    def mix():
      return recombine(
        k_mix,
        uploaded,
        grouping=grouping,
        num_segments=num_segments,
        layer_order=layer_order,
      )

    if bound == 0:
      client_models = mix()
    else:
      client_models = lax.cond(round_index < bound, reset, mix)
    metrics = {
      'pairwise_cosine': tree.pairwise_cosine(uploaded),
      'bytes_communicated': jnp.float32(2 * k * model_bytes) + client_bytes,
    }
    return FedMRState(global_params, client_models), metrics

  return types.Algorithm(
    init,
    dispatch,
    client.trains_per_client(client.make_local_update(local)),
    aggregate,
    clients_per_round=k,
  )


# ---------------------------------------------------------------------------
# Hyper-parameters (flags --fedmr_<field>) and the registry's factories.


def _flag(default, help_text, **more):
  return dataclasses.field(
    default=default, metadata={'help': help_text, **more}
  )


@dataclasses.dataclass(frozen=True)
class Hparams:
  """FedMR's and Indep's hyper-parameters (flags `--fedmr_<field>`)."""

  first_stage: int = _flag(
    0,
    'Rounds of the first (FedAvg) stage of two-stage training; '
    'recombination starts after them (papers: 0 for the CNN, 100 for '
    'ResNet-20 and VGG-16).',
  )
  grouping: str = _flag(
    'leaf',
    'What one layer is: leaf (every tensor, params and BatchNorm '
    "statistics, as the authors' code) or module (kernel and bias of one "
    'module together).',
    choices=grouping_lib.GROUPINGS,
  )
  secure_repeats: int = _flag(
    0,
    'Repeats r_s of the client-to-client secure recombination before '
    'upload (0: none).',
  )
  secure_min_sent: int = _flag(
    1,
    'Secure recombination: least number of layers a client sends per '
    'repeat (n_l).',
  )
  secure_max_sent: int = _flag(
    0,
    'Secure recombination: most layers a client sends per repeat (n_u); '
    '0: all layers.',
  )

  def validate(
    self, *, clients_per_round=None, weighted=None, **setting
  ) -> None:
    """Raises `ArgumentError` naming a bad field or setting."""
    del setting
    for name in (
      'first_stage',
      'secure_repeats',
      'secure_min_sent',
      'secure_max_sent',
    ):
      if getattr(self, name) < 0:
        raise errors.ArgumentError(
          name, f'must be >= 0, got {getattr(self, name)}'
        )
    if self.grouping not in grouping_lib.GROUPINGS:
      raise errors.ArgumentError(
        'grouping',
        f'must be one of {", ".join(grouping_lib.GROUPINGS)}, got '
        f'{self.grouping!r}',
      )
    if self.secure_repeats:
      if weighted:
        raise errors.ArgumentError(
          'weighted',
          'by examples is not available with secure recombination: after '
          'it the server cannot tell which client a layer came from',
        )
      if clients_per_round is not None and clients_per_round < 2:
        raise errors.ArgumentError(
          'clients_per_round',
          f'must be >= 2 for secure recombination, got {clients_per_round}',
        )
      hi = self.secure_max_sent
      if hi and self.secure_min_sent > hi:
        raise errors.ArgumentError(
          'secure_min_sent',
          f'must not exceed secure_max_sent={hi}, got {self.secure_min_sent}',
        )


@dataclasses.dataclass(frozen=True)
class PHparams(Hparams):
  """FedMR-p: FedMR's hyper-parameters and the number of segments."""

  segments: int = _flag(
    2,
    'FedMR-p: number of contiguous segments of layers (in model order) '
    'recombined as units; >= 2 (1 is --algorithm=indep).',
  )

  def validate(self, **setting) -> None:
    super().validate(**setting)
    if self.segments < 2:
      raise errors.ArgumentError(
        'segments',
        f'must be >= 2 for FedMR-p, got {self.segments} (one segment is '
        'Indep: --algorithm=indep)',
      )


def _build(setting: Any, hp: Hparams, num_segments: int | None):
  k = setting.clients_per_round
  hp.validate(clients_per_round=k, weighted=setting.weighted)
  repeats = hp.secure_repeats
  max_sent = hp.secure_max_sent or None
  if repeats:
    num_layers = len(secure_layers(setting.variables, hp.grouping))
    hi = max_sent or num_layers
    if not hp.secure_min_sent <= hi <= num_layers:
      raise errors.ArgumentError(
        'secure_max_sent',
        f'(n_u = {hi}) and secure_min_sent (n_l = {hp.secure_min_sent}) '
        f'must satisfy n_l <= n_u <= {num_layers}, the number of layers of '
        f'the model with grouping {hp.grouping}',
      )
  return fedmr(
    setting.local,
    k,
    first_stage_bound=hp.first_stage,
    grouping=hp.grouping,
    num_segments=num_segments,
    secure_repeats=repeats,
    weighted_global=setting.weighted,
    secure_min_sent=hp.secure_min_sent,
    secure_max_sent=max_sent,
    layer_order=grouping_lib.model_order(setting.variables),
  )


def build(setting: Any, hp: Hparams) -> types.Algorithm:
  """FedMR for the registry: one permutation per layer."""
  return _build(setting, hp, None)


def build_p(setting: Any, hp: PHparams) -> types.Algorithm:
  """FedMR-p for the registry: `hp.segments` contiguous segments."""
  return _build(setting, hp, hp.segments)


def build_indep(setting: Any, hp: Hparams) -> types.Algorithm:
  """Indep for the registry: whole models re-dispatched, never mixed."""
  return _build(setting, hp, 1)


# Named variants of `experiments.compare` (config overrides).
VARIANTS = {
  'fedmr_2stage20': {'fedmr_first_stage': 20},
  'fedmr_secure': {'fedmr_secure_repeats': 2},
}
P_VARIANTS = {'fedmr_p2': {'fedmr_segments': 2}}
