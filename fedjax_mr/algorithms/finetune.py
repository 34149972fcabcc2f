"""FT-Full and FT-Part: federated fine-tuning under client memory budgets.

FedStitch's second group of baselines (§V-A): a pre-trained model is
fine-tuned on the clients and aggregated by FedAvg, either whole (FT-Full),
which only the few clients whose memory holds a full training step can do,
or in its final layers alone (FT-Part), which most clients can afford.
The model to start from is the experiment's initial one (a pre-trained
pool model when the experiment is given one; from a random initialisation
both are merely FedAvg on fewer clients or on a frozen random trunk).

Modules. The model's parameterised modules are the top-level entries of
`variables['params']` (a Conv, a Dense, a BatchNorm, a whole residual
block), in the order the forward pass first calls them (`module_order`,
read from the model itself, so a checkpoint whose keys were sorted does
not reorder them). FT-Part trains the last `layers` of them, 2 by default:
the head and the module before it (the last residual block of a ResNet,
the hidden fully connected layer of the small CNNs) -- the smallest choice
that still adapts a hidden representation rather than only a linear
classifier on fixed features; FedStitch does not say how many.

Eligibility. Every client gets a memory budget (FedStitch: 1, 2, 4 and
8 GB for 30, 30, 30 and 10 % of the clients, seeded; see
`fedjax_mr.training.budgets`). The memory of one SGD step is measured
from XLA's buffer assignment at a reference setting (224 x 224 x 3 images
in batches of 32 by default, the pool's resolution, whatever the
experiment trains on): of the whole model for FT-Full, with only the final
`layers` modules trainable (no gradients, no updated copies of the frozen
ones) for FT-Part. A client is eligible when its budget is at least that
memory. As in HeteroFL, the measured network is the model built for the
reference input, so a network that flattens a feature map into a Dense
layer (the small CNNs) is measured with the larger Dense layer that input
gives it; networks with global pooling keep their parameters. At
`reference_size=0` the model's own input shape is used. Each round samples
K distinct clients uniformly from the eligible ones (the engine's uniform
draw over their list, so with every client eligible FT-Full samples what
FedAvg samples); fewer than K eligible clients is a configuration error
naming `clients_per_round`. The metric 'eligible_clients' reports their
number every round.

Measured on XLA:CPU at the reference setting with 10 classes (other
backends fuse differently), against the default budgets: cnn_mnist needs
0.61 GB to train whole and 0.09 GB for FT-Part (every client takes part
in both); resnet20 6.9 GB (the 8 GB tenth of the clients) and 0.88 GB
(all); resnet18 11.5 GB (no client: FT-Full cannot run) and 1.66 GB (the
70 % with 2 GB or more).

Local training of FT-Part. The frozen modules get no update at all: their
parameters are cut from the gradient (`lax.stop_gradient`, so no backward
pass runs through the frozen trunk), the optimizer gives them zero updates
and keeps no momentum for them, and the uploaded model carries the
dispatched values bit for bit. The frozen modules run in evaluation mode
(their BatchNorm layers normalise with the running statistics and do not
update them; dropout inside them is off): the trunk is a fixed feature
extractor, the same in training and evaluation. The trainable tail trains
as usual (batch statistics, running statistics updated, dropout on).
Top-level entries of other collections that belong to no trainable module
(statistics of a parameter-free BatchNorm) are frozen too; parameter-free
modules of the root (a Dropout between two classifier layers) run as in
training. (The memory measurement runs frozen BatchNorm layers with batch
statistics, without their gradients; the difference is a few
temporaries.)

Server. FedAvg over the K uploads, weighted by examples unless the
setting says otherwise. FT-Part averages the trainable modules (their
parameters and statistics) and keeps the frozen ones as they are.
'bytes_communicated' counts the whole model down to each of the K clients
(a newly sampled client may not hold the trunk) and what each uploads:
the whole model for FT-Full, the trainable modules' variables for FT-Part.

References:
  Zhan et al., "Heterogeneity-Aware Coordination for Federated Learning via
  Stitching Pre-trained blocks", 2024 (§V-A, the group-2 baselines).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import Collection
from typing import NamedTuple
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from fedjax_mr.algorithms import fedavg
from fedjax_mr.core import errors
from fedjax_mr.core import tree
from fedjax_mr.core import types
from fedjax_mr.models import model as model_lib
from fedjax_mr.training import budgets as budgets_lib
from fedjax_mr.training import client

# Modules that behave differently in training: (class, the attribute that
# selects evaluation mode when True).
_EVAL_MODE = (
  (nn.BatchNorm, 'use_running_average'),
  (nn.Dropout, 'deterministic'),
)


@dataclasses.dataclass(frozen=True)
class Hparams(budgets_lib.BudgetHparams):
  """The clients' memory budgets and where training memory is measured
  (FT-Full's; FT-Part adds `layers`)."""

  def validate(self, **setting) -> None:
    """Raises `ArgumentError` naming a bad field (`setting`: unused)."""
    del setting
    self.validate_budgets()


@dataclasses.dataclass(frozen=True)
class PartHparams(Hparams):
  """FT-Part's: FT-Full's and how many final modules train."""

  layers: int = 2

  def validate(self, **setting) -> None:
    """Raises `ArgumentError` naming a bad field."""
    super().validate(**setting)
    if self.layers < 1:
      raise errors.ArgumentError('layers', f'must be ≥ 1, got {self.layers}')


# ----------------------------------------------------------------------------
# Modules, memory and eligibility.


def module_order(model: model_lib.Model) -> tuple[str, ...]:
  """The model's top-level parameterised modules in the order its forward
  pass first calls them (the names of `variables['params']`'s entries).

  Read by tracing `model.init` (nothing runs), so it does not depend on
  the key order of a given variables dict. Parameters created by the root
  module itself, if any, come last.
  """
  called: list[str] = []

  def record(next_fun, args, kwargs, context):
    path = context.module.path
    if path and path[0] not in called:
      called.append(path[0])
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    params = jax.eval_shape(model.init, jax.random.key(0))['params']
  order = [name for name in called if name in params]
  return tuple(order + [name for name in params if name not in order])


def final_modules(model: model_lib.Model, layers: int) -> tuple[str, ...]:
  """The last `layers` parameterised modules (FT-Part's trainable ones).

  Raises:
    ArgumentError: `layers` outside 1 .. the number of modules.
  """
  order = module_order(model)
  if not 1 <= layers <= len(order):
    raise errors.ArgumentError(
      'layers',
      f'must be in 1..{len(order)}, the parameterised modules of '
      f'{model.name} ({", ".join(order)}), got {layers}',
    )
  return order[len(order) - layers :]


def reference_shape(
  model: model_lib.Model, size: int
) -> tuple[int, ...] | None:
  """The input shape memory is measured at: `size x size` RGB images for
  an image model (`size > 0`), else None (the model's own shape)."""
  if size and len(model.input_shape) == 3:
    return (size, size, budgets_lib.REFERENCE_INPUT_SHAPE[-1])
  return None


def training_memory(
  model: model_lib.Model,
  trainable: Collection[str] | None = None,
  batch_size: int = budgets_lib.REFERENCE_BATCH_SIZE,
  input_shape: Sequence[int] | None = budgets_lib.REFERENCE_INPUT_SHAPE,
) -> int:
  """Measured bytes of one SGD step of `model` with only the modules named
  in `trainable` training (None: all; `budgets.training_memory_bytes`)."""
  if trainable is None:
    return budgets_lib.training_memory_bytes(model, batch_size, input_shape)
  names = frozenset(trainable)
  return budgets_lib.training_memory_bytes(
    model, batch_size, input_shape, trainable=lambda path: path[0] in names
  )


def eligible_clients(client_budgets: np.ndarray, memory: int) -> np.ndarray:
  """`[M]` int32: the ids of the clients whose budget (bytes) is at least
  `memory` bytes, ascending."""
  fits = np.asarray(client_budgets, np.int64) >= int(memory)
  return np.flatnonzero(fits).astype(np.int32)


def eligible_sampler(
  eligible: Sequence[int], clients_per_round: int
) -> types.Sampler:
  """K distinct clients drawn uniformly from `eligible` with the round's
  sampling key: the engine's uniform draw over the eligible list (with
  every client eligible, exactly FedAvg's sample)."""
  ids = np.asarray(eligible, np.int32)
  k = int(clients_per_round)
  if not 1 <= k <= len(ids):
    raise ValueError(f'cannot draw {k} of {len(ids)} eligible clients')

  def sampler(key, round_index, server_state, data):
    del round_index, server_state, data
    picks = jax.random.choice(key, len(ids), (k,), replace=False)
    return jnp.asarray(ids)[picks]

  return sampler


# ----------------------------------------------------------------------------
# Partial local training.


def _eval_frozen(frozen: frozenset[str]):
  """A method interceptor that runs the BatchNorm and Dropout modules
  inside the `frozen` top-level modules in evaluation mode."""

  def interceptor(next_fun, args, kwargs, context):
    m = context.module
    if context.method_name == '__call__' and m.path and m.path[0] in frozen:
      for cls, attr in _EVAL_MODE:
        if not isinstance(m, cls):
          continue
        if getattr(m, attr) is not None:  # set as an attribute
          object.__setattr__(m, attr, True)
        elif len(args) > 1:  # the call's argument after the input
          args = (args[0], True, *args[2:])
        else:
          kwargs = {**kwargs, attr: True}
    return next_fun(*args, **kwargs)

  return interceptor


class PartModel(NamedTuple):
  """`model` trained with the modules named in `frozen` fixed: no gradient
  reaches their parameters and they run in evaluation mode (see the module
  docstring); used as `LocalTraining.model`."""

  model: model_lib.Model
  frozen: frozenset[str]

  def apply_train(self, variables, x, key, mask=None):
    params = {
      name: lax.stop_gradient(p) if name in self.frozen else p
      for name, p in variables['params'].items()
    }
    with nn.intercept_methods(_eval_frozen(self.frozen)):
      return self.model.apply_train(
        {**variables, 'params': params}, x, key, mask
      )


def frozen_optimizer(
  optimizer: optax.GradientTransformation, frozen: Collection[str]
) -> optax.GradientTransformation:
  """`optimizer` on the trainable modules; zero updates and no state for
  the `frozen` ones (their momentum is never kept)."""
  frozen = frozenset(frozen)

  def labels(params):
    return {
      name: jax.tree.map(lambda _: 'frozen' if name in frozen else 'train', p)
      for name, p in params.items()
    }

  return optax.multi_transform(
    {'train': optimizer, 'frozen': optax.set_to_zero()}, labels
  )


def keep_frozen(
  trained: types.Variables, fixed: types.Variables, frozen: Collection[str]
) -> types.Variables:
  """`trained` with every collection's `frozen` top-level entries taken
  from `fixed` (bit for bit), in `fixed`'s key order."""
  return {
    c: {
      name: fixed[c][name] if name in frozen else trained[c][name]
      for name in entries
    }
    for c, entries in fixed.items()
  }


def trainable_part(
  variables: types.Variables, frozen: Collection[str]
) -> types.Variables:
  """The entries of every collection outside `frozen` (what FT-Part's
  clients upload)."""
  return {
    c: {name: v for name, v in entries.items() if name not in frozen}
    for c, entries in variables.items()
  }


# ----------------------------------------------------------------------------
# The algorithms.


def _with_eligible(aggregate, count: int):
  def wrapped(state, outputs, client_ids, round_index, key):
    state, metrics = aggregate(state, outputs, client_ids, round_index, key)
    return state, {**metrics, 'eligible_clients': jnp.int32(count)}

  return wrapped


def ft_full(
  local: client.LocalTraining,
  clients_per_round: int,
  eligible: Sequence[int],
  weighted: bool = True,
) -> types.Algorithm:
  """Builds FT-Full: FedAvg over K clients drawn from `eligible`.

  Args:
    local: how clients train (the whole model trains).
    clients_per_round: K, at most `len(eligible)`.
    eligible: the ids of the clients that can take part.
    weighted: FedAvg's mean by numbers of examples (else plain).

  Returns:
    FedAvg's `Algorithm` (state `fedavg.FedAvgState`) with the eligible
    clients' sampler; metrics 'bytes_communicated' (K models down and up)
    and 'eligible_clients'.
  """
  base = fedavg.fedavg(local, clients_per_round, weighted)
  return base._replace(
    aggregate=_with_eligible(base.aggregate, len(eligible)),
    sampler=eligible_sampler(eligible, clients_per_round),
  )


def ft_part(
  local: client.LocalTraining,
  clients_per_round: int,
  eligible: Sequence[int],
  trainable: Collection[str],
  weighted: bool = True,
) -> types.Algorithm:
  """Builds FT-Part: FedAvg of the `trainable` modules over K clients drawn
  from `eligible`; the other modules stay as they are.

  Args:
    local: how clients train (`local.model` the whole network).
    clients_per_round: K, at most `len(eligible)`.
    eligible: the ids of the clients that can take part.
    trainable: names of the top-level parameterised modules that train
      (e.g. `final_modules(model, layers)`); every other top-level entry of
      the variables is frozen.
    weighted: FedAvg's mean by numbers of examples (else plain).

  Returns:
    An `Algorithm` with server state `fedavg.FedAvgState`; the global
    model is the dispatch's shared part. Metrics: 'bytes_communicated'
    (K models down, K trainable parts up) and 'eligible_clients'.
  """
  k = errors.check_count('clients_per_round', clients_per_round)
  frozen = _frozen_modules(local.model, trainable)
  update = client.make_local_update(
    local._replace(
      model=PartModel(local.model, frozen),
      optimizer=frozen_optimizer(local.optimizer, frozen),
    )
  )

  def init(variables):
    return fedavg.FedAvgState(params=variables)

  def dispatch(state, client_ids, round_index, key):
    del client_ids, round_index, key
    return types.Dispatch(shared=state.params)

  def client_update(shared, per_client, client_state, data, client_id, key):
    del per_client
    out = update(shared, data, client_id, key)
    variables = keep_frozen(out.variables, shared, frozen)
    return out._replace(variables=variables), client_state

  return types.Algorithm(
    init,
    dispatch,
    client_update,
    functools.partial(_part_aggregate, frozen, weighted, k, len(eligible)),
    sampler=eligible_sampler(eligible, k),
    clients_per_round=k,
  )


def _frozen_modules(
  model: model_lib.Model, trainable: Collection[str]
) -> frozenset[str]:
  """The top-level entries of the model's variables that stay frozen: all
  but `trainable` (checked to name modules of the model)."""
  trainable = frozenset(trainable)
  order = module_order(model)
  unknown = trainable.difference(order)
  if unknown or not trainable:
    raise ValueError(
      f'trainable must name modules of the model ({", ".join(order)}), '
      f'got {sorted(trainable)}'
    )
  # Frozen: every other top-level entry of any collection (statistics-only
  # modules included); parameter-free modules such as a Dropout between
  # two layers belong to none and run as in training.
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  return frozenset(n for c in shapes.values() for n in c) - trainable


def _part_aggregate(
  frozen: frozenset[str],
  weighted: bool,
  k: int,
  num_eligible: int,
  state: fedavg.FedAvgState,
  outputs: types.ClientOutput,
  client_ids: jax.Array,
  round_index: jax.Array,
  key: jax.Array,
) -> tuple[fedavg.FedAvgState, dict[str, jax.Array]]:
  """FedAvg of the uploaded trainable parts; the frozen modules stay."""
  del client_ids, round_index, key
  uploads = outputs._replace(
    variables=trainable_part(outputs.variables, frozen)
  )
  tail = fedavg.server_aggregate(uploads, weighted)
  params = keep_frozen(tail, state.params, frozen)
  sent = tree.nbytes(state.params) + tree.nbytes(
    trainable_part(state.params, frozen)
  )
  return fedavg.FedAvgState(params=params), {
    'bytes_communicated': jnp.float32(k * sent),
    'eligible_clients': jnp.int32(num_eligible),
  }


def _eligible_for(
  setting: Any, hp: Hparams, trainable: Collection[str] | None, what: str
) -> np.ndarray:
  """The clients whose budget holds the measured step; raises the
  one-line error when fewer than K do."""
  model = setting.local.model
  shape = reference_shape(model, hp.reference_size)
  memory = training_memory(model, trainable, hp.reference_batch, shape)
  gbs, fractions = hp.budgets()
  client_budgets = budgets_lib.client_budgets(
    setting.num_clients, hp.budget_seed, gbs, fractions
  )
  eligible = eligible_clients(client_budgets, memory)
  if len(eligible) < setting.clients_per_round:
    at = 'x'.join(map(str, shape or model.input_shape))
    raise errors.ArgumentError(
      'clients_per_round',
      f'must be at most {len(eligible)}: only {len(eligible)} of '
      f'{setting.num_clients} clients have a memory budget (`ft_budgets_gb='
      f'{hp.budgets_gb}`, `ft_budget_fractions={hp.budget_fractions}`) that '
      f"holds {what}'s training step ({memory / budgets_lib.GB:.3g} GB "
      f'measured at {at}, batch {hp.reference_batch})',
    )
  return eligible


def build_full(setting: Any, hp: Hparams) -> types.Algorithm:
  """The registry's factory of FT-Full: measures the model's training step
  and admits the clients whose budget holds it."""
  eligible = _eligible_for(setting, hp, None, 'FT-Full')
  return ft_full(
    setting.local, setting.clients_per_round, eligible, setting.weighted
  )


def build_part(setting: Any, hp: PartHparams) -> types.Algorithm:
  """The registry's factory of FT-Part: the final `hp.layers` modules
  train; measures that step and admits the clients whose budget holds
  it."""
  trainable = final_modules(setting.local.model, hp.layers)
  eligible = _eligible_for(setting, hp, trainable, 'FT-Part')
  return ft_part(
    setting.local,
    setting.clients_per_round,
    eligible,
    trainable,
    setting.weighted,
  )
