"""A round's contributions summed outside the round, in the round's order:
what a deployment's server does with the outputs of clients that trained
on other machines.

The simulated round (`engine.make_round_fn`) sums the contributions of
its K clients in an order set by its placement. Over D devices the
clients take the slots `placement.slots` gives them (filled up with
empty clients to a multiple of D); each device adds its clients in the
groups of `streaming.groups` (a group's contributions summed, then added
to the device's running sum; masked where the round fills or shards),
and the D sums are added over the mesh (`placement.sum_over_devices`).
Float addition is not associative: a fold equals the round because it
adds in the same order (`Layout`), each contribution computed by the
same function (`streaming.contribute`), which keeps XLA from fusing a
contribution's products into the additions (one rounding where the
round's program would make two, or the other way: `types.unfused`).
Where the round trains a client in a vmapped group, its node trains it
in a group of the same width and lane (`Layout.lane`; deploy/node.py).

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
from fedjax_mr.training import streaming


class Programs(NamedTuple):
  """A fold's compiled programs (`programs`).

  Attributes:
    contribution: the algorithm's `contribution`.
    add_one: `add_one(total, output, ok, masked)`, a step of a round that
      runs one client at a time.
    add_group: `add_group(total, outputs, ok, masked)`, a step that runs
      a group of clients (outputs stacked).
    place: `placer(mesh)`.
    across: `across(totals)`, the devices' sums (stacked) added over the
      mesh; None on one device.
    shards: D, the mesh's devices.
  """

  contribution: Callable
  add_one: Callable
  add_group: Callable
  place: Callable[..., Layout]
  across: Callable | None
  shards: int


def _add(a: Any, b: Any) -> Any:
  return jax.tree.map(jnp.add, a, b)


def programs(
  contribution: Callable[[types.ClientOutput], Any], mesh: jax.sharding.Mesh
) -> Programs:
  """The programs of the folds of a run whose round would run over
  `mesh`."""

  one = functools.partial(streaming.contribute, contribution)

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
    placer(mesh),
    placement.sum_over_devices(mesh) if shards > 1 else None,
    shards,
  )


class Layout:
  """Where a round's K clients run in the simulated round of the same
  config: each device's groups (`streaming.groups`), as arrays of
  sampling positions (>= K: an empty client that fills the client axis
  up over the devices), and whether each group runs vmapped.

  Args:
    perm: `[K']` the round's slots (`placement.slots`; `arange(K)` on one
      device).
    k: K.
    shards: D.
    chunk: the round's `client_chunk`.
    summed: whether the round sums its clients' contributions.
  """

  def __init__(self, perm, k: int, shards: int, chunk: int, summed: bool):
    self.k = k
    per = len(perm) // shards
    self.devices = [
      [
        (np.asarray(perm[d * per + g.start : d * per + g.stop]), g.vmapped)
        for g in streaming.groups(per, chunk, summed)
      ]
      for d in range(shards)
    ]
    self._lanes = {}
    for d, device in enumerate(self.devices):
      for positions, vmapped in device:
        for lane, position in enumerate(positions):
          if position < k:
            width = len(positions) if vmapped else 0
            self._lanes[int(position)] = (d, width, lane)

  def device_of(self, position: int) -> int:
    """The device that runs the client at `position`."""
    return self._lanes[position][0]

  def lane(self, position: int) -> tuple[int, int]:
    """`(width, lane)` of the client at `position`: the width of its
    vmapped group and its place there, or `(0, 0)` where it runs
    alone."""
    return self._lanes[position][1:]


def placer(mesh: jax.sharding.Mesh) -> Callable[..., Layout]:
  """`place(sizes, chunk, summed)`: the `Layout` of a round over `mesh`
  whose sampled clients have `sizes` (`[K]`, in sampling order)."""
  shards = int(mesh.devices.size)
  slots = jax.jit(functools.partial(placement.slots, num_shards=shards))

  def place(sizes, chunk: int, summed: bool) -> Layout:
    k = len(sizes)
    perm = np.arange(k)
    if shards > 1:
      perm = np.asarray(jax.device_get(slots(jnp.asarray(sizes))))
    return Layout(perm, k, shards, chunk, summed)

  return place


class _Device:
  """One device's running sum: its groups, added in order once each is
  complete."""

  def __init__(self, groups: list[tuple[np.ndarray, bool]], total: Any):
    self.groups = groups
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
    self.k = len(sizes)
    self.zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), template)
    total = jax.tree.map(
      jnp.asarray,
      jax.tree.map(
        lambda s: np.zeros(s.shape, s.dtype),
        jax.eval_shape(programs.contribution, template),
      ),
    )
    self.layout = programs.place(sizes, chunk, True)
    self.devices = [_Device(g, total) for g in self.layout.devices]
    self.seen: set[int] = set()
    self.waiting: dict[int, Any] = {}  # position -> output (None: failed)

  def put(self, position: int, output: Any | None) -> None:
    """Client `position`'s output (None: it failed and adds nothing);
    adds every group of its device that is complete."""
    if position in self.seen or not 0 <= position < self.k:
      raise ValueError(f'position {position} is put twice or is not one')
    self.seen.add(position)
    self.waiting[position] = output
    device = self.devices[self.layout.device_of(position)]
    while device.next < len(device.groups):
      group, vmapped = device.groups[device.next]
      if any(p < self.k and p not in self.waiting for p in group):
        return
      device.next += 1
      self._add(device, group, vmapped)

  def _add(self, device: _Device, group: np.ndarray, vmapped: bool) -> None:
    outputs = [self.waiting.pop(p) if p < self.k else None for p in group]
    ok = np.asarray([o is not None for o in outputs])
    # The round masks every contribution when it shards (filling clients
    # add zeros), else none; a failed client's is masked here too.
    masked = self.p.shards > 1 or not ok.all()
    filled = [self.zeros if o is None else o for o in outputs]
    if vmapped:
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
