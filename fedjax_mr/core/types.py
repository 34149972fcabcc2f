"""The interfaces every federated algorithm plugs into.

A round (see `fedjax_mr.training.engine`) is::

  server.dispatch(state) -> client inputs [K, ...]
  client_update(input_k, data, client_id_k, key_k) for each of the K clients
  server.aggregate(state, client outputs [K, ...]) -> new state, metrics

All functions are pure and jit-compatible; hyper-parameters are closed over
by the factory that builds them.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import NamedTuple

import jax

PyTree = Any
# A model's variables: {'params': ..., 'batch_stats': ...} (the latter only
# for models with BatchNorm). Every leaf is a "layer" for FedMR and FedMut.
Variables = dict[str, PyTree]


class ClientOutput(NamedTuple):
  """What one client returns after local training.

  In the engine these are stacked over the K clients of a round, so every
  field gains a leading `[K]` axis.

  Attributes:
    variables: the locally trained model variables.
    num_examples: int32 scalar, the client's number of training examples.
    loss: float32 scalar, mean training loss over every example seen in
      local training.
    num_steps: int32 scalar, local optimisation steps taken.
  """

  variables: Variables
  num_examples: jax.Array
  loss: jax.Array
  num_steps: jax.Array


class ServerTransform(NamedTuple):
  """A server algorithm: three pure functions built by a factory.

  Attributes:
    init: `init(variables) -> state`; `variables` is the initial model. The
      state exposes `.params`, the global model (all variables) used for
      evaluation.
    dispatch: `dispatch(state, round, key) -> client_variables` with leaves
      `[K, ...]`: the model each of the K sampled clients starts from.
    aggregate: `aggregate(state, outputs, round, key) -> (state, metrics)`;
      `outputs` is a `ClientOutput` with leaves `[K, ...]`; `metrics` is a
      dict of scalars.
    shared_dispatch: optional, for transforms whose K clients all start
      from one model: `shared_dispatch(state, round, key) -> variables`
      (no `[K]` axis), such that `dispatch` is its broadcast. The engine
      then hands that one model to every client and never holds K copies
      of it (K model copies fewer in memory in large cohorts).
  """

  init: Callable[[Variables], Any]
  dispatch: Callable[[Any, jax.Array, jax.Array], Variables]
  aggregate: Callable[
    [Any, ClientOutput, jax.Array, jax.Array], tuple[Any, dict[str, Any]]
  ]
  shared_dispatch: Callable[[Any, jax.Array, jax.Array], Variables] | None = (
    None
  )


# client_update(variables, data, client_id, key) -> ClientOutput
ClientUpdate = Callable[[Variables, Any, jax.Array, jax.Array], ClientOutput]
