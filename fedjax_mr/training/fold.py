"""A round's contributions summed outside the round, in the round's order:
what a deployment's server does with the outputs of clients that trained
on other machines.

The simulated round (`engine.make_round_fn`) sums the contributions of
its K clients in an order set by its placement. Over D devices the
clients take the slots `placement.slots` gives them (filled up with
empty clients to a multiple of D); each device adds its clients in groups
of `chunk` (`streaming.stream_clients`: a group's contributions summed,
then added to the device's running sum; a shorter last group after the
others; masked where the round fills or shards), and the D sums are
added over the mesh (`placement.sum_over_devices`). Float addition is not
associative, and XLA:CPU may compute `total + n_k * w_k` as one fused
multiply-add when both are in one program: a fold equals the round only
if it adds in the same order, with each contribution computed in the
program that adds it, as the round's step does.

`Fold(programs, template, sizes, chunk)` takes the clients' outputs as
they arrive, in any order, adds each group as soon as it is complete and
holds the D running sums and the outputs of incomplete groups, never K
models. `programs(contribution, mesh)` compiles its programs once a run.
"""

from __future__ import annotations

import functools
from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.core import types
from fedjax_mr.training import placement


class Programs(NamedTuple):
  """A fold's compiled programs (`programs`).

  Attributes:
    contribution: the algorithm's `contribution`.
    add_one: `add_one(total, output, ok, masked)`, a step of a round that
      runs one client at a time.
    add_group: `add_group(total, outputs, ok, masked)`, a step that runs
      a group of clients (outputs stacked).
    slots: `slots(sizes)`, `placement.slots` over the mesh's devices.
    across: `across(totals)`, the devices' sums (stacked) added over the
      mesh; None on one device.
    shards: D, the mesh's devices.
  """

  contribution: Callable
  add_one: Callable
  add_group: Callable
  slots: Callable
  across: Callable | None
  shards: int


def _add(a: Any, b: Any) -> Any:
  return jax.tree.map(jnp.add, a, b)


def programs(
  contribution: Callable[[types.ClientOutput], Any], mesh: jax.sharding.Mesh
) -> Programs:
  """The programs of the folds of a run whose round would run over
  `mesh`."""

  def one(output, ok, masked):
    part = contribution(output)
    if masked:
      part = jax.tree.map(lambda c: jnp.where(ok, c, jnp.zeros_like(c)), part)
    return part

  @functools.partial(jax.jit, static_argnames='masked')
  def add_one(total, output, ok, masked):
    return _add(total, one(output, ok, masked))

  @functools.partial(jax.jit, static_argnames='masked')
  def add_group(total, outputs, ok, masked):
    parts = jax.vmap(lambda o, v: one(o, v, masked))(outputs, ok)
    return _add(total, types.sum_clients(parts))

  shards = int(mesh.devices.size)
  return Programs(
    contribution,
    add_one,
    add_group,
    jax.jit(functools.partial(placement.slots, num_shards=shards)),
    placement.sum_over_devices(mesh) if shards > 1 else None,
    shards,
  )


class _Device:
  """One device's running sum: its slots' clients in groups of `chunk`,
  added in order once each group is complete."""

  def __init__(self, slots: np.ndarray, chunk: int, total: Any):
    n = len(slots)
    chunk = max(1, min(int(chunk), n))
    full = n // chunk * chunk
    self.groups = [slots[i : i + chunk] for i in range(0, full, chunk)]
    if full < n:
      self.groups.append(slots[full:])
    self.vmapped = chunk > 1  # a group of one client is vmapped too
    self.total = total
    self.next = 0  # the first group not yet added


class Fold:
  """The sum of a round's contributions, its clients' outputs put in any
  order (see the module docstring).

  Args:
    programs: the run's `programs`.
    template: the shape of a client's output (`jax.ShapeDtypeStruct`s).
    sizes: `[K]` the sampled clients' sizes, in sampling order (the
      placement of the round depends on them).
    chunk: the round's `client_chunk`.
  """

  def __init__(self, programs: Programs, template: Any, sizes, chunk: int):
    self.p = programs
    self.k = k = len(sizes)
    self.zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), template)
    total = jax.tree.map(
      jnp.asarray,
      jax.tree.map(
        lambda s: np.zeros(s.shape, s.dtype),
        jax.eval_shape(programs.contribution, template),
      ),
    )
    if programs.shards > 1:
      perm = np.asarray(jax.device_get(programs.slots(jnp.asarray(sizes))))
    else:
      perm = np.arange(k)
    per = len(perm) // programs.shards
    self.devices = [
      _Device(perm[d * per : (d + 1) * per], chunk, total)
      for d in range(programs.shards)
    ]
    self.device_of = {
      int(position): j // per for j, position in enumerate(perm) if position < k
    }
    self.seen: set[int] = set()
    self.waiting: dict[int, Any] = {}  # position -> output (None: failed)

  def put(self, position: int, output: Any | None) -> None:
    """Client `position`'s output (None: it failed and adds nothing);
    adds every group of its device that is complete."""
    if position in self.seen or not 0 <= position < self.k:
      raise ValueError(f'position {position} is put twice or is not one')
    self.seen.add(position)
    self.waiting[position] = output
    device = self.devices[self.device_of[position]]
    while device.next < len(device.groups):
      group = device.groups[device.next]
      if any(p < self.k and p not in self.waiting for p in group):
        return
      device.next += 1
      self._add(device, group)

  def _add(self, device: _Device, group: np.ndarray) -> None:
    outputs = [self.waiting.pop(p) if p < self.k else None for p in group]
    ok = np.asarray([o is not None for o in outputs])
    # The round masks every contribution when it shards (filling clients
    # add zeros), else none; a failed client's is masked here too.
    masked = self.p.shards > 1 or not ok.all()
    filled = [self.zeros if o is None else o for o in outputs]
    if device.vmapped:
      device.total = self.p.add_group(
        device.total, _stack(filled), ok, masked=masked
      )
    else:
      device.total = self.p.add_one(
        device.total, filled[0], ok[0], masked=masked
      )

  def total(self) -> Any:
    """The sum, once every client was put."""
    if any(d.next < len(d.groups) for d in self.devices):
      raise ValueError('not every client of the round was put')
    if self.p.across is None:
      return self.devices[0].total
    return self.p.across(_stack([d.total for d in self.devices]))


def _stack(trees: list[Any]) -> Any:
  return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)
