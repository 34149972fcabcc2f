"""SCAFFOLD: local steps corrected by control variates (option II).

The server holds the global model x and a control c; client i holds its
own control c_i (per-client state, zero at the start). A sampled client
starts from y = x and takes every local step with the corrected gradient
g(y) - c_i + c (then the optimizer; with the papers' plain SGD this is
y <- y - lr (g - c_i + c)). After its steps_i steps it sets

  c_i+ = c_i - c + (x - y_i) / (steps_i * lr)          (option II)

and uploads dy_i = y_i - x and dc_i = c_i+ - c_i. The server updates

  x <- x + eta_g * mean_i dy_i,    c <- c + (|S| / N) * mean_i dc_i.

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
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_mr.core import errors
from fedjax_mr.core import tree
from fedjax_mr.core import types
from fedjax_mr.training import client

CONTROL_DTYPES = ('float32', 'bfloat16')


class ScaffoldState(NamedTuple):
  """Attributes:
  params: the global model x (all variables).
  control: the server control c, shaped like `params['params']`, float32.
  """

  params: types.Variables
  control: types.PyTree


@dataclasses.dataclass(frozen=True)
class Hparams:
  """SCAFFOLD's server step size and the storage of client controls."""

  global_lr: float = dataclasses.field(
    default=1.0,
    metadata={'help': 'Global step size eta_g of the model update (paper: 1).'},
  )
  control_dtype: str = dataclasses.field(
    default='float32',
    metadata={
      'help': 'Storage dtype of the N client controls (bfloat16 halves '
      'their memory).',
      'choices': CONTROL_DTYPES,
    },
  )

  def validate(self, **setting) -> None:
    """Raises `ArgumentError` naming a bad field (`setting`: unused)."""
    del setting
    if not (self.global_lr > 0 and math.isfinite(self.global_lr)):
      raise errors.ArgumentError(
        'global_lr', f'must be finite and > 0, got {self.global_lr}'
      )
    if self.control_dtype not in CONTROL_DTYPES:
      raise errors.ArgumentError(
        'control_dtype',
        f'must be one of {", ".join(CONTROL_DTYPES)}, got '
        f'{self.control_dtype!r}',
      )


def corrected_gradient(grads, params, context):
  """g - c_i + c; `context` is (c_i, c)."""
  del params
  c_i, c = context
  return jax.tree.map(
    lambda g, ci, cs: (g - ci + cs).astype(g.dtype), grads, c_i, c
  )


def control_update(
  c_i: types.PyTree,
  c: types.PyTree,
  x: types.PyTree,
  y: types.PyTree,
  num_steps: jax.Array,
  learning_rate: float,
) -> types.PyTree:
  """Option II: c_i+ = c_i - c + (x - y) / (num_steps * learning_rate)."""
  scale = 1.0 / (num_steps.astype(jnp.float32) * learning_rate)
  return jax.tree.map(
    lambda ci, cs, a, b: ci - cs + (a - b) * scale, c_i, c, x, y
  )


def scaffold(
  local: client.LocalTraining,
  clients_per_round: int,
  num_clients: int,
  global_lr: float = 1.0,
  control_dtype: str = 'float32',
  weighted: bool = False,
) -> types.Algorithm:
  """Builds SCAFFOLD (option II control variates).

  Args:
    local: how clients train; `local.learning_rate` enters the control
      update.
    clients_per_round: K = |S|.
    num_clients: N.
    global_lr: eta_g.
    control_dtype: storage of the client controls, see `CONTROL_DTYPES`.
    weighted: average dy by numbers of examples instead of the plain mean.

  Returns:
    An `Algorithm` with server state `ScaffoldState` and per-client state
    c_i (leaves `[N, ...]` in the round state). Uploads: the model and dc_i
    (`ClientOutput.extra`). Metrics: 'bytes_communicated' (x and c down, y
    and dc up, for each of the K clients), 'control_norm' (||c||).
  """
  Hparams(global_lr, control_dtype).validate()
  k, n = int(clients_per_round), int(num_clients)
  if k < 1:
    raise ValueError(f'clients_per_round must be >= 1, got {k}')
  if n < k:
    raise ValueError(f'num_clients must be >= clients_per_round, got {n}')
  lr = float(local.learning_rate)
  if not (lr > 0 and math.isfinite(lr)):
    raise ValueError(
      f'local.learning_rate must be finite and > 0 for SCAFFOLD, got {lr}'
    )
  storage = jnp.dtype(control_dtype)
  update = client.make_local_update(local, grad_correction=corrected_gradient)

  def zeros_like_params(variables):
    return jax.tree.map(
      lambda p: jnp.zeros(p.shape, jnp.float32), variables['params']
    )

  def init(variables):
    return ScaffoldState(params=variables, control=zeros_like_params(variables))

  def init_client_state(variables):
    return jax.tree.map(
      lambda c: c.astype(storage), zeros_like_params(variables)
    )

  def dispatch(state, client_ids, round_index, key):
    del client_ids, round_index, key
    return types.Dispatch(shared=(state.params, state.control))

  def client_update(shared, per_client, c_i, data, client_id, key):
    del per_client
    variables, c = shared
    c_i = jax.tree.map(lambda v: v.astype(jnp.float32), c_i)
    out = update(variables, data, client_id, key, (c_i, c))
    new = control_update(
      c_i,
      c,
      variables['params'],
      out.variables['params'],
      out.num_steps,
      lr,
    )
    stored = jax.tree.map(lambda v: v.astype(storage), new)
    delta = jax.tree.map(
      lambda s, old: s.astype(jnp.float32) - old, stored, c_i
    )
    return out._replace(extra=delta), stored

  def aggregate(state, outputs, client_ids, round_index, key):
    del client_ids, round_index, key
    weights = outputs.num_examples if weighted else None
    mean = tree.weighted_mean(outputs.variables, weights)
    x = state.params['params']
    dy = jax.tree.map(lambda m, p: m.astype(jnp.float32) - p, mean['params'], x)
    params = jax.tree.map(
      lambda p, d: (p + global_lr * d).astype(p.dtype), x, dy
    )
    dc = tree.weighted_mean(outputs.extra)
    control = jax.tree.map(lambda c, d: c + (k / n) * d, state.control, dc)
    metrics = {
      'bytes_communicated': jnp.float32(
        2 * k * (tree.nbytes(state.params) + tree.nbytes(state.control))
      ),
      'control_norm': jnp.sqrt(
        sum(jnp.sum(jnp.square(c)) for c in jax.tree.leaves(control))
      ),
    }
    new_params = {**mean, 'params': params}
    return ScaffoldState(params=new_params, control=control), metrics

  return types.Algorithm(
    init,
    dispatch,
    client_update,
    aggregate,
    init_client_state=init_client_state,
  )


def build(setting: Any, hp: Hparams) -> types.Algorithm:
  """The registry's factory (see `fedjax_mr.algorithms.registry`)."""
  return scaffold(
    setting.local,
    setting.clients_per_round,
    setting.num_clients,
    hp.global_lr,
    hp.control_dtype,
    setting.weighted,
  )
