"""SCAFFOLD: local steps corrected by control variates (option II).

The server holds the global model x and a control c; client i holds its
own control c_i (per-client state, zero at the start). A sampled client
starts from y = x and takes every local step with the corrected gradient
g(y) - c_i + c (then the optimizer; with the papers' plain SGD this is
y <- y - lr (g - c_i + c)). After its steps_i steps it sets

  c_i+ = c_i - c + (x - y_i) / (steps_i * lr)          (option II)

and uploads dy_i = y_i - x and dc_i = c_i+ - c_i. The server updates

  x <- x + eta_g * mean_i dy_i,    c <- c + (|S| / N) * mean_i dc_i.

The model step is the server optimizer's on the pseudo-gradient
x - mean_i y_i (`optimizers.server_step`): SGD at rate eta_g is the
paper's (eta_g = 1 by default: x becomes the clients' mean exactly), and
any other server optimizer (FedAvgM, FedAdam, ...) can take its place.

With heavy-ball momentum beta (the papers' clients use 0.9; SCAFFOLD's
paper uses plain SGD) the corrected gradient goes through the momentum
buffer, so n steps of a constant gradient g move y by lr * S(n) * g with

  S(n) = sum_{t=1..n} (1 - beta^t) / (1 - beta),

not by lr * n * g: the literal formula then makes c_i about 1 / (1 - beta)
times the client's gradient, and that amplified control, amplified again
by the momentum, feeds back into the next round. Measured on the FMNIST
table setting (momentum 0.9) it diverges (NaN by round 8-13). The default
`control_steps='effective'` therefore divides by S(steps_i) instead of
steps_i, so c_i estimates the gradient at any momentum; S(n) = n for
beta = 0, where both choices are the paper's option II exactly.
`control_steps='taken'` keeps the literal steps_i.

Controls cover the trainable parameters; BatchNorm statistics are averaged
as in FedAvg. The mean over dy is plain, as in the paper (`weighted` uses
numbers of examples instead); the control mean is always plain. Each
client's steps_i is its own exact step count.

Memory: the N client controls are model-sized, `[N, ...]` in the round
state, stored in `control_dtype` (float32, or bfloat16 for half the
memory; the server's c and all arithmetic stay float32, and dc_i is taken
from the stored value, so c remains the mean of the stored c_i).

References:
  Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for
  Federated Learning", ICML 2020, Algorithm 1 (option II).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_mr.algorithms import fedavg
from fedjax_mr.core import errors
from fedjax_mr.core import tree
from fedjax_mr.core import types
from fedjax_mr.training import client
from fedjax_mr.training import optimizers

CONTROL_DTYPES = ('float32', 'bfloat16')
CONTROL_STEPS = ('effective', 'taken')


class ScaffoldState(NamedTuple):
  """Attributes:
  params: the global model x (all variables).
  control: the server control c, shaped like `params['params']`, float32.
  server_state: the server optimizer's state.
  """

  params: types.Variables
  control: types.PyTree
  server_state: Any = ()


@dataclasses.dataclass(frozen=True)
class Hparams:
  """The storage and the step count of the client controls (the global
  step size eta_g is the server optimizer's learning rate)."""

  control_dtype: str = 'float32'
  control_steps: str = 'effective'

  def validate(self, **setting) -> None:
    """Raises `ArgumentError` naming a bad field (`setting`: unused)."""
    del setting
    if self.control_dtype not in CONTROL_DTYPES:
      raise errors.ArgumentError(
        'control_dtype',
        f'must be one of {", ".join(CONTROL_DTYPES)}, got '
        f'{self.control_dtype!r}',
      )
    if self.control_steps not in CONTROL_STEPS:
      raise errors.ArgumentError(
        'control_steps',
        f'must be one of {", ".join(CONTROL_STEPS)}, got '
        f'{self.control_steps!r}',
      )


def corrected_gradient(grads, params, context):
  """g - c_i + c; `context` is (c_i, c)."""
  del params
  c_i, c = context
  return jax.tree.map(
    lambda g, ci, cs: (g - ci + cs).astype(g.dtype), grads, c_i, c
  )


def effective_steps(num_steps: jax.Array, momentum: float) -> jax.Array:
  """S(n) = sum_{t=1..n} (1 - beta^t) / (1 - beta): how many plain-SGD steps
  of the same size n heavy-ball steps (buffer starting at zero) move a
  constant gradient. S(n) = n for beta = 0; float32.

  Summed term by term (a scalar loop of n steps): the closed form
  (n - beta (1 - beta^n) / (1 - beta)) / (1 - beta) cancels badly in
  float32 for beta near 1 (relative error 6e-5 at beta = 0.99, 4e-3 at
  0.999, against 1e-6 and 8e-6 for the sum).
  """
  n = num_steps.astype(jnp.int32)
  if momentum == 0:
    return n.astype(jnp.float32)
  b = jnp.float32(momentum)

  def body(_, carry):
    g, total = carry
    g = b * g + 1
    return g, total + g

  zero = jnp.float32(0)
  return jax.lax.fori_loop(0, n, body, (zero, zero))[1]


def control_update(
  c_i: types.PyTree,
  c: types.PyTree,
  x: types.PyTree,
  y: types.PyTree,
  num_steps: jax.Array,
  learning_rate: float,
) -> types.PyTree:
  """Option II: c_i+ = c_i - c + (x - y) / (num_steps * learning_rate).

  `num_steps` may be fractional (`effective_steps`).
  """
  scale = 1.0 / (num_steps.astype(jnp.float32) * learning_rate)
  return jax.tree.map(
    lambda ci, cs, a, b: ci - cs + (a - b) * scale, c_i, c, x, y
  )


def zero_controls(variables: types.Variables) -> types.PyTree:
  """Zero controls: float32 zeros shaped like `variables['params']`."""
  return jax.tree.map(
    lambda p: jnp.zeros(p.shape, jnp.float32), variables['params']
  )


def client_control(
  c_i: types.PyTree,
  c: types.PyTree,
  x: types.PyTree,
  y: types.PyTree,
  num_steps: jax.Array,
  learning_rate: float,
  storage: jnp.dtype,
) -> tuple[types.PyTree, types.PyTree]:
  """A client's new control as stored and its upload dc_i.

  Args:
    c_i: the client's control (float32).
    c, x, y, num_steps, learning_rate: as for `control_update`.
    storage: the dtype the controls are stored in.

  Returns:
    `(stored, delta)`: c_i+ (`control_update`) in `storage`, and dc_i, the
    stored value minus c_i in float32 (so the server's c stays the mean of
    the stored controls).
  """
  new = control_update(c_i, c, x, y, num_steps, learning_rate)
  stored = jax.tree.map(lambda v: v.astype(storage), new)
  delta = jax.tree.map(lambda s, old: s.astype(jnp.float32) - old, stored, c_i)
  return stored, delta


def contribution(output: types.ClientOutput, weighted: bool) -> dict[str, Any]:
  """One client's part of SCAFFOLD's sums: FedAvg's mean of the models
  (`fedavg.mean_contribution`) and its control delta dc_i (float32)."""
  return {
    **fedavg.mean_contribution(output, weighted),
    'controls': jax.tree.map(lambda d: d.astype(jnp.float32), output.extra),
  }


def server_update(
  server: optax.GradientTransformation,
  state: ScaffoldState,
  sums: types.Sums,
  clients_per_round: int,
  num_clients: int,
) -> tuple[ScaffoldState, dict[str, jax.Array]]:
  """SCAFFOLD's aggregation from the round's summed `contribution`s: the
  `server` step on x - mean_i y_i (the mean by examples with `weighted`;
  BatchNorm statistics become that mean) and c <- c + (K / N) mean_i
  dc_i; metrics 'bytes_communicated' and 'control_norm'."""
  k, n = clients_per_round, num_clients
  mean = fedavg.mean_of(sums.total, state.params)
  params, server_state = optimizers.server_step(
    server, state.server_state, state.params['params'], mean['params']
  )
  control = jax.tree.map(
    lambda c, d: c + (k / n) * (d / k).astype(c.dtype),
    state.control,
    sums.total['controls'],
  )
  metrics = {
    'bytes_communicated': jnp.float32(
      2 * k * (tree.nbytes(state.params) + tree.nbytes(state.control))
    ),
    'control_norm': jnp.sqrt(
      sum(jnp.sum(jnp.square(c)) for c in jax.tree.leaves(control))
    ),
  }
  new_params = {**mean, 'params': params}
  new = ScaffoldState(new_params, control, server_state)
  return new, metrics


def _sgd_of(local: client.LocalTraining) -> tuple[float, float]:
  """The clients' SGD learning rate and momentum; raises `ArgumentError`
  naming `optimizer` for any other optimizer."""
  hp = optimizers.sgd_hparams(local.optimizer)
  if hp is None:
    got = optimizers.describe(local.optimizer)
    raise errors.ArgumentError(
      'optimizer',
      "must be sgd for SCAFFOLD's control update (it needs the clients' "
      f'learning rate and momentum), got {got}',
    )
  return hp


def scaffold(
  local: client.LocalTraining,
  clients_per_round: int,
  num_clients: int,
  control_dtype: str = 'float32',
  weighted: bool = False,
  control_steps: str = 'effective',
  server_optimizer: optax.GradientTransformation | None = None,
) -> types.Algorithm:
  """Builds SCAFFOLD (option II control variates).

  Args:
    local: how clients train; its optimizer must be `optimizers.sgd`,
      whose learning rate (and, for `control_steps='effective'`, momentum)
      enter the control update.
    clients_per_round: K = |S|.
    num_clients: N.
    control_dtype: storage of the client controls, see `CONTROL_DTYPES`.
    weighted: average dy by numbers of examples instead of the plain mean.
    control_steps: 'effective' divides x - y by `effective_steps` (the
      paper's option II at momentum 0, stable with momentum); 'taken' by
      the steps taken (the literal formula at any momentum).
    server_optimizer: the model's server step on x - mean_i y_i; None:
      `optimizers.sgd(1.0)` (eta_g = 1, the paper's).

  Returns:
    An `Algorithm` with server state `ScaffoldState` and per-client state
    c_i (leaves `[N, ...]` in the round state). Uploads: the model and dc_i
    (`ClientOutput.extra`). Metrics: 'bytes_communicated' (x and c down, y
    and dc up, for each of the K clients), 'control_norm' (||c||).
  """
  Hparams(control_dtype, control_steps).validate()
  return _scaffold(
    local,
    clients_per_round,
    num_clients,
    control_dtype,
    weighted,
    control_steps,
    server_optimizer,
  )


def _scaffold(
  local: client.LocalTraining,
  clients_per_round: int,
  num_clients: int,
  control_dtype: str = 'float32',
  weighted: bool = False,
  control_steps: str = 'effective',
  server_optimizer: optax.GradientTransformation | None = None,
) -> types.Algorithm:
  """`scaffold` from validated hyper-parameters (the registry's
  `build`: the config layer validated them)."""
  k = errors.check_count('clients_per_round', clients_per_round)
  n = int(num_clients)
  if n < k:
    raise ValueError(f'num_clients must be >= clients_per_round, got {n}')
  lr, momentum = _sgd_of(local)
  beta = momentum if control_steps == 'effective' else 0.0
  server = server_optimizer or optimizers.sgd(1.0)
  storage = jnp.dtype(control_dtype)
  update = client.make_local_update(local, grad_correction=corrected_gradient)

  def init(variables):
    return ScaffoldState(
      params=variables,
      control=zero_controls(variables),
      server_state=server.init(variables['params']),
    )

  def init_client_state(variables):
    return jax.tree.map(lambda c: c.astype(storage), zero_controls(variables))

  def dispatch(state, client_ids, round_index, key):
    del client_ids, round_index, key
    return types.Dispatch(shared=(state.params, state.control))

  def aggregate(state, sums, client_ids, round_index, key):
    del client_ids, round_index, key
    return server_update(server, state, sums, k, n)

  return types.Algorithm(
    init,
    dispatch,
    functools.partial(_client_update, update, lr, beta, storage),
    aggregate,
    init_client_state=init_client_state,
    clients_per_round=k,
    contribution=lambda output: contribution(output, weighted),
    # The model beside the server control (what DP clips the update from).
    client_model=lambda shared, row: shared[0],
  )


def _client_update(
  update: Callable,
  lr: float,
  beta: float,
  storage: jnp.dtype,
  shared: Any,
  per_client: Any,
  c_i: Any,
  data: Any,
  client_id: jax.Array,
  key: jax.Array,
) -> tuple[types.ClientOutput, Any]:
  """Corrected local training (`update`) from x with c and c_i; uploads
  dc_i, keeps the new c_i (stored as `storage`)."""
  del per_client
  variables, c = shared
  c_i = jax.tree.map(lambda v: v.astype(jnp.float32), c_i)
  out = update(variables, data, client_id, key, (c_i, c))
  stored, delta = client_control(
    c_i,
    c,
    variables['params'],
    out.variables['params'],
    effective_steps(out.num_steps, beta),
    lr,
    storage,
  )
  return out._replace(extra=delta), stored


def build(setting: Any, hp: Hparams) -> types.Algorithm:
  """The registry's factory (see `fedjax_mr.pipeline.registry`)."""
  return _scaffold(
    setting.local,
    setting.clients_per_round,
    setting.num_clients,
    hp.control_dtype,
    setting.weighted,
    hp.control_steps,
    setting.server_optimizer,
  )
