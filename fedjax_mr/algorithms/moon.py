"""MOON: model-contrastive federated learning.

Each client adds to its task loss a contrastive term that pulls the
representation z of its current model towards the global model's, z_glob,
and pushes it away from its own previous local model's, z_prev, on the
same inputs:

  l_con = -log( exp(cos(z, z_glob) / tau)
                / (exp(cos(z, z_glob) / tau) + exp(cos(z, z_prev) / tau)) )

  loss = cross-entropy + mu * l_con          (per example, then the mean)

The representation is the output of a projection head (a two-layer MLP,
256 outputs) that sits between the network's body and its output layer,
as in the paper: `fedjax_mr.models.projection.with_projection`, applied to
the model by the experiment programs (`moon_projection_dim`; 0 uses the
input of the model's own last layer instead, for an unchanged network).
z comes from the training forward pass itself (no second pass); z_glob and
z_prev from inference-mode passes of the two frozen models, as in the
authors' code. The server is FedAvg's, weighted by numbers of examples as
in the authors' code.

Each client's previous model (all its variables) is per-client state,
`[N, ...]` in the round state. A client that has never trained has no
previous model; its l_con has no negative and is 0 (the authors' code
behaves so in the first round, when its model pool is still empty; with
partial participation a client's first round can come at any time). Only
the last previous model is kept (the authors' default buffer of one).

mu = 0 is FedAvg on the same network exactly.

Defaults: tau = 0.5 and P = 256 (the paper); mu = 1, the authors' code's
default and the paper's choice for CIFAR-100 and Tiny-ImageNet (it
reports mu = 5 as best on CIFAR-10).

References:
  Li, He and Song, "Model-Contrastive Federated Learning", CVPR 2021.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_mr.algorithms import fedavg
from fedjax_mr.core import errors
from fedjax_mr.core import types
from fedjax_mr.models import model as model_lib
from fedjax_mr.models import projection
from fedjax_mr.training import client

# torch.nn.CosineSimilarity's default eps: the product of the norms is
# clamped below by it.
COSINE_EPS = 1e-8


class PreviousModel(NamedTuple):
  """One client's persistent state.

  Attributes:
    variables: the client's model after its last local training.
    valid: bool scalar, False until the client has trained once.
  """

  variables: types.Variables
  valid: jax.Array


@dataclasses.dataclass(frozen=True)
class Hparams:
  """MOON's contrastive weight and temperature and its projection head."""

  mu: float = 1.0
  temperature: float = 0.5
  projection_dim: int = 256

  def validate(self, **setting) -> None:
    """Raises `ArgumentError` naming a bad field (`setting`: unused)."""
    del setting
    if not (math.isfinite(self.mu) and self.mu >= 0):
      raise errors.ArgumentError(
        'mu', f'must be finite and >= 0, got {self.mu}'
      )
    if not (math.isfinite(self.temperature) and self.temperature > 0):
      raise errors.ArgumentError(
        'temperature', f'must be finite and > 0, got {self.temperature}'
      )
    if not 0 <= self.projection_dim <= MAX_PROJECTION_DIM:
      # Bounded before the head is built: its weights grow with it.
      raise errors.ArgumentError(
        'projection_dim',
        f'must be in [0, {MAX_PROJECTION_DIM:,}], got {self.projection_dim:,}',
      )


# The widest projection head `projection_dim` may ask for.
MAX_PROJECTION_DIM = 65_536


def cosine(a: jax.Array, b: jax.Array) -> jax.Array:
  """Row-wise cosine similarity of `[B, D]` arrays: `[B]`.

  a.b / sqrt(max(|a|^2 |b|^2, eps^2)), from squared norms: a zero row (a
  ReLU layer that is all zero for an example makes the projection its
  bias, zero at initialisation) gives cosine 0 and a finite gradient,
  where the gradient of |a| itself is 0/0.
  """
  sq = jnp.sum(a * a, axis=-1) * jnp.sum(b * b, axis=-1)
  return jnp.sum(a * b, axis=-1) / jnp.sqrt(jnp.maximum(sq, COSINE_EPS**2))


def contrastive_loss(
  z: jax.Array,
  z_glob: jax.Array,
  z_prev: jax.Array,
  has_previous: jax.Array,
  temperature: float,
) -> jax.Array:
  """MOON's l_con per example, `[B]` (see the module docstring).

  -log(e^a / (e^a + e^b)) = softplus(b - a) with a = cos(z, z_glob) / tau,
  b = cos(z, z_prev) / tau; 0 where `has_previous` is False.
  """
  a = cosine(z, z_glob) / temperature
  b = cosine(z, z_prev) / temperature
  return jnp.where(has_previous, jax.nn.softplus(b - a), 0.0)


def wrap_model(model: model_lib.Model, hp: Hparams) -> model_lib.Model:
  """The network MOON trains: `model` with the projection head (none for
  `projection_dim` 0)."""
  if hp.projection_dim == 0:
    return model
  return projection.with_projection(model, hp.projection_dim)


def moon(
  local: client.LocalTraining,
  clients_per_round: int,
  mu: float = 1.0,
  temperature: float = 0.5,
  weighted: bool = True,
  server_optimizer: optax.GradientTransformation | None = None,
) -> types.Algorithm:
  """Builds MOON.

  Args:
    local: how clients train; `local.model` is the network as trained
      (`wrap_model` adds the paper's projection head); its representation
      (`apply_train_features`) is what l_con compares.
    clients_per_round: K.
    mu: weight of l_con, >= 0 (0: FedAvg exactly).
    temperature: tau > 0.
    weighted: the server's mean by numbers of examples (as FedAvg).
    server_optimizer: the server step (FedAvg's; None: the plain mean).

  Returns:
    FedAvg's server (state, dispatch, aggregate, metrics) with MOON's local
    loss and per-client state `PreviousModel`.
  """
  Hparams(mu, temperature).validate()
  return _moon(
    local, clients_per_round, mu, temperature, weighted, server_optimizer
  )


def _moon(
  local: client.LocalTraining,
  clients_per_round: int,
  mu: float = 1.0,
  temperature: float = 0.5,
  weighted: bool = True,
  server_optimizer: optax.GradientTransformation | None = None,
) -> types.Algorithm:
  """`moon` from validated hyper-parameters (the registry's
  `build`: the config layer validated them)."""
  model = local.model

  def representation_loss(z, params, context, batch, key):
    del params, key
    global_vars, previous = context
    frozen = jax.lax.stop_gradient
    z_glob = frozen(model.apply_features(global_vars, batch.x))
    z_prev = frozen(model.apply_features(previous.variables, batch.x))
    per_example = contrastive_loss(
      z, z_glob, z_prev, previous.valid, temperature
    )
    real = jnp.sum(batch.mask)
    return mu * jnp.sum(per_example * batch.mask) / jnp.maximum(real, 1.0)

  update = client.make_local_update(
    local, representation_loss=representation_loss
  )
  algorithm = fedavg.fedavg(
    local, clients_per_round, weighted, server_optimizer
  )

  def init_client_state(variables):
    return PreviousModel(
      variables=jax.tree.map(jnp.asarray, variables),
      valid=jnp.zeros((), jnp.bool_),
    )

  def client_update(shared, per_client, previous, data, client_id, key):
    del per_client
    out = update(shared, data, client_id, key, (shared, previous))
    stored = jax.tree.map(
      lambda new, old: new.astype(old.dtype), out.variables, previous.variables
    )
    return out, PreviousModel(stored, jnp.ones((), jnp.bool_))

  return algorithm._replace(
    client_update=client_update, init_client_state=init_client_state
  )


def build(setting: Any, hp: Hparams) -> types.Algorithm:
  """The registry's factory (`setting.local.model` is already
  `wrap_model`'s)."""
  return _moon(
    setting.local,
    setting.clients_per_round,
    hp.mu,
    hp.temperature,
    setting.weighted,
    setting.server_optimizer,
  )
