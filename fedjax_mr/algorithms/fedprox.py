"""FedProx: FedAvg whose clients add a proximal term to their local loss.

Client k minimises F_k(w) + mu/2 * ||w - w_t||^2 around the global model
w_t it was sent (over the trainable parameters, not BatchNorm statistics);
the server is FedAvg's. mu = 0 is FedAvg exactly.

References:
  Li et al., "Federated Optimization in Heterogeneous Networks", MLSys
  2020 (the FedMR and FedMut papers compare against it with mu = 0.01).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedjax_mr.algorithms import fedavg
from fedjax_mr.core import errors
from fedjax_mr.core import types
from fedjax_mr.training import client


@dataclasses.dataclass(frozen=True)
class Hparams:
  """Attributes: mu: weight of the proximal term (papers: 0.01)."""

  mu: float = 0.01

  def validate(self, **setting) -> None:
    """Raises `ArgumentError` naming a bad field (`setting`: unused)."""
    del setting
    if not (self.mu >= 0 and math.isfinite(self.mu)):
      raise errors.ArgumentError(
        'mu', f'must be finite and >= 0, got {self.mu}'
      )


def proximal_term(mu: float) -> client.LossTerm:
  """`mu/2 * ||params - global params||^2` (the context is the global
  model's variables)."""

  def term(params, global_variables, batch):
    del batch
    sq = sum(
      jnp.sum(jnp.square(w - g))
      for w, g in zip(
        jax.tree.leaves(params),
        jax.tree.leaves(global_variables['params']),
      )
    )
    return 0.5 * mu * sq

  return term


def fedprox(
  local: client.LocalTraining,
  clients_per_round: int,
  mu: float = 0.01,
  weighted: bool = True,
  server_optimizer: optax.GradientTransformation | None = None,
) -> types.Algorithm:
  """Builds FedProx.

  Args:
    local: how clients train (model, optimizer, E, B).
    clients_per_round: K.
    mu: weight of the proximal term, >= 0.
    weighted: the server's mean by numbers of examples (as FedAvg).
    server_optimizer: the server step (FedAvg's; None: the plain mean).

  Returns:
    FedAvg's `Algorithm` (same server state, dispatch, aggregate and
    metrics) with the proximal local update.
  """
  Hparams(mu=mu).validate()
  return _fedprox(local, clients_per_round, mu, weighted, server_optimizer)


def _fedprox(
  local: client.LocalTraining,
  clients_per_round: int,
  mu: float = 0.01,
  weighted: bool = True,
  server_optimizer: optax.GradientTransformation | None = None,
) -> types.Algorithm:
  """`fedprox` from validated hyper-parameters (the registry's
  `build`: the config layer validated them)."""
  update = client.make_local_update(local, loss_term=proximal_term(mu))
  # The global model is both the start and the proximal centre.
  algorithm = fedavg.fedavg(
    local, clients_per_round, weighted, server_optimizer
  )
  return algorithm._replace(
    client_update=client.trains_shared(update, context_of=lambda v: (v, v))
  )


def build(setting: Any, hp: Hparams) -> types.Algorithm:
  """The registry's factory (see `fedjax_mr.pipeline.registry`)."""
  return _fedprox(
    setting.local,
    setting.clients_per_round,
    hp.mu,
    setting.weighted,
    setting.server_optimizer,
  )
