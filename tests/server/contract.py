"""The contract every `ServerTransform` meets, checked on a tiny tree."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.core import tree
from fedjax_mr.core import types


def tiny_variables() -> types.Variables:
  """Params of two modules (one leaf in bfloat16) and BatchNorm stats."""
  return {
    'params': {
      'Dense_0': {
        'kernel': jnp.arange(6, dtype=jnp.float32).reshape(3, 2) / 8,
        'bias': jnp.array([0.5, -0.25], jnp.float32),
      },
      'BatchNorm_0': {'scale': jnp.array([1.0, 2.0], jnp.bfloat16)},
    },
    'batch_stats': {
      'BatchNorm_0': {
        'mean': jnp.array([0.25, 0.75], jnp.float32),
        'var': jnp.array([1.0, 1.5], jnp.float32),
      },
    },
  }


class ConvBNDense(nn.Module):
  """A tiny real model with BatchNorm (params and batch_stats)."""

  @nn.compact
  def __call__(self, x, train=False):
    x = nn.Conv(2, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


def bn_variables() -> types.Variables:
  """`ConvBNDense` variables, fresh from `init` (keys in model order)."""
  return ConvBNDense().init(jax.random.key(0), jnp.zeros((1, 4, 4, 1)))


@jax.jit
def fake_outputs(
  client_variables: types.Variables, key: jax.Array
) -> types.ClientOutput:
  """Pretend local training: every model moves by its own random step."""
  flat, treedef = jax.tree.flatten(client_variables)
  k = flat[0].shape[0]
  sizes = [x.size for x in flat]
  k_noise, k_num = jax.random.split(key)
  noise = jax.random.normal(k_noise, (sum(sizes),))
  offsets = np.cumsum([0] + sizes)
  moved = [
    (x + 0.1 * noise[a:b].reshape(x.shape)).astype(x.dtype)
    for x, a, b in zip(flat, offsets[:-1], offsets[1:])
  ]
  return types.ClientOutput(
    variables=jax.tree.unflatten(treedef, moved),
    num_examples=jax.random.randint(k_num, (k,), 1, 10),
    loss=jnp.ones((k,), jnp.float32),
    num_steps=jnp.ones((k,), jnp.int32),
  )


def _same_layout(got, reference, prefix=()):
  chex.assert_trees_all_equal_structs(got, reference)
  jax.tree.map(
    lambda x, r: (
      np.testing.assert_equal(x.shape, prefix + r.shape),
      np.testing.assert_equal(x.dtype, r.dtype),
    ),
    got,
    reference,
  )


def check_server_transform(
  transform: types.ServerTransform,
  num_models: int,
  variables: types.Variables | None = None,
  rounds: int = 2,
  seed: int = 0,
) -> list:
  """Runs `rounds` rounds by hand and checks the `ServerTransform` contract.

  Checks: the state exposes `.params` with the variables' structure, shapes
  and dtypes, and no two state leaves share a buffer (the engine donates the
  state); dispatch gives `[K, ...]` leaves of the same dtypes; the state
  keeps its structure, shapes and dtypes through aggregate; a
  `shared_dispatch`, where given, broadcasts to exactly `dispatch`; metrics are
  finite scalars; dispatch and aggregate run under `jax.jit` (aggregate
  with the state donated, as the experiment does) and are deterministic
  given a key.

  Returns:
    The metrics of every round.
  """
  variables = tiny_variables() if variables is None else variables
  state = transform.init(variables)
  _same_layout(state.params, variables)
  leaves = jax.tree.leaves(state)
  assert len({id(x) for x in leaves}) == len(leaves), 'state shares a buffer'
  dispatch = jax.jit(transform.dispatch)
  aggregate = jax.jit(transform.aggregate, donate_argnums=0)
  history = []
  for r in range(rounds):
    k_dispatch, k_train, k_aggregate = jax.random.split(
      jax.random.key(seed * 1000 + r), 3
    )
    round_index = jnp.int32(r)
    client = dispatch(state, round_index, k_dispatch)
    chex.assert_tree_shape_prefix(client, (num_models,))
    _same_layout(client, variables, (num_models,))
    chex.assert_trees_all_equal(
      client, dispatch(state, round_index, k_dispatch)
    )
    if transform.shared_dispatch is not None:  # dispatch is its broadcast
      one = jax.jit(transform.shared_dispatch)(state, round_index, k_dispatch)
      chex.assert_trees_all_equal(client, tree.broadcast(one, num_models))
    outputs = fake_outputs(client, k_train)
    copy = jax.tree.map(jnp.copy, state)
    new_state, metrics = aggregate(copy, outputs, round_index, k_aggregate)
    copy = jax.tree.map(jnp.copy, state)
    again = aggregate(copy, outputs, round_index, k_aggregate)
    chex.assert_trees_all_equal((new_state, metrics), again)
    _same_layout(new_state, state)
    _same_layout(new_state.params, variables)
    assert isinstance(metrics, dict)
    for name, value in metrics.items():
      assert jnp.shape(value) == (), name
      assert np.isfinite(np.asarray(value, np.float64)), name
    history.append(metrics)
    state = new_state
  return history


def run_by_hand(
  transform: types.ServerTransform,
  variables: types.Variables,
  rounds: int,
  seed: int = 0,
) -> tuple[list, list]:
  """Jitted dispatch -> `fake_outputs` -> aggregate, `rounds` times.

  Returns:
    `(dispatched, states)`: the K models dispatched in each round and the
    state before round 0 and after every round.
  """
  dispatch = jax.jit(transform.dispatch)
  aggregate = jax.jit(transform.aggregate)
  state = transform.init(variables)
  dispatched, states = [], [state]
  for r in range(rounds):
    k_d, k_t, k_a = jax.random.split(jax.random.key(seed * 100 + r), 3)
    client = dispatch(state, jnp.int32(r), k_d)
    state, _ = aggregate(state, fake_outputs(client, k_t), jnp.int32(r), k_a)
    dispatched.append(client)
    states.append(state)
  return dispatched, states


def assert_same_runs(
  transform: types.ServerTransform,
  reference: types.ServerTransform,
  rounds: int = 3,
) -> None:
  """`transform` dispatches exactly what `reference` does, every round, and
  evaluates the same global model."""
  v = tiny_variables()
  d_a, s_a = run_by_hand(transform, v, rounds)
  d_b, s_b = run_by_hand(reference, v, rounds)
  for a, b in zip(d_a, d_b):
    chex.assert_trees_all_equal(a, b)
  for a, b in zip(s_a, s_b):
    chex.assert_trees_all_equal(a.params, b.params)
