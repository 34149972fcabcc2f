"""Local training of one client, in reusable pieces.

`make_local_update` builds the local SGD loop every algorithm's client
update is assembled from; its hooks add an extra loss term on the
parameters (FedProx) or on the representation of the same forward pass
(MOON, FedGen), correct the gradient (SCAFFOLD) or take a two-pass
sharpness-aware step (SAM/ASAM, for FedASAM). Every hook receives the
per-call `context` (e.g. the global model, the controls), so one built
update serves all clients and rounds.

Exact step counts, no padding steps:

Client k with n_k examples runs E epochs of ceil(n_k / B) steps. Every epoch
draws a fresh permutation of its n_k examples; the last batch of an epoch
holds the n_k mod B leftover examples (when non-zero) and its loss is their
mean, as PyTorch's `DataLoader(drop_last=False)` gives. The step loop has a
data-dependent trip count, so a client never computes a step it does not
take (under `vmap` the lanes of a chunk run to the chunk's longest client;
see the engine's `client_chunk`).
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from fedjax_mr.core import types
from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.models import model as model_lib

# fold_in tag of the key a representation_loss hook receives.
_HOOK = 0x4F4B


# Up to this many positions, `epoch_permutation` sorts one uint32 per
# position: 23 random bits above 8 bits of position.
_PACKED_POSITIONS = 2**8


def epoch_permutation(key: jax.Array, n_max: int, n: jax.Array) -> jax.Array:
  """A random order of positions `0..n-1` followed by `n..n_max-1`.

  Positions are ordered by `jax.random.uniform(key, (n_max,))`, ties by
  position. A float32 uniform keeps 23 of its 32 random bits (`bits >> 9`),
  so for `n_max` ≤ 256 the same order sorts a single uint32 array, those
  bits above the position (and the top bit above positions ≥ `n`): on
  XLA:CPU a one-array integer sort of 200 takes 3.6 µs where the argsort
  (float keys and positions) takes 17 µs, paid by every client each epoch.

  Args:
    key: PRNG key.
    n_max: static row length.
    n: dynamic count of valid positions, `1 <= n <= n_max`.

  Returns:
    `[n_max]` int32; its first `n` entries are a uniform permutation of
    `range(n)`.
  """
  pos = jnp.arange(n_max)
  if n_max > _PACKED_POSITIONS:
    u = jax.random.uniform(key, (n_max,))
    u = jnp.where(pos < n, u, 2.0 + pos)
    return jnp.argsort(u).astype(jnp.int32)
  bits = jax.random.bits(key, (n_max,), jnp.uint32) >> 9
  low = pos.astype(jnp.uint32)
  packed = jnp.where(pos < n, bits << 8 | low, jnp.uint32(2**31) | low)
  return (lax.sort(packed) & 0xFF).astype(jnp.int32)


def masked_cross_entropy(
  logits: jax.Array, labels: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Returns (mean loss over real examples, sum of losses)."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  total = jnp.sum(losses * mask)
  return total / jnp.maximum(jnp.sum(mask), 1.0), total


class LocalTraining(NamedTuple):
  """How a client trains locally: the pieces every algorithm shares.

  Attributes:
    model: the model.
    optimizer: any optax transformation, e.g. `optimizers.sgd(lr, 0.9)`;
      a fresh state per call. A rule that needs the client's learning rate
      and momentum (SCAFFOLD's control update) reads them from an
      optimizer built by `optimizers.sgd` (`optimizers.sgd_hparams`).
    local_epochs: E.
    batch_size: B.
  """

  model: model_lib.Model
  optimizer: optax.GradientTransformation
  local_epochs: int
  batch_size: int


class Batch(NamedTuple):
  """One local step's batch: `x` `[B, ...]` (normalised), `y` `[B]`,
  `mask` `[B]` float32 (1 for real examples; the last batch of an epoch is
  partly masked)."""

  x: jax.Array
  y: jax.Array
  mask: jax.Array


# loss_term(params, context, batch) -> float32 scalar added to each step's
# mean task loss (only its gradient matters; the reported loss is the task
# loss alone).
LossTerm = Callable[[types.PyTree, Any, Batch], jax.Array]
# representation_loss(features, params, context, batch, key) -> float32
# scalar added to each step's mean task loss; `features` `[B, D]` is the
# representation (the head's input) from the step's own forward pass, with
# its gradient (MOON's contrastive term, FedGen's generated-feature term).
RepresentationLoss = Callable[
  [jax.Array, types.PyTree, Any, Batch, jax.Array], jax.Array
]
# grad_correction(grads, params, context) -> grads, applied before the
# optimizer.
GradCorrection = Callable[[types.PyTree, types.PyTree, Any], types.PyTree]
# perturbation(params, grads) -> eps: the second pass evaluates the gradient
# at params + eps (sharpness-aware minimisation).
Perturbation = Callable[[types.PyTree, types.PyTree], types.PyTree]
# local_update(variables, data, client_id, key, context=()) -> ClientOutput
LocalUpdate = Callable[..., types.ClientOutput]


def _global_norm(tree: types.PyTree) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def sam(rho: float) -> Perturbation:
  """SAM's perturbation: eps = rho * g / ||g||.

  References:
    Foret et al., "Sharpness-Aware Minimization for Efficiently Improving
    Generalization", ICLR 2021.
  """
  if not rho >= 0:
    raise ValueError(f'rho must be >= 0, got {rho}')

  def perturb(params, grads):
    scale = rho / (_global_norm(grads) + 1e-12)
    return jax.tree.map(lambda g: scale * g, grads)

  return perturb


def _is_bias(path) -> bool:
  last = path[-1] if path else None
  return getattr(last, 'key', getattr(last, 'name', None)) == 'bias'


def asam(rho: float, eta: float) -> Perturbation:
  """Adaptive SAM's perturbation: with the normalisation operator T,
  eps = rho * T^2 g / ||T g||.

  T = |w| + eta element-wise for every parameter except biases, whose T is
  1 (the ASAM authors' code, which FedASAM's authors use: it scales the
  parameters named 'weight', the kernels and normalisation scales, and
  leaves biases alone; leaves named 'bias' here).

  References:
    Kwon et al., "ASAM: Adaptive Sharpness-Aware Minimization for
    Scale-Invariant Learning of Deep Neural Networks", ICML 2021.
  """
  if not rho >= 0:
    raise ValueError(f'rho must be >= 0, got {rho}')
  if not eta >= 0:
    raise ValueError(f'eta must be >= 0, got {eta}')

  def perturb(params, grads):
    t = jax.tree_util.tree_map_with_path(
      lambda path, w: jnp.ones_like(w) if _is_bias(path) else jnp.abs(w) + eta,
      params,
    )
    tg = jax.tree.map(lambda a, g: a * g, t, grads)
    scale = rho / (_global_norm(tg) + 1e-12)
    return jax.tree.map(lambda a, g: scale * a * g, t, tg)

  return perturb


# step_grads(params, state, batch, key) -> (grads, new non-param state,
# the batch's summed task loss): one local step's gradient, before the
# optimizer.
StepGrads = Callable[
  [types.PyTree, types.PyTree, Batch, jax.Array],
  tuple[types.PyTree, types.PyTree, jax.Array],
]


def train_steps(
  local: LocalTraining,
  step_grads: StepGrads,
  variables: types.Variables,
  data: client_data_lib.ClientData,
  client_id: jax.Array,
  key: jax.Array,
) -> types.ClientOutput:
  """The exact-step local loop every local update runs (module docstring).

  E epochs of ceil(n / B) steps over client `client_id`'s n examples, a
  fresh permutation per epoch (key `fold_in(key, e)`, step key
  `fold_in(epoch key, j)`), the last batch masked; each step applies
  `local.optimizer` (a fresh state per call) to `step_grads`.

  Returns:
    The trained variables, n, the per-example mean of the summed task
    losses over the E epochs, and the number of steps.
  """
  optimizer = local.optimizer
  n_max = data.max_size
  b = min(local.batch_size, n_max)  # no client fills a larger batch
  n = data.sizes[client_id]
  steps_per_epoch = (n + b - 1) // b
  params = variables['params']
  state = {k: v for k, v in variables.items() if k != 'params'}

  def epoch(e, carry):
    ekey = jax.random.fold_in(key, e)
    perm = epoch_permutation(ekey, n_max, n)
    perm = jnp.concatenate([perm, jnp.zeros((b,), perm.dtype)])

    def step(j, carry):
      params, state, opt_state, loss_sum = carry
      start = j * b
      pos = lax.dynamic_slice(perm, (start,), (b,))
      mask = (start + jnp.arange(b) < n).astype(jnp.float32)
      x, y = data.batch(client_id, pos)
      batch = Batch(x, y, mask)
      skey = jax.random.fold_in(ekey, j)
      grads, new_state, total = step_grads(params, state, batch, skey)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      state = {**state, **new_state}
      return params, state, opt_state, loss_sum + total

    return lax.fori_loop(0, steps_per_epoch, step, carry)

  carry = (params, state, optimizer.init(params), jnp.zeros((), jnp.float32))
  params, state, _, loss_sum = lax.fori_loop(
    0, local.local_epochs, epoch, carry
  )
  seen = (n * local.local_epochs).astype(jnp.float32)
  return types.ClientOutput(
    variables={'params': params, **state},
    num_examples=n.astype(jnp.int32),
    loss=loss_sum / seen,
    num_steps=(steps_per_epoch * local.local_epochs).astype(jnp.int32),
  )


def make_local_update(
  local: LocalTraining,
  *,
  loss_term: LossTerm | None = None,
  representation_loss: RepresentationLoss | None = None,
  grad_correction: GradCorrection | None = None,
  perturbation: Perturbation | None = None,
) -> LocalUpdate:
  """Builds local SGD for one client, with optional hooks.

  A fresh optimizer state is made per call (momentum starts at zero), as in
  the papers' reference code. Each step: the gradient of the batch's mean
  task loss (+ `loss_term`, + `representation_loss`), taken at
  `params + perturbation(params, g)` when a perturbation is given (a
  second forward/backward pass; BatchNorm
  statistics come from the first pass), then `grad_correction`, then the
  optimizer. Step counts and the masked last batch are the same with every
  hook.

  Args:
    local: the shared pieces (model, optimizer, E, B).
    loss_term: extra loss `(params, context, batch) -> scalar`.
    representation_loss: extra loss `(features, params, context, batch,
      key) -> scalar` on the step's representation (from
      `model.apply_train_features`, the same forward pass; `key` is the
      step's key, folded for the hook).
    grad_correction: `(grads, params, context) -> grads`.
    perturbation: `(params, grads) -> eps`, e.g. `sam(rho)`, `asam(rho,
      eta)`.

  Returns:
    `local_update(variables, data, client_id, key, context=()) ->
    ClientOutput`, where `data` is a `ClientData`, `client_id` an int32
    scalar and `context` whatever the hooks read.
  """
  model = local.model

  def loss_fn(params, state, batch, key, context):
    variables = {'params': params, **state}
    if representation_loss is None:
      logits, new_state = model.apply_train(
        variables, batch.x, key, mask=batch.mask
      )
    else:
      logits, feats, new_state = model.apply_train_features(
        variables, batch.x, key, mask=batch.mask
      )
    mean_loss, total = masked_cross_entropy(logits, batch.y, batch.mask)
    if loss_term is not None:
      mean_loss = mean_loss + loss_term(params, context, batch)
    if representation_loss is not None:
      hook_key = jax.random.fold_in(key, _HOOK)
      mean_loss = mean_loss + representation_loss(
        feats, params, context, batch, hook_key
      )
    return mean_loss, (new_state, total)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def local_update(variables, data, client_id, key, context=()):
    def step_grads(params, state, batch, skey):
      (_, (new_state, total)), grads = grad_fn(
        params, state, batch, skey, context
      )
      if perturbation is not None:
        eps = perturbation(params, grads)
        moved = jax.tree.map(lambda w, d: w + d.astype(w.dtype), params, eps)
        _, grads = grad_fn(moved, state, batch, skey, context)
      if grad_correction is not None:
        grads = grad_correction(grads, params, context)
      return grads, new_state, total

    return train_steps(local, step_grads, variables, data, client_id, key)

  return local_update


def trains_shared(
  local_update: LocalUpdate,
  context_of: Callable[[Any], tuple[types.Variables, Any]] | None = None,
) -> types.ClientUpdate:
  """A client update that trains the model every client is sent alike.

  Args:
    local_update: from `make_local_update`.
    context_of: optional `shared -> (variables, context)` for dispatches
      whose shared part holds more than the model (the context goes to the
      local update's hooks); None: the shared part is the model itself.

  Returns:
    A `types.ClientUpdate` that keeps the client state as it is.
  """

  def client_update(shared, per_client, client_state, data, client_id, key):
    del per_client
    if context_of is None:
      out = local_update(shared, data, client_id, key)
    else:
      variables, context = context_of(shared)
      out = local_update(variables, data, client_id, key, context)
    return out, client_state

  return client_update


def trains_per_client(local_update: LocalUpdate) -> types.ClientUpdate:
  """A client update that trains the client's own model, its row of the
  dispatch's per-client part (FedMR, FedMut)."""

  def client_update(shared, per_client, client_state, data, client_id, key):
    del shared
    return local_update(per_client, data, client_id, key), client_state

  return client_update


def make_client_update(
  model: model_lib.Model,
  optimizer: optax.GradientTransformation,
  *,
  local_epochs: int,
  batch_size: int,
) -> LocalUpdate:
  """Plain local SGD for one client (`make_local_update` without hooks).

  Returns:
    `local_update(variables, data, client_id, key) -> ClientOutput`.
  """
  return make_local_update(
    LocalTraining(model, optimizer, local_epochs, batch_size)
  )
