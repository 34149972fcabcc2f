"""One FedStitch experiment: data, pool, clients, the run, its records.

`stitch_and_evaluate(config)` validates a `StitchConfig`, loads the dataset
and the pool, partitions the clients' examples, runs FedStitch's rounds
(`fedjax_mr.stitch.federated.run_round`) in the host loop of every run
(`experiment.drive`: the workdir's lock, config.json, metrics.jsonl and
clients.jsonl with their digests, a checkpoint after every round, resume
from the newest intact one, roll back past a damaged row) with the
clients' energy coordinators in the loop, evaluates every stitched
network, every pool model and the "Local" baseline (`evaluation`), and
writes under `config.run.workdir` besides the records: log.jsonl,
energy.jsonl, results.json, partition.json, client_indices.json and
networks.npz (see experiments/stitch.py for what each holds). A
workdir of an earlier version (its state in state.npz) resumes from it.
Every message names the config field (in backticks) that the program
turns into its flag.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any
from typing import Callable
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from fedjax_mr import energy as energy_lib
from fedjax_mr.core import errors
from fedjax_mr.core import files
from fedjax_mr.core import jsonfile
from fedjax_mr.core import workdir as workdir_lib
from fedjax_mr.data import datasets
from fedjax_mr.data import partition
from fedjax_mr.energy import fleet
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import energy_report
from fedjax_mr.pipeline import evaluation
from fedjax_mr.pipeline import experiment
from fedjax_mr.pipeline import progress
from fedjax_mr.pipeline import records
from fedjax_mr.pipeline import resume
from fedjax_mr.pipeline import stitch_config as config_lib
from fedjax_mr.runtime import checkpoint
from fedjax_mr.stitch import federated
from fedjax_mr.stitch import label_maps
from fedjax_mr.stitch import network
from fedjax_mr.stitch import pool as pool_lib
from fedjax_mr.stitch import state as state_lib
from fedjax_mr.stitch import torchvision_import

# Where a FedStitch run of an earlier version kept its state (imported).
STATE_FILE = 'state.npz'
CLIENTS_FILE = 'client_indices.json'
# What a run reports besides its records (experiments/stitch.py).
REPORT_FILES = ('log.jsonl', 'energy.jsonl', 'results.json', 'networks.npz')

Log = Callable[[str], None]


def _log_default(line: str) -> None:
  print(line, flush=True)


# --- Checks that read files, before anything is written ---------------------


MAX_LABEL_MAP_BYTES = torchvision_import.MAX_LABEL_MAP_BYTES


def read_label_map(
  config: config_lib.StitchConfig, classes: list[int] | None = None
) -> list | None:
  """The map of `label_map` (a bundled map's name or a JSON file), the
  dataset's bundled map under an `imagenet_pool` without one, else None. A
  bundled map covers all the dataset's classes: with `classes`, the
  entries of those classes."""
  named, path = None, config.evaluation.label_map
  if path:
    named = label_maps.bundled(path)
  elif config.pool.imagenet_pool:
    named = label_maps.bundled(config.data.dataset)
  if named is not None:
    return named if classes is None else [named[c] for c in classes]
  if not path:
    return None
  where = f'`label_map={errors.clip(path)}`'
  try:
    return jsonfile.load(path, MAX_LABEL_MAP_BYTES, top=list)
  except jsonfile.JsonFileError as e:
    raise errors.ConfigError(
      f'{where}: {e.reason} (a label map is a JSON list in a regular file '
      f'of at most {MAX_LABEL_MAP_BYTES >> 20} MiB; bundled maps: '
      f'{", ".join(sorted(label_maps.BUNDLED))})'
    ) from None


def check_workdir(workdir: str) -> None:
  """Refuses a workdir that cannot be written, is in use, holds a symbolic
  link (or a folder) where the run writes a file, or holds a pickled
  state of an older version (never unpickled)."""
  workdir_lib.check_free(workdir)
  workdir_lib.check_entries(
    workdir,
    files=(*records.OWN_FILES, *REPORT_FILES, CLIENTS_FILE, STATE_FILE),
    folders=(checkpoint.FOLDER, *resume.OWN_FOLDERS),
  )
  old_state = os.path.join(workdir, 'state.pkl')
  if os.path.exists(old_state):
    raise errors.ConfigError(
      f'`workdir`: {old_state} is a state saved as a pickle by an older '
      'version; fedjax_mr never unpickles, so it cannot resume it: pass '
      'another `workdir` (or remove that file to start over)'
    )


# --- Data, pool and clients --------------------------------------------------


class Setup(NamedTuple):
  """What a FedStitch run needs, loaded and checked (`setup`).

  Attributes:
    config: the experiment.
    ds: the dataset (its `classes` only, relabelled, if set).
    classes: the dataset's classes the clients hold, or None (all).
    models: the pool's pre-trained models.
    chains: each model cut into blocks.
    pool: the block pool.
    label_map: per dataset class, the pool classes that count as it.
    parts: per client, its training-example indices.
    public: the pool's public examples of the clients' classes.
    coordinators: the clients' energy coordinators
      (`energy_report.make_fleet`).
  """

  config: config_lib.StitchConfig
  ds: Any
  classes: list[int] | None
  models: list[pool_lib.PoolModel]
  chains: list
  pool: pool_lib.Pool
  label_map: list | None
  parts: list[np.ndarray]
  public: np.ndarray
  coordinators: fleet.Fleet


def load_dataset(data: config_lib.Data) -> tuple[Any, Any]:
  """`(dataset, classes)`: the dataset, with `classes` only if set."""
  try:
    return datasets.load_task(data.dataset, data.data_dir or None, data.classes)
  except errors.ArgumentError as e:
    raise checks.data_error(e) from None


def load_models(
  config: config_lib.StitchConfig, ds: Any, classes: list[int] | None
) -> list[pool_lib.PoolModel]:
  """The pool's models; each must take the dataset's examples and, unless
  evaluated by a kNN probe alone, answer the clients' classes."""
  p = config.pool
  if p.imagenet_pool:
    models = torchvision_import.load_pool(
      p.imagenet_pool,
      input_shape=ds.input_shape,
      scale=ds.scale,
      shift=ds.shift,
      resolution=p.imagenet_resolution,
      ids=list(p.pool_models) or None,
    )
  else:
    models = pool_lib.load(p.pool, list(p.pool_models) or None)
  for m in models:
    if tuple(m.model.input_shape) != ds.input_shape:
      raise errors.ConfigError(
        f'`pool`: model {m.id} takes {m.model.input_shape}, `dataset='
        f'{ds.name}` has examples of shape {ds.input_shape}'
      )
  mode = config.evaluation.mode
  if mode != 'knn':
    task = list(classes or range(ds.num_classes))
    for m in models:
      pool_classes = m.meta.get('classes')
      if pool_classes is not None and list(pool_classes) != task:
        raise errors.ConfigError(
          f'`eval={mode}`: pool model {m.id} was trained on classes '
          f"{pool_classes}, the clients' task (`classes`) is {task}: its "
          'head cannot answer it; use `eval=knn`'
        )
  return models


def check_label_map(
  config: config_lib.StitchConfig,
  ds: Any,
  models: list[pool_lib.PoolModel],
  classes: list[int] | None,
) -> list | None:
  """The label map (`read_label_map`), checked against the dataset and the
  pool's heads; refused where the heads need one and there is none."""
  label_map = read_label_map(config, classes)
  if label_map is not None and config.pool.imagenet_pool:
    label_map = torchvision_import.check_label_map(
      label_map, ds.num_classes, min(m.model.num_classes for m in models)
    )
  if label_map is not None:
    if len(label_map) != ds.num_classes:
      raise errors.ConfigError(
        f'`label_map`: {len(label_map)} entries, `dataset` has '
        f'{ds.num_classes} classes'
      )
  elif config.evaluation.mode != 'knn' and any(
    m.model.num_classes != ds.num_classes for m in models
  ):
    raise errors.ConfigError(
      '`label_map` is needed: pool models have other label spaces than '
      f'`dataset={ds.name}` (bundled maps: '
      f'{", ".join(sorted(label_maps.BUNDLED))})'
    )
  return label_map


def public_examples(
  pool: config_lib.Pool, ds: Any
) -> tuple[np.ndarray, np.ndarray]:
  """`(public, private)`: the indices of the training examples in the
  pool's public split of `ds` (none without one) and of the others, both
  of the clients' classes only."""
  split = None
  if not pool.imagenet_pool:
    split = pool_lib.public_indices(pool.pool)
  if split is not None and split.get('dataset') == ds.name:
    public = np.asarray(split['indices'], np.int64)
    bad = public[(public < 0) | (public >= len(ds.y_train))]
    if len(bad) or len(np.unique(public)) != len(public):
      what = f'index {bad[0]}' if len(bad) else 'an index twice'
      raise errors.DataError(
        f'`pool`: {errors.clip(pool.pool)}/public.json holds {what}; '
        f'`dataset={ds.name}` has {len(ds.y_train)} training examples'
      )
  else:
    public = np.zeros((0,), int)
  private = np.setdiff1d(np.arange(len(ds.y_train)), public)
  private = private[ds.y_train[private] >= 0]  # `classes`
  public = public[ds.y_train[public] >= 0]
  return public, private


def client_examples(
  config: config_lib.StitchConfig, ds: Any
) -> tuple[list[np.ndarray], np.ndarray]:
  """`(parts, public)`: per client its training-example indices (the
  examples not in the pool's public split, partitioned by `partition`),
  and the public examples, both of the clients' classes only."""
  public, private = public_examples(config.pool, ds)
  p, seed = config.partition, config.run.seed
  n, y = p.num_clients, ds.y_train[private]
  try:
    parts = partition.drawn(
      p.kind,
      y,
      n,
      seed,
      alpha=p.alpha,
      shards_per_client=p.shards_per_client,
    )
  except errors.ArgumentError as e:
    raise checks.partition_error(e, config.flat()) from None
  return [private[p] for p in parts], public


def check(
  config: config_lib.StitchConfig, *, deployed: bool = False
) -> fleet.Fleet:
  """Validates `config` and checks the files it names and the workdir
  (nothing is read beyond them, nothing is written); the clients'
  energy coordinators (`energy_report.make_fleet`).

  Raises:
    UserError: a bad field, file or workdir (the message names the field).
  """
  config_lib.validate(config)
  read_label_map(config)  # a bad file is refused before the data loads
  coordinators = energy_report.make_fleet(
    config.energy,
    config.partition.num_clients,
    config.run.seed,
    deployed=deployed,
  )
  check_workdir(config.run.workdir)
  return coordinators


def load(
  config: config_lib.StitchConfig,
  coordinators: fleet.Fleet,
  log: Log = _log_default,
) -> Setup:
  """Loads the dataset and the pool of a valid `config` and partitions
  the clients' examples (nothing is written); what a deployed client's
  node loads too (`fedjax_mr.deploy`)."""
  ds, classes = load_dataset(config.data)
  models = load_models(config, ds, classes)
  label_map = check_label_map(config, ds, models, classes)
  parts, public = client_examples(config, ds)
  chains = pool_lib.chains(models, config.pool.cuts)
  pool = pool_lib.make_pool(chains)
  p = config.partition
  log(
    f'pool: {len(pool.blocks)} blocks from {len(models)} models '
    f'({", ".join(f"{m.id}: {len(c)}" for m, c in zip(models, chains))}); '
    f'{p.num_clients} clients, {p.kind}'
    + (f' α={p.alpha}' if 'dirichlet' in p.kind else '')
  )
  return Setup(
    config,
    ds,
    classes,
    models,
    chains,
    pool,
    label_map,
    parts,
    public,
    coordinators,
  )


def setup(config: config_lib.StitchConfig, log: Log = _log_default) -> Setup:
  """`check`, then `load`.

  Raises:
    UserError: a bad field, file or workdir (the message names the field).
  """
  return load(config, check(config), log)


def make_batch_fn(s: Setup) -> federated.BatchFn:
  """`(client, round) → [B, ...]`: `batch_size` of the client's examples
  (with replacement if it has fewer), drawn by `(seed, client, round)`,
  model-ready."""
  ds, parts, seed = s.ds, s.parts, s.config.run.seed
  b = s.config.selection.batch_size

  def batch_fn(c, r):
    rng = np.random.default_rng([seed, c, r, 7])
    idx = parts[c]
    pick = rng.choice(len(idx), b, replace=len(idx) < b)
    xb = ds.x_train[np.sort(idx[pick])]
    return jnp.asarray(xb).astype(jnp.float32) * ds.scale + ds.shift

  return batch_fn


# --- The run and its records -------------------------------------------------


class Opened(NamedTuple):
  """A FedStitch run's workdir opened for its rounds (`open_run`).

  Attributes:
    ckpt: its checkpointer.
    start: the rounds done.
    state: the state after them.
    imported: whether that state came from a state.npz of an earlier
      version (its rows and a checkpoint are written first).
    identity: what defines the run (`stitch_config.identity`).
  """

  ckpt: checkpoint.Checkpointer
  start: int
  state: state_lib.State
  imported: bool
  identity: dict


def run_stitching(
  s: Setup,
  clients: federated.Clients,
  opened: Opened,
  log: Log = _log_default,
  clock: Callable[[], float] = time.perf_counter,
) -> state_lib.State:
  """FedStitch over every client, their work done by `clients`
  (`federated.LocalClients` on this host), the coordinators in the loop,
  from the rounds `opened` holds: the host loop of every run
  (`experiment.drive`), each round's rows in metrics.jsonl and
  clients.jsonl and its state checkpointed; each round's lines timed by
  `clock` (seconds). Then the reports log.jsonl and energy.jsonl."""
  config = s.config
  ckpt, start, state = opened.ckpt, opened.start, opened.state
  lib = config_lib.library_config(config)
  rows = records.Records(
    config.run.workdir,
    0 if opened.imported else start,
    True,
    log,
    tensorboard=config.run.tensorboard,
  )

  def save(r, state):
    tree = state_lib.to_checkpoint(state, opened.identity)
    ckpt.save(r, tree, {IDENTITY_KEY: opened.identity, **rows.binding()})

  if opened.imported:  # a state.npz of an earlier version: rows, state
    for entry in state.log:
      rows.write(*state_lib.rows_of(entry))
    save(start, state)
  limit = federated.round_limit(lib)
  step, record = _round_fns(s, clients, rows, start, log, clock)
  run = experiment.Drive(
    rounds=limit,
    every=1,
    step=step,
    record=record,
    save=save,
    rows=rows,
    log=log,
    done=lambda state: not state.live,
  )
  try:
    with s.coordinators or contextlib.nullcontext():
      state = experiment.drive(state, start, run)
  except energy_lib.EnergyError as e:  # e.g. the kernel refused a clock
    raise errors.UserError(
      f'`energy_backend={config.energy.backend}`: {e}'
    ) from None
  except KeyboardInterrupt:
    # Every round is checkpointed when done; the one interrupted is
    # recomputed identically. Rounds named as the round lines name them
    # (from 0): checkpoint r holds the state after round r - 1.
    if saved := ckpt.latest_round():
      log(
        f'interrupted: {checkpoint.FOLDER}/{saved} holds the state after '
        f'round {saved - 1}'
      )
    raise
  finally:
    ckpt.close()
  _write_reports(config.run.workdir, state)
  return state


def _round_fns(
  s: Setup,
  clients: federated.Clients,
  rows: records.Records,
  start: int,
  log: Log,
  clock: Callable[[], float],
) -> tuple[Callable, Callable]:
  """`(step, record)` of `experiment.Drive` for a FedStitch run resumed
  after round `start`: a round of `federated.run_round`, its log entry
  written as the run's rows (`state.rows_of`) and its lines logged with
  the pace of the rounds this process ran (by `clock`)."""
  config = s.config
  lib = config_lib.library_config(config)
  limit = federated.round_limit(lib)
  t0 = clock()

  def step(state, r):
    del r
    state = federated.run_round(
      s.pool,
      state,
      clients,
      lib,
      population=list(range(config.partition.num_clients)),
      energy=s.coordinators,
    )
    return state, state.log[-1]

  def record(state, saved_round, r, entry, t_round):
    del state, saved_round, t_round
    row, clients_row = state_lib.rows_of(entry)
    rows.write(row, clients_row)
    pace = progress.Pace(clock() - t0, r - start, limit)
    for line in progress.stitch_round_lines(entry, pace):
      log(line)
    return row

  return step, record


# A FedStitch checkpoint's metadata key: the identity of its run.
IDENTITY_KEY = 'identity'


def open_run(s: Setup, log: Log = _log_default) -> Opened:
  """The run's workdir opened for its rounds: the newest intact checkpoint
  (`resume.restore_checkpoint`), else (`imported`) a state.npz of an
  earlier version, else round 0; config.json written, after the checks.

  Raises:
    UserError: config.json, a checkpoint or state.npz of another run.
  """
  workdir = s.config.run.workdir
  identity = config_lib.identity(s.config, [m.id for m in s.models])
  folder = os.path.join(workdir, checkpoint.FOLDER)
  config_path = os.path.join(workdir, records.CONFIG_FILE)
  if os.path.exists(config_path):
    _check_identity(_saved_identity(config_path), identity, config_path)

  def accept(step, metadata, resumed):
    del resumed
    where = f'the checkpoint after round {step} in {folder}'
    _check_identity(metadata.get(IDENTITY_KEY), identity, where)

  ckpt, start, tree = resume.restore_checkpoint(
    workdir, None, s.config.run.keep_checkpoints, log, True, accept
  )
  imported = False
  if start is not None:
    where = os.path.join(folder, str(start))
    state = state_lib.from_checkpoint(tree, s.pool, identity, where)
  elif os.path.exists(old := os.path.join(workdir, STATE_FILE)):
    state = state_lib.load_state(old, s.pool, identity)
    start, imported = state.round, True
    log(
      f'{old}: the state of an earlier version (state format '
      f'{state_lib.STATE_VERSION}) after round {start - 1} (rounds counted '
      f'from 0 as the round lines count them): resumed; from now '
      f'on the run keeps its rows in {records.METRICS_FILE} and '
      f'{records.CLIENTS_FILE}, its states in {checkpoint.FOLDER}/'
    )
  else:
    num_clients = s.config.partition.num_clients
    state, start = state_lib.init_state(s.pool, num_clients), 0
  os.makedirs(workdir, exist_ok=True)
  records.write_config(
    workdir, {**s.config.flat(), IDENTITY_KEY: identity}, bool(start)
  )
  if ckpt is None:
    ckpt = checkpoint.Checkpointer(workdir, keep=s.config.run.keep_checkpoints)
  return Opened(ckpt, start, state, imported, identity)


def _saved_identity(config_path: str) -> Any:
  try:
    saved = jsonfile.load(config_path, checks.MAX_CONFIG_BYTES)
  except jsonfile.JsonFileError as e:
    raise errors.ConfigError(
      f'`workdir`: cannot read {errors.clip(config_path)}: {e.reason}'
    ) from None
  return saved.get(IDENTITY_KEY) if isinstance(saved, dict) else None


def _check_identity(saved: Any, identity: dict, where: str) -> None:
  """Refuses a run saved (`saved`, its identity, read from `where`) with
  another config than `identity`, naming the flags that differ."""
  if saved == identity:
    return
  if isinstance(saved, dict):
    diffs = [
      f'`{k}={saved.get(k)!r}` there, {identity.get(k)!r} here'
      for k in sorted(set(saved) | set(identity))
      if saved.get(k) != identity.get(k)
    ]
  else:
    diffs = ['not a FedStitch run']
  raise errors.ConfigError(
    f'{where} holds a run of a different config ({"; ".join(diffs)}); '
    'pass another `workdir` or the same flags'
  )


def _write_reports(workdir: str, state: state_lib.State) -> None:
  """log.jsonl (the rounds' log entries without their energy records) and
  energy.jsonl (one per round), from the state's log."""
  files.write_atomic(
    os.path.join(workdir, 'log.jsonl'),
    lambda f: f.writelines(
      json.dumps({k: v for k, v in e.items() if k != 'energy'}) + '\n'
      for e in state.log
    ),
  )
  files.write_atomic(
    os.path.join(workdir, 'energy.jsonl'),
    lambda f: f.writelines(
      json.dumps({'round': e['round'], **e['energy']}) + '\n'
      for e in state.log
      if 'energy' in e  # a run without coordinators (a library caller's)
    ),
  )


def stitch_and_evaluate(
  config: config_lib.StitchConfig,
  *,
  log: Log = _log_default,
  deployed: Callable[[Setup], federated.Clients] | None = None,
) -> dict[str, Any]:
  """Runs (or resumes) one FedStitch experiment and evaluates it.

  Args:
    config: the experiment.
    log: where progress lines go.
    deployed: for a deployed run, `setup → the clients' work on their
      own machines` (`fedjax_mr.deploy`); each client's energy
      coordinator then runs on its own device. None: every client runs
      here, one after another.

  Returns:
    What results.json holds.

  Raises:
    UserError: a bad field, file or workdir, or an energy backend that
      failed (the message names the config field).
    KeyboardInterrupt: Ctrl-C or SIGTERM; a re-run resumes after the last
      round that ended.
  """
  with resume.TerminationAsInterrupt():  # SIGTERM ends as Ctrl-C does
    return _stitch_and_evaluate(config, log, deployed)


def _stitch_and_evaluate(
  config: config_lib.StitchConfig, log: Log, deployed
) -> dict[str, Any]:
  s = load(config, check(config, deployed=deployed is not None), log)
  if deployed is None:
    clients = federated.LocalClients(s.pool, make_batch_fn(s))
  else:
    clients = deployed(s)
  evaluate = evaluation.make_evaluate(s)
  workdir = config.run.workdir
  with workdir_lib.acquire(workdir):  # one writer per workdir
    opened = open_run(s, log)
    # The clients' training examples, for experiments.run's
    # `partition=file`: the training baselines learn from the same clients.
    partition.save_file(os.path.join(workdir, CLIENTS_FILE), s.parts)
    # Per client: size and examples per class (experiments.run's summary).
    partition.save_summary(
      os.path.join(workdir, records.PARTITION_FILE),
      partition.summary(s.parts, s.ds.y_train, s.ds.num_classes),
    )
    state = run_stitching(s, clients, opened, log)
    nets = evaluation.evaluate_networks(s, state, evaluate, log)
    pool_acc = {
      # A pool model is its own blocks, with nothing between them.
      m.id: evaluate(network.Network(tuple(chain), (None,) * len(chain)))
      for m, chain in zip(s.models, s.chains)
    }
    local = evaluation.local_baseline(s, clients, evaluate, log)
    results = evaluation.make_results(s, state, nets, pool_acc, local)
    files.write_atomic(
      os.path.join(workdir, 'results.json'),
      lambda f: json.dump(results, f, indent=1, default=evaluation.plain),
    )
  writes = sum(
    len(c.get('writes', ())) for r in state.log for c in r['energy']['clients']
  )
  key = evaluation.eval_key(config.evaluation)
  for line in progress.stitch_summary_lines(results, key, writes):
    log(line)
  return results
