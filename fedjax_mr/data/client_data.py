"""Client data on the device: every example once, plus index rows.

A `ClientData` holds the whole training set (storage dtype) and, for each
of the N clients, a row of indices into it padded to the largest client
size, with the true sizes. Local training gathers batches through these
rows, so no example is ever copied per client.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.data import host


@flax.struct.dataclass
class ClientData:
  """Per-client views of one training set.

  Attributes:
    x: `[M, ...]` all training examples (storage dtype).
    y: `[M]` int32 labels.
    indices: `[N, n_max]` int32; row k lists client k's examples, padded with
      0 past `sizes[k]`.
    sizes: `[N]` int32 true client sizes.
    scale: model input is `x * scale + shift` (static).
    shift: see `scale`.
  """

  x: jax.Array
  y: jax.Array
  indices: jax.Array
  sizes: jax.Array
  scale: float = flax.struct.field(pytree_node=False, default=1.0)
  shift: float = flax.struct.field(pytree_node=False, default=0.0)

  @property
  def num_clients(self) -> int:
    return self.indices.shape[0]

  @property
  def max_size(self) -> int:
    return self.indices.shape[1]


def from_partition(
  x: np.ndarray,
  y: np.ndarray,
  parts: Sequence[np.ndarray],
  scale: float = 1.0,
  shift: float = 0.0,
) -> ClientData:
  """Builds `ClientData` from host arrays and a partition (index lists)."""
  sizes = np.array([len(p) for p in parts], np.int32)
  if sizes.min() < 1:
    raise ValueError('every client needs at least one example')
  rows = np.zeros((len(parts), int(sizes.max())), np.int32)
  for k, p in enumerate(parts):
    rows[k, : len(p)] = p
  return ClientData(
    x=host.to_device(x),
    y=host.to_device(y, np.int32),
    indices=jnp.asarray(rows),
    sizes=jnp.asarray(sizes),
    scale=float(scale),
    shift=float(shift),
  )


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
