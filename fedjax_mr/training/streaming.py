"""The clients of a round mapped over one device: stacked (`map_clients`)
or streamed, their contributions summed as they finish (`stream_clients`).

Streaming keeps one chunk of trained models and the running sum in
memory, never all K (../shared/STYLE.md, "The round").
"""

from __future__ import annotations

from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from fedjax_mr.core import types


def map_clients(fn: Callable, xs: Any, chunk: int) -> Any:
  """Maps `fn` over the leading axis of `xs` (a tuple of trees).

  `chunk` = 1 runs the clients one after another (`lax.map`); `chunk` ≥ K
  vmaps all of them; in between, vmapped chunks of `chunk` clients run one
  after another.
  """
  k = jax.tree.leaves(xs)[0].shape[0]
  if chunk >= k:
    return jax.vmap(fn)(*xs)
  return lax.map(lambda a: fn(*a), xs, batch_size=chunk if chunk > 1 else None)


def _add(a: Any, b: Any) -> Any:
  return jax.tree.map(jnp.add, a, b)


def stream_clients(
  fn: Callable,
  contribution: Callable[[types.ClientOutput], Any],
  xs: Any,
  chunk: int,
  valid: jax.Array | None = None,
) -> tuple[types.Sums, Any]:
  """Runs `fn` over the leading axis of `xs` (as `map_clients`) and sums
  the clients' contributions as they finish.

  Clients run in vmapped chunks of `chunk` (1: one after another), the
  chunks one after another (`lax.scan`) with the running sum carried:
  memory holds one chunk of trained models and the sum, never all K.

  Args:
    fn: `fn(*x) -> (ClientOutput, client_state)` for one client.
    contribution: what one client's output adds (`Algorithm.contribution`).
    xs: a tuple of trees with leaves `[K, ...]`.
    chunk: clients vmapped at once (≥ 1).
    valid: optional `[K]` bool; clients where it is False (the engine's
      filling clients) add zeros.

  Returns:
    `(Sums, client_states)`: the sum over the K clients and their scalars
    (`[K]` each, in the order of `xs`), and their new states `[K, ...]`.
  """
  k = jax.tree.leaves(xs)[0].shape[0]
  chunk = max(1, min(int(chunk), k))
  masked = valid is not None
  if not masked:
    valid = jnp.ones((k,), bool)  # carried along, never read

  def one(x, ok):
    out, state = fn(*x)
    part = contribution(out)
    if masked:
      part = jax.tree.map(lambda c: jnp.where(ok, c, jnp.zeros_like(c)), part)
    scalars = (out.num_examples, out.loss, out.num_steps)
    return part, scalars, state

  def group(x, ok):
    if chunk == 1:
      return one(jax.tree.map(lambda a: a[0], x), ok[0])
    part, scalars, state = jax.vmap(one)(x, ok)
    return types.sum_clients(part), scalars, state

  def split(tree, start, stop, rows):
    return jax.tree.map(
      lambda a: a[start:stop].reshape(rows, -1, *a.shape[1:]), tree
    )

  full, rest = divmod(k, chunk)
  shape = jax.eval_shape(
    group, jax.tree.map(lambda a: a[:chunk], xs), valid[:chunk]
  )
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape[0])

  def step(total, args):
    part, scalars, state = group(*args)
    return _add(total, part), (scalars, state)

  total, ys = lax.scan(
    step,
    zeros,
    (split(xs, 0, full * chunk, full), split(valid, 0, full * chunk, full)),
  )
  flat = (lambda a: a.reshape(-1, *a.shape[2:])) if chunk > 1 else None
  if flat is not None:
    ys = jax.tree.map(flat, ys)
  if rest:
    tail = jax.tree.map(lambda a: a[full * chunk :], (xs, valid))
    part, scalars, state = jax.vmap(one)(*tail)
    total = _add(total, types.sum_clients(part))
    ys = jax.tree.map(
      lambda a, b: jnp.concatenate([a, b]), ys, (scalars, state)
    )
  (num_examples, loss, num_steps), states = ys
  return types.Sums(total, num_examples, loss, num_steps), states
