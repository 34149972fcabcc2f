"""FeDepth: memory-adaptive depth-wise training of one global model.

Every client holds the whole global model but trains it in pieces that fit
its memory. The model's body is a chain of layers (the zoo ResNets'
residual blocks 'layer{i}_{j}'; ResNet-18: eight) followed by a classifier
(the head, shared by every piece). Client k's memory budget decomposes the
layers into consecutive blocks; the client trains its blocks one after
another, in depth order. While block j trains:

  * the layers before it are frozen and run forward only (no gradient
    reaches them, so their activations need not be kept);
  * the layers after it are not used;
  * the output of its last layer goes to the head through a
    parameter-free adaptor: global average pooling over the spatial axes
    and zero-padding of the channels to the head's input width (the
    paper's skip connection with zero-padding for ResNets; the deepest
    layer's output is exactly the network's own representation);
  * the block's layers and the head are trained on the ordinary
    cross-entropy of the head's logits.

So a block's training needs the memory of that block and the head (plus a
forward pass through the frozen prefix), not that of the whole network. A
client whose budget holds the whole model has one block, the whole
network: ordinary local training. The server averages each variable over
the sampled clients that trained it (example-weighted or plain, as the
setting says); a variable no sampled client trained keeps its value.

Decomposition from memory budgets. Budgets are FedStitch's (1/2/4/8 GB at
30/30/30/10 % of the clients, a seeded assignment,
`fedjax_mr.training.budgets`). The training memory of block [a, b] (layers
a..b trained with the head, layers < a frozen, layers > b absent) is
measured from XLA at the reference setting (224 × 224 × 3, batch 32;
`budgets.training_memory_bytes` on the truncated network with a
`trainable` predicate). For a budget M (`decompose`):
  1. the whole model, if its training fits M;
  2. otherwise greedily from the input: a block starts at the next layer
     and grows while it fits M; a layer that does not fit M even alone is
     skipped (the client runs it frozen and never trains it);
  3. a client that can train no layer at all trains the head alone on the
     frozen network's representation, even over its budget (every client
     takes part).
Only the blocks the greedy rule visits are measured, each once per build.
`layers_per_block` > 0 gives every client fixed blocks of that many layers
instead (no measurement). For ResNet-18 (layers 0..7, the stem in layer
0) XLA:CPU measures 11.5 GB for the whole model and 1.6 GB for the head
alone, which gives: 1 GB: the head alone; 2 GB: layers 0-2 skipped, then
[3], [4, 5], [6, 7]; 4 GB: layer 0 skipped, then [1], [2, 3], [4, 7];
8 GB: [0, 1], [2, 7]. (The CIFAR-style stem keeps 224 × 224 feature maps
through the first stage, so the first layers are the most expensive.)

Fixed shapes: every client of a round runs the same program under `vmap`.
A client's decomposition is data: its blocks' first and last layers
`[S]` (S the largest number of blocks of any client) and its number of
blocks, read by client id from a table closed over by the factory. The
client's loop over its blocks has a data-dependent trip count (a client
with fewer blocks computes nothing more; under `vmap` the lanes of a chunk
run to the chunk's longest client). Within a block the whole network
runs: frozen layers behind `stop_gradient`, later layers computed and
discarded (a per-client cut cannot skip them under `vmap`). Once a block
has trained, every leaf outside it and the head is set back to its value
from before the block (frozen layers stay exactly put, BatchNorm
statistics included, whatever the optimizer).

Deviations/choices (the paper leaves these open or we could not verify
them):
  * Local work: each block gets the full E local epochs (our reading of
    the paper's sequential training; we could not confirm whether it
    divides the epochs between blocks instead), with a fresh optimizer
    state (momentum from zero) per block, so a client with J blocks makes
    J·E passes over its data. The first block uses the client's key and
    block j > 0 `fold_in(key, j)`, so a one-block client is exactly
    FedAvg's local training.
  * Frozen layers compute with batch statistics (training mode, as a
    PyTorch model in `train()` with frozen parameters) but their running
    statistics are not updated: a frozen layer is frozen entirely.
  * The adaptor pads channels at the end (channels 0..c-1 carry the
    features); ResNet's option-A shortcut pads on both sides. It pools
    before padding, so it needs no strided subsampling.
  * Layers are the residual blocks of the zoo ResNets (top-level modules
    named 'layer{i}_{j}', in call order); other body modules (the stem)
    join the next layer. A model without such blocks (the CNNs, VGG, the
    LSTM) is one layer: it trains whole when its budget holds it, else its
    head alone.
  * Layers that do not fit a budget are skipped (rule 2 above) rather
    than trained over budget; the paper's memory-surplus variant
    (m-FeDepth: several models with mutual distillation on clients with
    spare memory) is not implemented.
  * The head is the module(s) the zoo's `from_features` call uses.
  * Uploads are the trained variables (and the head); the download is the
    whole model (the frozen prefix is needed to train later blocks).

References:
  Zhang, Dai, Wang, Xing, Chen and Sun, "Memory-adaptive Depth-wise
  Heterogeneous Federated Learning", arXiv:2303.04887, 2023.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any
from typing import Callable
from typing import NamedTuple
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fedjax_mr.core import errors
from fedjax_mr.core import tree
from fedjax_mr.core import types
from fedjax_mr.models import model as model_lib
from fedjax_mr.training import budgets as budgets_lib
from fedjax_mr.training import client

# Names of the residual blocks of the zoo ResNets: the layers blocks are
# made of.
_LAYER = re.compile(r'^layer\d+_\d+$')
# The variables collection that carries a block's layer range into the
# local update.
_INFO = 'fedepth'
# Memory is measured on RGB images (the FedStitch pool's).
REFERENCE_CHANNELS = budgets_lib.REFERENCE_INPUT_SHAPE[-1]


@dataclasses.dataclass(frozen=True)
class Hparams(budgets_lib.BudgetHparams):
  """FeDepth's decomposition: memory budgets or fixed blocks."""

  layers_per_block: int = 0

  def validate(self, **setting) -> None:
    """Raises `ArgumentError` naming a bad field (`setting`: unused)."""
    del setting
    if self.layers_per_block < 0:
      raise errors.ArgumentError(
        'layers_per_block', f'must be >= 0, got {self.layers_per_block}'
      )
    self.validate_budgets()


class FeDepthState(NamedTuple):
  """Attributes: params: the global model (all variables)."""

  params: types.Variables


# ----------------------------------------------------------------------------
# Layers, the head and the adaptor.


class Layout(NamedTuple):
  """How a model's top-level modules split into layers and the head.

  Attributes:
    layers: names of the layers (residual blocks) in call order; `()` when
      the model has none (its whole body is then one layer).
    owner: {top-level module name: index}: a layer's own index, the next
      layer's for other body modules (the stem), `num_layers` for the
      head.
    width: D, the head's input width (the representation's size).
  """

  layers: tuple[str, ...]
  owner: dict[str, int]
  width: int

  @property
  def num_layers(self) -> int:
    """U >= 1 (a model without residual blocks is one layer)."""
    return max(len(self.layers), 1)


def _top_calls(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
  """`fn()` and the names of the top-level modules it calls, in call
  order, each once."""
  names: list[str] = []

  def hook(next_fun, args, kwargs, context):
    path = context.module.path
    if context.method_name == '__call__' and len(path) == 1:
      if path[0] not in names:
        names.append(path[0])
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(hook):
    result = fn()
  return result, names


def layout_of(model: model_lib.Model) -> Layout:
  """The layers, head and representation width of a zoo `model`, found by
  tracing (shapes only) its forward pass and its head."""
  variables = jax.eval_shape(model.init, jax.random.key(0))
  x = jnp.zeros((1, *model.input_shape), model.input_dtype)
  apply = model.module.apply
  rep, called = _top_calls(
    lambda: jax.eval_shape(
      lambda v: apply(v, x, train=False, features_only=True), variables
    )
  )
  width = int(rep.shape[-1])
  feats = jnp.zeros((1, width), jnp.float32)
  _, head = _top_calls(
    lambda: jax.eval_shape(lambda v: model.apply_head(v, feats), variables)
  )
  layers = tuple(n for n in called if _LAYER.match(n) and n not in head)
  owner: dict[str, int] = {}
  pending: list[str] = []
  for name in called:
    if name in layers:
      for other in pending + [name]:
        owner[other] = layers.index(name)
      pending = []
    elif name not in head:
      pending.append(name)
  for name in pending:  # after the last layer: they join it
    owner[name] = max(len(layers) - 1, 0)
  for name in head:
    owner[name] = max(len(layers), 1)
  return Layout(layers, owner, width)


def leaf_layers(variables: types.PyTree, layout: Layout) -> types.PyTree:
  """The layer index (Python int; `num_layers` for the head) of every leaf
  of a variables tree (collection name first); modules the forward pass
  never calls count as layer 0."""

  def index(path, _):
    name = getattr(path[1], 'key', getattr(path[1], 'name', path[1]))
    return layout.owner.get(str(name), 0)

  return jax.tree_util.tree_map_with_path(index, variables)


def adapt(out: jax.Array, width: int) -> jax.Array:
  """The parameter-free adaptor: `out` `[B, ..., c]` averaged over its
  middle (spatial) axes and zero-padded to `[B, width]` (c <= width)."""
  pooled = jnp.mean(out.reshape(out.shape[0], -1, out.shape[-1]), axis=1)
  return jnp.pad(pooled, ((0, 0), (0, width - pooled.shape[-1])))


def trainable(
  leaves: types.PyTree, first: Any, last: Any, num_layers: int
) -> types.PyTree:
  """Bool per leaf: trained in block [first, last] (its layers and the
  head). `first`, `last` may be traced int32 scalars."""
  return jax.tree.map(
    lambda u: ((u >= first) & (u <= last)) | (u == num_layers), leaves
  )


def block_forward(
  model: model_lib.Model,
  layout: Layout,
  variables: types.Variables,
  x: jax.Array,
  key: jax.Array,
  mask: jax.Array | None,
  first: jax.Array,
  last: jax.Array,
) -> tuple[jax.Array, types.Variables]:
  """Training-mode forward pass for block [first, last] (see the module
  docstring): the whole network runs, layers before `first` behind
  `stop_gradient`, and the head reads layer `last`'s adapted output.

  Returns:
    `(logits [B, C], state)`, `state` the new non-parameter collections of
    every layer (the caller keeps those of the block's layers).
  """
  index = {name: i for i, name in enumerate(layout.layers)}
  outs: list[Any] = [None] * len(layout.layers)

  def hook(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    path = context.module.path
    if context.method_name == '__call__' and len(path) == 1:
      i = index.get(path[0])
      if i is not None:
        out = jnp.where(i < first, lax.stop_gradient(out), out)
        outs[i] = out
    return out

  mutable = [k for k in variables if k != 'params']
  kwargs = dict(
    train=True, mask=mask, rngs={'dropout': key}, features_only=True
  )
  with nn.intercept_methods(hook):
    if mutable:
      rep, state = model.module.apply(variables, x, mutable=mutable, **kwargs)
      state = dict(state)
    else:
      rep, state = model.module.apply(variables, x, **kwargs), {}
  # The head alone (first = U): nothing before the head trains.
  rep = jnp.where(first >= layout.num_layers, lax.stop_gradient(rep), rep)
  # The deepest layer's feature is the network's own representation.
  chosen = rep
  for i in reversed(range(len(layout.layers) - 1)):
    chosen = jnp.where(last == i, adapt(outs[i], layout.width), chosen)
  return model.apply_head(variables, chosen), state


class BlockModel(NamedTuple):
  """`model` trained one block at a time: `apply_train` reads the block's
  `first` and `last` layers from the variables' 'fedepth' collection and
  returns new statistics for the block's layers only (the others as
  received); see `client.LocalTraining.model`."""

  model: model_lib.Model
  layout: Layout

  def apply_train(self, variables, x, key, mask=None):
    info = variables[_INFO]
    rest = {k: v for k, v in variables.items() if k != _INFO}
    logits, state = block_forward(
      self.model, self.layout, rest, x, key, mask, info['first'], info['last']
    )
    if state:
      old = {k: rest[k] for k in state}
      keep = trainable(
        leaf_layers(old, self.layout),
        info['first'],
        info['last'],
        self.layout.num_layers,
      )
      state = jax.tree.map(jnp.where, keep, state, old)
    return logits, state


# ----------------------------------------------------------------------------
# Memory of a block and the decomposition.


class _Prefix(nn.Module):
  """The network block [.., last] trains: `inner`'s layers up to `last`
  (later ones are not called), the adaptor and the head."""

  inner: nn.Module
  layers: tuple[str, ...]
  last: int
  width: int

  def __call__(self, x, train=False, mask=None):
    skipped = set(self.layers[self.last + 1 :])
    kept = {}

    def hook(next_fun, args, kwargs, context):
      path = context.module.path
      if context.method_name == '__call__' and len(path) == 2:
        if path[-1] in skipped:
          return args[0]
        out = next_fun(*args, **kwargs)
        kept[path[-1]] = out
        return out
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(hook):
      rep = self.inner(x, train=train, mask=mask, features_only=True)
    if self.last < len(self.layers) - 1:
      rep = adapt(kept[self.layers[self.last]], self.width)
    return self.inner(rep, train=train, mask=mask, from_features=True)


def block_memory(
  model: model_lib.Model,
  layout: Layout,
  batch_size: int = budgets_lib.REFERENCE_BATCH_SIZE,
  input_shape: Sequence[int] | None = budgets_lib.REFERENCE_INPUT_SHAPE,
) -> Callable[[int, int], int]:
  """`need(first, last)`: the measured training memory (bytes) of block
  [first, last] of `model` (`first = num_layers`: the head alone), at the
  reference setting by default; memoised."""
  u = layout.num_layers
  memo: dict[tuple[int, int], int] = {}

  def need(first: int, last: int) -> int:
    if (first, last) not in memo:
      if layout.layers:
        module = _Prefix(
          model.module.clone(parent=None, name='inner'),
          layout.layers,
          last,
          layout.width,
        )
        measured = model._replace(module=module)
        depth = 1  # paths are ('inner', module, ...)
      else:
        measured, depth = model, 0

      def is_trained(path):
        i = layout.owner.get(str(path[depth]), 0)
        return first <= i <= last or i == u

      memo[first, last] = budgets_lib.training_memory_bytes(
        measured, batch_size, input_shape, trainable=is_trained
      )
    return memo[first, last]

  return need


Blocks = list[tuple[int, int]]


def decompose(
  budget: int, num_layers: int, need: Callable[[int, int], int]
) -> Blocks:
  """One client's blocks `[(first, last), ...]` for a budget (bytes).

  The whole model if `need(0, U - 1)` fits; else greedy from the input
  (each block grows while it fits; a layer that does not fit alone is
  skipped); `[(U, U - 1)]` (the head alone) when no layer fits.
  """
  u = num_layers
  if need(0, u - 1) <= budget:
    return [(0, u - 1)]
  blocks: Blocks = []
  a = 0
  while a < u:
    if need(a, a) > budget:
      a += 1
      continue
    b = a
    while b + 1 < u and need(a, b + 1) <= budget:
      b += 1
    blocks.append((a, b))
    a = b + 1
  return blocks or [(u, u - 1)]


def fixed_blocks(num_layers: int, layers_per_block: int) -> Blocks:
  """Consecutive blocks of `layers_per_block` layers (the last may be
  shorter) covering all `num_layers` layers."""
  n = max(1, int(layers_per_block))
  return [(a, min(a + n, num_layers) - 1) for a in range(0, num_layers, n)]


def client_blocks(
  client_budgets: np.ndarray, num_layers: int, need: Callable[[int, int], int]
) -> list[Blocks]:
  """`decompose` for every client (each distinct budget once)."""
  by_budget = {int(b): None for b in np.asarray(client_budgets).tolist()}
  for b in by_budget:
    by_budget[b] = decompose(b, num_layers, need)
  return [list(by_budget[int(b)]) for b in np.asarray(client_budgets)]


class BlockTable(NamedTuple):
  """Every client's decomposition as arrays (numpy, host).

  Attributes:
    first: `[N, S]` int32, the first layer of each block (padding 0).
    last: `[N, S]` int32, its last layer (padding -1).
    count: `[N]` int32, number of blocks (>= 1).
    trained: `[N, U + 1]` bool, the layers (and, last, the head) a client
      trains.
  """

  first: np.ndarray
  last: np.ndarray
  count: np.ndarray
  trained: np.ndarray


def block_table(blocks: Sequence[Blocks], num_layers: int) -> BlockTable:
  """The arrays of `blocks` (one list per client).

  Raises:
    ValueError: a client without blocks, or blocks that are not ascending,
      disjoint ranges of layers (or the head-only block `(U, U - 1)`).
  """
  u = num_layers
  s = max(len(b) for b in blocks) if blocks else 0
  if not blocks or min(len(b) for b in blocks) < 1:
    raise ValueError('every client needs at least one block')
  n = len(blocks)
  first = np.zeros((n, s), np.int32)
  last = np.full((n, s), -1, np.int32)
  trained = np.zeros((n, u + 1), bool)
  trained[:, u] = True
  for k, client_blocks_k in enumerate(blocks):
    previous = -1
    for j, (a, b) in enumerate(client_blocks_k):
      head_only = (a, b) == (u, u - 1) and len(client_blocks_k) == 1
      if not head_only and not (previous < a <= b < u):
        raise ValueError(f'client {k}: bad blocks {client_blocks_k}')
      first[k, j], last[k, j] = a, b
      trained[k, a : b + 1] = True
      previous = b
  count = np.asarray([len(b) for b in blocks], np.int32)
  return BlockTable(first, last, count, trained)


def masked_mean(
  client_variables: types.Variables,
  global_variables: types.Variables,
  leaves: types.PyTree,
  client_trained: jax.Array,
  weights: jax.Array | None = None,
) -> types.Variables:
  """Each leaf's mean over the clients that trained its layer.

  Args:
    client_variables: leaves `[K, ...]`.
    global_variables: leaves `[...]`, kept where no client trained a leaf.
    leaves: `leaf_layers` of the variables (Python ints).
    client_trained: `[K, U + 1]` bool (`BlockTable.trained` rows).
    weights: `[K]` (numbers of examples) or None (equal).

  Returns:
    The new global variables, in each leaf's dtype.
  """
  masks = jax.tree.map(lambda layer: client_trained[:, layer], leaves)
  return tree.masked_mean(client_variables, global_variables, masks, weights)


def _block_key(key: jax.Array, j: jax.Array) -> jax.Array:
  """The client's key for block 0, `fold_in(key, j)` for block j > 0."""
  folded = jax.random.fold_in(key, j)
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    data = jnp.where(
      j == 0, jax.random.key_data(key), jax.random.key_data(folded)
    )
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))
  return jnp.where(j == 0, key, folded)


# ----------------------------------------------------------------------------
# The algorithm.


def fedepth(
  local: client.LocalTraining,
  clients_per_round: int,
  blocks: Sequence[Blocks],
  weighted: bool = True,
) -> types.Algorithm:
  """Builds FeDepth.

  Args:
    local: how clients train (`local.model` the global network, a zoo
      model; E local epochs per block).
    clients_per_round: K.
    blocks: `[N]` each client's blocks `[(first, last), ...]` of layers
      (`client_blocks`, `fixed_blocks`; `(U, U - 1)` alone: the head).
    weighted: weight clients by numbers of examples in the server's mean.

  Returns:
    An `Algorithm` with server state `FeDepthState`; the dispatch shares
    the global model. Metrics: 'bytes_communicated' (the whole model down,
    the trained variables up), 'mean_blocks' (of the sampled clients).
  """
  k = errors.check_count('clients_per_round', clients_per_round)
  model = local.model
  layout = layout_of(model)
  table = block_table(blocks, layout.num_layers)
  update = client.make_local_update(
    local._replace(model=BlockModel(model, layout))
  )
  return types.Algorithm(
    _init,
    _dispatch,
    functools.partial(_client_update, update, layout, table),
    functools.partial(_aggregate, k, layout, table, weighted),
    clients_per_round=k,
  )


def _init(variables: types.Variables) -> FeDepthState:
  return FeDepthState(params=variables)


def _dispatch(state, client_ids, round_index, key):
  del client_ids, round_index, key
  return types.Dispatch(shared=state.params)


def _client_update(
  update, layout, table, shared, per_client, client_state, data, client_id, key
):
  """Client `client_id` trains its blocks in turn (`update` on the block
  model), each block's layers only (`trainable`)."""
  del per_client
  leaves = leaf_layers(shared, layout)
  firsts = jnp.asarray(table.first)[client_id]
  lasts = jnp.asarray(table.last)[client_id]

  def block(j, carry):
    variables, loss_sum, steps = carry
    info = {'first': firsts[j], 'last': lasts[j]}
    out = update(
      {**variables, _INFO: info}, data, client_id, _block_key(key, j)
    )
    new = {c: v for c, v in out.variables.items() if c != _INFO}
    keep = trainable(leaves, info['first'], info['last'], layout.num_layers)
    variables = jax.tree.map(jnp.where, keep, new, variables)
    return variables, loss_sum + out.loss, steps + out.num_steps

  count = jnp.asarray(table.count)[client_id]
  carry = (shared, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
  variables, loss_sum, steps = lax.fori_loop(0, count, block, carry)
  out = types.ClientOutput(
    variables=variables,
    num_examples=data.sizes[client_id].astype(jnp.int32),
    loss=loss_sum / count.astype(jnp.float32),
    num_steps=steps,
  )
  return out, client_state


def _layer_bytes(layout: Layout, variables: types.Variables) -> jax.Array:
  """`[U + 1]` bytes of each layer's (and the head's) variables."""
  sizes = [0] * (layout.num_layers + 1)
  for leaf, layer in zip(
    jax.tree.leaves(variables),
    jax.tree.leaves(leaf_layers(variables, layout)),
  ):
    sizes[layer] += tree.nbytes(leaf)
  return jnp.asarray(sizes, jnp.float32)


def _aggregate(
  k, layout, table, weighted, state, outputs, client_ids, round_index, key
):
  """Each layer's mean over the clients that trained it, and the bytes
  communicated."""
  del round_index, key
  trained = jnp.asarray(table.trained)[client_ids]
  weights = outputs.num_examples if weighted else None
  leaves = leaf_layers(state.params, layout)
  params = masked_mean(
    outputs.variables, state.params, leaves, trained, weights
  )
  up = jnp.sum(trained.astype(jnp.float32) @ _layer_bytes(layout, state.params))
  down = jnp.float32(k * tree.nbytes(state.params))
  metrics = {
    'bytes_communicated': (down + up).astype(jnp.float32),
    'mean_blocks': jnp.mean(
      jnp.asarray(table.count)[client_ids].astype(jnp.float32)
    ),
  }
  return FeDepthState(params=params), metrics


def blocks_for(
  model: model_lib.Model, num_clients: int, hp: Hparams
) -> list[Blocks]:
  """Every client's blocks: fixed (`hp.layers_per_block` > 0) or from
  FedStitch's budgets and the measured memory of each block."""
  layout = layout_of(model)
  u = layout.num_layers
  if hp.layers_per_block > 0:
    return [fixed_blocks(u, hp.layers_per_block)] * num_clients
  shape = None  # the model's own input shape
  if hp.reference_size and len(model.input_shape) == 3:
    shape = (hp.reference_size, hp.reference_size, REFERENCE_CHANNELS)
  need = block_memory(model, layout, hp.reference_batch, shape)
  client_budgets = budgets_lib.client_budgets(
    num_clients,
    hp.budget_seed,
    *hp.budgets(),
  )
  return client_blocks(client_budgets, u, need)


def build(setting: Any, hp: Hparams) -> types.Algorithm:
  """The registry's factory (see the module docstring)."""
  blocks = blocks_for(setting.local.model, setting.num_clients, hp)
  return fedepth(
    setting.local, setting.clients_per_round, blocks, setting.weighted
  )
