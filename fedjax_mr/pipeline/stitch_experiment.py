"""One FedStitch experiment: data, pool, clients, the run, its records.

`stitch_and_evaluate(config)` validates a `StitchConfig`, loads the dataset
and the pool, partitions the clients' examples, runs FedStitch
(`fedjax_mr.stitch.federated.run`, resuming `state.npz` in the workdir)
with the clients' energy coordinators in the loop, evaluates every
stitched network, every pool model and the "Local" baseline, and writes
under `config.run.workdir`: log.jsonl, energy.jsonl, results.json,
partition.json, client_indices.json, networks.npz and state.npz (see
experiments/stitch.py for what each holds). Every message names the
config field (in backticks) that the program turns into its flag.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any
from typing import Callable
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from fedjax_mr import energy
from fedjax_mr.core import errors
from fedjax_mr.core import files
from fedjax_mr.core import jsonfile
from fedjax_mr.core import workdir as workdir_lib
from fedjax_mr.data import datasets
from fedjax_mr.data import partition
from fedjax_mr.energy import fleet
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import energy_report
from fedjax_mr.pipeline import progress
from fedjax_mr.pipeline import resume
from fedjax_mr.pipeline import stitch_config as config_lib
from fedjax_mr.stitch import federated
from fedjax_mr.stitch import label_maps
from fedjax_mr.stitch import network
from fedjax_mr.stitch import pool as pool_lib
from fedjax_mr.stitch import state as state_lib
from fedjax_mr.stitch import torchvision_import

STATE_FILE = 'state.npz'
CLIENTS_FILE = 'client_indices.json'

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
    files=(STATE_FILE, CLIENTS_FILE, 'partition.json', 'results.json'),
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


def knn_examples(
  evaluation: config_lib.Evaluation,
  ds: Any,
  public: np.ndarray,
  parts: list[np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
  """`(x, y)`: the labelled examples a kNN probe is fitted on, the first
  `knn_reference` public examples (client 0's without a public split)."""
  ref = public[: evaluation.knn_reference] if len(public) else parts[0]
  return ds.x_train[ref], ds.y_train[ref]


def test_examples(
  evaluation: config_lib.Evaluation, ds: Any
) -> tuple[np.ndarray, np.ndarray]:
  """`(x, y)`: the test examples networks are evaluated on, the first
  `eval_examples` (0: all) of the clients' classes."""
  n_eval = evaluation.eval_examples or len(ds.y_test)
  return ds.x_test[:n_eval], ds.y_test[:n_eval]


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


def make_evaluate(s: Setup) -> Callable[[network.Network], dict]:
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


# --- The run and its records -------------------------------------------------


def run_stitching(
  s: Setup,
  clients: federated.Clients,
  log: Log = _log_default,
  clock: Callable[[], float] = time.perf_counter,
) -> state_lib.State:
  """FedStitch over every client (resuming the workdir's state), their
  work done by `clients` (`federated.LocalClients` on this host), the
  coordinators in the loop, each round's lines timed by `clock` (seconds);
  then log.jsonl and energy.jsonl."""
  config = s.config
  workdir = config.run.workdir
  saved = []  # the rounds this process finished (each saved when done)
  limit = federated.round_limit(config_lib.library_config(config))
  t0 = clock()

  def on_round(state):
    saved.append(state.log[-1]['round'])
    pace = progress.Pace(clock() - t0, len(saved), limit)
    for line in progress.stitch_round_lines(state.log[-1], pace):
      log(line)

  try:
    state = federated.run(
      s.pool,
      None,
      config.partition.num_clients,
      config_lib.library_config(config),
      state_path=os.path.join(workdir, STATE_FILE),
      identity=config_lib.identity(config, [m.id for m in s.models]),
      on_round=on_round,
      energy=s.coordinators,
      clients=clients,
    )
  except energy.EnergyError as e:  # e.g. the kernel refused a clock
    raise errors.UserError(
      f'`energy_backend={config.energy.backend}`: {e}'
    ) from None
  except KeyboardInterrupt:
    # The state file is replaced whole after each round, so the one there
    # is complete; the interrupted round is recomputed identically.
    if saved:
      log(f'interrupted: {STATE_FILE} holds the state after round {saved[-1]}')
    raise
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
      json.dumps({'round': e['round'], **e['energy']}) + '\n' for e in state.log
    ),
  )
  return state


def eval_key(evaluation: config_lib.Evaluation) -> str:
  """The accuracy networks are ranked by: the head's, else the kNN's."""
  return 'head' if evaluation.mode in ('head', 'both') else 'knn'


def evaluate_networks(
  s: Setup, state: state_lib.State, evaluate, log: Log = _log_default
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
    config_lib.identity(s.config, [m.id for m in s.models]),
  )
  return nets


def local_baseline(
  s: Setup,
  clients: federated.Clients,
  evaluate,
  log: Log = _log_default,
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
  local_cfg = config_lib.library_config(config)._replace(clients_per_round=1)
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


def _plain(o):
  """JSON for numpy scalars and arrays."""
  if isinstance(o, (np.generic, np.ndarray)):
    return o.tolist()
  raise TypeError(f'{type(o).__name__} is not JSON serializable')


def make_results(
  s: Setup,
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
    'config': config_lib.library_config(config)._asdict(),
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
  evaluate = make_evaluate(s)
  workdir = config.run.workdir
  with workdir_lib.acquire(workdir):  # one writer per workdir
    # The clients' training examples, for experiments.run's
    # `partition=file`: the training baselines learn from the same clients.
    partition.save_file(os.path.join(workdir, CLIENTS_FILE), s.parts)
    # Per client: size and examples per class (experiments.run's summary).
    partition.save_summary(
      os.path.join(workdir, 'partition.json'),
      partition.summary(s.parts, s.ds.y_train, s.ds.num_classes),
    )
    state = run_stitching(s, clients, log)
    nets = evaluate_networks(s, state, evaluate, log)
    pool_acc = {
      # A pool model is its own blocks, with nothing between them.
      m.id: evaluate(network.Network(tuple(chain), (None,) * len(chain)))
      for m, chain in zip(s.models, s.chains)
    }
    local = local_baseline(s, clients, evaluate, log)
    results = make_results(s, state, nets, pool_acc, local)
    files.write_atomic(
      os.path.join(workdir, 'results.json'),
      lambda f: json.dump(results, f, indent=1, default=_plain),
    )
  writes = sum(
    len(c.get('writes', ())) for r in state.log for c in r['energy']['clients']
  )
  key = eval_key(config.evaluation)
  for line in progress.stitch_summary_lines(results, key, writes):
    log(line)
  return results
