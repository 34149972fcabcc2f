"""The interface every federated algorithm implements.

An algorithm is an `Algorithm`: pure functions built by a factory that
closes over its hyper-parameters (one module per algorithm in
`fedjax_mr.algorithms`). A round (see `fedjax_mr.training.engine`) is::

  ids = sampler(key, round, server_state, data)            # [K]
  sent = dispatch(server_state, ids, round, key)           # Dispatch
  for each of the K clients (mapped and sharded by the engine):
    output_k, client_state_k = client_update(
        sent.shared, sent.per_client[k], client_state[ids[k]],
        data, ids[k], key_k)
  client_state[ids] = the K new client states               # [N, ...]
  server_state, metrics = aggregate(server_state, outputs, ids, round, key)

An algorithm whose server needs only sums over the round's clients
declares `contribution(output_k)`, what one client adds; `aggregate` then
receives `Sums` (the summed contributions and the K clients' scalars)
instead of the K stacked outputs, and the engine adds contributions up as
clients finish, so a round never holds the K trained models at once.

All functions are pure and jit-compatible; how the K client updates are
mapped over devices is the engine's business, never the algorithm's.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

PyTree = Any
# A model's variables: {'params': ..., 'batch_stats': ...} (the latter only
# for models with BatchNorm). Every leaf is a "layer" for FedMR and FedMut.
Variables = dict[str, PyTree]


class ClientOutput(NamedTuple):
  """What one client uploads after local training.

  In the engine these are stacked over the K clients of a round, so every
  field gains a leading `[K]` axis.

  Attributes:
    variables: the locally trained model variables.
    num_examples: int32 scalar, the client's number of training examples.
    loss: float32 scalar, mean training (task) loss over every example seen
      in local training.
    num_steps: int32 scalar, local optimisation steps taken.
    extra: further uploads beside the model (SCAFFOLD's control delta),
      any pytree; `()` when none.
  """

  variables: Variables
  num_examples: jax.Array
  loss: jax.Array
  num_steps: jax.Array
  extra: PyTree = ()


class Dispatch(NamedTuple):
  """What the server sends the K clients of a round.

  Attributes:
    shared: sent to every client alike (FedAvg's global model, SCAFFOLD's
      model and server control); the engine holds it once and never stacks
      it K times. `()` when nothing is shared.
    per_client: one entry per client, leaves `[K, ...]` (FedMR's K
      recombined models, FedMut's K mutated ones); `()` when none.
  """

  shared: PyTree = ()
  per_client: PyTree = ()


class Sums(NamedTuple):
  """What `aggregate` receives when the algorithm declares a
  `contribution`: the round's clients summed, and their scalars.

  Attributes:
    total: the sum over the round's K clients of `contribution(output_k)`.
    num_examples: `[K]` int32, as `ClientOutput.num_examples`.
    loss: `[K]` float32, as `ClientOutput.loss`.
    num_steps: `[K]` int32, as `ClientOutput.num_steps`.
  """

  total: PyTree
  num_examples: jax.Array
  loss: jax.Array
  num_steps: jax.Array


# sampler(key, round, server_state, data) -> [K] int32 distinct client ids.
Sampler = Callable[[jax.Array, jax.Array, Any, Any], jax.Array]

# client_update(shared, per_client_k, client_state_k, data, client_id, key)
#   -> (ClientOutput, new client_state_k)
ClientUpdate = Callable[
  [PyTree, PyTree, PyTree, Any, jax.Array, jax.Array],
  tuple[ClientOutput, PyTree],
]


class Algorithm(NamedTuple):
  """A federated algorithm, both sides: pure functions built by a factory.

  Attributes:
    init: `init(variables) -> server_state`; `variables` is the initial
      model. The state exposes `.params`, the global model (all variables)
      evaluated by the experiment.
    dispatch: `dispatch(state, client_ids, round, key) -> Dispatch` for the
      round's sampled `client_ids` `[K]`.
    client_update: local work of ONE client, see `ClientUpdate`:
      `(shared, per_client_k, client_state_k, data, client_id, key) ->
      (ClientOutput, client_state_k)`; `per_client_k` is row k of
      `Dispatch.per_client` (`()` when none), `client_state_k` the client's
      persistent state (`()` when the algorithm keeps none).
    aggregate: `aggregate(state, outputs, client_ids, round, key) ->
      (state, metrics)`; `outputs` is a `ClientOutput` with leaves
      `[K, ...]`, or `Sums` when the algorithm declares a `contribution`;
      `metrics` is a dict of scalars and always holds
      'bytes_communicated' (down- and upload of the round, float32).
    init_client_state: optional, `init_client_state(variables) -> one
      client's persistent state`; the engine stacks it N times (leaves
      `[N, ...]`) into the round state, gathers the K sampled rows for the
      client updates and scatters their new values back; checkpointed with
      everything else. None: no per-client state.
    sampler: optional `Sampler`; None samples K distinct clients uniformly.
      Sampled ids must be distinct when the algorithm keeps client state.
    evaluated: optional `evaluated(state) -> variables`, the model the
      experiment evaluates as the global one (FedExP: the average of the
      last two iterates); None: `state.params`. See `evaluated_model`.
    clients_per_round: the K the factory built the algorithm for (every
      factory sets it); the engine refuses a round of another K. None:
      any K.
    contribution: optional, `contribution(output) -> pytree`: what ONE
      client's `ClientOutput` adds to the sums `aggregate` receives
      (`Sums.total`); float32 leaves. The engine sums as clients finish
      (a carried sum on each device, then one sum over the devices), so
      the round holds a few models, not K. None: `aggregate` receives
      the K stacked outputs.
    client_model: optional, `client_model(shared, per_client_k) ->
      variables`: the model client k starts from, where the dispatch's
      parts are not the model itself (FedMut: the global models once and
      each client's mutation coefficients; SCAFFOLD: the model beside the
      server control). None: row k of `per_client` is the model, or the
      shared part where there is no per-client part. See
      `dispatched_models`.
  """

  init: Callable[[Variables], Any]
  dispatch: Callable[[Any, jax.Array, jax.Array, jax.Array], Dispatch]
  client_update: ClientUpdate
  aggregate: Callable[
    [Any, ClientOutput, jax.Array, jax.Array, jax.Array],
    tuple[Any, dict[str, Any]],
  ]
  init_client_state: Callable[[Variables], PyTree] | None = None
  sampler: Sampler | None = None
  evaluated: Callable[[Any], Variables] | None = None
  clients_per_round: int | None = None
  contribution: Callable[[ClientOutput], PyTree] | None = None
  client_model: Callable[[PyTree, PyTree], Variables] | None = None


def dispatched_models(algorithm: Algorithm, sent: Dispatch) -> Variables:
  """The K models a multi-model dispatch (FedMR's, FedMut's) starts its
  clients from, stacked (leaves `[K, ...]`)."""
  if algorithm.client_model is None:
    return sent.per_client
  return jax.vmap(lambda row: algorithm.client_model(sent.shared, row))(
    sent.per_client
  )


def unfused(tree: PyTree, count: jax.Array) -> PyTree:
  """`tree`, its floating leaves passed through an operation that no
  compiler can see through, so that the arithmetic that made them is
  never fused with the arithmetic that reads them into one rounding (a
  fused multiply-add); `count` is any int32 >= 0 known only at run time
  (a client's number of examples).

  XLA:CPU lets LLVM make `t + a * b` one fused multiply-add wherever its
  fusions put both in one loop, and they differ from program to program;
  `lax.optimization_barrier` does not stop it (XLA:CPU removes barriers
  before fusing). Each leaf's bits are xor-ed with `count >> 31`, zero
  for a count >= 0 but not known to be: the values are unchanged, and a
  sum of the leaves is the same bits in every program that adds them in
  the same order (the simulated round's and a deployment's fold,
  `training/fold.py`).
  """
  zero = jnp.right_shift(jnp.asarray(count, jnp.int32), 31)

  def one(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    bits = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
    mask = lax.bitcast_convert_type(zero, jnp.uint32).astype(bits)
    return lax.bitcast_convert_type(
      lax.bitcast_convert_type(x, bits) ^ mask, x.dtype
    )

  return jax.tree.map(one, tree)


def sum_rows(tree: PyTree) -> PyTree:
  """Each leaf summed over its leading axis, row 0 first and then one row
  after another, as the engine adds clients that finish one at a time.

  Not `leaf.sum(axis=0)`: XLA:CPU (jax 0.10) reduces the leading axis of a
  large rank-3 leaf fused with the product that makes it some 400 times
  slower than adding its rows (a weighted sum of ten [3136, 512] kernels:
  2.1 s against 5 ms), which made FT-Part's server step cost several times
  its clients' training.
  """
  first = jax.tree.map(lambda c: c[0], tree)
  k = jax.tree.leaves(tree)[0].shape[0]
  if k == 1:
    return first

  def add(i, total):
    return jax.tree.map(lambda t, c: t + c[i], total, tree)

  return lax.fori_loop(1, k, add, first)


def sum_clients(tree: PyTree) -> PyTree:
  """Each leaf summed over its leading (client) axis: `sum_rows` on the
  CPU, where XLA's own reduction of that axis is the slow one, and XLA's
  reduction (`leaf.sum(axis=0)`) on other backends, where a loop of K
  small additions could cost more (not measured: no accelerator here).
  The backend is JAX's default one, read when the caller is traced."""
  if jax.default_backend() == 'cpu':
    return sum_rows(tree)
  return jax.tree.map(lambda c: c.sum(axis=0), tree)


def sum_outputs(
  contribution: Callable[[ClientOutput], PyTree], outputs: ClientOutput
) -> Sums:
  """`Sums` of K stacked outputs (leaves `[K, ...]`): what `aggregate`
  receives for them, summed all at once (`sum_clients`: in client order on
  the CPU; the engine sums as clients finish, in vmapped chunks where it
  runs them so: the two agree up to the order of float32 additions)."""
  parts = jax.vmap(contribution)(outputs)
  return Sums(
    total=sum_clients(parts),
    num_examples=outputs.num_examples,
    loss=outputs.loss,
    num_steps=outputs.num_steps,
  )


def aggregate_stacked(
  algorithm: Algorithm,
  state: Any,
  outputs: ClientOutput,
  client_ids: jax.Array,
  round_index: jax.Array,
  key: jax.Array,
) -> tuple[Any, dict[str, Any]]:
  """`algorithm.aggregate` of K stacked outputs, summed first when the
  algorithm declares a `contribution` (see `sum_outputs`)."""
  if algorithm.contribution is not None:
    outputs = sum_outputs(algorithm.contribution, outputs)
  return algorithm.aggregate(state, outputs, client_ids, round_index, key)


def evaluated_model(algorithm: Algorithm, state: Any) -> Variables:
  """The global model to evaluate for server state `state`."""
  if algorithm.evaluated is None:
    return state.params
  return algorithm.evaluated(state)
