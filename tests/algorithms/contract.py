"""The contract every `Algorithm` meets.

`check_server_side` drives init/dispatch/aggregate by hand with pretend
uploads on a tiny tree (for algorithms whose clients upload only their
model); `check_algorithm` runs the real engine round (client updates,
per-client state, sampler) on a tiny model with BatchNorm, on 1 and 2
devices.
"""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.core import tree
from fedjax_mr.core import types
from fedjax_mr.training import client
from fedjax_mr.training import engine
from fedjax_mr.training import optimizers
from fedjax_mr.training import sampling
from tests import helpers


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


def local_training(model=None, lr=0.1) -> client.LocalTraining:
  """Local SGD pieces on a tiny model (the linear one by default)."""
  model = model or helpers.linear_model()
  return client.LocalTraining(model, optimizers.sgd(lr, momentum=0.9), 2, 4)


LOCAL = local_training()


def models_sent(
  sent: types.Dispatch, k: int, algorithm: types.Algorithm | None = None
) -> types.Variables:
  """The K models a dispatch starts its clients from: its per-client part
  (or the models `algorithm.client_model` builds from it), or its shared
  model (the first item when the shared part is a tuple)."""
  if jax.tree.leaves(sent.per_client):
    if algorithm is not None:
      return types.dispatched_models(algorithm, sent)
    return sent.per_client
  shared = sent.shared[0] if isinstance(sent.shared, tuple) else sent.shared
  return tree.broadcast(shared, k)


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


def server_params_after(algorithms, model, data, rounds=2, k=4):
  """Each algorithm's server params after `rounds` engine rounds of `k`
  clients from the same init and keys (for reductions to FedAvg). The
  rounds stack the K uploads (`stream=False`): FedAvg's streamed sum adds
  the same terms in another order."""
  out = []
  for algorithm in algorithms:
    fn = jax.jit(
      engine.make_round_fn(algorithm, clients_per_round=k, stream=False)
    )
    state = engine.init_state(algorithm, model.init(jax.random.key(0)))
    for _ in range(rounds):
      state, _ = fn(state, data, jax.random.key(4))
    out.append(jax.device_get(state.server.params))
  return out


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


def check_server_side(
  algorithm: types.Algorithm,
  num_models: int,
  variables: types.Variables | None = None,
  rounds: int = 2,
  seed: int = 0,
  num_clients: int = 10,
) -> list:
  """Runs `rounds` rounds by hand with pretend uploads; checks the server
  side of the contract.

  Checks: the state exposes `.params` with the variables' structure, shapes
  and dtypes, and no two state leaves share a buffer (the engine donates the
  state); dispatch gives a `Dispatch` whose per-client leaves are `[K, ...]`
  of the variables' dtypes; the state keeps its structure, shapes and
  dtypes through aggregate; metrics are finite scalars and include
  'bytes_communicated'; dispatch and aggregate run under `jax.jit`
  (aggregate with the state donated, as the experiment does) and are
  deterministic given a key.

  Returns:
    The metrics of every round.
  """
  variables = tiny_variables() if variables is None else variables
  state = algorithm.init(variables)
  _same_layout(state.params, variables)
  leaves = jax.tree.leaves(state)
  assert len({id(x) for x in leaves}) == len(leaves), 'state shares a buffer'
  dispatch = jax.jit(algorithm.dispatch)
  aggregate = jax.jit(
    functools.partial(types.aggregate_stacked, algorithm), donate_argnums=0
  )
  history = []
  for r in range(rounds):
    k_dispatch, k_train, k_aggregate, k_ids = jax.random.split(
      jax.random.key(seed * 1000 + r), 4
    )
    ids = sampling.sample_clients(k_ids, num_clients, num_models)
    round_index = jnp.int32(r)
    sent = dispatch(state, ids, round_index, k_dispatch)
    assert isinstance(sent, types.Dispatch)
    if jax.tree.leaves(sent.per_client):
      chex.assert_tree_shape_prefix(sent.per_client, (num_models,))
    models = models_sent(sent, num_models, algorithm)
    _same_layout(models, variables, (num_models,))
    chex.assert_trees_all_equal(
      sent, dispatch(state, ids, round_index, k_dispatch)
    )
    outputs = fake_outputs(models, k_train)
    copy = jax.tree.map(jnp.copy, state)
    new_state, metrics = aggregate(copy, outputs, ids, round_index, k_aggregate)
    copy = jax.tree.map(jnp.copy, state)
    again = aggregate(copy, outputs, ids, round_index, k_aggregate)
    chex.assert_trees_all_equal((new_state, metrics), again)
    _same_layout(new_state, state)
    _same_layout(new_state.params, variables)
    _finite_scalars(metrics)
    history.append(metrics)
    state = new_state
  return history


def _finite_scalars(metrics):
  assert isinstance(metrics, dict)
  assert 'bytes_communicated' in metrics
  for name, value in metrics.items():
    assert jnp.shape(value) == (), name
    assert np.isfinite(np.asarray(value, np.float64)), name


def check_algorithm(
  build,
  *,
  clients_per_round: int = 4,
  sizes=(5, 9, 3, 12, 7, 4),
  rounds: int = 3,
  model=None,
  two_device_atol: float = 1e-5,
) -> list:
  """The whole contract through the real engine, on a tiny BatchNorm model
  (or `model`, for algorithms that change the network).

  `build(local, clients_per_round, num_clients) -> Algorithm`. Checks, over
  `rounds` jitted rounds with the state donated: the round state keeps its
  structure, shapes and dtypes (per-client state `[N, ...]` included); the
  sampled ids are K clients in range, distinct when the algorithm keeps
  client state; only the sampled clients'
  state rows change; the per-client records are the sampled clients'
  sizes, positive step counts and finite losses; the other metrics are
  finite scalars with 'bytes_communicated'; two runs from the same key
  are identical; 2 devices give the 1-device result (up to
  reassociation) and a sharded run's per-client state equals the
  unsharded one.

  Returns:
    The 1-device metrics of every round, with the round's sampled
    `client_ids`.
  """
  model = model or helpers.linear_bn_model()
  local = local_training(model)
  data, _ = helpers.toy_data(list(sizes))
  n, k = len(sizes), clients_per_round
  algorithm = build(local, k, n)
  variables = model.init(jax.random.key(0))

  def round_fn(mesh):
    return jax.jit(
      engine.make_round_fn(algorithm, clients_per_round=k, mesh=mesh),
      donate_argnums=0,
    )

  def run(fn):
    state = engine.init_state(algorithm, variables, n)
    layout = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    history = []
    for _ in range(rounds):
      before = jax.device_get(state.clients)
      state, metrics = fn(state, data, jax.random.key(7))
      metrics = jax.device_get(metrics)
      ids = np.asarray(metrics.pop('client_ids'))
      assert len(ids) == k and 0 <= ids.min() and ids.max() < n
      if algorithm.init_client_state is not None:
        # Client state needs distinct clients (clustered sampling may draw
        # one client twice: it keeps no client state).
        assert len(set(ids.tolist())) == k
      after = jax.device_get(state.clients)
      untouched = np.setdiff1d(np.arange(n), ids)
      jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a[untouched], b[untouched]),
        before,
        after,
      )
      assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == layout
      # The per-client records: [K], in sampling order, of those clients.
      np.testing.assert_array_equal(
        metrics.pop('client_examples'), np.asarray(sizes)[ids]
      )
      steps = metrics.pop('client_steps')
      assert steps.shape == (k,) and (steps > 0).all()
      client_loss = metrics.pop('client_loss')
      assert client_loss.shape == (k,) and np.isfinite(client_loss).all()
      _finite_scalars(
        {m: v for m, v in metrics.items() if m not in ('num_examples',)}
      )
      history.append((ids, metrics))
    return jax.device_get(state), history

  # Both 1-device runs go through one jitted function: the second run
  # checks that executing it again from the same key repeats the first,
  # without tracing and loading the same program a second time.
  single = round_fn(None)
  one, h1 = run(single)
  again, h2 = run(single)
  chex.assert_trees_all_equal(one, again)
  for (i1, m1), (i2, m2) in zip(h1, h2):
    np.testing.assert_array_equal(i1, i2)
    chex.assert_trees_all_equal(m1, m2)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('clients',))
  two, h3 = run(round_fn(mesh))
  # Reassociation only (controls divide differences by steps * lr; an
  # algorithm whose server runs Adam, FedGen, can move a parameter whose
  # gradient is at rounding level by up to one learning rate per step:
  # `two_device_atol`). Every leaf carries the rounding of the coarsest
  # dtype the state stores (SCAFFOLD's bfloat16 controls: one ULP of a
  # client's stored control moves the float32 server control by 1/N of it).
  helpers.assert_close(
    one,
    two,
    rtol=1e-4,
    atol=two_device_atol,
    precision=helpers.coarsest_float_dtype(one),
  )
  for (i1, m1), (i3, m3) in zip(h1, h3):
    np.testing.assert_array_equal(i1, i3)
    helpers.assert_close(m1['train_loss'], m3['train_loss'], rtol=1e-5)
  return [{**m, 'client_ids': i} for i, m in h1]


def run_by_hand(
  algorithm: types.Algorithm,
  variables: types.Variables,
  rounds: int,
  num_models: int,
  seed: int = 0,
) -> tuple[list, list]:
  """Jitted dispatch -> `fake_outputs` -> aggregate, `rounds` times.

  Returns:
    `(dispatched, states)`: the K models dispatched in each round and the
    state before round 0 and after every round.
  """
  dispatch = jax.jit(algorithm.dispatch)
  aggregate = jax.jit(functools.partial(types.aggregate_stacked, algorithm))
  state = algorithm.init(variables)
  dispatched, states = [], [state]
  ids = jnp.arange(num_models, dtype=jnp.int32)
  for r in range(rounds):
    k_d, k_t, k_a = jax.random.split(jax.random.key(seed * 100 + r), 3)
    sent = dispatch(state, ids, jnp.int32(r), k_d)
    models = models_sent(sent, num_models, algorithm)
    state, _ = aggregate(
      state, fake_outputs(models, k_t), ids, jnp.int32(r), k_a
    )
    dispatched.append(models)
    states.append(state)
  return dispatched, states


def assert_same_runs(
  transform: types.Algorithm,
  reference: types.Algorithm,
  num_models: int,
  rounds: int = 3,
) -> None:
  """`transform` dispatches exactly what `reference` does, every round, and
  evaluates the same global model."""
  v = tiny_variables()
  d_a, s_a = run_by_hand(transform, v, rounds, num_models)
  d_b, s_b = run_by_hand(reference, v, rounds, num_models)
  for a, b in zip(d_a, d_b):
    chex.assert_trees_all_equal(a, b)
  for a, b in zip(s_a, s_b):
    chex.assert_trees_all_equal(a.params, b.params)
