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
import warnings
from typing import Any
from typing import Callable
from typing import Mapping
from typing import NamedTuple
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.core import types
from fedjax_mr.core import workdir as workdir_lib
from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.data import datasets
from fedjax_mr.data import partition as partition_lib
from fedjax_mr.harness import checkpoint
from fedjax_mr.harness import compare
from fedjax_mr.harness import config as config_lib
from fedjax_mr.harness import distributed
from fedjax_mr.harness import metrics_io
from fedjax_mr.harness import plots
from fedjax_mr.harness import provenance
from fedjax_mr.harness import registry
from fedjax_mr.harness import tensorboard
from fedjax_mr.models import layers
from fedjax_mr.models import model as model_lib
from fedjax_mr.training import client
from fedjax_mr.training import engine

METRICS_FILE = 'metrics.jsonl'
# Per round: each sampled client's id, examples, local steps and training
# loss, and the K local models' test accuracies when evaluated.
CLIENTS_FILE = 'clients.jsonl'
ENERGY_FILE = 'energy.json'
CONFIG_FILE = 'config.json'
# config.json's list of provenance records (see `provenance.collect`).
PROVENANCE_KEY = 'provenance'
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


def build_algorithm(
  config: config_lib.ExperimentConfig,
  model: model_lib.Model,
  variables: types.Variables,
) -> types.Algorithm:
  """The algorithm named by `config.algorithm`, from the registry.

  Args:
    config: the experiment (validated).
    model: the model the clients train.
    variables: the initial model variables as `model.init` returns them
      (their key order is the model's layer order, which FedMR-p's segments
      follow).

  Raises:
    ConfigError: a hyper-parameter that does not fit the model, named by
      its flag.
  """
  local = client.LocalTraining(
    model,
    config_lib.client_optimizer(config),
    config.local_epochs,
    config.batch_size,
  )
  entry = registry.get(config.algorithm)
  setting = registry.Setting(
    local=local,
    clients_per_round=config.clients_per_round,
    num_clients=config.num_clients,
    weighted=not config_lib.uniform_weights(config),
    variables=variables,
    server_optimizer=(
      config_lib.server_optimizer(config) if entry.server_optimizer else None
    ),
  )
  try:
    return entry.factory(setting, config_lib.hparams(config))
  except errors.ArgumentError as e:
    raise config_lib.as_config_error(config.algorithm, e) from None


def make_partition(
  config: config_lib.ExperimentConfig,
  labels: np.ndarray,
  clients: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
  """Client index lists; `clients`: the dataset's own (partition=natural).

  Examples labelled −1 (not among `--classes`) are in no client.
  """
  if config.classes and config.partition in (
    'iid',
    'dirichlet',
    'dirichlet_equal',
    'shards',
  ):
    # Partition the examples of the kept classes only.
    keep = np.flatnonzero(labels >= 0)
    return [keep[p] for p in _partition(config, labels[keep], clients)]
  parts = _partition(config, labels, clients)
  if not config.classes:
    return parts
  kept = [p[labels[p] >= 0] for p in parts]
  if config.partition == 'file':
    for k, (p, q) in enumerate(zip(parts, kept)):
      if len(q) < len(p):
        bad = int(p[labels[p] < 0][0])
        raise errors.ConfigError(
          f'--partition_file={config.partition_file}: client {k} holds '
          f'example {bad}, of a class outside --classes={config.classes}'
        )
  empty = [k for k, q in enumerate(kept) if not len(q)]
  if empty:
    raise errors.ConfigError(
      f'--classes={config.classes}: client {empty[0]} has no examples of '
      'these classes'
    )
  return kept


def _partition(
  config: config_lib.ExperimentConfig,
  labels: np.ndarray,
  clients: Sequence[np.ndarray] | None,
) -> list[np.ndarray]:
  if config.partition == 'natural':
    if clients is None:
      raise errors.ConfigError(
        f'--partition=natural: --dataset={config.dataset} has no natural '
        'clients'
      )
    return list(clients)
  if config.partition == 'iid':
    return partition_lib.iid(len(labels), config.num_clients, config.seed)
  if config.partition == 'shards':
    return partition_lib.shards(
      labels, config.num_clients, config.shards_per_client, config.seed
    )
  if config.partition == 'file':
    parts, _ = partition_lib.load_file(
      config.partition_file,
      config.num_clients,
      num_examples=len(labels),
      sha256=config.partition_sha256,
    )
    return parts
  if config.partition == 'dirichlet_equal':
    return partition_lib.dirichlet_equal(
      labels, config.num_clients, config.alpha, config.seed
    )
  return partition_lib.dirichlet(
    labels,
    config.num_clients,
    config.alpha,
    config.seed,
    min_size=config.min_client_size,
  )


# Measured with jaxlib 0.10.2 (BUILD.md, "Reproducibility"): with the
# convolution gradient, several XLA host devices running at once on several
# cores give results that differ from run to run in the last digits (one
# device, one core, or the default im2col gradient do not).
CPU_DEVICES_NOTE = (
  'note: with the convolution gradient (layers.conv_implementation'
  "('conv')) XLA:CPU does not give bit-identical results from run to run "
  'with several host devices on several cores (differences start in the '
  'last digits and grow with the rounds); the default im2col gradient, or '
  '--host_devices=1 --num_devices=1, is bit-reproducible'
)


# XLA's GPU backend may sum with atomics (scatter-adds, some reductions)
# and pick convolution algorithms that do, unless told not to.
GPU_NOTE = (
  'note: XLA on GPU is bit-reproducible only with '
  'XLA_FLAGS=--xla_gpu_deterministic_ops=true (slower); without it results '
  'may differ from run to run in the last digits'
)


def reproducibility_note(platform: str, num_devices: int) -> str | None:
  """The one-line note for a run traced now whose backend cannot promise
  bit-identical results from run to run, else None."""
  if platform == 'cpu' and num_devices > 1:
    if layers.conv_gradient() == 'conv':
      return CPU_DEVICES_NOTE
  if platform == 'gpu':
    flags = os.environ.get('XLA_FLAGS', '').split()
    if '--xla_gpu_deterministic_ops=true' not in flags:
      return GPU_NOTE
  return None


def _describe(mapping: Mapping[str, Any]) -> str:
  """A client mapping (see `_run`) in words."""
  return (
    f'{mapping.get("devices")} {mapping.get("platform")} device(s) in '
    f'{mapping.get("processes")} process(es), --client_chunk='
    f'{mapping.get("client_chunk")}'
  )


def _log_default(line: str) -> None:
  print(line, flush=True)


class Experiment(NamedTuple):
  """Everything a run needs, built by `setup` (or by hand, from a notebook).

  Attributes:
    config: the experiment (its loop settings: rounds, evaluation,
      checkpoints, devices).
    model: the model.
    algorithm: the federated algorithm.
    data: the clients' training data (`ClientData`, on the devices).
    test: the test set (`EvalData`, on the devices).
    state: the initial `RoundState` (on the devices).
    key: the run key; round r uses `fold_in(key, r)`.
    mesh: the devices the client axis is sharded over.
    client_sizes: every client's number of training examples.
    partition: the partition summary written to partition.json, or None.
  """

  config: config_lib.ExperimentConfig
  model: model_lib.Model
  algorithm: types.Algorithm
  data: client_data_lib.ClientData
  test: client_data_lib.EvalData
  state: engine.RoundState
  key: jax.Array
  mesh: jax.sharding.Mesh
  client_sizes: list[int]
  partition: dict[str, Any] | None = None


def setup(config: config_lib.ExperimentConfig) -> Experiment:
  """Config → data, partition, model, algorithm and initial state.

  Writes nothing. Every piece can be replaced before `run` (e.g.
  `setup(config)._replace(algorithm=..., state=engine.init_state(...))`).

  Raises:
    UserError: bad config or data (the message names the flag).
  """
  config_lib.validate(config)
  if not distributed.backend_started():
    # From Python as from the command line: the host devices (one per
    # core, at most K) and processes of the config.
    distributed.initialize_for(config)
  else:
    _note_devices(config)
  mesh = distributed.make_mesh(config.num_devices)
  num_devices = mesh.devices.size
  if num_devices > config.clients_per_round:
    raise errors.ConfigError(
      f'--clients_per_round={config.clients_per_round} is fewer than the '
      f'{num_devices} devices the clients are sharded over; set '
      '--num_devices (or --host_devices on CPU) to at most '
      f'{config.clients_per_round}'
    )
  dataset = load_dataset(config)
  model = model_lib.get(
    config.model,
    dataset.num_classes,
    dataset.input_shape,
    dataset=config.dataset,
  )
  model = registry.model_for(
    config.algorithm, model, config_lib.hparams(config)
  )
  parts = make_partition(config, dataset.y_train, dataset.clients)
  data = client_data_lib.from_partition(
    dataset.x_train, dataset.y_train, parts, dataset.scale, dataset.shift
  )
  test = client_data_lib.eval_data(
    dataset.x_test,
    dataset.y_test,
    config.eval_batch_size,
    dataset.scale,
    dataset.shift,
    num_shards=mesh.devices.size,
  )
  key = jax.random.key(config.seed)
  variables = model.init(jax.random.fold_in(key, _INIT))
  if config.init_from:
    variables = pretrained_variables(config, model, variables)
  algorithm = build_algorithm(config, model, variables)
  state = engine.init_state(algorithm, variables, len(parts))
  data, test, state = distributed.replicate((data, test, state), mesh)
  return Experiment(
    config=config,
    model=model,
    algorithm=algorithm,
    data=data,
    test=test,
    state=state,
    key=jax.random.fold_in(key, _ROUNDS),
    mesh=mesh,
    client_sizes=[len(p) for p in parts],
    partition=partition_lib.summary(
      parts, dataset.y_train, dataset.num_classes
    ),
  )


def load_dataset(config: config_lib.ExperimentConfig) -> datasets.Dataset:
  """The dataset of a run, as `setup` loads it (its folder, CIFAR-100
  labels, LEAF filter, and the natural clients kept)."""
  dataset = datasets.load(
    config.dataset,
    config.data_dir or None,
    cifar100_labels=config.cifar100_labels,
    leaf_min_samples=config.leaf_min_samples,
  )
  if config.partition == 'natural':
    dataset = datasets.natural_clients(dataset, config.num_clients, config.seed)
  if config.classes:
    classes = datasets.parse_classes(config.classes, dataset.num_classes)
    # Training indices stay valid (other classes get label −1), so a
    # natural partition is kept and filtered by `make_partition`.
    dataset = datasets.select_classes(dataset, classes)._replace(
      clients=dataset.clients
    )
  return dataset


def pretrained_variables(
  config: config_lib.ExperimentConfig,
  model: model_lib.Model,
  fresh: types.Variables,
) -> types.Variables:
  """The variables of `--init_from` (a pool model folder) in place of the
  fresh init `fresh`; a model trained on other classes than `--classes`
  keeps the fresh classifier (the last module of `params`, and its
  statistics if any).

  Raises:
    ConfigError: the folder cannot be read, or holds another model, input
      shape, dataset or number of classes (one line naming --init_from).
  """
  from fedjax_mr.stitch import pool as pool_lib  # orbax, on demand

  where = f'--init_from={config.init_from}'
  folder, model_id = os.path.split(os.path.normpath(config.init_from))
  try:
    pretrained = pool_lib.load_model(folder, model_id)
  except errors.UserError as e:
    raise errors.ConfigError(f'{where}: {e}') from None
  except Exception as e:  # an unreadable or mismatched orbax checkpoint
    raise errors.ConfigError(
      f'{where}: cannot restore its variables ({type(e).__name__}: '
      f'{str(e).splitlines()[0] if str(e) else ""})'
    ) from None
  meta = pretrained.meta
  if meta.get('model') != config.model:
    raise errors.ConfigError(
      f'{where}: a {meta.get("model")} model, not --model={config.model}'
    )
  if meta.get('dataset', config.dataset) != config.dataset:
    raise errors.ConfigError(
      f'{where}: trained on {meta.get("dataset")}, not --dataset='
      f'{config.dataset}'
    )
  if tuple(pretrained.model.input_shape) != tuple(model.input_shape) or (
    pretrained.model.num_classes != model.num_classes
  ):
    raise errors.ConfigError(
      f'{where}: takes {tuple(pretrained.model.input_shape)} and answers '
      f'{pretrained.model.num_classes} classes; this run needs '
      f'{tuple(model.input_shape)} and {model.num_classes}'
    )
  loaded = pretrained.variables
  same = jax.tree.structure(loaded) == jax.tree.structure(fresh) and all(
    a.shape == b.shape
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(fresh))
  )
  if not same:
    raise errors.ConfigError(
      f'{where}: its variables do not have the shapes of --model='
      f'{config.model} under --algorithm={config.algorithm}'
    )
  loaded = jax.tree.map(
    lambda a, b: jnp.asarray(a, b.dtype), dict(loaded), dict(fresh)
  )
  pool_classes = meta.get('classes')
  # (`load_dataset` checked the ids against the dataset's classes.)
  run_classes = (
    list(datasets.parse_classes(config.classes, 2**31))
    if config.classes
    else None
  )
  if pool_classes != run_classes:
    head = list(fresh['params'])[-1]
    for collection in loaded:
      if head in loaded[collection]:
        loaded[collection] = {
          **loaded[collection],
          head: fresh[collection][head],
        }
  return loaded


def _note_devices(config: config_lib.ExperimentConfig) -> None:
  """Warns when JAX set up fewer CPU devices than the command line would
  give this config (it started before `setup` could choose)."""
  if jax.process_count() > 1 or jax.devices()[0].platform != 'cpu':
    return
  want = (
    config.host_devices
    or config.num_devices
    or distributed.auto_host_devices(config.clients_per_round)
  )
  have = len(jax.devices())
  if have < want and not config.num_devices:
    warnings.warn(
      f'JAX started with {have} CPU device(s) before this run was set up; '
      f'the command line would use {want}. Call '
      'fedjax_mr.harness.distributed.initialize_for(config) before any '
      'JAX computation to get them.',
      stacklevel=3,
    )


def train_and_evaluate(
  config: config_lib.ExperimentConfig,
  workdir: str | None = None,
  *,
  log: Callable[[str], None] = _log_default,
  on_round: Callable[[int, dict[str, Any]], None] | None = None,
) -> Result:
  """Runs (or resumes) an experiment: `run(setup(config), workdir)`.

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
  workdir = workdir or config.workdir or config.default_workdir()
  config_path = os.path.join(workdir, CONFIG_FILE)
  # Refuse another run's workdir before loading anything (the primary
  # process only, see `run`).
  if distributed.is_primary():
    workdir_lib.check_free(workdir)
    if os.path.exists(config_path):
      config_lib.check_resumable(config, config_path)
  return run(setup(config), workdir, log=log, on_round=on_round)


def run(
  experiment: Experiment,
  workdir: str,
  *,
  log: Callable[[str], None] = _log_default,
  on_round: Callable[[int, dict[str, Any]], None] | None = None,
) -> Result:
  """The host loop: rounds, metrics, evaluation, checkpoints, plots.

  A workdir holding a checkpoint resumes from it (its config.json must
  define the same run). The primary process holds the workdir's lock
  (`fedjax_mr.core.workdir`) while it runs: a second run on the same
  workdir is refused.

  Args:
    experiment: from `setup` (or built by hand).
    workdir: output folder.
    log: where progress lines go.
    on_round: called with (round, metrics row) after each round is logged
      and checkpointed.

  Returns:
    A `Result`.
  """
  primary = distributed.is_primary()
  if not primary:
    return _run(experiment, workdir, _quiet, on_round)
  # The primary process writes the workdir; one such process at a time.
  with workdir_lib.acquire(workdir):
    return _run(experiment, workdir, log, on_round)


def _run(experiment, workdir, log, on_round) -> Result:
  config = experiment.config
  algorithm, data, test = experiment.algorithm, experiment.data, experiment.test
  state, mesh = experiment.state, experiment.mesh
  round_key = experiment.key
  num_devices = mesh.devices.size
  primary = distributed.is_primary()
  config_path = os.path.join(workdir, CONFIG_FILE)
  # Only the primary process reads and writes config.json: the others
  # could find the file the primary has just written for this very run.
  if primary and os.path.exists(config_path):
    config_lib.check_resumable(config, config_path)
  # What the workdir's checkpoints hold decides whether the run can start:
  # nothing is written before (a fresh workdir has no checkpoints folder,
  # and the checkpointer is only made once the run starts).
  ckpt, start = None, None
  if os.path.isdir(os.path.join(workdir, checkpoint.FOLDER)):
    ckpt = checkpoint.Checkpointer(workdir, keep=config.keep_checkpoints)
    start, state = ckpt.restore_newest(state, log, move_aside=primary)
  if start is not None:
    # The config a checkpoint was made with is kept inside it: config.json
    # alone could be deleted or replaced.
    saved = ckpt.metadata(start).get('config')
    diffs = config_lib.config_diffs(config, saved) if saved else []
    if diffs:
      raise errors.ConfigError(
        f'the checkpoint after round {start} in {workdir} was made with '
        f'another config ({"; ".join(diffs)}); pass another --workdir or '
        'the same flags'
      )
  if start is not None and start > config.rounds:
    raise errors.ConfigError(
      f'--rounds={config.rounds}: the run in {workdir} is already past it '
      f'({start} rounds done); pass --rounds={start} or more to resume it'
    )
  os.makedirs(workdir, exist_ok=True)
  if primary:
    # config.json: the config, and one provenance record per process that
    # ran (or resumed) the run.
    records = _provenance_records(config_path) if start else []
    records.append(provenance.collect())
    metrics_io.write_json(
      config_path, {**config.to_dict(), PROVENANCE_KEY: records}, indent=2
    )
    if experiment.partition is not None:
      partition_lib.save_summary(
        os.path.join(workdir, PARTITION_FILE), experiment.partition
      )
  if ckpt is None:
    ckpt = checkpoint.Checkpointer(workdir, keep=config.keep_checkpoints)
  platform = mesh.devices.flat[0].platform
  per_device = -(-config.clients_per_round // num_devices)
  chunk = config.client_chunk or (1 if platform == 'cpu' else per_device)
  # How the clients are mapped onto devices decides the order of the
  # floating-point sums over clients, so it is kept with each checkpoint.
  mapping = {
    'platform': platform,
    'processes': jax.process_count(),
    'devices': int(num_devices),
    'client_chunk': int(chunk),
  }
  meta = {'config': config.to_dict(), 'mapping': mapping}
  metrics_path = os.path.join(workdir, METRICS_FILE)
  clients_path = os.path.join(workdir, CLIENTS_FILE)
  if start is not None:
    log(f'resuming {workdir} after round {start}')
    before = ckpt.metadata(start).get('mapping')
    if before and before != mapping:
      log(
        f'note: round {start} was run with {_describe(before)}, this '
        f'process runs {_describe(mapping)}: the sums over clients are '
        'grouped differently, so the results are not bit-identical to an '
        'uninterrupted run (differences start in the last digits)'
      )
  else:
    start = 0
  history = []
  if primary:
    if start > 0 and not os.path.exists(metrics_path):
      log(
        f'{metrics_path} is missing: rounds 1-{start} of this run have no '
        'metrics rows (the checkpoint resumes the training itself)'
      )
    history, dropped = metrics_io.truncate(metrics_path, start)
    if dropped:
      log(f'{metrics_path}: {dropped}')
    _, dropped = metrics_io.truncate(clients_path, start)
    if dropped:
      log(f'{clients_path}: {dropped}')
  num_params = sum(x.size for x in jax.tree.leaves(state.server.params))
  log(
    f'{config.algorithm} on {config.dataset} ({int(data.x.shape[0])} train '
    f'/ {int(jax.numpy.sum(test.mask))} test), {config.model} '
    f'({num_params:,} parameters), {data.num_clients} clients '
    f'({config.partition}), {config.clients_per_round} per round, '
    f'{config.rounds} rounds'
  )
  unassigned = (experiment.partition or {}).get('unassigned', 0)
  if unassigned:
    log(
      f'note: {unassigned} of {int(data.x.shape[0])} training examples are '
      f'in no client (--partition={config.partition})'
    )
  log(
    f'{num_devices} {platform} device(s) in {jax.process_count()} '
    f'process(es); {per_device} clients per device, {chunk} at a time'
  )
  note = reproducibility_note(platform, num_devices)
  if note:
    log(note)

  round_fn = jax.jit(
    engine.make_round_fn(
      algorithm,
      clients_per_round=config.clients_per_round,
      client_chunk=chunk,
      mesh=mesh if num_devices > 1 else None,
    ),
    donate_argnums=0,
    out_shardings=distributed.replicated(mesh),
  )
  eval_mesh = mesh if num_devices > 1 else None
  evaluate_model = engine.make_evaluate(experiment.model, eval_mesh)
  evaluate = jax.jit(
    lambda server, t: evaluate_model(
      types.evaluated_model(algorithm, server), t
    ),
    out_shardings=distributed.replicated(mesh),
  )
  evaluate_many = engine.make_evaluate_many(experiment.model, eval_mesh)
  local_evaluate = None
  if config_lib.multi_model(config):
    # The K different models the next round dispatches (recombined or
    # mutated), each on the whole test set.
    def next_models(s, d):
      return engine.next_dispatch(
        algorithm, s, d, round_key, config.clients_per_round
      ).per_client

    local_evaluate = jax.jit(
      lambda s, d, t: evaluate_many(next_models(s, d), t),
      out_shardings=distributed.replicated(mesh),
    )

  def should(every: int, r: int) -> bool:
    return r == config.rounds or (every > 0 and r % every == 0)

  timer = _Timer(start, config.rounds)
  saved_round = written = start

  clients_written = start
  events = None  # the TensorBoard writer, opened with the first row

  def write_events(row: dict[str, Any]) -> None:
    nonlocal events
    if not (primary and config.tensorboard):
      return
    if events is None:
      # A resumed run's file makes TensorBoard drop the rounds it redoes.
      events = tensorboard.EventWriter(
        os.path.join(workdir, tensorboard.FOLDER),
        purge_step=start + 1 if start else None,
      )
    events.scalars(row['round'], row)

  def write_clients_row(clients_row: dict[str, Any]) -> None:
    # Once per round, also when an interrupt lands between this row and
    # the metrics row and the round's record is finished on the way out.
    nonlocal clients_written
    if clients_row['round'] > clients_written:
      metrics_io.append(clients_path, clients_row)
      clients_written = clients_row['round']

  def record(r: int, metrics: Any, t0: float) -> dict[str, Any]:
    """Evaluates round r's state and writes its metrics row."""
    nonlocal written
    metrics = jax.device_get(metrics)
    # The round's own time (dispatch, local training, aggregation, back on
    # the host); evaluation is timed apart in 'eval_time_s'.
    round_s = time.perf_counter() - t0
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
        if k not in row and k not in engine.PER_CLIENT_METRICS
      }
    )
    # Who trained this round: the energy simulation replays it.
    row['client_ids'] = [int(i) for i in metrics['client_ids']]
    clients_row = {
      'round': r,
      'clients': [
        {'id': int(i), 'examples': int(n), 'steps': int(t), 'loss': float(x)}
        for i, n, t, x in zip(
          metrics['client_ids'],
          metrics['client_examples'],
          metrics['client_steps'],
          metrics['client_loss'],
        )
      ],
    }
    if not math.isfinite(row['train_loss']):
      if primary:
        write_clients_row(clients_row)
        metrics_io.append(metrics_path, row)
        write_events(row)
        # The curve up to here, the divergence marked.
        plot_curve(config, [*history, row], workdir)
      raise errors.NonFiniteError(
        f'non-finite train loss ({row["train_loss"]}) at round {r}; '
        f'stopped. Metrics up to it are in {metrics_path}; the last '
        f'checkpoint (round {saved_round}) is kept. Try a smaller --lr.'
      )
    t_eval = time.perf_counter()
    evaluated = False
    if should(config.eval_every, r):
      ev = jax.device_get(evaluate(state.server, test))
      row['test_accuracy'] = float(ev['accuracy'])
      row['test_loss'] = float(ev['loss'])
      evaluated = True
    if local_evaluate is not None and should(config.local_eval_every, r):
      local = jax.device_get(local_evaluate(state, data, test))['accuracy']
      row['local_accuracy_mean'] = float(np.mean(local))
      row['local_accuracy_std'] = float(np.std(local))
      clients_row['local_accuracy'] = [float(a) for a in local]
      evaluated = True
    row['round_time_s'] = round_s
    if evaluated:
      row['eval_time_s'] = time.perf_counter() - t_eval
    timer.tick(r, time.perf_counter() - t0)
    row['elapsed_s'] = timer.elapsed
    if primary:
      write_clients_row(clients_row)
      metrics_io.append(metrics_path, row)
    written = r
    # After `written`: an interrupt here must not write the rows again.
    write_events(row)
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
          with _SignalsDeferred():
            ckpt.save(r, state, meta)
            saved_round = r
        if on_round is not None:
          on_round(r, row)
    except (OSError, errors.StorageError) as e:
      # A full disk or a folder that became read-only: what is written
      # stays (a partial metrics row is dropped on resume).
      what = (
        str(e)
        if isinstance(e, errors.StorageError)
        else f'cannot write {e.filename or "a file"}: {e.strerror or e}'
      )
      raise errors.StorageError(
        f'{what}; stopped. Nothing written before is lost: free space (or '
        f'make the folder writable) and re-run the same command, it resumes '
        f'after round {saved_round}'
      ) from None
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
        # A second interrupt waits for this save (and then ends the run).
        with _SignalsDeferred():
          ckpt.save(written, state, meta)
          log(f'interrupted: saved a checkpoint after round {written}')
      ckpt.close()
      raise
    finally:
      if events is not None:
        events.close()
  ckpt.close()
  if history and primary:
    plot_curve(config, history, workdir)
  log(timer.summary(history, workdir))
  if primary and config_lib.energy_mixes(config):
    energy = simulate_energy(config, history, experiment.client_sizes)
    metrics_io.write_json(os.path.join(workdir, ENERGY_FILE), energy, indent=1)
    for mix, e in energy.items():
      log(energy_line(mix, e))
  return Result(state=state, history=history, workdir=workdir)


def plot_curve(
  config: config_lib.ExperimentConfig,
  history: Sequence[Mapping[str, Any]],
  workdir: str,
) -> None:
  """Writes a run's learning curves (`plots.curves_figure`) as
  `<workdir>/learning_curve.png`."""
  plots.plot_curves(
    {registry.display_name(config.algorithm): {config.seed: history}},
    os.path.join(workdir, CURVE_FILE),
    title=compare.setting_title(config),
  )


class FinishedRun(NamedTuple):
  """A run read back from its workdir (`load_run`).

  Attributes:
    config: the run's config (from config.json).
    state: the `RoundState` of the checkpoint read (host arrays, on the
      devices of this process's mesh as `setup` places them).
    model: the model (`model.apply_eval(state.server.params, x)`), as the run
      built it.
    history: the metrics rows up to that round.
    round: the rounds completed at that checkpoint.
  """

  config: config_lib.ExperimentConfig
  state: engine.RoundState
  model: Any
  history: list[dict[str, Any]]
  round: int


def load_run(workdir: str, round_index: int | None = None) -> FinishedRun:
  """Reads a run back: config, state, model and history in one call.

  The model and the state's layout are rebuilt from config.json the way
  the run built them (`setup`, so the run's dataset must be readable) and
  the newest checkpoint that restores (or the one of `round_index`) is
  read into them; nothing in the workdir is written or moved.

  Raises:
    UserError: no config.json or no checkpoint (of that round), or one
      that this version cannot read; the message names the file.
  """
  config_path = os.path.join(workdir, CONFIG_FILE)
  try:
    with open(config_path) as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise errors.ConfigError(f'cannot read {config_path}: {e}') from None
  known = set(config_lib.ExperimentConfig().to_dict())
  try:
    config = config_lib.ExperimentConfig(
      **{k: v for k, v in saved.items() if k in known}
    )
  except TypeError as e:
    raise errors.ConfigError(f'{config_path}: {e}') from None
  experiment = setup(config)
  ckpt = checkpoint.Checkpointer(workdir, keep=config.keep_checkpoints)
  try:
    if round_index is None:
      done, state = ckpt.restore_newest(
        experiment.state, log=_quiet, move_aside=False
      )
    elif round_index in ckpt.all_rounds():
      done, state = round_index, ckpt.restore(round_index, experiment.state)
    else:
      done = None
  finally:
    ckpt.close()
  if done is None:
    which = '' if round_index is None else f' of round {round_index}'
    raise errors.ConfigError(
      f'{os.path.join(workdir, checkpoint.FOLDER)}: no checkpoint{which}'
    )
  rows = metrics_io.read(os.path.join(workdir, METRICS_FILE))
  history = [r for r in rows if r['round'] <= done]
  return FinishedRun(config, state, experiment.model, history, done)


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


def _provenance_records(config_path: str) -> list[dict[str, Any]]:
  """The provenance records of an earlier config.json (none if unreadable
  or missing: the checkpoint, not this file, defines the run)."""
  try:
    with open(config_path) as f:
      records = json.load(f).get(PROVENANCE_KEY, [])
  except (OSError, ValueError, AttributeError):
    return []
  if not isinstance(records, list):
    return []
  return [r for r in records if isinstance(r, dict)]


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
      f'workdir {workdir}: {METRICS_FILE}, {CLIENTS_FILE}, {CONFIG_FILE}, '
      f'{PARTITION_FILE}, {CURVE_FILE}, checkpoints/'
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


class _SignalsDeferred:
  """Holds SIGINT and SIGTERM back while a checkpoint is written.

  An interrupt inside orbax's save abandons a half-written temporary
  folder, and the interrupt handler then saves the same round again (with
  an older orbax that second save failed, `OSError: Directory not empty`,
  2 runs in 11; orbax 0.12.8 removes the folder first). Inside this block
  the two signals are only recorded (Python runs signal handlers in the
  main thread between bytecodes, so a recording handler never interrupts
  the save); on leaving it, a recorded signal becomes the
  KeyboardInterrupt it would have been, after the checkpoint is complete.
  """

  _SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __enter__(self):
    self._got = None
    self._previous = {}
    try:
      for s in self._SIGNALS:
        self._previous[s] = signal.signal(s, self._record)
    except ValueError:  # not in the main thread: nothing to defer
      self._previous = {}
    return self

  def _record(self, signum, frame):
    del frame
    self._got = signum

  def __exit__(self, exc_type, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    if self._got is not None and exc_type is None:
      raise KeyboardInterrupt
    return False
