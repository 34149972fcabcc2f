"""FedAvg: the server averages the clients' trained models.

References:
  McMahan et al., "Communication-Efficient Learning of Deep Networks from
  Decentralized Data", AISTATS 2017.
"""

from __future__ import annotations

from typing import NamedTuple

from fedjax_mr.core import tree
from fedjax_mr.core import types


class FedAvgState(NamedTuple):
  """Attributes: params: the global model variables (params and BatchNorm
  statistics alike)."""

  params: types.Variables


def fedavg(
  clients_per_round: int, weighted: bool = True
) -> types.ServerTransform:
  """Builds FedAvg.

  Args:
    clients_per_round: K, the number of models dispatched per round.
    weighted: weight each client by its number of examples (McMahan et al.);
      False gives the unweighted mean of the K models (as FedMR/FedMut's
      reference code does for its global model).

  Returns:
    A `ServerTransform`. Metrics: none beyond the engine's.
  """
  k = int(clients_per_round)

  def init(variables):
    return FedAvgState(params=variables)

  def shared_dispatch(state, round_index, key):
    del round_index, key
    return state.params

  def dispatch(state, round_index, key):
    return tree.broadcast(shared_dispatch(state, round_index, key), k)

  def aggregate(state, outputs, round_index, key):
    del state, round_index, key
    weights = outputs.num_examples if weighted else None
    return FedAvgState(
      params=tree.weighted_mean(outputs.variables, weights)
    ), {}

  return types.ServerTransform(init, dispatch, aggregate, shared_dispatch)
