"""The clients of a round mapped over one device: stacked (`map_clients`)
or streamed, their contributions summed as they finish (`stream_clients`).

Streaming keeps one chunk of trained models and the running sum in
memory, never all K (../shared/STYLE.md, "The round").
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fedjax_mr.core import types


class Group(NamedTuple):
  """A group of a device's clients run in one program (`groups`).

  Attributes:
    start: its first client, an index of the device's clients.
    stop: one past its last.
    vmapped: its clients run vmapped (a group of one too), not as one
      client's program.
  """

  start: int
  stop: int
  vmapped: bool


def groups(n: int, chunk: int, summed: bool) -> list[Group]:
  """How a device runs its `n` clients with `client_chunk` = `chunk`:
  its groups, in order, each one program (`stream_clients` when
  `summed`, else `map_clients`).

  Groups of `chunk` clients (all `n` in one where `chunk` >= `n`), then a
  shorter group of the rest, run vmapped; `chunk` = 1 runs each client
  alone, as does `chunk` > 1 on a device of one client when `summed`.
  A client's numbers depend on its group's width and its place in it
  (a vmapped program rounds as it will), not on the other clients there:
  a deployment trains each client where the simulation would
  (`fold.Layout`).
  """
  if n < 1 or chunk < 1:
    raise ValueError(f'n and chunk must be >= 1, got n={n}, chunk={chunk}')
  vmapped = (min(chunk, n) if summed else chunk) > 1
  width = min(chunk, n) if vmapped else 1
  full = n // width * width
  out = [Group(i, i + width, vmapped) for i in range(0, full, width)]
  if full < n:
    out.append(Group(full, n, True))
  return out


def map_clients(fn: Callable, xs: Any, chunk: int) -> Any:
  """Maps `fn` over the leading axis of `xs` (a tuple of trees), in the
  `groups` of `chunk`: `chunk` = 1 runs the clients one after another
  (`lax.map`); `chunk` >= K vmaps all of them; in between, vmapped chunks
  of `chunk` clients run one after another, then the rest vmapped.
  """
  k = jax.tree.leaves(xs)[0].shape[0]
  spans = groups(k, chunk, summed=False)
  if not spans[0].vmapped:
    return lax.map(lambda a: fn(*a), xs)
  if len(spans) == 1:
    return jax.vmap(fn)(*xs)
  return lax.map(lambda a: fn(*a), xs, batch_size=spans[0].stop)


def contribute(
  contribution: Callable[[types.ClientOutput], Any],
  output: types.ClientOutput,
  ok: jax.Array,
  masked: bool,
) -> Any:
  """One client's contribution to its round's sums: `contribution(output)`,
  zeros where `ok` is False when `masked`, passed through `types.unfused`
  (keyed by the client's example count) before any sum reads it.

  So XLA never fuses the arithmetic that makes a contribution into the
  additions that sum it (at a program's flags XLA:CPU makes `total + n *
  w` one fused multiply-add, rounded once, where its fusions allow, and
  they differ from program to program): the sums are the same bits in
  every program that adds the same contributions in the same order, the
  round's and a deployment's fold (`training/fold.py`).
  """
  part = contribution(output)
  if masked:
    part = jax.tree.map(lambda c: jnp.where(ok, c, jnp.zeros_like(c)), part)
  return types.unfused(part, output.num_examples)


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

  Clients run in the `groups` of `chunk` (1: one after another), the
  groups one after another (`lax.scan`) with the running sum carried:
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
  spans = groups(k, int(chunk), summed=True)
  chunk = spans[0].stop  # the groups' width; a last one may be shorter
  masked = valid is not None
  if not masked:
    valid = jnp.ones((k,), bool)  # carried along, never read

  def one(x, ok):
    out, state = fn(*x)
    part = contribute(contribution, out, ok, masked)
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

  full = sum(g.stop - g.start == chunk for g in spans)
  rest = k - full * chunk
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
