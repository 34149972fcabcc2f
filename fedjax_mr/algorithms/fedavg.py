"""FedAvg: clients train the global model; the server averages them.

The server moves the global parameters toward the clients' mean with a
server optimizer on the pseudo-gradient w - mean (`optimizers.server_step`):
SGD at learning rate 1, the default, is FedAvg itself (the mean, bit for
bit); SGD with momentum is FedAvgM, and the FedOpt family gives FedAdam,
FedYogi and FedAdagrad. BatchNorm statistics are always the clients' mean.

References:
  McMahan et al., "Communication-Efficient Learning of Deep Networks from
  Decentralized Data", AISTATS 2017.
  Reddi et al., "Adaptive Federated Optimization", ICLR 2021.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_mr.core import errors
from fedjax_mr.core import tree
from fedjax_mr.core import types
from fedjax_mr.training import client
from fedjax_mr.training import optimizers


class FedAvgState(NamedTuple):
  """Attributes:
  params: the global model variables (params and BatchNorm statistics).
  server_state: the server optimizer's state (no arrays for plain SGD).
  """

  params: types.Variables
  server_state: Any = ()


@dataclasses.dataclass(frozen=True)
class Hparams:
  """FedAvg has no hyper-parameters of its own."""

  def validate(self, **setting) -> None:
    del setting


def server_aggregate(
  outputs: types.ClientOutput, weighted: bool
) -> types.Variables:
  """The (example-weighted or plain) mean of the K uploaded models, all at
  once: FedAvg's own mean (`mean_contribution` summed, `mean_of`) with
  the same operations, so an algorithm that reduces to FedAvg matches its
  stacked round bit for bit."""
  total = types.sum_outputs(
    lambda output: mean_contribution(output, weighted), outputs
  ).total
  return mean_of(total, jax.tree.map(lambda x: x[0], outputs.variables))


def mean_contribution(
  output: types.ClientOutput, weighted: bool
) -> dict[str, Any]:
  """One client's part of the (example-weighted or plain) mean: its
  weight w (n or 1) and w times its model, in float32."""
  w = output.num_examples.astype(jnp.float32) if weighted else jnp.float32(1)
  return {
    'weight': w,
    'models': jax.tree.map(
      lambda x: w * x.astype(jnp.float32), output.variables
    ),
  }


def mean_of(total: dict[str, Any], like: types.Variables) -> types.Variables:
  """The mean from summed `mean_contribution`s, each leaf in the dtype of
  `like`'s (the global model's)."""
  return jax.tree.map(
    lambda m, v: (m / total['weight']).astype(v.dtype), total['models'], like
  )


def server_update(
  optimizer: optax.GradientTransformation,
  state: FedAvgState,
  mean: types.Variables,
) -> FedAvgState:
  """The server's step from `state` toward the clients' `mean`: the server
  optimizer on the parameters, the mean for every other collection."""
  params, server_state = optimizers.server_step(
    optimizer, state.server_state, state.params['params'], mean['params']
  )
  return FedAvgState({**mean, 'params': params}, server_state)


def round_bytes(variables: types.Variables, k: int) -> Any:
  """K models down and K up, as a float32 scalar."""
  return jnp.float32(2 * k * tree.nbytes(variables))


def fedavg(
  local: client.LocalTraining,
  clients_per_round: int,
  weighted: bool = True,
  server_optimizer: optax.GradientTransformation | None = None,
) -> types.Algorithm:
  """Builds FedAvg (FedAvgM, FedAdam, ... with another server optimizer).

  Args:
    local: how clients train (model, optimizer, E, B).
    clients_per_round: K.
    weighted: weight each client by its number of examples (McMahan et al.);
      False gives the unweighted mean of the K models (as FedMR/FedMut's
      reference code does for its global model).
    server_optimizer: the server's step on the pseudo-gradient; None:
      `optimizers.sgd(1.0)`, the plain mean.

  Returns:
    An `Algorithm` whose server state is a `FedAvgState`; the global model
    is sent once as the dispatch's shared part, and the server needs only
    sums (`contribution`: `mean_contribution`). Metrics:
    'bytes_communicated'.
  """
  k = errors.check_count('clients_per_round', clients_per_round)
  update = client.make_local_update(local)
  server = server_optimizer or optimizers.sgd(1.0)

  def init(variables):
    return FedAvgState(variables, server.init(variables['params']))

  def dispatch(state, client_ids, round_index, key):
    del client_ids, round_index, key
    return types.Dispatch(shared=state.params)

  def aggregate(state, sums, client_ids, round_index, key):
    del client_ids, round_index, key
    mean = mean_of(sums.total, state.params)
    return server_update(server, state, mean), {
      'bytes_communicated': round_bytes(state.params, k)
    }

  return types.Algorithm(
    init,
    dispatch,
    client.trains_shared(update),
    aggregate,
    clients_per_round=k,
    contribution=lambda output: mean_contribution(output, weighted),
  )


def build(setting: Any, hp: Hparams) -> types.Algorithm:
  """The registry's factory (see `fedjax_mr.pipeline.registry`)."""
  del hp
  return fedavg(
    setting.local,
    setting.clients_per_round,
    setting.weighted,
    setting.server_optimizer,
  )
