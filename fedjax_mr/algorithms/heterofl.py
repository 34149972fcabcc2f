"""HeteroFL: clients train width-scaled sub-models of one global model.

A client with rate r trains the sub-model that keeps the first ceil(r C)
channels of every hidden layer of width C (the network's input channels
and its output classes stay whole). The server averages every parameter
entry over the clients of the round that hold it; an entry nobody held
keeps its value.

Sub-models as masks. The engine maps one client update over clients of
equal shapes, so a client trains the full-shape parameters through
per-channel masks: the forward pass uses `params * mask * s`, zero outside
the client's width, so those channels output zero, BatchNorm (zero scale
and bias) keeps them zero and their gradients are zero: the narrow network
exactly (tested against an actually narrow one). Channel axes come from
the parameters' layout, in model order (`layout`): a `kernel`'s last axis
(Dense `[in, out]`, Conv `[h, w, in, out]`) is its output channels, the
one before its input; 1-D leaves are output channels. The first kernel
keeps its input whole, the head its outputs; a kernel reading a flattened
feature map keeps the features of the kept channels.

Scaler. HeteroFL divides each hidden layer's output by r in training
(the identity at evaluation): s = 1 / r on every hidden kernel module
(its kernel and bias), 1 elsewhere (BatchNorm, the head).

Static BatchNorm (sBN). Clients train with batch statistics and keep no
running statistics (the uploaded statistics are ignored). The global
model's statistics are queried from data: each client of round t also
runs its training data through the global model w_t it was sent (full
width, training mode) and uploads the example-weighted average of the
per-batch means and variances (the cumulative average PyTorch's BatchNorm
keeps with momentum=None, as the authors' code queries); the server
averages them over the round's clients by examples. The evaluated model
(`Algorithm.evaluated`) is therefore w_t with its queried statistics, one
round behind `state.params` (whose statistics are the last query's and
not those of its own weights). `data_statistics` queries all clients,
for a final pass after training (the experiment programs evaluate the
per-round query). Models without BatchNorm query nothing and evaluate
`state.params`.

The evaluated model is the sub-model of the largest rate some client
trains (the whole model when one has rate 1, as in the paper; with
FedStitch's budgets no client fits ResNet-18 at rate 1, and the channels
beyond it keep their init), without the scaler; sBN queries it.

Masked loss. With `masked_loss` (the authors' default for their non-IID
splits) the logits of the classes absent from the client's training data
are set to zero in its local loss (the authors' `masked_fill`).

Rates from memory budgets. Each client's rate is the largest of `rates`
whose narrow sub-model's measured training memory (one SGD step at a
reference input and batch size, `fedjax_mr.training.budgets`) fits its
budget (FedStitch's comparison: 1/2/4/8 GB at 30/30/30/10 % of clients);
a client whose budget fits none trains the smallest rate (it would
otherwise never take part). The server's mean is plain over the holders
of an entry, as in the authors' code (`weighted` uses numbers of
examples).

References:
  Diao, Ding and Tarokh, "HeteroFL: Computation and Communication
  Efficient Federated Learning for Heterogeneous Clients", ICLR 2021.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any
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
from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.models import model as model_lib
from fedjax_mr.training import budgets as budgets_lib
from fedjax_mr.training import client

PAPER_RATES = (1.0, 0.5, 0.25, 0.125, 0.0625)
# Memory is measured on RGB images (the FedStitch pool's), whatever the
# dataset's channels.
REFERENCE_CHANNELS = budgets_lib.REFERENCE_INPUT_SHAPE[-1]
# The variables collection that carries a client's width into training.
_INFO = 'heterofl'


def _floats(text: str) -> tuple[float, ...]:
  return tuple(float(v) for v in str(text).split(',') if v.strip())


@dataclasses.dataclass(frozen=True)
class Hparams(budgets_lib.BudgetHparams):
  """HeteroFL's rates, the clients' memory budgets and the loss mask."""

  rates: str = '1,0.5,0.25,0.125,0.0625'
  masked_loss: bool = True
  scaler: bool = True

  def validate(self, **setting) -> None:
    """Raises `ArgumentError` naming a bad field (`setting`: unused)."""
    del setting
    try:
      rates = _floats(self.rates)
    except ValueError as e:
      raise errors.ArgumentError('rates', f'must be numbers: {e}') from None
    if not rates or not all(0 < r <= 1 for r in rates):
      raise errors.ArgumentError(
        'rates', f'must be in (0, 1], got {self.rates!r}'
      )
    self.validate_budgets()


class HeteroFLState(NamedTuple):
  """Attributes:
  params: the global model w (all variables; its BatchNorm statistics are
    the last query's, see the module docstring).
  queried: the model the last round started from with the BatchNorm
    statistics its clients queried; the evaluated model. `{}` for models
    without BatchNorm statistics.
  """

  params: types.Variables
  queried: types.Variables


# ----------------------------------------------------------------------------
# Channel layout and masks.


class Axis(NamedTuple):
  """How one axis of a leaf narrows: `kind` 'whole', 'width' (keep the
  first ceil(r size)) or 'flat' (a flattened map of `channels` channels,
  channel fastest: keep the features of the kept channels)."""

  kind: str
  size: int
  channels: int = 0


class LeafLayout(NamedTuple):
  """The axes of one parameter leaf and its scaler (True: divide by r)."""

  axes: tuple[Axis, ...]
  scaled: bool


def _key(entry) -> Any:
  return getattr(entry, 'key', getattr(entry, 'name', entry))


def layout(params: types.PyTree) -> types.PyTree:
  """The channel layout of every parameter leaf (see the module docstring).

  Args:
    params: a model's `params`, keys in model order (as `init` gives).

  Returns:
    A tree like `params` whose leaves are `LeafLayout`s.
  """
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
  paths = [tuple(_key(k) for k in p) for p, _ in with_paths]
  leaves = [leaf for _, leaf in with_paths]
  kernels = [p[:-1] for p, leaf in zip(paths, leaves) if p[-1] == 'kernel']
  out_of = {
    p[:-1]: leaf.shape[-1]
    for p, leaf in zip(paths, leaves)
    if p[-1] == 'kernel'
  }
  first = kernels[0] if kernels else None
  head = kernels[-1] if kernels else None
  result = []
  for path, leaf in zip(paths, leaves):
    module, shape = path[:-1], tuple(leaf.shape)
    axes = [Axis('whole', s) for s in shape]
    is_layer = module in out_of
    if path[-1] == 'kernel' and len(shape) >= 2:
      if module != head:
        axes[-1] = Axis('width', shape[-1])
      if module != first:
        previous = out_of[kernels[kernels.index(module) - 1]]
        d = shape[-2]
        if len(shape) == 2 and d > previous and d % previous == 0:
          axes[-2] = Axis('flat', d, previous)
        else:
          axes[-2] = Axis('width', d)
    elif len(shape) == 1 and module != head:
      axes[0] = Axis('width', shape[0])
    result.append(LeafLayout(tuple(axes), is_layer and module != head))
  return jax.tree_util.tree_unflatten(treedef, result)


def width(rate: float, size: int) -> int:
  """ceil(rate · size), at least 1 (rounding `rate · size` to 1e-9 first,
  so that 0.1 · 50 is 5)."""
  return max(1, math.ceil(round(rate * size, 9)))


def _axis_keep(axis: Axis, rates: Sequence[float], index: jax.Array):
  """`[size]` bool: the kept entries of `axis` at rate `rates[index]`."""
  if axis.kind == 'whole':
    return jnp.ones((axis.size,), jnp.bool_)
  channels = axis.size if axis.kind == 'width' else axis.channels
  widths = jnp.asarray([width(r, channels) for r in rates], jnp.int32)
  position = jnp.arange(axis.size) % channels
  return position < widths[index]


def masks(
  lay: types.PyTree, rates: Sequence[float], index: jax.Array
) -> types.PyTree:
  """0/1 float32 masks shaped like the parameters for rate `rates[index]`
  (`index` an int32 scalar, may be traced)."""

  def leaf_mask(leaf: LeafLayout):
    mask = jnp.ones((), jnp.bool_)
    for i, axis in enumerate(leaf.axes):
      keep = _axis_keep(axis, rates, index)
      shape = [1] * len(leaf.axes)
      shape[i] = axis.size
      mask = mask & keep.reshape(shape)
    return mask.astype(jnp.float32)

  return jax.tree.map(
    leaf_mask, lay, is_leaf=lambda x: isinstance(x, LeafLayout)
  )


def effective_params(
  params: types.PyTree,
  lay: types.PyTree,
  rates: Sequence[float],
  index: jax.Array,
  scaler: bool = True,
) -> types.PyTree:
  """The parameters the sub-model of rate `rates[index]` computes with:
  `params · mask`, divided by the rate on hidden layers (the scaler; not
  when `scaler` is False)."""
  scale = 1.0 / jnp.asarray(rates, jnp.float32)[index] if scaler else 1.0
  mask = masks(lay, rates, index)
  return jax.tree.map(
    lambda p, m, leaf: (p * (m * scale if leaf.scaled else m)).astype(p.dtype),
    params,
    mask,
    lay,
    is_leaf=lambda x: isinstance(x, LeafLayout),
  )


def aggregate_masked(
  global_params: types.PyTree,
  client_params: types.PyTree,
  client_masks: types.PyTree,
  weights: jax.Array,
) -> types.PyTree:
  """Each entry's weighted mean over the clients that hold it.

  Args:
    global_params: the current global parameters.
    client_params: leaves `[K, ...]`.
    client_masks: leaves `[K, ...]`, 1 where a client holds the entry.
    weights: `[K]` non-negative client weights.

  Returns:
    Parameters shaped like `global_params`; an entry no client holds keeps
    its global value.
  """
  w = weights.astype(jnp.float32)

  def mean(g, p, m):
    wm = m * w.reshape((-1,) + (1,) * (m.ndim - 1))
    den = jnp.sum(wm, axis=0)
    share = wm / jnp.where(den > 0, den, 1.0)
    new = jnp.sum(share * p.astype(jnp.float32), axis=0)
    return jnp.where(den > 0, new, g.astype(jnp.float32)).astype(g.dtype)

  return jax.tree.map(mean, global_params, client_params, client_masks)


class WidthModel(NamedTuple):
  """`model` trained as a sub-model: `apply_train` reads the client's rate
  index and label mask from the variables' `'heterofl'` collection (see
  `fedjax_mr.training.client.LocalTraining.model`)."""

  model: model_lib.Model
  lay: types.PyTree
  rates: tuple[float, ...]
  scaler: bool = True

  def apply_train(self, variables, x, key, mask=None):
    info = variables[_INFO]
    params = effective_params(
      variables['params'], self.lay, self.rates, info['rate_index'], self.scaler
    )
    others = {k: v for k, v in variables.items() if k not in ('params', _INFO)}
    logits, state = self.model.apply_train(
      {'params': params, **others}, x, key, mask
    )
    return jnp.where(info['labels'], logits, 0.0), state


# ----------------------------------------------------------------------------
# sBN: BatchNorm statistics queried from data.


def query_statistics(
  model: model_lib.Model,
  variables: types.Variables,
  data: client_data_lib.ClientData,
  client_id: jax.Array,
  batch_size: int,
) -> types.PyTree:
  """Client `client_id`'s BatchNorm statistics of `variables`.

  Runs the client's examples in order, in batches of `batch_size`,
  through the model in training mode and returns the example-weighted
  mean of the per-batch statistics (`batch_stats`-shaped). Batch
  statistics are read from the running update of a zero state; the update
  factor (1 - momentum) is found from one more pass with a state of ones,
  so any BatchNorm momentum works.
  """
  n_max = data.max_size
  b = min(batch_size, n_max)
  row = jnp.concatenate([data.row(client_id), jnp.zeros((b,), jnp.int32)])
  n = data.sizes[client_id]
  key = jax.random.key(0)
  stats = variables['batch_stats']
  zeros = jax.tree.map(jnp.zeros_like, stats)

  def batch(j):
    idx = lax.dynamic_slice(row, (j * b,), (b,))
    mask = (j * b + jnp.arange(b) < n).astype(jnp.float32)
    x = client_data_lib.normalize(data.x[idx], data.scale, data.shift)
    return x, mask

  def updated(state, x, mask):
    v = {**variables, 'batch_stats': state}
    return model.apply_train(v, x, key, mask)[1]['batch_stats']

  x0, m0 = batch(0)
  ones = jax.tree.map(jnp.ones_like, stats)
  factor = jax.tree.map(
    lambda o, z: 1.0 - (o - z), updated(ones, x0, m0), updated(zeros, x0, m0)
  )

  def body(j, total):
    x, mask = batch(j)
    count = jnp.sum(mask)
    new = updated(zeros, x, mask)
    return jax.tree.map(lambda t, s: t + count * s, total, new)

  total = lax.fori_loop(0, (n + b - 1) // b, body, zeros)
  seen = n.astype(jnp.float32)
  return jax.tree.map(lambda t, f: t / (seen * f), total, factor)


def data_statistics(
  model: model_lib.Model,
  variables: types.Variables,
  data: client_data_lib.ClientData,
  batch_size: int,
) -> types.Variables:
  """`variables` with the BatchNorm statistics queried over every client's
  training data (`query_statistics`, averaged by examples): sBN's final
  pass over all clients, e.g. for the model after the last round."""
  ids = jnp.arange(data.sizes.shape[0], dtype=jnp.int32)
  per_client = lax.map(
    lambda i: query_statistics(model, variables, data, i, batch_size), ids
  )
  stats = tree.weighted_mean(per_client, data.sizes)
  return {**variables, 'batch_stats': stats}


# ----------------------------------------------------------------------------
# Rates from memory budgets.


def narrow_model(model: model_lib.Model, rate: float) -> model_lib.Model:
  """The actually narrow network of `model` at `rate`, for measuring its
  memory: every Conv and Dense but the head gets ceil(rate · features)
  outputs, and so does every block with a `planes` width (the zoo's
  ResNets; its layers then take the narrowed planes as they are, and its
  shortcut is decided on narrow widths, as in HeteroFL's own networks);
  BatchNorm follows its input. Built by intercepting the modules' calls,
  so the zoo's networks need no width argument."""
  params = jax.eval_shape(model.init, jax.random.key(0))['params']
  kernels = [
    tuple(_key(k) for k in p)[:-1]
    for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    if _key(p[-1]) == 'kernel'
  ]
  head = kernels[-1]

  def narrow(next_fun, args, kwargs, context):
    m = context.module
    if context.method_name == '__call__' and tuple(m.path[1:]) != head:
      if isinstance(getattr(m, 'planes', None), int):
        object.__setattr__(m, 'planes', width(rate, m.planes))
        object.__setattr__(m, '_heterofl_narrow', True)
      elif isinstance(getattr(m, 'features', None), int) and not getattr(
        m.parent, '_heterofl_narrow', False
      ):
        object.__setattr__(m, 'features', width(rate, m.features))
    return next_fun(*args, **kwargs)

  class Narrow(nn.Module):
    inner: nn.Module

    def __call__(self, x, train=False, mask=None, **kwargs):
      with nn.intercept_methods(narrow):
        return self.inner(x, train=train, mask=mask, **kwargs)

  module = Narrow(inner=model.module.clone(parent=None))
  return model._replace(name=f'{model.name}@{rate:g}', module=module)


def rate_memory(
  model: model_lib.Model,
  rates: Sequence[float],
  batch_size: int = budgets_lib.REFERENCE_BATCH_SIZE,
  input_shape: Sequence[int] | None = budgets_lib.REFERENCE_INPUT_SHAPE,
) -> list[int]:
  """Measured training memory (bytes) of the narrow network of each rate
  (`budgets.training_memory_bytes` of `narrow_model`)."""
  return [
    budgets_lib.training_memory_bytes(
      narrow_model(model, r), batch_size, input_shape
    )
    for r in rates
  ]


def assign_rates(
  budgets: np.ndarray, rates: Sequence[float], memory: Sequence[int]
) -> np.ndarray:
  """Each client's rate index: the largest rate whose `memory` fits its
  budget (bytes), the smallest rate where none fits. `[N]` int32."""
  fit = budgets_lib.largest_fitting(budgets, memory)
  smallest = int(np.argmin(np.asarray(rates)))
  return np.where(fit < 0, smallest, fit).astype(np.int32)


# ----------------------------------------------------------------------------
# The algorithm.


def apply_masks(params: types.PyTree, mask: types.PyTree) -> types.PyTree:
  """`params` times their `masks` (zero outside a sub-model), in each
  leaf's dtype."""
  return jax.tree.map(lambda p, m: (p * m).astype(p.dtype), params, mask)


def present_labels(
  data: client_data_lib.ClientData, client_id: jax.Array, num_classes: int
) -> jax.Array:
  """`[C]` bool: the classes of client `client_id`'s training examples
  (the logits HeteroFL's masked loss keeps)."""
  row = data.row(client_id)
  real = jnp.arange(data.max_size) < data.sizes[client_id]
  present = jnp.zeros((num_classes,), jnp.int32)
  return present.at[data.y[row]].max(real.astype(jnp.int32)) > 0


def server_update(
  state: HeteroFLState,
  outputs: types.ClientOutput,
  index: jax.Array,
  lay: types.PyTree,
  rates: Sequence[float],
  weighted: bool,
) -> tuple[HeteroFLState, dict[str, jax.Array]]:
  """HeteroFL's aggregation of a round.

  Args:
    state: the server state.
    outputs: the K clients' uploads (masked sub-models; queried BatchNorm
      statistics in `extra` for models with BatchNorm).
    index: `[K]` the clients' indices into `rates`.
    lay: `layout` of the global params.
    rates: the width rates.
    weighted: weight holders by numbers of examples (else plain).

  Returns:
    The new state (every entry the mean over its holders,
    `aggregate_masked`; the statistics the example-weighted mean of the
    queries) and the metrics 'bytes_communicated' and 'mean_rate'.
  """
  client_masks = jax.vmap(lambda i: masks(lay, rates, i))(index)
  weights = (
    outputs.num_examples if weighted else jnp.ones_like(outputs.num_examples)
  )
  params = aggregate_masked(
    state.params['params'],
    outputs.variables['params'],
    client_masks,
    weights,
  )
  new = {**state.params, 'params': params}
  queried = state.queried
  if 'batch_stats' in state.params:
    stats = tree.weighted_mean(outputs.extra, outputs.num_examples)
    queried = {**state.params, 'batch_stats': stats}
    new = {**new, 'batch_stats': stats}
  sent = sum(
    jnp.sum(m, axis=tuple(range(1, m.ndim))) * p.dtype.itemsize
    for m, p in zip(
      jax.tree.leaves(client_masks), jax.tree.leaves(state.params['params'])
    )
  )
  metrics = {
    'bytes_communicated': (2.0 * jnp.sum(sent)).astype(jnp.float32),
    'mean_rate': jnp.mean(jnp.asarray(rates, jnp.float32)[index]),
  }
  return HeteroFLState(params=new, queried=queried), metrics


def init_state(variables: types.Variables) -> HeteroFLState:
  """HeteroFL's state before round 0; models with BatchNorm evaluate the
  initial statistics (a copy) until the first query."""
  variables = jax.tree.map(jnp.asarray, variables)
  queried = {}
  if 'batch_stats' in variables:
    queried = jax.tree.map(jnp.copy, variables)
  return HeteroFLState(params=variables, queried=queried)


def _checked_rates(
  rates: Sequence[float], client_rates: Sequence[int]
) -> tuple[tuple[float, ...], np.ndarray]:
  """`rates` as floats, each in (0, 1], and `client_rates` as int32
  indices into them; raises naming the argument otherwise."""
  rates = tuple(float(r) for r in rates)
  if not rates or not all(0 < r <= 1 for r in rates):
    raise errors.ArgumentError('rates', f'must be in (0, 1], got {rates}')
  client_rates = np.asarray(client_rates, np.int32)
  if client_rates.min() < 0 or client_rates.max() >= len(rates):
    raise ValueError('client_rates must index rates')
  return rates, client_rates


def heterofl(
  local: client.LocalTraining,
  clients_per_round: int,
  client_rates: Sequence[int],
  rates: Sequence[float] = PAPER_RATES,
  masked_loss: bool = True,
  weighted: bool = False,
  scaler: bool = True,
) -> types.Algorithm:
  """Builds HeteroFL.

  Args:
    local: how clients train (`local.model` the global network).
    clients_per_round: K.
    client_rates: `[N]` each client's index into `rates`.
    rates: the width rates, each in (0, 1].
    masked_loss: zero the logits of classes absent from a client's data in
      its loss.
    weighted: weight each holder of an entry by its number of examples
      (else the plain mean over holders, as the authors' code).
    scaler: HeteroFL's scaler in training (divide hidden outputs by r).

  Returns:
    An `Algorithm` with server state `HeteroFLState`; the dispatch's
    shared part is `(global model, [N] rate indices)`. Uploads: the masked
    sub-model and, for models with BatchNorm, the queried statistics
    (`ClientOutput.extra`). Metrics: 'bytes_communicated' (each client's
    sub-model down and up), 'mean_rate'.
  """
  k = errors.check_count('clients_per_round', clients_per_round)
  rates, client_rates = _checked_rates(rates, client_rates)
  top = int(max(set(client_rates.tolist()), key=lambda i: rates[i]))
  w = _Widths(local, rates, top, masked_loss, scaler, {})

  def dispatch(state, client_ids, round_index, key):
    del client_ids, round_index, key
    return types.Dispatch(shared=(state.params, jnp.asarray(client_rates)))

  def aggregate(state, outputs, client_ids, round_index, key):
    del round_index, key
    lay = w.layout_of(state.params['params'])
    index = jnp.asarray(client_rates)[client_ids]
    return server_update(state, outputs, index, lay, rates, weighted)

  def evaluated(state):
    return w.largest(state.queried if state.queried else state.params)

  return types.Algorithm(
    init_state,
    dispatch,
    functools.partial(_client_update, w),
    aggregate,
    evaluated=evaluated,
    clients_per_round=k,
  )


class _Widths(NamedTuple):
  """What a HeteroFL client's update reads besides its arguments."""

  local: client.LocalTraining
  rates: tuple[float, ...]
  top: int  # the index of the largest rate any client has
  masked_loss: bool
  scaler: bool
  layouts: dict[str, Any]  # `layout` of the params, once computed

  def layout_of(self, params: types.PyTree) -> types.PyTree:
    if 'lay' not in self.layouts:
      self.layouts['lay'] = layout(params)
    return self.layouts['lay']

  def largest(self, variables: types.Variables) -> types.Variables:
    """The sub-model of the largest assigned rate, without the scaler (the
    identity at evaluation); the whole model when a client has rate 1."""
    lay = self.layout_of(variables['params'])
    mask = masks(lay, self.rates, jnp.int32(self.top))
    return {**variables, 'params': apply_masks(variables['params'], mask)}


def _client_update(w, shared, per_client, client_state, data, client_id, key):
  """Client `client_id` trains its width's sub-model and uploads it
  masked, with the queried BatchNorm statistics (if any)."""
  del per_client
  model = w.local.model
  num_classes = model.num_classes
  variables, rate_table = shared
  lay = w.layout_of(variables['params'])
  index = rate_table[client_id]
  if w.masked_loss:
    labels = present_labels(data, client_id, num_classes)
  else:
    labels = jnp.ones((num_classes,), jnp.bool_)
  update = client.make_local_update(
    w.local._replace(model=WidthModel(model, lay, w.rates, w.scaler))
  )
  info = {'rate_index': index, 'labels': labels}
  out = update({**variables, _INFO: info}, data, client_id, key)
  params = apply_masks(out.variables['params'], masks(lay, w.rates, index))
  extra = ()
  if 'batch_stats' in variables:
    extra = query_statistics(
      model, w.largest(variables), data, client_id, w.local.batch_size
    )
  uploaded = {**variables, 'params': params}
  return out._replace(variables=uploaded, extra=extra), client_state


def build(setting: Any, hp: Hparams) -> types.Algorithm:
  """The registry's factory: measures each rate's narrow network at the
  reference setting and gives each client the largest that fits its
  budget (see the module docstring)."""
  rates = _floats(hp.rates)
  model = setting.local.model
  shape = None  # the model's own input shape
  if hp.reference_size and len(model.input_shape) == 3:
    shape = (hp.reference_size, hp.reference_size, REFERENCE_CHANNELS)
  memory = rate_memory(model, rates, hp.reference_batch, shape)
  budgets = budgets_lib.client_budgets(
    setting.num_clients,
    hp.budget_seed,
    *hp.budgets(),
  )
  return heterofl(
    setting.local,
    setting.clients_per_round,
    assign_rates(budgets, rates, memory),
    rates,
    hp.masked_loss,
    setting.weighted,
    hp.scaler,
  )
