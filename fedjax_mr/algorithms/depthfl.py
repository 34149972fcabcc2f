"""DepthFL: depth-wise federated learning with self-distilled exits.

The global model has a classifier (exit) after each of its D stages
(`fedjax_mr.models.multi_exit`; ResNet-18: D = 4). Client k has a depth
d_k: it trains the stem, stages 1..d_k and exits 1..d_k on

  loss = sum_{i <= d_k} CE(y, p_i)
         + w_r * sum_{i <= d_k} sum_{j <= d_k, j != i}
             T^2 KL(sg(q_j) || q_i) / (d_k - 1)

(batch means), where p_i is exit i's softmax, q_i = softmax(z_i / T), sg
stops the gradient (each exit learns from the others' detached
predictions: mutual self-distillation) and the term is 0 for d_k = 1. The
distillation weight ramps up over the rounds as in the authors' code,
w_r = kd_weight * exp(-5 (1 - min(r, R) / R)^2) in round r (0-based) with
R = `kd_rampup` (0: constant kd_weight). The server averages every
variable over the clients whose sub-network holds it (example-weighted or
plain, as the setting says); a variable that no sampled client holds keeps
its value. The global prediction is the mean of all exits' logits (the
authors' evaluation); `inference='last'` evaluates the deepest exit alone.

Fixed shapes: all K clients train the whole network under `vmap`; a client
of depth d uses only exits 1..d in its loss, so deeper parameters get a
zero gradient and stay put (plain or heavy-ball SGD from zero momentum),
their BatchNorm statistics are reset to the received ones, and the server
leaves them out of that client's share. (The deeper stages' forward pass is
computed and discarded: under `vmap` a per-client depth cannot skip it.)

Client depths come from memory budgets (`fedjax_mr.training.budgets`,
FedStitch's 1/2/4/8 GB at 30/30/30/10 % of the clients, a seeded
assignment): the training memory of each depth-d sub-network is measured at
the reference setting (224 × 224 × 3, batch 32) and each client gets the
deepest one that fits its budget; a client whose budget holds none gets
depth 1 (the shallowest sub-network: every client takes part). `depth` > 0
gives every client that depth instead.

Deviations from the paper (Kim et al.) and its authors' code:
  * Exits are global average pooling and one dense layer; the authors put
    depthwise-separable convolution stacks with an attention mask before
    the shallow exits (their bottleneck layers).
  * Local training is plain local SGD (as every algorithm here); the
    paper's experiments run DepthFL on top of FedDyn's regulariser, and
    its code adds weight decay 1e-3 and a per-round learning-rate decay.
  * The distillation target is softmax(z_j / T) exactly; the code adds
    1e-7 to it before the KL.
  * Aggregation weights follow the experiment's weighting (by examples by
    default).
  * The reported client loss is the mean cross-entropy over the exits it
    trains (the training objective's task part, divided by their number).
`extended=False` trains only each client's deepest exit (the authors'
code's InclusiveFL-style baseline; the distillation term then pulls that
exit towards the shallower ones).

No other client state: the depth table `[N]` is closed over and read by
client id.

References:
  Kim, Yu, Kim and Moon, "DepthFL: Depthwise Federated Learning for
  Heterogeneous Clients", ICLR 2023.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from typing import NamedTuple
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from fedjax_mr.core import errors
from fedjax_mr.core import tree
from fedjax_mr.core import types
from fedjax_mr.models import model as model_lib
from fedjax_mr.models import multi_exit
from fedjax_mr.training import budgets
from fedjax_mr.training import client


class DepthFLState(NamedTuple):
  """Attributes: params: the global multi-exit model (all variables)."""

  params: types.Variables


@dataclasses.dataclass(frozen=True)
class Hparams:
  """DepthFL's distillation, inference and client depths."""

  kd_weight: float = 1.0
  kd_rampup: int = 300
  temperature: float = 1.0
  extended: bool = True
  inference: str = 'ensemble'
  depth: int = 0
  budget_seed: int = 0

  def validate(self, **setting) -> None:
    """Raises `ArgumentError` naming a bad field (`setting`: unused)."""
    del setting
    if not (math.isfinite(self.kd_weight) and self.kd_weight >= 0):
      raise errors.ArgumentError(
        'kd_weight', f'must be finite and >= 0, got {self.kd_weight}'
      )
    if self.kd_rampup < 0:
      raise errors.ArgumentError(
        'kd_rampup', f'must be >= 0, got {self.kd_rampup}'
      )
    if not (math.isfinite(self.temperature) and self.temperature > 0):
      raise errors.ArgumentError(
        'temperature', f'must be finite and > 0, got {self.temperature}'
      )
    if self.inference not in multi_exit.INFERENCE:
      raise errors.ArgumentError(
        'inference',
        f'must be one of {", ".join(multi_exit.INFERENCE)}, got '
        f'{self.inference!r}',
      )
    if self.depth < 0:
      raise errors.ArgumentError('depth', f'must be >= 0, got {self.depth}')


def wrap_model(model: model_lib.Model, hp: Hparams) -> model_lib.Model:
  """The network DepthFL trains: the multi-exit version of `model`
  (ResNet-18: four exits; any other zoo model: one stage)."""
  return multi_exit.from_zoo(model, hp.inference)


def kd_weight_at(
  round_index: jax.Array, kd_weight: float, rampup: int
) -> jax.Array:
  """The distillation weight of round `round_index` (0-based), float32:
  kd_weight * exp(-5 (1 - min(r, R) / R)^2), or kd_weight for R = 0."""
  if rampup == 0:
    return jnp.float32(kd_weight)
  r = jnp.minimum(round_index.astype(jnp.float32), rampup)
  phase = 1.0 - r / rampup
  return (kd_weight * jnp.exp(-5.0 * phase * phase)).astype(jnp.float32)


def self_distillation(
  logits: jax.Array,
  students: jax.Array,
  teachers: jax.Array,
  temperature: float = 1.0,
) -> jax.Array:
  """Mutual self-distillation per example, `[B]`.

  sum_i s_i sum_{j != i} t_j T^2 KL(sg(softmax(z_j / T)) || softmax(z_i /
  T)) / (n - 1), with n = sum_j t_j (0 when n < 2).

  Args:
    logits: `[B, D, C]`, the D exits' logits z.
    students: `[D]` float, 1 for the exits that learn (s).
    teachers: `[D]` float, 1 for the exits whose predictions teach (t:
      the client's exits).
    temperature: T.

  References:
    Kim, Yu, Kim and Moon, "DepthFL: Depthwise Federated Learning for
    Heterogeneous Clients", ICLR 2023, Eq. (2).
  """
  z = logits.astype(jnp.float32) / temperature
  log_q = jax.nn.log_softmax(z, axis=-1)  # [B, D, C]
  target = lax.stop_gradient(log_q)
  # kl[b, j, i] = KL(q_j || q_i) = sum_c q_j (log q_j - log q_i).
  kl = jnp.einsum('bjc,bjc->bj', jnp.exp(target), target)[:, :, None] - (
    jnp.einsum('bjc,bic->bji', jnp.exp(target), log_q)
  )
  d = logits.shape[1]
  off = 1.0 - jnp.eye(d, dtype=jnp.float32)
  pair = teachers[:, None] * students[None, :] * off  # [j, i]
  n = jnp.sum(teachers)
  per_example = jnp.einsum('bji,ji->b', kl, pair) / jnp.maximum(n - 1.0, 1.0)
  return temperature**2 * per_example


def exit_masks(
  depth: jax.Array, num_exits: int, extended: bool = True
) -> tuple[jax.Array, jax.Array]:
  """`(students, teachers)` `[D]` float32 of a client of depth `depth`:
  teachers are exits 1..depth, students the same (`extended`) or the
  deepest alone."""
  pos = jnp.arange(num_exits)
  teachers = (pos < depth).astype(jnp.float32)
  if extended:
    return teachers, teachers
  return (pos == depth - 1).astype(jnp.float32), teachers


def holds(variables: types.Variables, depth: jax.Array) -> types.PyTree:
  """Bool scalar per leaf: does the depth-`depth` sub-network hold it."""
  return jax.tree.map(lambda d: depth >= d, multi_exit.leaf_depths(variables))


def masked_mean(
  client_variables: types.Variables,
  global_variables: types.Variables,
  client_depths: jax.Array,
  weights: jax.Array | None = None,
) -> types.Variables:
  """Each leaf's mean over the clients whose sub-network holds it.

  Args:
    client_variables: leaves `[K, ...]`.
    global_variables: leaves `[...]`, kept where no client holds a leaf.
    client_depths: `[K]` int32.
    weights: `[K]` (numbers of examples) or None (equal).

  Returns:
    The new global variables, in each leaf's dtype.
  """
  masks = jax.tree.map(
    lambda need: client_depths >= need,
    multi_exit.leaf_depths(global_variables),
  )
  return tree.masked_mean(client_variables, global_variables, masks, weights)


def depth_memory(
  model: model_lib.Model,
  batch_size: int = budgets.REFERENCE_BATCH_SIZE,
  input_shape: Sequence[int] | None = budgets.REFERENCE_INPUT_SHAPE,
) -> list[int]:
  """Measured training memory (bytes) of the depth-1..D sub-networks of a
  multi-exit `model` (`budgets.training_memory_bytes`, at the reference
  setting by default)."""
  d = multi_exit.num_exits(model.module)
  return [
    budgets.training_memory_bytes(
      multi_exit.at_depth(model, depth), batch_size, input_shape
    )
    for depth in range(1, d + 1)
  ]


def depths_from_budgets(
  client_budgets: np.ndarray, needs: Sequence[int]
) -> np.ndarray:
  """Each client's depth (1-based) `[N]` int32: the deepest d whose
  sub-network's measured memory `needs[d - 1]` fits its budget (bytes);
  1 where none fits."""
  needs = np.asarray(needs, np.int64)
  fits = needs[None, :] <= np.asarray(client_budgets, np.int64)[:, None]
  deepest = np.where(fits, np.arange(1, len(needs) + 1), 0).max(axis=1)
  return np.maximum(deepest, 1).astype(np.int32)


def client_depths(
  model: model_lib.Model, num_clients: int, depth: int, seed: int
) -> np.ndarray:
  """The `[N]` depths of `num_clients` clients: `depth` for all, or (0)
  from FedStitch's memory budgets."""
  d = multi_exit.num_exits(model.module)
  if depth > d:
    raise errors.ArgumentError(
      'depth', f'must be <= {d}, the stages of {model.name}, got {depth}'
    )
  if depth > 0 or d == 1:
    return np.full((num_clients,), max(depth, 1), np.int32)
  return depths_from_budgets(
    budgets.client_budgets(num_clients, seed), depth_memory(model)
  )


def make_depth_update(
  local: client.LocalTraining, temperature: float, extended: bool
):
  """Local SGD on the DepthFL loss for one client.

  Returns:
    `local_update(variables, data, client_id, key, depth, kd_weight) ->
    ClientOutput`; the same epochs, batches and exact step counts as
    `client.make_local_update`; the variables a depth-`depth` client does
    not hold come back as received.
  """
  model = local.model
  num = multi_exit.num_exits(model.module)

  def forward(variables, x, key, mask):
    mutable = [k for k in variables if k != 'params']
    kwargs = dict(train=True, mask=mask, all_exits=True, rngs={'dropout': key})
    if not mutable:
      return model.module.apply(variables, x, **kwargs), {}
    logits, state = model.module.apply(variables, x, mutable=mutable, **kwargs)
    return logits, dict(state)

  def loss_fn(params, state, batch, key, masks, kd_weight):
    students, teachers = masks
    logits, new_state = forward(
      {'params': params, **state}, batch.x, key, batch.mask
    )
    ce = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), batch.y[:, None]
    )  # [B, D]
    real = jnp.maximum(jnp.sum(batch.mask), 1.0)
    per_example = jnp.sum(ce * students, axis=1)  # [B]
    kd = self_distillation(logits, students, teachers, temperature)
    loss = jnp.sum((per_example + kd_weight * kd) * batch.mask) / real
    task_sum = jnp.sum(per_example * batch.mask) / jnp.sum(students)
    return loss, (new_state, task_sum)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def local_update(variables, data, client_id, key, depth, kd_weight):
    masks = exit_masks(depth, num, extended)

    def step_grads(params, state, batch, skey):
      (_, (new_state, total)), grads = grad_fn(
        params, state, batch, skey, masks, kd_weight
      )
      return grads, new_state, total

    out = client.train_steps(local, step_grads, variables, data, client_id, key)
    kept = jax.tree.map(
      lambda h, new, old: jnp.where(h, new, old),
      holds(variables, depth),
      out.variables,
      variables,
    )
    return out._replace(variables=kept)

  return local_update


def depthfl(
  local: client.LocalTraining,
  clients_per_round: int,
  depths: Sequence[int],
  kd_weight: float = 1.0,
  kd_rampup: int = 300,
  temperature: float = 1.0,
  extended: bool = True,
  weighted: bool = True,
) -> types.Algorithm:
  """Builds DepthFL.

  Args:
    local: how clients train; `local.model` is a multi-exit network
      (`wrap_model`, `multi_exit.resnet18`).
    clients_per_round: K.
    depths: `[N]` each client's depth in 1..D (`client_depths`).
    kd_weight: the distillation weight once ramped up, >= 0.
    kd_rampup: R, rounds of the ramp-up (0: none).
    temperature: T > 0.
    extended: train all the client's exits (False: its deepest only).
    weighted: weight clients by numbers of examples in the server's mean.

  Returns:
    An `Algorithm` with server state `DepthFLState`; the dispatch shares
    (global model, this round's distillation weight). Metrics:
    'bytes_communicated' (each client's sub-network down and up),
    'mean_depth' (of the sampled clients).
  """
  Hparams(kd_weight, kd_rampup, temperature, extended).validate()
  return _depthfl(
    local,
    clients_per_round,
    depths,
    kd_weight,
    kd_rampup,
    temperature,
    extended,
    weighted,
  )


def _depthfl(
  local: client.LocalTraining,
  clients_per_round: int,
  depths: Sequence[int],
  kd_weight: float = 1.0,
  kd_rampup: int = 300,
  temperature: float = 1.0,
  extended: bool = True,
  weighted: bool = True,
) -> types.Algorithm:
  """`depthfl` from validated hyper-parameters (the registry's
  `build`: the config layer validated them)."""
  k = errors.check_count('clients_per_round', clients_per_round)
  num = multi_exit.num_exits(local.model.module)
  table = np.asarray(depths, np.int32)
  if table.ndim != 1 or table.min() < 1 or table.max() > num:
    raise ValueError(f'depths must be in 1..{num}, got {depths}')
  update = make_depth_update(local, temperature, extended)

  def init(variables):
    return DepthFLState(params=variables)

  def dispatch(state, client_ids, round_index, key):
    del client_ids, key
    weight = kd_weight_at(round_index, kd_weight, kd_rampup)
    return types.Dispatch(shared=(state.params, weight))

  def client_update(shared, per_client, client_state, data, client_id, key):
    del per_client
    variables, weight = shared
    depth = jnp.asarray(table)[client_id]
    out = update(variables, data, client_id, key, depth, weight)
    return out, client_state

  def sub_bytes(variables):
    # Bytes of the depth-d sub-network, d = 1..D, as a [D + 1] table.
    sizes = [0] * (num + 1)
    flat = jax.tree_util.tree_leaves_with_path(variables)
    for path, leaf in flat:
      nbytes = tree.nbytes(leaf)
      for d in range(multi_exit.leaf_depth(path), num + 1):
        sizes[d] += nbytes
    return jnp.asarray(sizes, jnp.float32)

  def aggregate(state, outputs, client_ids, round_index, key):
    del round_index, key
    sampled = jnp.asarray(table)[client_ids]
    weights = outputs.num_examples if weighted else None
    params = masked_mean(outputs.variables, state.params, sampled, weights)
    metrics = {
      'bytes_communicated': 2 * jnp.sum(sub_bytes(state.params)[sampled]),
      'mean_depth': jnp.mean(sampled.astype(jnp.float32)),
    }
    return DepthFLState(params=params), metrics

  return types.Algorithm(
    init, dispatch, client_update, aggregate, clients_per_round=k
  )


def build(setting: Any, hp: Hparams) -> types.Algorithm:
  """The registry's factory (`setting.local.model` is already
  `wrap_model`'s)."""
  depths = client_depths(
    setting.local.model, setting.num_clients, hp.depth, hp.budget_seed
  )
  return _depthfl(
    setting.local,
    setting.clients_per_round,
    depths,
    hp.kd_weight,
    hp.kd_rampup,
    hp.temperature,
    hp.extended,
    setting.weighted,
  )
