"""A run's evaluations on the test set, jit-compiled once per run.

Every `eval_every` rounds (and after the last) the global model, the one
the algorithm evaluates (`types.evaluated_model`); for the algorithms that
keep K different models (`config.multi_model`), every `local_eval_every`
rounds each of the K models the next round dispatches.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import numpy as np

from fedjax_mr.core import types
from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.pipeline import build
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.runtime import distributed
from fedjax_mr.training import engine
from fedjax_mr.training import evaluation
from fedjax_mr.training import host_round


class Evaluators(NamedTuple):
  """The jit-compiled evaluations of a run.

  Attributes:
    server: (server state, test set) → {'accuracy', 'loss'} of the
      evaluated model.
    local: (round state, client data, test set) → {'accuracy': [K]} of
      the K models the next round dispatches; None unless the algorithm
      keeps K models.
  """

  server: Callable[..., Any]
  local: Callable[..., Any] | None


def due(every: int, r: int, rounds: int) -> bool:
  """Whether a step taken every `every` rounds (0: never) and after the
  last of `rounds` is due after round r (evaluations, checkpoints)."""
  return r == rounds or (every > 0 and r % every == 0)


def make_evaluators(experiment: build.Experiment) -> Evaluators:
  """The evaluations of `experiment`, replicated over its mesh."""
  config, algorithm, mesh = (
    experiment.config,
    experiment.algorithm,
    experiment.mesh,
  )
  eval_mesh = mesh if mesh.devices.size > 1 else None
  evaluate_model = evaluation.make_evaluate(experiment.model, eval_mesh)
  server = jax.jit(
    lambda s, t: evaluate_model(types.evaluated_model(algorithm, s), t),
    out_shardings=distributed.replicated(mesh),
  )
  if not config_lib.multi_model(config):
    return Evaluators(server=server, local=None)

  evaluate_dispatched = evaluation.make_evaluate_dispatched(
    experiment.model, algorithm, eval_mesh
  )

  # The K different models the next round dispatches (recombined or
  # mutated), each on the whole test set.
  def evaluate_next(s, d, t):
    sent = engine.next_dispatch(
      algorithm, s, d, experiment.key, config.server.clients_per_round
    )
    return evaluate_dispatched(sent, t)

  local = jax.jit(
    evaluate_next,
    out_shardings=distributed.replicated(mesh),
  )
  return Evaluators(server=server, local=local)


def evaluate_round(
  evaluators: Evaluators,
  config: config_lib.ExperimentConfig,
  r: int,
  state: engine.RoundState,
  data: client_data_lib.ClientData,
  test: client_data_lib.EvalData,
  row: dict[str, Any],
  clients_row: dict[str, Any],
) -> bool:
  """Adds the evaluations due after round r (`state`: its result) to its
  metrics row and clients row; whether any ran."""
  evaluated = False
  if due(config.evaluation.eval_every, r, config.run.rounds):
    ev = jax.device_get(evaluators.server(state.server, test))
    row['test_accuracy'] = float(ev['accuracy'])
    row['test_loss'] = float(ev['loss'])
    evaluated = True
  if evaluators.local is not None and due(
    config.evaluation.local_eval_every, r, config.run.rounds
  ):
    local = evaluators.local(
      state.replace(clients=()), host_round.round_data(data), test
    )
    local = jax.device_get(local)['accuracy']
    row['local_accuracy_mean'] = float(np.mean(local))
    row['local_accuracy_std'] = float(np.std(local))
    clients_row['local_accuracy'] = [float(a) for a in local]
    evaluated = True
  return evaluated
