"""FedASAM and FedSAM: FedAvg whose clients train with (adaptive)
sharpness-aware minimisation.

Each local step takes two forward/backward passes on the same batch: the
gradient g at the weights w gives a perturbation eps, and the optimizer
(the papers' SGD with momentum) steps with the gradient taken at w + eps.

- SAM (Foret et al.): eps = rho * g / ||g||.
- ASAM (Kwon et al.): eps = rho * T^2 g / ||T g|| with T = |w| + eta
  element-wise, biases excepted (T = 1 for them, as in the ASAM and FedASAM
  authors' code); see `fedjax_mr.training.client.asam`.

The step loop is ordinary local training's: the same exact step counts,
the same masked last batch (both passes see the same batch and mask), the
same dropout key in both passes; BatchNorm statistics come from the first
pass. The reported training loss is the first pass's (at the unperturbed
weights). rho = 0 is FedAvg exactly (the second pass recomputes the first
pass's gradient). The server is FedAvg's, weighted by numbers of examples
as in the FedASAM authors' code (FedOpt with server SGD, lr 1).

Defaults are the FedASAM authors' CIFAR-10 settings (their published run
scripts): ASAM rho 0.7, eta 0.2; SAM rho 0.1. Their stochastic weight
averaging on the server (SWA, the paper's second ingredient) is not part
of FedASAM as the FedMR papers compare it and is not built here.

References:
  Caldarola, Caputo and Ciccone, "Improving Generalization in Federated
  Learning by Seeking Flat Minima", ECCV 2022.
  Kwon et al., "ASAM: Adaptive Sharpness-Aware Minimization for
  Scale-Invariant Learning of Deep Neural Networks", ICML 2021.
  Foret et al., "Sharpness-Aware Minimization for Efficiently Improving
  Generalization", ICLR 2021.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from fedjax_mr.algorithms import fedavg
from fedjax_mr.core import errors
from fedjax_mr.core import types
from fedjax_mr.training import client


@dataclasses.dataclass(frozen=True)
class Hparams:
  """FedASAM's local ASAM: radius rho and normalisation offset eta."""

  rho: float = 0.7
  eta: float = 0.2

  def validate(self, **setting) -> None:
    """Raises `ArgumentError` naming a bad field (`setting`: unused)."""
    del setting
    errors.check_finite('rho', self.rho)
    errors.check_finite('eta', self.eta)


@dataclasses.dataclass(frozen=True)
class SamHparams:
  """FedSAM's local SAM: radius rho."""

  rho: float = 0.1

  def validate(self, **setting) -> None:
    """Raises `ArgumentError` naming a bad field (`setting`: unused)."""
    del setting
    errors.check_finite('rho', self.rho)


def fedasam(
  local: client.LocalTraining,
  clients_per_round: int,
  rho: float = 0.7,
  eta: float = 0.2,
  weighted: bool = True,
  adaptive: bool = True,
  server_optimizer: optax.GradientTransformation | None = None,
) -> types.Algorithm:
  """Builds FedASAM (`adaptive=True`) or FedSAM (`adaptive=False`).

  Args:
    local: how clients train (model, optimizer, E, B).
    clients_per_round: K.
    rho: the neighbourhood radius, >= 0 (0: FedAvg exactly).
    eta: ASAM's offset, >= 0 (unused by SAM).
    weighted: the server's mean by numbers of examples (as FedAvg).
    adaptive: ASAM; False gives SAM.
    server_optimizer: the server step (FedAvg's; None: the plain mean).

  Returns:
    FedAvg's `Algorithm` (same server state, dispatch, aggregate and
    metrics) with the two-pass local step.
  """
  if adaptive:
    Hparams(rho, eta).validate()
  else:
    SamHparams(rho).validate()
  return _fedasam(
    local, clients_per_round, rho, eta, weighted, adaptive, server_optimizer
  )


def _fedasam(
  local: client.LocalTraining,
  clients_per_round: int,
  rho: float = 0.7,
  eta: float = 0.2,
  weighted: bool = True,
  adaptive: bool = True,
  server_optimizer: optax.GradientTransformation | None = None,
) -> types.Algorithm:
  """`fedasam` from validated hyper-parameters (the registry's `build` and
  `build_sam`: the config layer validated them)."""
  if adaptive:
    perturbation = client.asam(rho, eta)
  else:
    perturbation = client.sam(rho)
  update = client.make_local_update(local, perturbation=perturbation)
  algorithm = fedavg.fedavg(
    local, clients_per_round, weighted, server_optimizer
  )
  return algorithm._replace(client_update=client.trains_shared(update))


def build(setting: Any, hp: Hparams) -> types.Algorithm:
  """The registry's factory for FedASAM."""
  return _fedasam(
    setting.local,
    setting.clients_per_round,
    hp.rho,
    hp.eta,
    setting.weighted,
    server_optimizer=setting.server_optimizer,
  )


def build_sam(setting: Any, hp: SamHparams) -> types.Algorithm:
  """The registry's factory for FedSAM."""
  return _fedasam(
    setting.local,
    setting.clients_per_round,
    hp.rho,
    weighted=setting.weighted,
    adaptive=False,
    server_optimizer=setting.server_optimizer,
  )
