"""The limit a round is measured against: centralised SGD on the same
number of sample-steps and batch, as one jitted loop with the same layers;
and the device's matmul peak."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

from fedjax_mr.data import client_data
from fedjax_mr.data import synthetic


def limit_fn(
  model, opt, variables, data, b: int, flops_batch: int
) -> tuple[Callable[[int, jax.Array], None], float]:
  """Centralised SGD as one jitted loop with the same layers.

  Returns:
    `(run, flops)`: `run(steps, key)` trains `steps` steps of batch `b`
    from a random start on what `limit_batches` reads and blocks until
    done; `flops` is XLA's cost analysis of one step of batch
    `flops_batch` (a round's).
  """
  inputs, batch, m = limit_batches(data, b)
  # BatchNorm's running statistics (resnet20's): read as the clients read
  # them; their update is not part of the limit's work.
  rest = {k: v for k, v in variables.items() if k != 'params'}

  def loss_fn(params, x, y):
    logits, _ = model.apply_train(
      {**rest, 'params': params}, x, jax.random.key(0)
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  grad_fn = jax.grad(loss_fn)

  def train_step(params, opt_state, x, y):
    g = grad_fn(params, x, y)
    updates, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def train(params, inputs, start, steps):
    def step(i, carry):
      params, opt_state = carry
      return train_step(params, opt_state, *batch(inputs, start + i * b))

    # A run-time step count, like the clients' exact step counts.
    return lax.fori_loop(0, steps, step, (params, opt.init(params)))[0]

  fn = jax.jit(train)
  params = variables['params']

  def run(steps, key):
    start = jax.random.randint(key, (), 0, m)
    jax.block_until_ready(fn(params, inputs, start, jnp.int32(steps)))

  x = jnp.zeros((flops_batch, *model.input_shape), jnp.float32)
  y = jnp.zeros((flops_batch,), jnp.int32)
  cost = (
    jax.jit(train_step)
    .lower(params, opt.init(params), x, y)
    .compile()
    .cost_analysis()
  )
  if isinstance(cost, list):
    cost = cost[0]
  flops = float(cost.get('flops', 0.0)) if cost else 0.0
  return run, flops


def limit_batches(data, b: int):
  """What the limit trains on, read the fastest way.

  Stored clients (`ClientData`): their whole training set, shuffled once
  outside the timing and read in contiguous batches (the step's offset
  wrapped around). Generated clients (`SyntheticData`): client 0's
  examples at the `b` positions from the step's offset on, generated as
  the round generates every batch (`SyntheticData.batch`; its parameters
  are loop-invariant, drawn once).

  Returns:
    `(inputs, batch, m)`: the arrays the jitted loop takes,
    `batch(inputs, offset) -> (x [b, ...] normalised, y [b])` and the
    range `[0, m)` of a random start.
  """
  if isinstance(data, synthetic.SyntheticData):
    # Positions up to m + steps × b stay far below 2**31.
    return data, lambda d, at: d.batch(jnp.int32(0), at + jnp.arange(b)), 2**20
  m = data.x.shape[0]

  def batch(inputs, offset):
    x_all, y_all = inputs
    at = offset % (m - b + 1)
    x = lax.dynamic_slice_in_dim(x_all, at, b)
    x = client_data.normalize(x, data.scale, data.shift)
    return x, lax.dynamic_slice_in_dim(y_all, at, b)

  # The fastest input pipeline: the dataset shuffled once, outside the
  # timing, and read in contiguous batches.
  perm = jax.random.permutation(jax.random.key(0), m)
  return jax.block_until_ready((data.x[perm], data.y[perm])), batch, m


def limit_steps(num_steps: int, samples: int, limit_batch: int) -> int:
  """The limit's steps for a round of `num_steps` steps over `samples`
  samples (examples × E): the round's, or with `limit_batch` (> 0) the
  samples in batches of that size."""
  if not limit_batch:
    return num_steps
  return -(-samples // limit_batch)


def peak_gflops(dtype_name: str) -> float:
  """GFLOP/s of a large square matmul in `dtype_name` on device 0, jitted,
  default precision (as the models compute): the machine's arithmetic peak
  as this process can reach it."""
  gpu = jax.devices()[0].platform != 'cpu'
  n = 8192 if gpu else 2048
  dtype = jnp.dtype(dtype_name)
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
  f = jax.jit(lambda a, b: a @ b)
  jax.block_until_ready(f(a, b))
  reps = 20 if gpu else 5
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(f(a, b))
    times.append(time.perf_counter() - t)
  return 2 * n**3 / statistics.median(times) / 1e9
