"""Client and server optimizers: optax transformations that remember the
hyper-parameters they were built from.

Clients run any `optax.GradientTransformation`; the ones built here
(`sgd`, `adam`) also carry their hyper-parameters (`Optimizer.hparams`),
so a rule that needs the client's learning rate and momentum (SCAFFOLD's
control update) reads them from the optimizer itself instead of from a
copy that could disagree with it.

The server optimizer is applied to the pseudo-gradient g = w - target,
where w is the global model and target what the clients' contributions
average to (FedAvg's mean), and moves w by the optimizer's update u:
w' = w + u. `server_step` writes that as w' = target - ((-u) - g), which
equals w + u in exact arithmetic and gives `target` bit for bit when
u = -g, as SGD at learning rate 1 does: FedAvg is the server optimizer
`sgd(1.0)`. FedAvgM is `sgd(lr, momentum)`; FedAdam, FedYogi and FedAdagrad
are `fedopt(...)`, Algorithm 2 of Reddi et al. as written there (no bias
correction, tau added to the root of the second moment, which starts at
tau^2).

References:
  Reddi et al., "Adaptive Federated Optimization", ICLR 2021.
  Hsu et al., "Measuring the Effects of Non-Identical Data Distribution for
  Federated Visual Classification", arXiv:1909.06335, 2019 (FedAvgM).
"""

from __future__ import annotations

from typing import Any
from typing import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_mr.core import errors

CLIENT_OPTIMIZERS = ('sgd', 'adam')
SERVER_OPTIMIZERS = ('sgd', 'momentum', 'adam', 'yogi', 'adagrad')


class Optimizer(NamedTuple):
  """An `optax.GradientTransformation` (its `init` and `update`) with the
  name and hyper-parameters it was built from.

  Attributes:
    init: optax's `init(params) -> state`.
    update: optax's `update(updates, state, params) -> (updates, state)`.
    name: 'sgd', 'momentum', 'adam', 'yogi' or 'adagrad'.
    hparams: e.g. `{'learning_rate': 0.01, 'momentum': 0.9}`.
  """

  init: Any
  update: Any
  name: str
  hparams: Mapping[str, float]


def _positive(name: str, value: float) -> float:
  value = float(value)
  errors.check_finite(name, value, positive=True)
  return value


def _fraction(name: str, value: float) -> float:
  value = float(value)
  if not 0 <= value < 1:
    raise errors.ArgumentError(name, f'must be in [0, 1), got {value}')
  return value


def sgd(learning_rate: float, momentum: float = 0.0) -> Optimizer:
  """SGD with optional heavy-ball momentum: `optax.sgd` (momentum 0 keeps
  no trace), with its hyper-parameters readable."""
  lr = _positive('learning_rate', learning_rate)
  beta = _fraction('momentum', momentum)
  opt = optax.sgd(lr, momentum=beta or None)
  return Optimizer(
    opt.init, opt.update, 'sgd', {'learning_rate': lr, 'momentum': beta}
  )


def adam(
  learning_rate: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> Optimizer:
  """Adam (`optax.adam`, bias-corrected), with its hyper-parameters."""
  lr = _positive('learning_rate', learning_rate)
  b1, b2 = _fraction('b1', b1), _fraction('b2', b2)
  eps = _positive('eps', eps)
  opt = optax.adam(lr, b1=b1, b2=b2, eps=eps)
  hp = {'learning_rate': lr, 'b1': b1, 'b2': b2, 'eps': eps}
  return Optimizer(opt.init, opt.update, 'adam', hp)


def sgd_hparams(optimizer: Any) -> tuple[float, float] | None:
  """(learning rate, momentum) of an optimizer built by `sgd`; None for any
  other (an arbitrary optax transformation does not say its rate)."""
  if isinstance(optimizer, Optimizer) and optimizer.name == 'sgd':
    return optimizer.hparams['learning_rate'], optimizer.hparams['momentum']
  return None


def describe(optimizer: Any) -> str:
  """The optimizer's name ('adam'), or its type's for a plain optax one."""
  if isinstance(optimizer, Optimizer):
    return optimizer.name
  return type(optimizer).__name__


class FedOptState(NamedTuple):
  """Reddi et al.'s moments: `m` (first) and `v` (second), float32, shaped
  like the parameters."""

  m: Any
  v: Any


def scale_by_fedopt(
  kind: str, b1: float, b2: float, tau: float
) -> optax.GradientTransformation:
  """Algorithm 2 of Reddi et al. without its learning rate: g -> m / (sqrt(v)
  + tau), with m = b1 m + (1 - b1) g and, by `kind`, v = b2 v + (1 - b2) g^2
  ('adam'), v = v - (1 - b2) g^2 sign(v - g^2) ('yogi') or v = v + g^2
  ('adagrad'); m starts at 0 and v at tau^2.
  """
  if kind not in ('adam', 'yogi', 'adagrad'):
    raise errors.ArgumentError(
      'kind', f"must be 'adam', 'yogi' or 'adagrad', got {kind!r}"
    )

  def init(params):
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return FedOptState(m=zeros, v=jax.tree.map(lambda z: z + tau**2, zeros))

  def second(v, g2):
    if kind == 'adam':
      return b2 * v + (1 - b2) * g2
    if kind == 'yogi':
      return v - (1 - b2) * g2 * jnp.sign(v - g2)
    return v + g2

  def update(grads, state, params=None):
    del params
    g = jax.tree.map(lambda x: x.astype(jnp.float32), grads)
    m = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, state.m, g)
    v = jax.tree.map(lambda v, x: second(v, jnp.square(x)), state.v, g)
    out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + tau), m, v)
    return out, FedOptState(m=m, v=v)

  return optax.GradientTransformation(init, update)


def server_optimizer(
  name: str,
  learning_rate: float = 1.0,
  *,
  momentum: float = 0.9,
  b1: float = 0.9,
  b2: float = 0.99,
  tau: float = 1e-3,
) -> Optimizer:
  """A server optimizer by name.

  Args:
    name: 'sgd' (FedAvg at learning rate 1), 'momentum' (FedAvgM),
      'adam', 'yogi' or 'adagrad' (FedAdam, FedYogi, FedAdagrad).
    learning_rate: the server rate eta.
    momentum: FedAvgM's beta (only 'momentum').
    b1, b2: the moments' decay (the FedOpt family; b2 unused by 'adagrad').
    tau: the adaptivity constant (the FedOpt family).

  Returns:
    An `Optimizer` for `server_step`.
  """
  lr = _positive('learning_rate', learning_rate)
  if name == 'sgd':
    return sgd(lr)
  if name == 'momentum':
    beta = _fraction('momentum', momentum)
    if beta == 0:
      raise errors.ArgumentError(
        'momentum', "must be > 0 for 'momentum' (0 is 'sgd')"
      )
    opt = optax.sgd(lr, momentum=beta)
    hp = {'learning_rate': lr, 'momentum': beta}
    return Optimizer(opt.init, opt.update, name, hp)
  if name in ('adam', 'yogi', 'adagrad'):
    b1, b2 = _fraction('b1', b1), _fraction('b2', b2)
    tau = _positive('tau', tau)
    opt = optax.chain(
      scale_by_fedopt(name, b1, b2, tau), optax.scale_by_learning_rate(lr)
    )
    hp = {'learning_rate': lr, 'b1': b1, 'b2': b2, 'tau': tau}
    return Optimizer(opt.init, opt.update, name, hp)
  raise errors.ArgumentError(
    'name', f'must be one of {", ".join(SERVER_OPTIMIZERS)}, got {name!r}'
  )


def server_step(
  optimizer: optax.GradientTransformation,
  opt_state: optax.OptState,
  params: Any,
  target: Any,
) -> tuple[Any, optax.OptState]:
  """One server step from `params` toward `target` (see the module
  docstring).

  Args:
    optimizer: the server optimizer.
    opt_state: its state (`optimizer.init(params)` before the first round).
    params: the global parameters w.
    target: the clients' aggregate, shaped like `params`.

  Returns:
    `(w', new opt_state)`, `w'` in the dtypes of `target`.
  """
  g = jax.tree.map(
    lambda w, t: w.astype(jnp.float32) - t.astype(jnp.float32), params, target
  )
  u, opt_state = optimizer.update(g, opt_state, params)
  new = jax.tree.map(
    lambda t, u, g: (t.astype(jnp.float32) - (-u - g)).astype(t.dtype),
    target,
    u,
    g,
  )
  return new, opt_state
