"""Layers of a model, in model order, for the layer-wise server transforms.

FedMR recombines and FedMut mutates a model layer by layer. As in the
authors' reference code, a *layer* is every leaf of the model variables:
kernel and bias of one module are two layers, and so is every BatchNorm
tensor (scale, bias, running mean, running variance). `grouping='module'`
is the coarser reading of the papers' figures: all leaves of one module
(kernel+bias, or BatchNorm's scale, bias, mean and variance) form one layer.

Model order is the order in which Flax created the modules: for every
module (in order of first appearance in the `params` collection), its
`params` leaves, then its leaves of the other collections (`batch_stats`,
…). This is the order of PyTorch's `state_dict`, which FedMR-p cuts into
contiguous segments.

Where model order comes from: a Flax `init` returns dicts whose insertion
order is the module creation order, but jax flattens dicts in sorted-key
order and every jax transformation (`jax.tree.map`, `jit`, `vmap`) returns
dicts with sorted keys, so inside a server transform that order is gone.
Read it once with `model_order(model.init(key))` and pass the result as
`layer_order` wherever order matters (FedMR-p segments). Without
`layer_order`, the tree's own dict iteration order is used.

Everything here depends only on a tree's structure, so it works on traced
arrays inside `jax.jit`.

References:
  Hu et al., "FedMR: Federated Learning via Model Recombination" (layer-wise
  recombination, FedMR-p segments); Hu et al., "FedMut: Generalized
  Federated Learning via Stochastic Mutation", AAAI 2024 (layer-wise
  mutation).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Literal
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.core import types

Grouping = Literal['leaf', 'module']
GROUPINGS = ('leaf', 'module')

# The collection whose module order defines model order.
_PRIMARY = 'params'


class Leaf(NamedTuple):
  """One leaf of a model's variables.

  Attributes:
    name: its '/'-joined path, e.g. 'params/Conv_0/kernel'.
    collection: its Flax collection ('params', 'batch_stats', …), or '' for
      a tree that is not a Flax variables dict.
    module: the '/'-joined path of its module inside the collection, e.g.
      'Conv_0' ('' for the root module).
    index: its position in `jax.tree.leaves(tree)`.
  """

  name: str
  collection: str
  module: str
  index: int


class Layer(NamedTuple):
  """A set of leaves moved (recombined, mutated) as one unit.

  Attributes:
    name: a leaf's name (grouping 'leaf'), a module's name (grouping
      'module'), or 'first..last' for a segment of several layers.
    leaves: positions in `jax.tree.leaves(tree)`, in model order.
  """

  name: str
  leaves: tuple[int, ...]


def _key_str(entry) -> str:
  for attr in ('key', 'idx', 'name'):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _path_name(path) -> tuple[str, ...]:
  return tuple(_key_str(e) for e in path)


def _walk(node, prefix: tuple[str, ...]):
  """Leaf paths in the tree's own iteration order (dicts: insertion)."""
  if isinstance(node, Mapping):
    for k, v in node.items():
      yield from _walk(v, prefix + (str(k),))
    return
  children, _ = jax.tree_util.tree_flatten_with_path(
    node, is_leaf=lambda x: x is not node
  )
  for path, child in children:
    if path == ():
      yield prefix
    else:
      yield from _walk(child, prefix + _path_name(path))


def _is_variables(tree) -> bool:
  return isinstance(tree, Mapping) and _PRIMARY in tree


def leaves(
  tree: types.PyTree, layer_order: Sequence[str] | None = None
) -> tuple[Leaf, ...]:
  """The leaves of `tree` in model order.

  Args:
    tree: a model's variables `{'params': ..., 'batch_stats': ...}` (a dict
      with a 'params' key is read as Flax collections), any other pytree,
      or a stack of either (leading axes do not matter).
    layer_order: leaf names in model order, as `model_order` returns them
      for freshly initialised variables; None: the tree's own iteration
      order (model order only for dicts straight from `module.init`).

  Returns:
    One `Leaf` per leaf of `tree`, in model order.

  Raises:
    ValueError: `layer_order` does not name exactly the leaves of `tree`.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  paths = [_path_name(p) for p, _ in flat]
  by_path = {p: i for i, p in enumerate(paths)}
  variables = _is_variables(tree)

  def make(path):
    if variables:
      collection, module = path[0], '/'.join(path[1:-1])
    else:
      collection, module = '', '/'.join(path[:-1])
    return Leaf('/'.join(path), collection, module, by_path[path])

  if layer_order is not None:
    by_name = {'/'.join(p): p for p in paths}
    order = list(layer_order)
    if sorted(order) != sorted(by_name):
      missing = sorted(set(by_name) - set(order))
      extra = sorted(set(order) - set(by_name))
      raise ValueError(
        f'layer_order does not match the tree: missing {missing}, '
        f'unknown {extra}'
      )
    return tuple(make(by_name[n]) for n in order)

  walked = list(_walk(tree, ()))
  if sorted(walked) != sorted(paths):  # An unusual container: jax order.
    walked = paths
  # Module order: that of the primary collection, with modules found only in
  # other collections inserted after the module that precedes them there.
  collections, modules = [], {}
  for path in walked:
    leaf = make(path)
    if leaf.collection not in modules:
      collections.append(leaf.collection)
      modules[leaf.collection] = []
    if leaf.module not in modules[leaf.collection]:
      modules[leaf.collection].append(leaf.module)
  if _PRIMARY in collections:
    collections.remove(_PRIMARY)
    collections.insert(0, _PRIMARY)
  merged = list(modules[collections[0]]) if collections else []
  for c in collections[1:]:
    pos = -1
    for m in modules[c]:
      if m in merged:
        pos = merged.index(m)
      else:
        pos += 1
        merged.insert(pos, m)
  rank = {m: i for i, m in enumerate(merged)}
  crank = {c: i for i, c in enumerate(collections)}
  walked_leaves = [make(p) for p in walked]
  # A stable sort keeps the walk order inside each (module, collection).
  return tuple(
    sorted(walked_leaves, key=lambda x: (rank[x.module], crank[x.collection]))
  )


def model_order(tree: types.PyTree) -> tuple[str, ...]:
  """Leaf names of `tree` in model order (see `leaves`).

  Call it on the variables `module.init` returns (before any jax
  transformation re-sorts their keys) and pass the result as `layer_order`.
  """
  return tuple(leaf.name for leaf in leaves(tree))


def layer_groups(
  tree: types.PyTree,
  *,
  grouping: Grouping = 'leaf',
  num_segments: int | None = None,
  layer_order: Sequence[str] | None = None,
) -> tuple[Layer, ...]:
  """The units a layer-wise transform treats independently, in model order.

  Args:
    tree: as for `leaves`.
    grouping: 'leaf' (every leaf is a layer) or 'module' (all leaves of one
      module are one layer).
    num_segments: None for one unit per layer; else cut the layers (in model
      order) into this many contiguous segments of as equal a number of
      layers as possible (the first ones one layer longer), FedMR-p. More
      segments than layers gives one layer per segment; 1 is the whole
      model.
    layer_order: as for `leaves`.

  Returns:
    The units, each a `Layer` (leaf positions in `jax.tree.leaves(tree)`);
    every leaf belongs to exactly one unit.

  Raises:
    ValueError: an unknown grouping or a non-positive `num_segments`.
  """
  if grouping not in GROUPINGS:
    raise ValueError(f'grouping must be one of {GROUPINGS}, got {grouping!r}')
  ordered = leaves(tree, layer_order)
  layers: list[Layer] = []
  if grouping == 'leaf':
    layers = [Layer(leaf.name, (leaf.index,)) for leaf in ordered]
  else:
    for leaf in ordered:  # A module's leaves are contiguous in model order.
      if layers and layers[-1].name == leaf.module:
        layers[-1] = Layer(leaf.module, layers[-1].leaves + (leaf.index,))
      else:
        layers.append(Layer(leaf.module, (leaf.index,)))
  if num_segments is None:
    return tuple(layers)
  if int(num_segments) < 1:
    raise ValueError(f'num_segments must be >= 1, got {num_segments}')
  segments = []
  for part in np.array_split(np.arange(len(layers)), int(num_segments)):
    if len(part) == 0:
      continue
    first, last = layers[part[0]].name, layers[part[-1]].name
    name = first if len(part) == 1 else f'{first}..{last}'
    segments.append(
      Layer(name, tuple(i for j in part for i in layers[j].leaves))
    )
  return tuple(segments)


def layer_keys(key: jax.Array, layers: Sequence[Layer]) -> jax.Array:
  """One PRNG key per unit, derived from the unit's name.

  A unit's randomness thus depends only on `key` and its name, not on the
  dict order of the tree nor on the other units: the same key gives the
  same result on a fresh `module.init` dict and on its re-sorted copy
  inside `jit`.

  Args:
    key: PRNG key.
    layers: as `layer_groups` returns them.

  Returns:
    `[len(layers)]` keys.
  """
  hashes: list[int] = []
  for layer in layers:
    h, salt = zlib.crc32(layer.name.encode()) & 0x7FFFFFFF, 0
    while h in hashes:  # An (unlikely) collision: rehash with a salt.
      salt += 1
      h = zlib.crc32(f'{layer.name}#{salt}'.encode()) & 0x7FFFFFFF
    hashes.append(h)
  data = jnp.asarray(hashes, jnp.uint32)
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, data)


def unit_permutations(keys: jax.Array, n: int) -> jax.Array:
  """An independent random permutation of `range(n)` per key.

  Each sorts n random 32-bit keys: uniform up to ties among them
  (probability below n^2 / 2^33).

  Args:
    keys: `[G]` PRNG keys, e.g. from `layer_keys`.
    n: length of each permutation.

  Returns:
    `[G, n]` int32.
  """
  if keys.shape[0] == 0 or n == 0:
    return jnp.zeros((keys.shape[0], n), jnp.int32)

  def one(key):
    return jnp.argsort(jax.random.bits(key, (n,), jnp.uint32))

  return jax.vmap(one)(keys).astype(jnp.int32)


def layer_sizes(
  tree: types.PyTree, layers: Sequence[Layer], *, leading: int = 0
) -> tuple[int, ...]:
  """Bytes of each layer of one model.

  Args:
    tree: the tree `layers` was built for.
    layers: as `layer_groups` returns them.
    leading: number of leading (stacking) axes to ignore, 1 for `[K, ...]`.

  Returns:
    One Python int per layer: bytes of its leaves for a single model.
  """
  flat = jax.tree.leaves(tree)

  def nbytes(x):
    return int(np.prod(x.shape[leading:], dtype=np.int64)) * x.dtype.itemsize

  return tuple(sum(nbytes(flat[i]) for i in layer.leaves) for layer in layers)
