"""A run's evaluations on the test set, jit-compiled once per run.

Every `eval_every` rounds (and after the last) the global model, the one
the algorithm evaluates (`types.evaluated_model`); for the algorithms that
keep K different models (`config.multi_model`), every `local_eval_every`
rounds each of the K models the next round dispatches. A FedStitch run
evaluates at its end every stitched network, every pool model and the
"Local" baseline (`make_evaluate`, `evaluate_networks`, `local_baseline`)
and reports them in results.json (`make_results`; `s` there is
`stitch_experiment.Setup`).
"""

from __future__ import annotations

import os
import time
from typing import Any
from typing import Callable
from typing import NamedTuple

import jax
import numpy as np

from fedjax_mr.core import types
from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.energy import fleet
from fedjax_mr.pipeline import build
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import progress
from fedjax_mr.pipeline import stitch_config
from fedjax_mr.runtime import distributed
from fedjax_mr.stitch import federated
from fedjax_mr.stitch import network
from fedjax_mr.stitch import state as state_lib
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


# --- FedStitch ----------------------------------------------------------------


def _say(line: str) -> None:
  print(line, flush=True)


def knn_examples(
  evaluation: stitch_config.Evaluation,
  ds: Any,
  public: np.ndarray,
  parts: list[np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
  """`(x, y)`: the labelled examples a kNN probe is fitted on, the first
  `knn_reference` public examples (client 0's without a public split)."""
  ref = public[: evaluation.knn_reference] if len(public) else parts[0]
  return ds.x_train[ref], ds.y_train[ref]


def test_examples(
  evaluation: stitch_config.Evaluation, ds: Any
) -> tuple[np.ndarray, np.ndarray]:
  """`(x, y)`: the test examples networks are evaluated on, the first
  `eval_examples` (0: all) of the clients' classes."""
  n_eval = evaluation.eval_examples or len(ds.y_test)
  return ds.x_test[:n_eval], ds.y_test[:n_eval]


def make_evaluate(s: Any) -> Callable[[network.Network], dict]:
  """`net → {'head' and/or 'knn': accuracy}` on the test set (its first
  `eval_examples`), as `eval` and `knn_at` say."""
  e, ds = s.config.evaluation, s.ds
  x_test, y_test = test_examples(e, ds)
  x_ref, y_ref = knn_examples(e, ds, s.public, s.parts)

  def evaluate(net):
    knn = e.mode != 'head'
    trunk = knn and e.knn_at == 'trunk' and net.finished
    acc = network.accuracies(
      net,
      x_test,
      y_test,
      scale=ds.scale,
      shift=ds.shift,
      head=e.mode in ('head', 'both'),
      knn_reference=(x_ref, y_ref) if knn and not trunk else None,
      label_map=s.label_map,
    )
    if trunk:  # the features its end block starts from
      acc.update(
        network.accuracies(
          network.trunk(net),
          x_test,
          y_test,
          scale=ds.scale,
          shift=ds.shift,
          head=False,
          knn_reference=(x_ref, y_ref),
        )
      )
    return acc

  return evaluate


def eval_key(evaluation: stitch_config.Evaluation) -> str:
  """The accuracy networks are ranked by: the head's, else the kNN's."""
  return 'head' if evaluation.mode in ('head', 'both') else 'knn'


def evaluate_networks(
  s: Any, state: state_lib.State, evaluate, log: Callable[[str], None] = _say
) -> list[dict[str, Any]]:
  """Every finished network's accuracy, best first; the networks (paths
  and stitches, never a pickle) go to networks.npz."""
  nets = []
  for fin in state.finished:
    acc = evaluate(fin.net)
    nets.append(
      {
        'path': fin.net.describe(),
        'depth': fin.net.depth,
        'round': fin.round,
        'share': fin.share,
        **acc,
      }
    )
    log(
      f'{fin.net.describe()}: '
      + ', '.join(f'{k} {100 * v:.2f} %' for k, v in acc.items())
    )
  key = eval_key(s.config.evaluation)
  nets.sort(key=lambda n: -n[key])
  state_lib.write_document(
    os.path.join(s.config.run.workdir, 'networks.npz'),
    state_lib.to_host(state)['finished'],
    stitch_config.identity(s.config, [m.id for m in s.models]),
  )
  return nets


def local_baseline(
  s: Any,
  clients: federated.Clients,
  evaluate,
  log: Callable[[str], None] = _say,
  clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any] | None:
  """The "Local" baseline: `local_clients` clients (drawn by the seed)
  each stitching alone; the best accuracy each finds, logged with the time
  by `clock` (seconds)."""
  config = s.config
  n, count = config.partition.num_clients, config.evaluation.local_clients
  if count <= 0:
    return None
  rng = np.random.default_rng([config.run.seed, 99])
  who = sorted(int(c) for c in rng.choice(n, count, replace=False))
  local_cfg = stitch_config.library_config(config)._replace(clients_per_round=1)
  local = {'clients': who, 'best': []}
  t0 = clock()
  for i, c in enumerate(who, 1):
    st = federated.run(
      s.pool, None, n, local_cfg, population=[c], clients=clients
    )
    accs = [evaluate(f.net)[eval_key(config.evaluation)] for f in st.finished]
    best = max(accs) if accs else float('nan')
    local['best'].append(best)
    log(progress.stitch_local_line(i, who, best, len(accs), clock() - t0))
  local['mean_best'] = float(np.nanmean(local['best']))
  return local


def _peak_mib() -> float:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('VmHWM:'):
        return int(line.split()[1]) / 1024
  return 0.0


def plain(o):
  """JSON for numpy scalars and arrays."""
  if isinstance(o, (np.generic, np.ndarray)):
    return o.tolist()
  raise TypeError(f'{type(o).__name__} is not JSON serializable')


def make_results(
  s: Any,
  state: state_lib.State,
  nets: list[dict[str, Any]],
  pool_acc: dict[str, dict],
  local: dict[str, Any] | None,
) -> dict[str, Any]:
  """What results.json holds."""
  config, rounds = s.config, state.log
  e = config.energy
  energy_summary = {
    'backend': e.backend,
    'devices': e.mix if e.backend == 'simulated' else e.profile,
    **fleet.summarize([e['energy'] for e in rounds]),
  }
  return {
    'config': stitch_config.library_config(config)._asdict(),
    'partition': config.partition.kind,
    'dirichlet_alpha': config.partition.alpha,
    'eval': config.evaluation.mode,
    'knn_at': config.evaluation.knn_at,
    'pool_blocks': len(s.pool.blocks),
    'pool_models': pool_acc,
    'networks': nets,
    'best': nets[0] if nets else None,
    'local': local,
    'rounds': len(rounds),
    # Over every round of the run, also those before a resume.
    'run_seconds': sum(e.get('round_time_s', 0.0) for e in rounds),
    'selection_seconds_per_round': [sum(e['client_time_s']) for e in rounds],
    'pool_sizes': [e['pool_sizes'] for e in rounds],
    'selection_seconds_total': float(
      sum(sum(e['client_time_s']) for e in rounds)
    ),
    'final_weights': rounds[-1]['weights'] if rounds else None,
    'energy': energy_summary,
    'peak_host_mib': _peak_mib(),
  }
