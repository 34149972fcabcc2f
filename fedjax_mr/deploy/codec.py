"""Pytrees as Flower array records, checked on arrival.

A tree travels as one `flwr.app.ArrayRecord`: one `Array` per leaf, keyed
by the leaf's path (`jax.tree_util.keystr`), in the order of
`jax.tree.flatten`. The receiver decodes it against the tree it expects
(the template: what it dispatched, or `jax.eval_shape` of what the reply
should be): the same paths in the same order, each leaf of the template's
shape and dtype, no more bytes than those leaves take, and finite values
in every floating leaf. Anything else is refused with `ReplyError`
naming the leaf, before a single value reaches the caller.

Arrays are serialized by Flower (`np.save` without pickles) and read back
with `np.load(allow_pickle=False)`: nothing is ever unpickled. NumPy has
no bfloat16, so a bfloat16 leaf comes back as a two-byte void array; its
dtype is restored from the template (the bits are the ones sent).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import Array
from flwr.app import ArrayRecord

PyTree = Any

# Bytes an `.npy` header may take beyond the leaf's own: NumPy pads the
# header to a multiple of 64 bytes; a shape of many dimensions needs more
# than one block, never near this.
NPY_HEADER_BYTES = 4096


class ReplyError(ValueError):
  """A record that does not match the tree it should hold; the message
  names the leaf (its path) and what is wrong."""


def _paths(tree: PyTree) -> tuple[list[str], list[Any], Any]:
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  keys = [jax.tree_util.keystr(path) or '.' for path, _ in flat]
  return keys, [leaf for _, leaf in flat], treedef


def encode(tree: PyTree) -> ArrayRecord:
  """`tree` (arrays or scalars as leaves) as an `ArrayRecord`, one `Array`
  per leaf keyed by its path. Typed PRNG keys are sent as their key data.

  Raises:
    TypeError: `tree` holds a leaf that is not an array or a number.
  """
  keys, leaves, _ = _paths(tree)
  record = ArrayRecord()
  for key, leaf in zip(keys, leaves):
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(
      leaf.dtype, jax.dtypes.prng_key
    ):
      leaf = jax.random.key_data(leaf)
    if not isinstance(leaf, (np.ndarray, np.generic, jax.Array, int, float)):
      raise TypeError(
        f'tree leaf {key} is a {type(leaf).__name__}, not an array'
      )
    record[key] = Array(np.array(jax.device_get(leaf), order='C'))
  return record


def payload_bytes(record: ArrayRecord) -> int:
  """The serialized bytes of `record`'s arrays (headers included)."""
  return sum(len(array.data) for array in record.values())


def max_bytes(template: PyTree) -> int:
  """The most serialized bytes a record of `template`'s leaves may take:
  the leaves' own bytes and one `.npy` header each."""
  _, leaves, _ = _paths(template)
  return sum(_nbytes(leaf) + NPY_HEADER_BYTES for leaf in leaves)


def _nbytes(leaf: Any) -> int:
  return (
    int(np.prod(np.shape(leaf), dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
  )


def decode(record: ArrayRecord, template: PyTree) -> PyTree:
  """The tree `record` holds, checked against `template` (a tree of
  arrays or `jax.ShapeDtypeStruct`s: what was dispatched, or the shape
  of the expected reply).

  Returns:
    `template`'s structure with numpy leaves of its shapes and dtypes.

  Raises:
    ReplyError: `record` is not an `ArrayRecord`, or its paths, a leaf's
      shape or dtype, its size or a value (non-finite) differ from what
      `template` allows; the message names the leaf.
  """
  if not isinstance(record, ArrayRecord):
    raise ReplyError(f'record is a {type(record).__name__}, not an ArrayRecord')
  keys, expected, treedef = _paths(template)
  got = list(record.keys())
  if got != keys:
    missing = [k for k in keys if k not in record]
    extra = [k for k in got if k not in set(keys)]
    raise ReplyError(
      'record does not hold the expected tree: '
      f'missing {missing[:3]}, unexpected {extra[:3]}'
      + ('' if missing or extra else ', leaves out of order')
    )
  size = payload_bytes(record)
  if size > max_bytes(template):
    raise ReplyError(
      f'record holds {size} bytes, more than the {max_bytes(template)} '
      'its tree allows'
    )
  return jax.tree.unflatten(
    treedef,
    [_leaf(key, record[key], want) for key, want in zip(keys, expected)],
  )


def _leaf(key: str, array: Array, want: Any) -> np.ndarray:
  """One checked leaf (see `decode`)."""
  dtype, shape = np.dtype(want.dtype), tuple(np.shape(want))
  if not isinstance(array, Array):
    raise ReplyError(f'leaf {key} is a {type(array).__name__}, not an Array')
  if tuple(array.shape) != shape or array.dtype != str(dtype):
    raise ReplyError(
      f'leaf {key} is {array.dtype}{list(array.shape)}, expected '
      f'{dtype}{list(shape)}'
    )
  if len(array.data) > _nbytes(want) + NPY_HEADER_BYTES:
    raise ReplyError(f'leaf {key} holds {len(array.data)} bytes, too many')
  try:
    value = array.numpy()
  except (ValueError, TypeError, OSError, EOFError) as e:
    raise ReplyError(f'leaf {key} does not read as an array: {e}') from None
  if value.dtype != dtype and value.dtype.kind == 'V':
    # bfloat16 (and other ml_dtypes) come back as raw bytes of their size.
    if value.dtype.itemsize == dtype.itemsize:
      value = value.view(dtype)
  if value.shape != shape or value.dtype != dtype:
    raise ReplyError(
      f'leaf {key} reads as {value.dtype}{list(value.shape)}, expected '
      f'{dtype}{list(shape)}'
    )
  if jax.dtypes.issubdtype(dtype, jnp.floating) and not np.all(
    np.isfinite(value)
  ):
    raise ReplyError(f'leaf {key} holds non-finite values')
  return value
