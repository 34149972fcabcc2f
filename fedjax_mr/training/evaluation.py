"""Evaluation of one model, of K stacked models and of the models a
dispatch starts its clients from, on padded test batches, optionally split
over the devices of a mesh.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from fedjax_mr.core import types
from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.models import model as model_lib
from fedjax_mr.training import client


def make_evaluate(
  model: model_lib.Model,
  mesh: jax.sharding.Mesh | None = None,
) -> Callable[
  [types.Variables, client_data_lib.EvalData], dict[str, jax.Array]
]:
  """Builds `evaluate(variables, eval_data) -> {'accuracy', 'loss'}`.

  Inference mode (BatchNorm running statistics, no dropout); batches run
  one after another with `lax.map`; padded examples are masked out. With
  a `mesh` of D devices the batches are split over them (D must divide
  the number of batches: `client_data.eval_data(..., num_shards=D)`), each
  device evaluating its share of every model; the per-batch sums come
  back in batch order and are added as on one device, so the results are
  those of the unsharded evaluation.
  """

  def batch(variables, data, args):
    x, y, mask = args
    logits = model.apply_eval(
      variables, client_data_lib.normalize(x, data.scale, data.shift)
    )
    correct = jnp.sum((jnp.argmax(logits, -1) == y) * mask)
    _, loss_sum = client.masked_cross_entropy(logits, y, mask)
    return correct, loss_sum

  def per_batch(variables, data):
    return lax.map(
      functools.partial(batch, variables, data), (data.x, data.y, data.mask)
    )

  shards = 1 if mesh is None else mesh.devices.size
  if shards > 1:
    spec = jax.sharding.PartitionSpec(mesh.axis_names[0])
    per_batch = jax.shard_map(
      per_batch,
      mesh=mesh,
      in_specs=(jax.sharding.PartitionSpec(), spec),
      out_specs=spec,
      check_vma=False,
    )

  def evaluate(variables, data):
    if data.x.shape[0] % shards:
      raise ValueError(
        f'{data.x.shape[0]} test batches do not split over {shards} '
        'devices; build them with eval_data(..., num_shards=...)'
      )
    correct, loss_sum = per_batch(variables, data)
    count = jnp.sum(data.mask)
    return {
      'accuracy': jnp.sum(correct) / count,
      'loss': jnp.sum(loss_sum) / count,
    }

  return evaluate


def make_evaluate_many(
  model: model_lib.Model,
  mesh: jax.sharding.Mesh | None = None,
) -> Callable[
  [types.Variables, client_data_lib.EvalData], dict[str, jax.Array]
]:
  """Like `make_evaluate`, for K stacked models (leaves `[K, ...]`).

  The models run one after another (`lax.map`), so memory stays that of
  one evaluation; with a `mesh` each is split over its devices as in
  `make_evaluate`. Returns `{'accuracy': [K], 'loss': [K]}`.
  """
  evaluate = make_evaluate(model, mesh)
  return lambda stacked, data: lax.map(lambda v: evaluate(v, data), stacked)


def make_evaluate_dispatched(
  model: model_lib.Model,
  algorithm: types.Algorithm,
  mesh: jax.sharding.Mesh | None = None,
) -> Callable[[types.Dispatch, client_data_lib.EvalData], dict[str, jax.Array]]:
  """Like `make_evaluate_many`, for the K models a dispatch starts its
  clients from (`types.dispatched_models`): each is built (FedMut's from
  the coefficients) and evaluated in its turn, so memory stays that of one
  model. Returns `{'accuracy': [K], 'loss': [K]}`."""
  evaluate = make_evaluate(model, mesh)
  model_of = algorithm.client_model or (lambda shared, row: row)

  def evaluate_dispatched(sent, data):
    return lax.map(
      lambda row: evaluate(model_of(sent.shared, row), data), sent.per_client
    )

  return evaluate_dispatched
