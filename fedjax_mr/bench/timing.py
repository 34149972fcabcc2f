"""One setting's round compiled and timed as a training run runs it: the
round, its server-side work alone and its evaluation.

A prepared run is a dict: what `prepare` compiled (`step`, `evaluate`)
and what the timed rounds append to (`times`, `steps`, `examples`,
`limits`, `balance`).
"""

from __future__ import annotations

import functools
import hashlib
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.bench import runs as runs_lib
from fedjax_mr.bench import setting as setting_lib
from fedjax_mr.core import tree
from fedjax_mr.core import types
from fedjax_mr.data import client_data
from fedjax_mr.training import engine
from fedjax_mr.training import evaluation as evaluation_lib
from fedjax_mr.training import host_round
from fedjax_mr.training import placement


def prepare(
  setting: setting_lib.Setting,
  sizes: str,
  devices: str,
  data,
  test_set,
  name: str,
  built: tuple,
  client_chunk: int | None = None,
  like: dict | None = None,
) -> dict[str, Any]:
  """Compiles one setting's round and evaluation; times its server-side
  work alone.

  Args:
    setting: the benchmark's setting.
    sizes: the client-size kind of `data`.
    devices: '1', 'all' or a count: the devices of the client axis.
    data: the clients (`ClientData` or `SyntheticData`).
    test_set: `(x, y, scale, shift)`.
    name: the algorithm's registry name.
    built: `runs.algorithm`'s `(algorithm, variables, model, multi)`.
    client_chunk: as `setting.client_chunk` (None: that).
    like: a prepared run of the same devices and algorithm whose server
      time and compiled evaluation this one reuses (neither depends on the
      chunk).
  """
  algorithm, variables, model, multi = built
  k = setting.clients_per_round
  d = len(jax.devices()) if devices == 'all' else int(devices)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:d]), ('clients',))
  chunk = runs_lib.client_mapping(
    k,
    setting.client_chunk if client_chunk is None else client_chunk,
    mesh,
    tree.num_parameters(variables['params']),
  )['client_chunk']
  # As a training run: per-client state in host memory.
  state = engine.init_state(
    algorithm, variables, data.num_clients, host_clients=True
  )
  key = jax.random.key(1)
  t = time.perf_counter()
  step = compiled_round(algorithm, state, data, key, k, chunk, mesh)
  compile_s = time.perf_counter() - t
  if like is None:
    server_s = server_seconds(algorithm, state, data, key, k)
    test = client_data.eval_data(
      *test_set[:2], setting.eval_batch_size, *test_set[2:], num_shards=d
    )
    evaluate = evaluation(
      algorithm, model, multi, data, test, key, k, mesh if d > 1 else None
    )
    # Compiled at its first (warm-up) call: FedAvg timed beside another
    # algorithm is never evaluated.
    evaluate = jax.jit(evaluate)
    test_examples = len(test_set[1])
  else:
    server_s, evaluate = like['server_s'], like['evaluate']
    test_examples = like['test_examples']
  return {
    'name': name,
    'setting': sizes,
    'devices': d,
    'chunk': chunk,
    'compile_s': compile_s,
    'server_s': server_s,
    'step': lambda s: step(s, data, key),
    'evaluate': evaluate,
    'evaluated': 1 + k * multi,
    'test_examples': test_examples,
    'state': state,
    'times': [],
    'steps': [],
    'examples': [],
    'limits': [],
    'balance': [],
  }


def compiled_round(algorithm, state, data, key, k: int, chunk: int, mesh):
  """`step(state, data, key) -> (state, metrics)` of K=`k` clients,
  compiled as a training run compiles it (without donation): one jitted
  round, or for per-client state in host memory the jitted sampler and
  the round on the sampled rows (`host_round.make_host_round`)."""
  make = functools.partial(
    engine.make_round_fn,
    algorithm,
    clients_per_round=k,
    client_chunk=chunk,
    mesh=mesh if mesh.devices.size > 1 else None,
  )
  if not engine.has_clients(state):
    return jax.jit(make()).lower(state, data, key).compile()
  sample = jax.jit(engine.make_sample_fn(algorithm, k))
  device_state = state.replace(clients=())
  ids = sample(device_state, data, key)
  rows = jax.tree.map(lambda a: a[np.asarray(ids)], state.clients)
  rows_round = (
    jax.jit(make(client_rows=True))
    .lower(device_state, data, key, ids, rows)
    .compile()
  )
  return host_round.make_host_round(sample, rows_round)


def server_seconds(algorithm, state, data, key, k: int) -> float:
  """Seconds of the server-side work of a round of `k` clients alone:
  sampling (when the algorithm has its own sampler), dispatch and
  aggregate on stand-in uploads of the right layout (the client update's
  output for K clients, as ones, or their sums for an algorithm that needs
  only sums); the mean of 10 after a warm-up."""
  ids = jnp.arange(k, dtype=jnp.int32)
  one_client = jax.tree.map(lambda x: x[0], state.clients)
  sent = jax.eval_shape(algorithm.dispatch, state.server, ids, state.round, key)
  per_client = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), sent.per_client
  )
  upload = jax.eval_shape(
    algorithm.client_update,
    sent.shared,
    per_client,
    one_client,
    data,
    ids[0],
    key,
  )[0]
  if algorithm.contribution is None:
    outputs = jax.tree.map(lambda s: jnp.ones((k, *s.shape), s.dtype), upload)
  else:
    # The server sees only the sums (the clients add as they finish).
    total = jax.eval_shape(algorithm.contribution, upload)
    outputs = types.Sums(
      jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), total),
      *(jnp.ones((k,), s.dtype) for s in upload[1:4]),
    )

  def server_only(st, out):
    if algorithm.sampler is not None:
      algorithm.sampler(key, st.round, st.server, data)
    inputs = algorithm.dispatch(st.server, ids, st.round, key)
    new, _ = algorithm.aggregate(st.server, out, ids, st.round, key)
    return new, inputs

  srv = jax.jit(server_only)
  jax.block_until_ready(srv(state, outputs))
  t = time.perf_counter()
  for _ in range(10):
    jax.block_until_ready(srv(state, outputs))
  return (time.perf_counter() - t) / 10


def evaluation(algorithm, model, multi: bool, data, test, key, k: int, mesh):
  """What a training run evaluates on the test batches `test`: the
  algorithm's model and, for multi-model algorithms, the `k` models the
  next round dispatches, split over the devices of `mesh` (None: one).

  Returns:
    `evaluate(state)` (not jitted): the evaluations.
  """
  evaluate_model = evaluation_lib.make_evaluate(model, mesh)
  evaluate_many = evaluation_lib.make_evaluate_dispatched(
    model, algorithm, mesh
  )

  def evaluate(st):
    out = {
      'model': evaluate_model(types.evaluated_model(algorithm, st.server), test)
    }
    if multi:
      sent = engine.next_dispatch(algorithm, st, data, key, k)
      out['models'] = evaluate_many(sent, test)
    return out

  return evaluate


def time_round(run: dict, local_epochs: int) -> dict:
  """Times one round of the prepared `run` and appends its seconds, steps
  and samples (examples × `local_epochs`); returns its metrics."""
  t = time.perf_counter()
  run['state'], m = run['step'](run['state'])
  jax.block_until_ready(run['state'])
  run['times'].append(time.perf_counter() - t)
  run['steps'].append(int(m['num_steps']))
  run['examples'].append(int(m['num_examples']) * local_epochs)
  return m


def time_evaluation(run: dict) -> float:
  """The run's evaluation seconds, timed after its rounds (one warm-up,
  then the median of 3)."""
  jax.block_until_ready(run['evaluate'](run['state']))
  evals = []
  for _ in range(3):
    t = time.perf_counter()
    jax.block_until_ready(run['evaluate'](run['state']))
    evals.append(time.perf_counter() - t)
  return statistics.median(evals)


def balance(data, client_ids, b: int, d: int) -> float:
  """Mean over max of the devices' local steps as the engine deals them.

  A client never splits across devices, so `d` devices can be at most
  `d × balance` times faster than one.
  """
  sizes = np.asarray(data.sizes)[np.asarray(client_ids)]
  steps = -(-sizes // b)
  perm = np.asarray(placement.balanced_order(sizes, d))
  per_device = steps[perm].reshape(d, -1).sum(axis=1)
  return float(per_device.mean() / per_device.max())


def state_sha256(state) -> str:
  """SHA-256 of the server state's bytes (leaf by leaf, in tree order): two
  runs that trained alike give the same."""
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(state.server):
    if jax.dtypes.issubdtype(getattr(leaf, 'dtype', None), jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    h.update(np.asarray(leaf).tobytes())
  return h.hexdigest()
