"""Client data on the device: every example once, plus index lists.

A `ClientData` holds the whole training set (storage dtype) and the N
clients' index lists laid end to end (`offsets`, `flat`: Σ sizes entries,
not N × the largest size), with the true sizes. Local training gathers
batches through these lists, so no example is ever copied per client.

Local training reads client data only through `num_clients`, `max_size`,
`sizes`, `batch(client_id, positions)` and `with_empty_client()`; any
pytree with these (the generated `fedjax_mr.data.synthetic` clients) can
stand in for a `ClientData`.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fedjax_mr.core import errors
from fedjax_mr.data import host


@flax.struct.dataclass
class ClientData:
  """Per-client views of one training set.

  Attributes:
    x: `[M, ...]` all training examples (storage dtype).
    y: `[M]` int32 labels.
    offsets: `[N]` int32; client k's examples are
      `flat[offsets[k] : offsets[k] + sizes[k]]`.
    flat: `[Σ sizes + max_size]` int32, the N index lists end to end,
      followed by `max_size` zeros so that every client's padded row
      (`row`) is one in-bounds slice.
    sizes: `[N]` int32 true client sizes.
    max_size: the largest client size (static).
    scale: model input is `x * scale + shift` (static).
    shift: see `scale`.
  """

  x: jax.Array
  y: jax.Array
  offsets: jax.Array
  flat: jax.Array
  sizes: jax.Array
  max_size: int = flax.struct.field(pytree_node=False, default=1)
  scale: float = flax.struct.field(pytree_node=False, default=1.0)
  shift: float = flax.struct.field(pytree_node=False, default=0.0)

  @property
  def num_clients(self) -> int:
    return self.sizes.shape[0]

  @property
  def num_examples(self) -> int:
    """M, the examples held (assigned to a client or not)."""
    return self.x.shape[0]

  def row(self, client_id: jax.Array) -> jax.Array:
    """`[max_size]` int32: client `client_id`'s example indices, followed
    by other entries (indices of other clients' examples, or 0) past its
    size."""
    return lax.dynamic_slice(
      self.flat, (self.offsets[client_id],), (self.max_size,)
    )

  def batch(
    self, client_id: jax.Array, positions: jax.Array
  ) -> tuple[jax.Array, jax.Array]:
    """Model inputs (float32, normalised) and labels of the examples at
    `positions` (`[b]`, each in `[0, max_size)`) of client `client_id`'s
    list; entries at positions past its size are other examples, for the
    caller to mask."""
    idx = self.row(client_id)[positions]
    return normalize(self.x[idx], self.scale, self.shift), self.y[idx]

  def with_empty_client(self) -> ClientData:
    """The same clients and one more, id N, with no examples."""
    return self.replace(
      offsets=jnp.concatenate([self.offsets, jnp.zeros((1,), jnp.int32)]),
      sizes=jnp.concatenate([self.sizes, jnp.zeros((1,), jnp.int32)]),
    )


def layout(parts: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
  """`(offsets [N], flat [Σ sizes + max size], sizes [N])`, int32 host
  arrays, of a partition's index lists (see `ClientData`)."""
  sizes = np.array([len(p) for p in parts], np.int64)
  if len(parts) == 0 or sizes.min() < 1:
    raise ValueError('every client needs at least one example')
  total = int(sizes.sum())
  if total + int(sizes.max()) >= 2**31:
    raise ValueError(
      f'the partition lists {total} examples; at most 2**31 - 1 fit int32 '
      'indices'
    )
  offsets = np.zeros(len(parts), np.int64)
  np.cumsum(sizes[:-1], out=offsets[1:])
  flat = np.zeros(total + int(sizes.max()), np.int32)
  flat[:total] = np.concatenate(parts)
  return offsets.astype(np.int32), flat, sizes.astype(np.int32)


def from_partition(
  x: np.ndarray,
  y: np.ndarray,
  parts: Sequence[np.ndarray],
  scale: float = 1.0,
  shift: float = 0.0,
) -> ClientData:
  """Builds `ClientData` from host arrays and a partition (index lists)."""
  offsets, flat, sizes = layout(parts)
  return ClientData(
    x=host.to_device(x),
    y=host.to_device(y, np.int32),
    offsets=jnp.asarray(offsets),
    flat=jnp.asarray(flat),
    sizes=jnp.asarray(sizes),
    max_size=int(sizes.max()),
    scale=float(scale),
    shift=float(shift),
  )


def to_host(data: ClientData) -> ClientData:
  """`data` with numpy fields (views of CPU device buffers where it can)."""
  return jax.tree.map(np.asarray, data)


def memory_mapped(data: ClientData, folder: str) -> ClientData:
  """Host data `data` (numpy fields, `to_host`) with its examples, labels
  and index lists (`x`, `y`, `flat`: what grows with the examples)
  memory-mapped from an unnamed file in `folder` (`host.memory_mapped`);
  `gather_round` then reads only the pages of the sampled clients' rows.
  The values are the same, so is every view gathered from it."""
  x, y, flat = host.memory_mapped([data.x, data.y, data.flat], folder)
  return data.replace(x=x, y=y, flat=flat)


def is_memory_mapped(data: ClientData) -> bool:
  """Whether `data`'s examples are memory-mapped (`memory_mapped`)."""
  return isinstance(data.x, np.memmap)


def round_capacity(sizes: np.ndarray, clients_per_round: int) -> int:
  """The most examples `clients_per_round` distinct clients hold: the sum
  of the largest sizes (the rows of a `gather_round` view)."""
  k = errors.check_count('clients_per_round', clients_per_round)
  return int(np.sort(np.asarray(sizes, np.int64))[::-1][:k].sum())


def gather_round(
  data: ClientData, ids: np.ndarray, capacity: int
) -> ClientData:
  """The view of host data `data` (numpy fields, `to_host`) that a round
  training clients `ids` reads: their examples only, copied end to end
  into `[capacity, ...]` (zeros after them), with `offsets` pointing each
  sampled client at its block; the other clients keep their sizes but
  point at row 0, and must not be trained on this view. Every batch
  `batch(c, positions)` of a sampled client `c` equals the full data's at
  the positions below its size (past it, both give some example, masked
  by the caller).

  Args:
    data: the whole training set on the host (in memory, or
      `memory_mapped`: only the sampled rows' pages are read).
    ids: `[K]` client ids (repeats allowed: each client's examples are
      copied once).
    capacity: rows of the view, at least the sampled clients' examples
      (`round_capacity`, fixed for a run so the view's shapes are).

  Returns:
    A `ClientData` of numpy arrays, `max_size`, `scale` and `shift` kept.
  """
  unique = np.unique(np.asarray(ids, np.int64))
  sizes = np.asarray(data.sizes)
  counts = sizes[unique].astype(np.int64)
  total = int(counts.sum())
  if total > capacity:
    raise ValueError(
      f'clients {unique.tolist()[:8]} hold {total} examples, more than '
      f'capacity={capacity}'
    )
  starts = np.zeros(len(unique), np.int64)
  np.cumsum(counts[:-1], out=starts[1:])
  # Positions in `flat` of the sampled clients' index lists, end to end.
  where = np.repeat(np.asarray(data.offsets)[unique] - starts, counts)
  rows = np.asarray(data.flat)[where + np.arange(total)]
  x = np.zeros((capacity, *data.x.shape[1:]), data.x.dtype)
  y = np.zeros((capacity,), data.y.dtype)
  x[:total] = np.asarray(data.x)[rows]
  y[:total] = np.asarray(data.y)[rows]
  offsets = np.zeros(sizes.shape, np.int32)
  offsets[unique] = starts
  flat = np.zeros(capacity + data.max_size, np.int32)
  flat[:capacity] = np.arange(capacity, dtype=np.int32)
  return data.replace(x=x, y=y, offsets=offsets, flat=flat, sizes=sizes)


def normalize(x: jax.Array, scale: float, shift: float) -> jax.Array:
  """Model input from stored examples: float32 `x * scale + shift`."""
  if jnp.issubdtype(x.dtype, jnp.integer) and scale == 1.0 and shift == 0.0:
    return x  # token ids and other integer inputs pass through
  return x.astype(jnp.float32) * scale + shift


@flax.struct.dataclass
class EvalData:
  """A test set cut into equal batches for jit-compiled evaluation.

  Attributes:
    x: `[num_batches, B, ...]` examples, zero-padded in the last batch.
    y: `[num_batches, B]` labels.
    mask: `[num_batches, B]` float32, 1 for real examples.
  """

  x: jax.Array
  y: jax.Array
  mask: jax.Array
  scale: float = flax.struct.field(pytree_node=False, default=1.0)
  shift: float = flax.struct.field(pytree_node=False, default=0.0)


def eval_data(
  x: np.ndarray,
  y: np.ndarray,
  batch_size: int,
  scale: float = 1.0,
  shift: float = 0.0,
  num_shards: int = 1,
) -> EvalData:
  """Pads and reshapes a test set into `[num_batches, batch_size, ...]`.

  `num_batches` is rounded up to a multiple of `num_shards` (wholly masked
  batches), so that the batches split evenly over that many devices.
  """
  n = len(x)
  b = min(batch_size, n)
  nb = -(-n // b)
  nb = -(-nb // num_shards) * num_shards
  pad = nb * b - n
  if pad:
    xp = host.empty((nb * b, *x.shape[1:]), x.dtype)
    xp[:n] = x
    xp[n:] = 0
  else:
    xp = np.ascontiguousarray(x)  # shared, not copied, where aligned
  yp = np.concatenate([y, np.zeros((pad,), y.dtype)]).astype(np.int32)
  mask = np.concatenate([np.ones(n), np.zeros(pad)]).astype(np.float32)
  return EvalData(
    x=host.to_device(xp.reshape(nb, b, *x.shape[1:])),
    y=jnp.asarray(yp.reshape(nb, b)),
    mask=jnp.asarray(mask.reshape(nb, b)),
    scale=float(scale),
    shift=float(shift),
  )
