"""FedExP: FedAvg with an adaptive server step size (extrapolation).

With the K uploaded models w_i, the global model w_t and the pseudo-
gradients Delta_i = w_t - w_i, Delta = sum_i p_i Delta_i, the server sets

  eta_g = max(1, sum_i p_i ||Delta_i||^2 / (2 (||Delta||^2 + eps)))
  w_{t+1} = w_t - eta_g Delta

(p_i = 1/K, the paper's plain mean, by default; by numbers of examples
with `weighted`). Since sum_i p_i ||Delta_i||^2 >= ||Delta||^2, eta_g only
exceeds 1 when the clients disagree: FedAvg's step is extrapolated when
averaging has shrunk it. The update is computed as
w_{t+1} = wbar + (eta_g - 1) (wbar - w_t) with wbar the clients' mean, so
that eta_g = 1 gives FedAvg's model bit for bit. That extrapolated point
is the target of the server optimizer (`optimizers.server_step`): its
default, SGD at rate 1, lands on it exactly (the paper's FedExP), and
another (momentum, FedAdam, ...) steps along FedExP's pseudo-gradient
eta_g Delta instead of FedAvg's Delta.

The iterates oscillate, so the paper evaluates the average of the last two,
(w_t + w_{t+1}) / 2; this is the model `evaluated` returns (the algorithm's
`types.Algorithm.evaluated`), and what the experiment reports as the global
model (`average_last_two=False` evaluates w_{t+1} itself). Clients always
start from w_{t+1}.

The step size acts on the trainable parameters (norms over them too);
BatchNorm statistics are averaged as in FedAvg.

eps defaults to 1e-3, the value the paper reports for its neural-network
experiments as we read it (the paper is not among the project's shared
papers; `fedexp_epsilon` changes it).

References:
  Jhunjhunwala, Wang and Joshi, "FedExP: Speeding Up Federated Averaging
  via Extrapolation", ICLR 2023.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_mr.algorithms import fedavg
from fedjax_mr.core import errors
from fedjax_mr.core import types
from fedjax_mr.training import client
from fedjax_mr.training import optimizers


class FedExPState(NamedTuple):
  """Attributes:
  params: the global model w_t (all variables); clients start from it.
  previous: w_{t-1} (the initial model before the first round).
  server_state: the server optimizer's state.
  """

  params: types.Variables
  previous: types.Variables
  server_state: Any = ()


@dataclasses.dataclass(frozen=True)
class Hparams:
  """FedExP's eps and which model is evaluated."""

  epsilon: float = 1e-3
  average_last_two: bool = True

  def validate(self, **setting) -> None:
    """Raises `ArgumentError` naming a bad field (`setting`: unused)."""
    del setting
    if not (self.epsilon >= 0 and math.isfinite(self.epsilon)):
      raise errors.ArgumentError(
        'epsilon', f'must be finite and >= 0, got {self.epsilon}'
      )


def _sq_norm(t: types.PyTree) -> jax.Array:
  return sum(
    jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(t)
  )


def step_size(
  deltas: types.PyTree,
  weights: jax.Array,
  epsilon: float,
  mean: types.PyTree | None = None,
) -> jax.Array:
  """eta_g = max(1, sum_i p_i ||Delta_i||^2 / (2 (||Delta||^2 + eps))).

  Args:
    deltas: the K pseudo-gradients, leaves `[K, ...]`.
    weights: `[K]` p_i, summing to 1.
    epsilon: eps >= 0.
    mean: Delta = sum_i p_i Delta_i when the caller has it (the server:
      w_t minus the clients' mean); None computes it.

  Returns:
    float32 scalar.
  """
  per_client = jax.vmap(_sq_norm)(deltas)
  if mean is None:
    mean = jax.tree.map(
      lambda d: jnp.tensordot(weights, d.astype(jnp.float32), axes=1), deltas
    )
  return extrapolation(jnp.sum(weights * per_client), mean, epsilon)


def extrapolation(
  spread: jax.Array, mean: types.PyTree, epsilon: float
) -> jax.Array:
  """eta_g = max(1, spread / (2 (||mean||^2 + eps))), from `spread` =
  sum_i p_i ||Delta_i||^2 and the mean update `mean` = sum_i p_i Delta_i
  (what the server needs: a sum over clients and the mean)."""
  ratio = spread / (2 * (_sq_norm(mean) + epsilon))
  return jnp.maximum(jnp.float32(1), ratio)


def fedexp(
  local: client.LocalTraining,
  clients_per_round: int,
  epsilon: float = 1e-3,
  weighted: bool = False,
  average_last_two: bool = True,
  server_optimizer: optax.GradientTransformation | None = None,
) -> types.Algorithm:
  """Builds FedExP.

  Args:
    local: how clients train (model, optimizer, E, B).
    clients_per_round: K.
    epsilon: eps, >= 0.
    weighted: p_i by numbers of examples instead of the paper's 1/K.
    average_last_two: evaluate (w_t + w_{t+1}) / 2 (the paper) instead of
      w_{t+1}.
    server_optimizer: the step toward the extrapolated point; None:
      `optimizers.sgd(1.0)`, the paper's FedExP.

  Returns:
    An `Algorithm` with server state `FedExPState` and an `evaluated`
    function; FedAvg's clients. Metrics: 'bytes_communicated' (FedAvg's)
    and 'global_lr' (eta_g).
  """
  Hparams(epsilon, average_last_two).validate()
  return _fedexp(
    local,
    clients_per_round,
    epsilon,
    weighted,
    average_last_two,
    server_optimizer,
  )


def _fedexp(
  local: client.LocalTraining,
  clients_per_round: int,
  epsilon: float = 1e-3,
  weighted: bool = False,
  average_last_two: bool = True,
  server_optimizer: optax.GradientTransformation | None = None,
) -> types.Algorithm:
  """`fedexp` from validated hyper-parameters (the registry's
  `build`: the config layer validated them)."""
  base = fedavg.fedavg(local, clients_per_round, weighted)
  k = int(clients_per_round)
  server = server_optimizer or optimizers.sgd(1.0)

  def init(variables):
    return FedExPState(variables, variables, server.init(variables['params']))

  def dispatch(state, client_ids, round_index, key):
    del client_ids, round_index, key
    return types.Dispatch(shared=state.params)

  return types.Algorithm(
    init,
    dispatch,
    functools.partial(_client_update, base.client_update),
    functools.partial(_aggregate, server, epsilon, k),
    evaluated=functools.partial(_evaluated, average_last_two),
    clients_per_round=k,
    contribution=functools.partial(_contribution, weighted),
  )


def _client_update(
  update: Callable, shared, per_client, client_state, data, client_id, key
) -> tuple[types.ClientOutput, Any]:
  """FedAvg's client update (`update`); uploads ||Delta_i||^2 too."""
  out, client_state = update(
    shared, per_client, client_state, data, client_id, key
  )
  delta = jax.tree.map(
    lambda wi, g: g.astype(jnp.float32) - wi.astype(jnp.float32),
    out.variables['params'],
    shared['params'],
  )
  return out._replace(extra=_sq_norm(delta)), client_state


def _contribution(weighted: bool, output: types.ClientOutput) -> Any:
  part = fedavg.mean_contribution(output, weighted)
  return {**part, 'sq_norms': part['weight'] * output.extra}


def _aggregate(
  server: optax.GradientTransformation,
  epsilon: float,
  k: int,
  state: FedExPState,
  sums: types.Sums,
  client_ids: jax.Array,
  round_index: jax.Array,
  key: jax.Array,
) -> tuple[FedExPState, dict[str, jax.Array]]:
  """The extrapolated step: eta_g from the clients' spread, then the
  server optimizer's step toward the extrapolated point."""
  del client_ids, round_index, key
  mean = fedavg.mean_of(sums.total, state.params)
  w = state.params['params']
  mean_delta = jax.tree.map(
    lambda m, g: g.astype(jnp.float32) - m.astype(jnp.float32),
    mean['params'],
    w,
  )
  # sum_i p_i ||Delta_i||^2, p_i the weights of the mean.
  spread = sums.total['sq_norms'] / sums.total['weight']
  eta = extrapolation(spread, mean_delta, epsilon)
  target = jax.tree.map(
    lambda m, g: (m + (eta - 1) * (m - g)).astype(m.dtype), mean['params'], w
  )
  params, server_state = optimizers.server_step(
    server, state.server_state, w, target
  )
  new = FedExPState({**mean, 'params': params}, state.params, server_state)
  return new, {
    'bytes_communicated': fedavg.round_bytes(state.params, k),
    'global_lr': eta,
  }


def _evaluated(average_last_two: bool, state: FedExPState) -> types.Variables:
  if not average_last_two:
    return state.params
  return jax.tree.map(
    lambda a, b: ((a.astype(jnp.float32) + b) / 2).astype(a.dtype),
    state.params,
    state.previous,
  )


def build(setting: Any, hp: Hparams) -> types.Algorithm:
  """The registry's factory (see `fedjax_mr.pipeline.registry`)."""
  return _fedexp(
    setting.local,
    setting.clients_per_round,
    hp.epsilon,
    setting.weighted,
    hp.average_last_two,
    setting.server_optimizer,
  )
