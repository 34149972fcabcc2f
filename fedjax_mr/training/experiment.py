"""`train_and_evaluate(config, workdir)`: a whole run, resumable.

The host loop around the jit-compiled round: data and partition, model and
algorithm from the config, then per round one metrics line (and an
evaluation every `eval_every` rounds), checkpoints every
`checkpoint_every` rounds, and a learning-curve PNG at the end. A workdir
that holds a checkpoint resumes from it; the rounds after it are recomputed
identically (every round's key is `fold_in(key, round)`). Ctrl-C or
SIGTERM writes the current round's row and checkpoints that round on the
way out, so no finished round is lost and no round's row is skipped.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from typing import Any
from typing import Callable
from typing import NamedTuple
from typing import Sequence

import jax
import numpy as np
import optax

from fedjax_mr.core import errors
from fedjax_mr.core import grouping
from fedjax_mr.core import types
from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.data import datasets
from fedjax_mr.data import partition as partition_lib
from fedjax_mr.models import model as model_lib
from fedjax_mr.server import fedavg
from fedjax_mr.server import fedmr
from fedjax_mr.server import fedmut
from fedjax_mr.training import checkpoint
from fedjax_mr.training import client
from fedjax_mr.training import config as config_lib
from fedjax_mr.training import distributed
from fedjax_mr.training import engine
from fedjax_mr.training import metrics_io

METRICS_FILE = 'metrics.jsonl'
ENERGY_FILE = 'energy.json'
CONFIG_FILE = 'config.json'
PARTITION_FILE = 'partition.json'
CURVE_FILE = 'learning_curve.png'

# Named subkeys of the run key.
_INIT, _ROUNDS = 0, 1


class Result(NamedTuple):
  """What a finished run returns.

  Attributes:
    state: the final `RoundState`.
    history: every metrics row of the run (resumed rounds included).
    workdir: where everything was written.
  """

  state: engine.RoundState
  history: list[dict[str, Any]]
  workdir: str


def build_server(
  config: config_lib.ExperimentConfig, variables: types.Variables
) -> types.ServerTransform:
  """The server transform named by `config.algorithm`.

  Args:
    config: the experiment (validated).
    variables: the initial model variables as `model.init` returns them
      (their key order is the model's layer order, which FedMR-p's segments
      follow).
  """
  k = config.clients_per_round
  weighted = not config_lib.uniform_weights(config)
  if config.algorithm == 'fedavg':
    return fedavg.fedavg(k, weighted=weighted)
  if config.algorithm == 'fedmut':
    return fedmut.fedmut(
      k,
      alpha=config.fedmut_alpha,
      beta0=config.fedmut_beta0,
      bound=config.fedmut_bound,
      weighted=weighted,
      grouping=config.fedmr_grouping,
    )
  if config.algorithm in ('fedmr', 'fedmr_p', 'indep'):
    segments = {'fedmr': None, 'fedmr_p': config.fedmr_segments, 'indep': 1}
    repeats = config.fedmr_secure_repeats
    max_sent = config.fedmr_secure_max_sent or None
    if repeats:
      num_layers = len(fedmr.secure_layers(variables, config.fedmr_grouping))
      hi = max_sent or num_layers
      if not config.fedmr_secure_min_sent <= hi <= num_layers:
        raise errors.ConfigError(
          f'--fedmr_secure_min_sent={config.fedmr_secure_min_sent} and '
          f'--fedmr_secure_max_sent={config.fedmr_secure_max_sent} must '
          f'satisfy min <= max <= {num_layers}, the number of layers of '
          f'--model={config.model} with --fedmr_grouping='
          f'{config.fedmr_grouping}'
        )
    return fedmr.fedmr(
      k,
      first_stage_bound=config.fedmr_first_stage,
      grouping=config.fedmr_grouping,
      num_segments=segments[config.algorithm],
      secure_repeats=repeats,
      weighted_global=weighted,
      secure_min_sent=config.fedmr_secure_min_sent,
      secure_max_sent=max_sent,
      layer_order=grouping.model_order(variables),
    )
  raise errors.ConfigError(
    f'--algorithm: unknown {config.algorithm!r}; choose one of '
    f'{", ".join(config_lib.ALGORITHMS)}'
  )


def make_partition(
  config: config_lib.ExperimentConfig,
  labels: np.ndarray,
  clients: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
  """Client index lists; `clients`: the dataset's own (partition=natural)."""
  if config.partition == 'natural':
    if clients is None:
      raise errors.ConfigError(
        f'--partition=natural: --dataset={config.dataset} has no natural '
        'clients'
      )
    return list(clients)
  if config.partition == 'iid':
    return partition_lib.iid(len(labels), config.num_clients, config.seed)
  return partition_lib.dirichlet(
    labels,
    config.num_clients,
    config.alpha,
    config.seed,
    min_size=config.min_client_size,
  )


def _log_default(line: str) -> None:
  print(line, flush=True)


def train_and_evaluate(
  config: config_lib.ExperimentConfig,
  workdir: str | None = None,
  *,
  log: Callable[[str], None] = _log_default,
  on_round: Callable[[int, dict[str, Any]], None] | None = None,
) -> Result:
  """Runs (or resumes) an experiment.

  Args:
    config: the experiment.
    workdir: output folder; default `config.workdir`, else
      `config.default_workdir()`.
    log: where progress lines go.
    on_round: called with (round, metrics row) after each round is logged
      and checkpointed (tests use it to interrupt a run).

  Returns:
    A `Result`.

  Raises:
    UserError: bad config, data or workdir (the message names the flag).
    NonFiniteError: the train loss became non-finite; the metrics written
      so far and the last checkpoint are kept.
  """
  config_lib.validate(config)
  mesh = distributed.make_mesh(config.num_devices)
  num_devices = mesh.devices.size
  if config.clients_per_round % num_devices:
    raise errors.ConfigError(
      f'--clients_per_round={config.clients_per_round} must be a multiple of '
      f'the {num_devices} devices the clients are sharded over; set '
      '--num_devices (or --host_devices on CPU) to a divisor of it'
    )
  primary = distributed.is_primary()
  if not primary:
    log = _quiet
  workdir = workdir or config.workdir or config.default_workdir()
  os.makedirs(workdir, exist_ok=True)
  config_path = os.path.join(workdir, CONFIG_FILE)
  if os.path.exists(config_path):
    config_lib.check_resumable(config, config_path)
  if primary:
    with open(config_path, 'w') as f:
      json.dump(config.to_dict(), f, indent=2)

  dataset = datasets.load(
    config.dataset,
    config.data_dir or None,
    cifar100_labels=config.cifar100_labels,
    leaf_min_samples=config.leaf_min_samples,
  )
  if config.partition == 'natural':
    dataset = datasets.natural_clients(dataset, config.num_clients, config.seed)
  model = model_lib.get(
    config.model,
    dataset.num_classes,
    dataset.input_shape,
    dataset=config.dataset,
  )
  parts = make_partition(config, dataset.y_train, dataset.clients)
  if primary:
    partition_lib.save_summary(
      os.path.join(workdir, PARTITION_FILE),
      partition_lib.summary(parts, dataset.y_train, dataset.num_classes),
    )
  data = client_data_lib.from_partition(
    dataset.x_train, dataset.y_train, parts, dataset.scale, dataset.shift
  )
  test = client_data_lib.eval_data(
    dataset.x_test,
    dataset.y_test,
    config.eval_batch_size,
    dataset.scale,
    dataset.shift,
  )

  key = jax.random.key(config.seed)
  variables = model.init(jax.random.fold_in(key, _INIT))
  server = build_server(config, variables)
  client_update = client.make_client_update(
    model,
    optax.sgd(config.lr, momentum=config.momentum or None),
    local_epochs=config.local_epochs,
    batch_size=config.batch_size,
  )
  state = engine.init_state(server, variables)
  data, test, state = distributed.replicate((data, test, state), mesh)
  round_key = jax.random.fold_in(key, _ROUNDS)

  ckpt = checkpoint.Checkpointer(workdir, keep=config.keep_checkpoints)
  metrics_path = os.path.join(workdir, METRICS_FILE)
  start = ckpt.latest_round()
  if start is not None:
    state = ckpt.restore(start, state)
    log(f'resuming {workdir} after round {start}')
  else:
    start = 0
  history = metrics_io.truncate(metrics_path, start) if primary else []
  num_params = sum(x.size for x in jax.tree.leaves(state.server.params))
  log(
    f'{config.algorithm} on {config.dataset} ({len(dataset.x_train)} train / '
    f'{len(dataset.x_test)} test), {config.model} ({num_params:,} '
    f'parameters), {config.num_clients} clients ({config.partition}), '
    f'{config.clients_per_round} per round, {config.rounds} rounds'
  )
  platform = mesh.devices.flat[0].platform
  chunk = config.client_chunk or (
    1 if platform == 'cpu' else config.clients_per_round // num_devices
  )
  log(
    f'{num_devices} {platform} device(s) in {jax.process_count()} '
    f'process(es); {config.clients_per_round // num_devices} clients per '
    f'device, {chunk} at a time'
  )

  round_fn = jax.jit(
    engine.make_round_fn(
      server,
      client_update,
      clients_per_round=config.clients_per_round,
      client_chunk=chunk,
      mesh=mesh if num_devices > 1 else None,
    ),
    donate_argnums=0,
    out_shardings=distributed.replicated(mesh),
  )
  evaluate = jax.jit(
    engine.make_evaluate(model), out_shardings=distributed.replicated(mesh)
  )
  evaluate_many = engine.make_evaluate_many(model)
  local_evaluate = None
  if config.algorithm in config_lib.MULTI_MODEL:
    # The K different models the next round dispatches (recombined or
    # mutated), each on the whole test set.
    local_evaluate = jax.jit(
      lambda s, t: evaluate_many(engine.next_models(server, s, round_key), t),
      out_shardings=distributed.replicated(mesh),
    )
  # Down- and upload of K models, for servers that do not count their own.
  model_bytes = sum(
    x.size * x.dtype.itemsize for x in jax.tree.leaves(variables)
  )
  round_bytes = 2 * config.clients_per_round * model_bytes

  def should(every: int, r: int) -> bool:
    return r == config.rounds or (every > 0 and r % every == 0)

  timer = _Timer(start, config.rounds)
  saved_round = written = start

  def record(r: int, metrics: Any, t0: float) -> dict[str, Any]:
    """Evaluates round r's state and writes its metrics row."""
    nonlocal written
    metrics = jax.device_get(metrics)
    row = {
      'round': r,
      'train_loss': float(metrics['train_loss']),
      'num_examples': int(metrics['num_examples']),
      'num_steps': int(metrics['num_steps']),
    }
    row.update(
      {
        k: _to_json(v)
        for k, v in metrics.items()
        if k not in row and k != 'client_ids'
      }
    )
    # Who trained this round: the energy simulation replays it.
    row['client_ids'] = [int(i) for i in metrics['client_ids']]
    row.setdefault('bytes_communicated', float(round_bytes))
    if not math.isfinite(row['train_loss']):
      if primary:
        metrics_io.append(metrics_path, row)
      raise errors.NonFiniteError(
        f'non-finite train loss ({row["train_loss"]}) at round {r}; '
        f'stopped. Metrics up to it are in {metrics_path}; the last '
        f'checkpoint (round {saved_round}) is kept. Try a smaller --lr.'
      )
    if should(config.eval_every, r):
      ev = jax.device_get(evaluate(state.server.params, test))
      row['test_accuracy'] = float(ev['accuracy'])
      row['test_loss'] = float(ev['loss'])
    if local_evaluate is not None and should(config.local_eval_every, r):
      local = jax.device_get(local_evaluate(state, test))['accuracy']
      row['local_accuracy_mean'] = float(np.mean(local))
      row['local_accuracy_std'] = float(np.std(local))
    row['round_time_s'] = time.perf_counter() - t0
    timer.tick(r, row['round_time_s'])
    row['elapsed_s'] = timer.elapsed
    if primary:
      metrics_io.append(metrics_path, row)
    written = r
    history.append(row)
    log(timer.progress_line(row))
    return row

  pending = None  # (round, metrics, t0) of a round whose row is not written
  with _TerminationAsInterrupt():
    try:
      for r in range(start + 1, config.rounds + 1):
        t0 = time.perf_counter()
        state, metrics = round_fn(state, data, round_key)
        pending = (r, metrics, t0)
        row = record(*pending)
        pending = None
        if should(config.checkpoint_every, r):
          ckpt.save(r, state)
          saved_round = r
        if on_round is not None:
          on_round(r, row)
    except KeyboardInterrupt:
      # Most of a round is spent waiting for its results, so that is where a
      # signal usually lands: the state has advanced but the row is missing.
      # Finish the row first; a checkpoint without it would make the resumed
      # run skip that round's metrics.
      if pending is not None and written < pending[0] and _alive(state):
        try:
          record(*pending)
        except (KeyboardInterrupt, errors.NonFiniteError):
          log(
            f'round {pending[0]} could not be finished; the run resumes '
            f'after round {saved_round}'
          )
      if (
        _alive(state) and written > saved_round and int(state.round) == written
      ):
        ckpt.save(written, state)
        log(f'interrupted: saved a checkpoint after round {written}')
      ckpt.close()
      raise
  ckpt.close()
  if history and primary:
    metrics_io.plot_curves(
      {config.algorithm: history},
      os.path.join(workdir, CURVE_FILE),
      title=f'{config.dataset} {config.model} {config.partition}',
    )
  log(timer.summary(history, workdir))
  if primary and config_lib.energy_mixes(config):
    energy = simulate_energy(config, history, [len(p) for p in parts])
    with open(os.path.join(workdir, ENERGY_FILE), 'w') as f:
      json.dump(energy, f, indent=1)
    for mix, e in energy.items():
      log(energy_line(mix, e))
  return Result(state=state, history=history, workdir=workdir)


def simulate_energy(
  config: config_lib.ExperimentConfig,
  history: list[dict[str, Any]],
  sizes: list[int],
) -> dict[str, dict[str, Any]]:
  """Each --energy_mix simulated on a run's rounds (coordinator vs the
  highest frequency).

  Args:
    config: the run (its mixes, seed, local epochs, time per example).
    history: the metrics rows, with each round's `client_ids`.
    sizes: every client's number of training examples.

  Returns:
    {mix: `SimulationReport.summary()`}; rounds logged before client ids
    were recorded are left out (`rounds_simulated` says how many count).
  """
  from fedjax_mr.energy import simulation  # host-only, no jax

  rows = [row for row in history if 'client_ids' in row]
  ids = [row['client_ids'] for row in rows]
  work = simulation.training_workloads(
    ids, sizes, config.local_epochs, config.energy_ms_per_sample / 1000
  )
  out = {}
  for mix in config_lib.energy_mixes(config):
    clients = simulation.assign_profiles(mix, len(sizes), config.seed)
    report = simulation.simulate(work, clients, client_ids=ids)
    out[mix] = {**report.summary(), 'rounds_simulated': len(rows)}
  return out


def energy_line(mix: str, e: dict[str, Any]) -> str:
  """One progress line for a simulated mix."""
  return (
    f'energy, {mix}: coordinator saves {100 * e["energy_saving"]:.1f} % '
    f'({e["default_energy_j"]:.0f} J → {e["coordinated_energy_j"]:.0f} J), '
    f'time {100 * e["time_change"]:+.1f} %, {e["missed"]} missed deadlines '
    f'over {e["rounds_simulated"]} rounds'
  )


def _quiet(line: str) -> None:
  del line


def _to_json(v: Any) -> Any:
  v = np.asarray(v)
  return v.item() if v.ndim == 0 else v.tolist()


def _alive(tree: Any) -> bool:
  return not any(
    getattr(x, 'is_deleted', lambda: False)() for x in jax.tree.leaves(tree)
  )


class _Timer:
  """Elapsed time, rounds/s (after the compiling first round) and ETA."""

  def __init__(self, start: int, total: int):
    self.start, self.total = start, total
    self.elapsed = 0.0
    self.first = None  # time of this process's first (compiling) round
    self.steady: list[float] = []

  def tick(self, r: int, seconds: float) -> None:
    self.elapsed += seconds
    if self.first is None:
      self.first = seconds
    else:
      self.steady.append(seconds)

  def rate(self) -> float:
    times = self.steady or [self.first or 0.0]
    return 1.0 / max(float(np.mean(times)), 1e-9)

  def progress_line(self, row: dict[str, Any]) -> str:
    r = row['round']
    eta = (self.total - r) / self.rate()
    acc = (
      f' | test acc {row["test_accuracy"]:.4f}'
      if 'test_accuracy' in row
      else ''
    )
    if 'local_accuracy_mean' in row:
      acc += f' | K models {row["local_accuracy_mean"]:.4f}'
    return (
      f'round {r}/{self.total} | train loss {row["train_loss"]:.4f}{acc} | '
      f'elapsed {self.elapsed:.1f}s | {self.rate():.2f} rounds/s | '
      f'ETA {eta:.0f}s'
    )

  def summary(self, history: list[dict[str, Any]], workdir: str) -> str:
    evals = [r for r in history if 'test_accuracy' in r]
    lines = [
      f'done: {self.total} rounds; this process ran '
      f'{self.total - self.start} in {self.elapsed:.1f}s'
    ]
    if self.first is not None:
      lines[0] += (
        f' (first round incl. compile {self.first:.1f}s, then '
        f'{1 / self.rate():.2f}s/round)'
      )
    if evals:
      best = max(evals, key=lambda r: r['test_accuracy'])
      last = evals[-1]
      lines.append(
        f'final test accuracy {last["test_accuracy"]:.4f} (loss '
        f'{last["test_loss"]:.4f}) at round {last["round"]}; best '
        f'{best["test_accuracy"]:.4f} at round {best["round"]}'
      )
    lines.append(
      f'workdir {workdir}: {METRICS_FILE}, {CONFIG_FILE}, {PARTITION_FILE}, '
      f'{CURVE_FILE}, checkpoints/'
    )
    return '\n'.join(lines)


class _TerminationAsInterrupt:
  """Turns SIGTERM into KeyboardInterrupt so a killed run checkpoints."""

  def __enter__(self):
    self._previous = None
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not in the main thread
      pass
    return self

  def _handle(self, signum, frame):
    raise KeyboardInterrupt

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
    return False
