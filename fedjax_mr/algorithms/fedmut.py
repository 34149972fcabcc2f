"""FedMut: federated learning by stochastic mutation of the global model.

Every round the server averages the K trained models into the global model
w, takes the global update delta = w - w_prev (w_prev: the previous global,
the initial model in round 0, so mutation already follows round 0) and
dispatches K mutated models: for every layer, a balanced random vector of
coefficients v (half +1, half -1 + beta_t) gives model j the layer
w + alpha * v_j * delta. With odd K the first model is the plain w.

FedMut only ever uses the aggregate: the new state is a function of the
mean of the uploaded models (and the old state) alone, never of an
individual client model, so it works under secure aggregation.

A layer is every leaf of the variables, params and BatchNorm statistics
alike (as in the authors' code; note that a large alpha can then push a
running variance below zero), or every module with `grouping='module'`; see
`fedjax_mr.core.grouping`.

References:
  Hu et al., "FedMut: Generalized Federated Learning via Stochastic
  Mutation", AAAI 2024 (Algorithm 2, Eqs. 2-5).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_mr.algorithms import fedavg
from fedjax_mr.core import errors
from fedjax_mr.core import grouping as grouping_lib
from fedjax_mr.core import tree
from fedjax_mr.core import types
from fedjax_mr.training import client
from fedjax_mr.training import optimizers


def beta_schedule(
  round_index: jax.Array | int, beta0: float, bound: float
) -> jax.Array:
  """Dynamic preference: beta_t = beta0 * max(1 - t / T_b, 0).

  Args:
    round_index: t, counted from 0 (int or int scalar array).
    beta0: beta_0.
    bound: T_b, the length of the early stage; <= 0 gives beta_t = 0.

  Returns:
    float32 scalar.

  References:
    Hu et al., FedMut, Eq. 5.
  """
  if bound <= 0:
    return jnp.zeros((), jnp.float32)
  t = jnp.asarray(round_index, jnp.float32)
  return (beta0 * jnp.maximum(1.0 - t / bound, 0.0)).astype(jnp.float32)


def _coefficients(
  keys: jax.Array, k: int, beta: jax.Array | float
) -> jax.Array:
  """`[len(keys), k]`: a balanced, shuffled coefficient vector per key."""
  half = k // 2
  base = jnp.concatenate(
    [
      jnp.ones((half,), jnp.float32),
      jnp.full((half,), -1.0, jnp.float32) + jnp.asarray(beta, jnp.float32),
    ]
  )
  num_layers = keys.shape[0]
  v = base[grouping_lib.unit_permutations(keys, 2 * half)]
  if k % 2:
    v = jnp.concatenate([jnp.zeros((num_layers, 1), jnp.float32), v], axis=1)
  return v


def mutation_coefficients(
  key: jax.Array, num_layers: int, num_models: int, beta: jax.Array | float
) -> jax.Array:
  """The mutation weights v of every layer and model.

  Args:
    key: PRNG key.
    num_layers: L.
    num_models: K.
    beta: beta_t.

  Returns:
    `[L, K]` float32. For each layer, 2 floor(K/2) values, half +1 and half
    -1 + beta, in an independent random order; with odd K column 0 is 0
    (the plain global model, first in the paper's list).

  References:
    Hu et al., FedMut, Algorithm 2 lines 3-11 and Eq. 4.
  """
  return _coefficients(
    jax.random.split(key, int(num_layers)), int(num_models), beta
  )


def mutate(
  key: jax.Array,
  global_params: types.PyTree,
  prev_global_params: types.PyTree,
  *,
  num_models: int,
  alpha: float,
  beta: jax.Array | float = 0.0,
  grouping: grouping_lib.Grouping = 'leaf',
) -> types.PyTree:
  """K mutated copies of the global model.

  Model j, layer l: w_l + alpha * v_{l,j} * (w_l - w_prev_l), with v from
  `mutation_coefficients` (one independent draw per layer, from a key
  derived from the layer's name, `grouping.layer_keys`). Computed in
  float32, returned in each leaf's dtype. Jit-compatible.

  Args:
    key: PRNG key.
    global_params: w, leaves `[...]`.
    prev_global_params: w_prev, same structure.
    num_models: K.
    alpha: mutation range.
    beta: beta_t (see `beta_schedule`).
    grouping: 'leaf' or 'module' (one coefficient per module).

  Returns:
    The K models, leaves `[K, ...]`. With beta = 0 and even K their mean is
    w and each is at distance alpha * ||delta_l|| from w in every layer.

  References:
    Hu et al., FedMut, Algorithm 2 and Eq. 2.
  """
  coeffs = mutation_rows(
    key, global_params, num_models=num_models, beta=beta, grouping=grouping
  )
  return jax.vmap(
    lambda row: mutated(
      global_params, prev_global_params, row, alpha=alpha, grouping=grouping
    )
  )(coeffs)


def mutation_rows(
  key: jax.Array,
  global_params: types.PyTree,
  *,
  num_models: int,
  beta: jax.Array | float = 0.0,
  grouping: grouping_lib.Grouping = 'leaf',
) -> jax.Array:
  """`[K, G]` float32: row j holds model j's coefficient for each of the G
  layers (groups) of `global_params`, as `mutate` draws them."""
  layers = grouping_lib.layer_groups(global_params, grouping=grouping)
  coeffs = _coefficients(
    grouping_lib.layer_keys(key, layers), int(num_models), beta
  )
  return coeffs.T


def mutated(
  global_params: types.PyTree,
  prev_global_params: types.PyTree,
  row: jax.Array,
  *,
  alpha: float,
  grouping: grouping_lib.Grouping = 'leaf',
) -> types.PyTree:
  """ONE mutated model: layer l is w_l + alpha * row[l] * (w_l - w_prev_l),
  in float32, returned in each leaf's dtype; `row` is a row of
  `mutation_rows`. Row j gives model j of `mutate`, bit for bit."""
  layers = grouping_lib.layer_groups(global_params, grouping=grouping)
  flat, treedef = jax.tree.flatten(global_params)
  prev, prev_def = jax.tree.flatten(prev_global_params)
  if prev_def != treedef:
    raise ValueError('global_params and prev_global_params differ in structure')
  out = list(flat)
  for g, layer in enumerate(layers):
    for i in layer.leaves:
      w = flat[i].astype(jnp.float32)
      delta = w - prev[i].astype(jnp.float32)
      out[i] = (w + alpha * row[g] * delta).astype(flat[i].dtype)
  return jax.tree.unflatten(treedef, out)


class FedMutState(NamedTuple):
  """Attributes:
  params: the global model w (params and BatchNorm statistics).
  prev_params: the previous round's global model (the initial model until
    the first aggregation).
  server_state: the server optimizer's state.
  """

  params: types.Variables
  prev_params: types.Variables
  server_state: Any = ()


def advance(
  state: FedMutState,
  global_params: types.Variables,
  round_index: jax.Array,
  *,
  num_models: int,
  beta0: float,
  bound: float,
) -> tuple[FedMutState, dict[str, jax.Array]]:
  """The rest of FedMut's `aggregate`: a function of the new global model
  (the mean, or the server optimizer's step toward it) and the state
  only.

  Returns:
    The next state (`server_state` left to the caller) and the metrics
    'delta_norm', 'beta' and 'bytes_communicated' (`num_models` models
    down and up).
  """
  sq = sum(
    jnp.sum(jnp.square(a.astype(jnp.float32) - b.astype(jnp.float32)))
    for a, b in zip(
      jax.tree.leaves(global_params), jax.tree.leaves(state.params)
    )
  )
  k = int(num_models)
  metrics = {
    'delta_norm': jnp.sqrt(jnp.asarray(sq, jnp.float32)),
    'beta': beta_schedule(round_index, beta0, bound),
    'bytes_communicated': jnp.float32(2 * k * tree.nbytes(global_params)),
  }
  return FedMutState(params=global_params, prev_params=state.params), metrics


def _client_side(
  local: client.LocalTraining, alpha: float, grouping: grouping_lib.Grouping
):
  """`(client_model, client_update)`: client k builds its mutated model
  from the shared (global, previous global) models and its row of
  coefficients, then trains it."""

  def client_model(shared, row):
    return mutated(*shared, row, alpha=alpha, grouping=grouping)

  local_update = client.make_local_update(local)

  def client_update(shared, row, client_state, data, client_id, key):
    out = local_update(client_model(shared, row), data, client_id, key)
    return out, client_state

  return client_model, client_update


def fedmut(
  local: client.LocalTraining,
  clients_per_round: int,
  alpha: float = 4.0,
  beta0: float = 0.3,
  bound: int = 50,
  weighted: bool = False,
  *,
  grouping: grouping_lib.Grouping = 'leaf',
  server_optimizer: optax.GradientTransformation | None = None,
) -> types.Algorithm:
  """Builds FedMut.

  `aggregate` only averages: the new state is (mean, old global); with a
  server optimizer other than the default SGD at rate 1, the new global
  variables are its step toward the mean (`optimizers.server_step`; on
  every variable, BatchNorm statistics included, as FedMut treats them
  alike). Round r mutates the global model of round r - 1 with
  beta_{r-1} (the mutation made after round t uses beta_t, t from 0); in
  round 0 the previous global is the initial model, delta = 0, and all K
  models equal it. Client k builds mutated model k from the dispatch.

  FedMut touches only the aggregate, never an individual client model: the
  next state and every later dispatch depend on the clients' models only
  through their mean.

  Args:
    local: how clients train; client k trains mutated model k.
    clients_per_round: K.
    alpha: mutation range (paper: 4.0; 5.0 fails to converge).
    beta0: initial dynamic preference (paper: 0.3 for CNN and VGG-16, 0.5
      for ResNet-18).
    bound: T_b, rounds of the early stage over which beta decays to 0.
    weighted: weight the mean by the clients' numbers of examples instead
      of the reference's plain mean.
    grouping: 'leaf' (default, as the reference) or 'module'.
    server_optimizer: the step toward the mean; None: `optimizers.sgd(1.0)`,
      the mean itself (the paper).

  Returns:
    An `Algorithm` whose server state is a `FedMutState`. Metrics: 'delta_norm'
    (||w - w_prev|| of this round's aggregation) and 'beta' (beta_t of the
    mutation that follows), float32 scalars.

  References:
    Hu et al., "FedMut: Generalized Federated Learning via Stochastic
    Mutation", AAAI 2024, Algorithms 1-2.
  """
  k = errors.check_count('clients_per_round', clients_per_round)
  if grouping not in grouping_lib.GROUPINGS:
    raise ValueError(f'grouping must be one of {grouping_lib.GROUPINGS}')

  server = server_optimizer or optimizers.sgd(1.0)
  client_model, client_update = _client_side(local, alpha, grouping)
  return types.Algorithm(
    functools.partial(_init, server),
    functools.partial(_dispatch, k, beta0, bound, grouping),
    client_update,
    functools.partial(_aggregate, server, k, beta0, bound),
    clients_per_round=k,
    contribution=lambda output: fedavg.mean_contribution(output, weighted),
    client_model=client_model,
  )


def _init(
  server: optax.GradientTransformation, variables: types.Variables
) -> FedMutState:
  # A copy: the engine donates the state, and one buffer cannot be donated
  # twice.
  return FedMutState(
    params=variables,
    prev_params=jax.tree.map(jnp.array, variables),
    server_state=server.init(variables),
  )


def _dispatch(
  k: int,
  beta0: float,
  bound: int,
  grouping: grouping_lib.Grouping,
  state: FedMutState,
  client_ids: jax.Array,
  round_index: jax.Array,
  key: jax.Array,
) -> types.Dispatch:
  """The global models once, and each client's coefficients: client j
  builds mutated model j itself (`client_model`), so the round never
  holds the K mutated models at once."""
  del client_ids
  beta = beta_schedule(jnp.maximum(round_index - 1, 0), beta0, bound)
  rows = mutation_rows(
    key, state.params, num_models=k, beta=beta, grouping=grouping
  )
  return types.Dispatch(
    shared=(state.params, state.prev_params), per_client=rows
  )


def _aggregate(
  server: optax.GradientTransformation,
  k: int,
  beta0: float,
  bound: int,
  state: FedMutState,
  sums: types.Sums,
  client_ids: jax.Array,
  round_index: jax.Array,
  key: jax.Array,
) -> tuple[FedMutState, dict[str, jax.Array]]:
  """The server step toward the clients' mean, then the mutation state
  of the next round (`advance`)."""
  del client_ids, key
  mean = fedavg.mean_of(sums.total, state.params)
  global_vars, server_state = optimizers.server_step(
    server, state.server_state, state.params, mean
  )
  new, metrics = advance(
    state, global_vars, round_index, num_models=k, beta0=beta0, bound=bound
  )
  return new._replace(server_state=server_state), metrics


@dataclasses.dataclass(frozen=True)
class Hparams:
  """FedMut's hyper-parameters (config fields `fedmut_<field>`; the
  grouping is FedMR's field `fedmr_grouping`)."""

  alpha: float = 4.0
  beta0: float = 0.3
  bound: int = 50
  grouping: str = 'leaf'

  def validate(self, **setting) -> None:
    """Raises `ArgumentError` naming a bad field (`setting`: unused)."""
    del setting
    if not (self.alpha >= 0 and math.isfinite(self.alpha)):
      raise errors.ArgumentError(
        'alpha', f'must be finite and >= 0, got {self.alpha}'
      )
    if not 0 <= self.beta0 < 2:
      raise errors.ArgumentError(
        'beta0',
        f'must be in [0, 2), got {self.beta0} (at 2 the negative '
        'coefficients -1 + beta turn into +1)',
      )
    if self.bound < 0:
      raise errors.ArgumentError('bound', f'must be >= 0, got {self.bound}')
    if self.grouping not in grouping_lib.GROUPINGS:
      raise errors.ArgumentError(
        'grouping',
        f'must be one of {", ".join(grouping_lib.GROUPINGS)}, got '
        f'{self.grouping!r}',
      )


def build(setting: Any, hp: Hparams) -> types.Algorithm:
  """The registry's factory (see `fedjax_mr.pipeline.registry`)."""
  return fedmut(
    setting.local,
    setting.clients_per_round,
    alpha=hp.alpha,
    beta0=hp.beta0,
    bound=hp.bound,
    weighted=setting.weighted,
    grouping=hp.grouping,
    server_optimizer=setting.server_optimizer,
  )
