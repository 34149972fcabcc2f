"""`train_and_evaluate(config, workdir)`: a whole run, resumable.

`setup(config)` builds an `Experiment` (data and partition, model and
algorithm, devices: `build`); `run(experiment, workdir)` is the host loop
around the jit-compiled round: per round one metrics line (and an
evaluation every `eval_every` rounds: `evaluation`), checkpoints every
`checkpoint_every` rounds, and a learning-curve PNG at the end
(`records`, `progress`). A workdir that holds a checkpoint resumes from
it; the rounds after it are recomputed identically (every round's key is
`fold_in(key, round)`). Ctrl-C or SIGTERM writes the current round's row
and checkpoints that round on the way out, so no finished round is lost
and no round's row is skipped (`resume`). `load_run` reads a run back.
`drive` is that loop alone, the one host loop of every run: FedStitch runs
(`stitch_experiment`) go through it too, with their own round, rows and
checkpointed state.
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Any
from typing import Callable
from typing import NamedTuple

import jax

from fedjax_mr import privacy
from fedjax_mr.core import errors
from fedjax_mr.core import jsonfile
from fedjax_mr.core import tree
from fedjax_mr.core import workdir as workdir_lib
from fedjax_mr.data import client_data as client_data_lib
from fedjax_mr.models import model as model_lib
from fedjax_mr.pipeline import build
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import energy_report
from fedjax_mr.pipeline import evaluation
from fedjax_mr.pipeline import progress
from fedjax_mr.pipeline import protection
from fedjax_mr.pipeline import records
from fedjax_mr.pipeline import registry
from fedjax_mr.pipeline import resume
from fedjax_mr.runtime import checkpoint
from fedjax_mr.runtime import distributed
from fedjax_mr.runtime import metrics_io
from fedjax_mr.training import engine
from fedjax_mr.training import host_round

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


def _log_default(line: str) -> None:
  print(line, flush=True)


def _quiet(line: str) -> None:
  del line


def setup(
  config: config_lib.ExperimentConfig | checks.Checked,
) -> build.Experiment:
  """Config (or what `checks.check` returned for it) → data, partition,
  model, algorithm and initial state.

  Writes nothing. Every piece can be replaced before `run` (e.g.
  `setup(config)._replace(algorithm=..., state=engine.init_state(...))`).

  Raises:
    UserError: bad config or data (the message names the config field).
  """
  if isinstance(config, checks.Checked):
    return _setup(config)
  return _setup(checks.check(config))


def _setup(checked: checks.Checked) -> build.Experiment:
  """`setup` of a config checked once (`checks.check`): its algorithm's
  hyper-parameters and partition file as the checks read them."""
  config, hparams = checked.config, checked.hparams
  try:
    mesh = distributed.mesh_for(config.devices, config.server.clients_per_round)
  except errors.ArgumentError as e:
    raise checks.value_error(config, e) from None
  if protection.distributed(config.privacy):
    mesh = protection.noise_mesh(mesh)
  clients = build.load_clients(config, checked.partition)
  model = model_lib.get(
    config.model.name,
    clients.num_classes,
    clients.input_shape,
    dataset=config.data.dataset,
  )
  model = registry.model_for(config.algorithm.name, model, hparams)
  test = client_data_lib.eval_data(
    clients.x_test,
    clients.y_test,
    config.evaluation.eval_batch_size,
    clients.scale,
    clients.shift,
    num_shards=mesh.devices.size,
  )
  key = jax.random.key(config.run.seed)
  variables = model.init(jax.random.fold_in(key, _INIT))
  if config.model.init_from:
    variables = build.pretrained_variables(config, model, variables)
  base = build.registry_algorithm(config, model, variables, hparams)
  algorithm = build.protected(
    config, base, variables, int(max(clients.sizes)), clients.data
  )
  build.check_round_memory(config, algorithm, variables, mesh)
  # Per-client state stays in host memory; each round moves its K rows.
  state = engine.init_state(
    algorithm, variables, len(clients.sizes), host_clients=True
  )
  on_host = build.data_placement(config, clients.data, mesh) in (
    'host',
    'memmap',
  )
  data, test, device_state = distributed.replicate(
    (() if on_host else clients.data, test, state.replace(clients=())), mesh
  )
  if on_host:
    # Each round sends the devices only its own clients' examples (from a
    # file that `run` writes, under 'memmap').
    data = host_round.host_data(clients.data, config.server.clients_per_round)
  state = device_state.replace(clients=state.clients)
  return build.Experiment(
    config=config,
    model=model,
    algorithm=algorithm,
    data=data,
    test=test,
    state=state,
    key=jax.random.fold_in(key, _ROUNDS),
    mesh=mesh,
    client_sizes=clients.sizes.tolist(),
    partition=clients.partition,
    data_fingerprint=clients.fingerprint,
    accountant=protection.accountant(config, base, variables, clients.data),
  )


def train_and_evaluate(
  config: config_lib.ExperimentConfig | checks.Checked,
  workdir: str | None = None,
  *,
  log: Callable[[str], None] = _log_default,
  on_round: Callable[[int, dict[str, Any]], None] | None = None,
  make_round: Callable[[build.Experiment, int], Callable] | None = None,
) -> Result:
  """Runs (or resumes) an experiment: `run(setup(config), workdir)`.

  Args:
    config: the experiment, or what `checks.check` returned for it (not
      checked again, nor its partition file read again).
    workdir: output folder; default `config.run.workdir`, else
      `config.default_workdir()`.
    log: where progress lines go.
    on_round: called with (round, metrics row) after each round is logged
      and checkpointed (tests use it to interrupt a run).
    make_round: see `run`.

  Returns:
    A `Result`.

  Raises:
    UserError: bad config, data or workdir (the message names the config
      field).
    NonFiniteError: the train loss became non-finite; the metrics written
      so far and the last checkpoint are kept.
  """
  if isinstance(config, checks.Checked):
    checked = config
  else:
    checked = checks.check(config)
  config = checked.config
  # The devices the command line would give, before anything asks JAX
  # which process this is (that would fix its devices).
  try:
    distributed.initialize_for(config.devices, config.server.clients_per_round)
  except errors.ArgumentError as e:
    raise checks.value_error(config, e) from None
  workdir = workdir or config.run.workdir or config.default_workdir()
  # Refuse another run's workdir before loading anything.
  resume.check_workdir(config, workdir)
  return run(
    _setup(checked),
    workdir,
    log=log,
    on_round=on_round,
    make_round=make_round,
  )


def run(
  experiment: build.Experiment,
  workdir: str,
  *,
  log: Callable[[str], None] = _log_default,
  on_round: Callable[[int, dict[str, Any]], None] | None = None,
  make_round: Callable[[build.Experiment, int], Callable] | None = None,
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
    make_round: `make_round(experiment, client_chunk) -> step(state,
      data, key) -> (state, metrics)`, the round the loop calls; default
      the jit-compiled engine round. The deployment layer passes a round
      whose clients are remote (`fedjax_mr.deploy`).

  Returns:
    A `Result`.
  """
  primary = distributed.is_primary()
  if not primary:
    experiment = _memory_mapped(experiment, workdir)
    return _run(experiment, workdir, _quiet, on_round, make_round)
  # The primary process writes the workdir; one such process at a time.
  with workdir_lib.acquire(workdir):
    # Rebound, so that the in-memory set can be freed (unless the caller
    # keeps `experiment`).
    experiment = _memory_mapped(experiment, workdir)
    return _run(experiment, workdir, log, on_round, make_round)


def _memory_mapped(
  experiment: build.Experiment, workdir: str
) -> build.Experiment:
  """`experiment` with its host training data memory-mapped from an
  unnamed file in `workdir` (`client_data.memory_mapped`; each process
  its own) where `build.data_placement` says 'memmap'.

  Raises:
    StorageError: the file cannot be written (a full disk).
  """
  data = experiment.data
  if not isinstance(data, host_round.HostData) or (
    client_data_lib.is_memory_mapped(data.data)
    or build.data_placement(experiment.config, data.data, experiment.mesh)
    != 'memmap'
  ):
    return experiment
  try:
    os.makedirs(workdir, exist_ok=True)
    mapped = client_data_lib.memory_mapped(data.data, workdir)
  except OSError as e:
    mb = build.data_bytes(data.data) / 2**20
    raise errors.StorageError(
      f'cannot write the training set ({mb:,.1f} MiB) to a file in '
      f'{e.filename or workdir}: {e.strerror or e}; free space, or run '
      'with `data_placement=host`'
    ) from None
  return experiment._replace(data=data._replace(data=mapped))


def _run(
  experiment: build.Experiment,
  workdir: str,
  log: Callable[[str], None],
  on_round: Callable[[int, dict[str, Any]], None] | None,
  make_round: Callable[[build.Experiment, int], Callable] | None = None,
) -> Result:
  """`run` in every process (only the primary one writes files)."""
  config = experiment.config
  primary = distributed.is_primary()
  data = experiment.data_fingerprint
  ckpt, start, state = resume.restore(
    config, workdir, experiment.state, log, primary, data
  )
  state = engine.to_host_clients(state)
  os.makedirs(workdir, exist_ok=True)
  if primary:
    records.write_run_files(
      config, workdir, bool(start), experiment.partition, data
    )
  if ckpt is None:
    ckpt = checkpoint.Checkpointer(workdir, keep=config.run.keep_checkpoints)
  mapping = distributed.client_mapping(
    config.server.clients_per_round,
    config.devices.client_chunk,
    experiment.mesh,
    tree.num_parameters(state.server.params),
  )
  meta = {'config': config.to_dict(), 'mapping': mapping, 'data': data}
  if start is not None:
    before = ckpt.metadata(start).get('mapping')
    resume.announce(workdir, start, before, mapping, log)
  else:
    start = 0
  rows = records.Records(
    workdir,
    start,
    primary,
    log,
    tensorboard=config.run.tensorboard,
    curve=lambda history: records.plot_curve(config, history, workdir),
  )
  progress.announce(experiment, state, mapping, log)
  round_fn = (make_round or _compile_round)(experiment, mapping['client_chunk'])
  accountant = experiment.accountant or protection.accountant(config)
  last = _last_round(config, accountant, log)
  loop = _Loop(
    experiment._replace(config=config.replace(rounds=last)),
    evaluation.make_evaluators(experiment),
    rows,
    progress.Timer(start, last),
    log,
    accountant,
  )
  run = Drive(
    rounds=last,
    every=config.run.checkpoint_every,
    step=lambda state, r: round_fn(state, experiment.data, experiment.key),
    record=functools.partial(_record, loop),
    save=lambda r, state: ckpt.save(r, state, {**meta, **rows.binding()}),
    rows=rows,
    log=log,
    on_round=on_round,
  )
  try:
    state = drive(state, start, run)
  except KeyboardInterrupt:
    ckpt.close()
    raise
  ckpt.close()
  _finish(loop, workdir, primary)
  return Result(state=state, history=rows.history, workdir=workdir)


class Drive(NamedTuple):
  """A run as the host loop (`drive`) sees it, training or FedStitch.

  Attributes:
    rounds: the last round.
    every: checkpoints every `every` rounds (0: never) and after the last.
    step: `step(state, r) -> (state, metrics)` runs round r.
    record: `record(state, saved_round, r, metrics, t0) -> row` writes
      round r's rows (`rows.write`) and logs its line (the round began at
      `t0`, `time.perf_counter()`; the last checkpoint is `saved_round`'s).
    save: `save(r, state)` checkpoints the state after round r with the
      rows' digest (`rows.binding()`).
    rows: the run's records.
    log: where notes go.
    on_round: called with (round, metrics row) after each round is logged
      and checkpointed, or None.
    done: `done(state)`: the run ends before `rounds` (FedStitch: no
      network left), or None.
  """

  rounds: int
  every: int
  step: Callable[[Any, int], tuple[Any, Any]]
  record: Callable[..., dict[str, Any]]
  save: Callable[[int, Any], None]
  rows: records.Records
  log: Callable[[str], None]
  on_round: Callable[[int, dict[str, Any]], None] | None = None
  done: Callable[[Any], bool] | None = None


def drive(state: Any, start: int, run: Drive) -> Any:
  """The host loop, one for training runs and FedStitch runs: rounds
  `start + 1 ..` `run.rounds` (until `run.done`), each one's rows written
  and its state checkpointed when due; the state after the last.

  Ctrl-C or SIGTERM (`resume.TerminationAsInterrupt`) writes the current
  round's rows and checkpoints that round on the way out
  (`resume.finish_interrupted`) and raises `KeyboardInterrupt`; a full
  disk raises `StorageError` naming the round the run resumes after.
  """
  saved_round = start
  pending = None  # the round whose rows are not written: (r, metrics, t0)
  with resume.TerminationAsInterrupt(), resume.InterruptAnnounced(run.log):
    try:
      for r in range(start + 1, run.rounds + 1):
        if run.done is not None and run.done(state):
          break
        t0 = time.perf_counter()
        state, metrics = run.step(state, r)
        pending = (r, metrics, t0)
        row = run.record(state, saved_round, *pending)
        pending = None
        if evaluation.due(run.every, r, run.rounds) or (
          run.done is not None and run.done(state)
        ):
          with resume.SignalsDeferred():
            run.save(r, state)
            saved_round = r
        if run.on_round is not None:
          run.on_round(r, row)
    except (OSError, errors.StorageError) as e:
      raise resume.storage_error(e, saved_round) from None
    except KeyboardInterrupt:
      resume.finish_interrupted(
        pending=pending[0] if pending else None,
        finish=lambda: run.record(state, saved_round, *pending),
        rows=run.rows,
        state=state,
        saved_round=saved_round,
        save=run.save,
        log=run.log,
      )
      raise
    finally:
      run.rows.close()
  return state


def _compile_round(experiment: build.Experiment, chunk: int) -> Callable:
  """The experiment's round `step(state, data, key) -> (state, metrics)`,
  jit-compiled with its state donated and its results replicated over
  the mesh. Per-client state, if any, and training data kept in host
  memory stay there (`host_round.make_host_round`); the next round's view of
  host data is gathered while a round runs where `build.prefetches`."""
  mesh = experiment.mesh
  k = experiment.config.server.clients_per_round
  jitted = functools.partial(
    jax.jit, donate_argnums=0, out_shardings=distributed.replicated(mesh)
  )
  make = functools.partial(
    engine.make_round_fn,
    experiment.algorithm,
    clients_per_round=k,
    client_chunk=chunk,
    mesh=mesh if mesh.devices.size > 1 else None,
  )
  host_data = isinstance(experiment.data, host_round.HostData)
  if not engine.has_clients(experiment.state) and not host_data:
    return jitted(make())
  sample = jax.jit(
    engine.make_sample_fn(experiment.algorithm, k),
    out_shardings=distributed.replicated(mesh),
  )
  return host_round.make_host_round(
    sample,
    jitted(make(client_rows=True)),
    prefetch=build.prefetches(experiment),
    # With several processes the views stay numpy, as jit takes them
    # (a device_put there would check them across processes every round).
    sharding=(
      distributed.replicated(mesh) if jax.process_count() == 1 else None
    ),
  )


class _Loop(NamedTuple):
  """What the host loop keeps from round to round (`experiment.config`'s
  `rounds`: the last round this run reaches)."""

  experiment: build.Experiment
  evaluators: evaluation.Evaluators
  rows: records.Records
  timer: progress.Timer
  log: Callable[[str], None]
  accountant: privacy.Accountant | None = None


def _last_round(
  config: config_lib.ExperimentConfig,
  accountant: privacy.Accountant | None,
  log: Callable[[str], None],
) -> int:
  """`rounds`, or the last round whose ε stays within `dp_target_epsilon`
  (said in one line where that stops the run sooner)."""
  rounds, target = config.run.rounds, config.privacy.target_epsilon
  if accountant is None or not target:
    return rounds
  last = accountant.rounds_within(target, rounds)
  if last < rounds:
    log(
      f'privacy: ε after round {last + 1} would be '
      f'{accountant.epsilon(last + 1):.3g} > dp_target_epsilon={target} '
      f'(δ = {accountant.delta:.3g}): the run stops after round {last}'
    )
  return last


def _record(
  loop: _Loop,
  state: engine.RoundState,
  saved_round: int,
  r: int,
  metrics: Any,
  t0: float,
) -> dict[str, Any]:
  """Evaluates round r's state (`state`, `metrics`; the round started at
  `t0`), writes its rows and logs its line.

  Raises:
    NonFiniteError: the round's train loss is not finite (its rows are
      written all the same).
  """
  config = loop.experiment.config
  metrics = jax.device_get(metrics)
  # The round's own time (dispatch, local training, aggregation, back on
  # the host); evaluation is timed apart in 'eval_time_s'.
  round_s = time.perf_counter() - t0
  row, clients_row = records.round_rows(r, metrics)
  if loop.accountant is not None:
    row['dp_epsilon'] = loop.accountant.epsilon(r)
  if protection.distributed(config.privacy):
    # Its clients upload no loss (a sum without noise): null, not a
    # divergence (its clipped updates stay finite).
    row['train_loss'] = None
  elif not math.isfinite(row['train_loss']):
    loop.rows.write_diverged(row, clients_row)
    raise errors.NonFiniteError(
      f'non-finite train loss ({row["train_loss"]}) at round {r}; '
      f'stopped. Metrics up to it are in {loop.rows.metrics_path}; the last '
      f'checkpoint (round {saved_round}) is kept. Try a smaller `lr`.'
    )
  t_eval = time.perf_counter()
  evaluated = evaluation.evaluate_round(
    loop.evaluators,
    config,
    r,
    state,
    loop.experiment.data,
    loop.experiment.test,
    row,
    clients_row,
  )
  row['round_time_s'] = round_s
  if evaluated:
    row['eval_time_s'] = time.perf_counter() - t_eval
  loop.timer.tick(r, time.perf_counter() - t0)
  row['elapsed_s'] = loop.timer.elapsed
  loop.rows.write(row, clients_row)
  loop.log(loop.timer.progress_line(row))
  return row


def _finish(loop: _Loop, workdir: str, primary: bool) -> None:
  """After the last round: the learning curve, the summary lines and the
  energy simulation (`energy_mix`)."""
  config, history = loop.experiment.config, loop.rows.history
  if history and primary:
    records.plot_curve(config, history, workdir)
  loop.log(loop.timer.summary(history, workdir))
  if primary and config_lib.energy_mixes(config.energy):
    energy_report.write(
      config, history, loop.experiment.client_sizes, workdir, loop.log
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


def read_config(workdir: str) -> config_lib.ExperimentConfig:
  """The config a run was made with (its config.json; fields this version
  does not know are left out).

  Raises:
    ConfigError: no config.json, or one that does not read as a config.
  """
  config_path = os.path.join(workdir, records.CONFIG_FILE)
  try:
    saved = jsonfile.load(config_path, checks.MAX_CONFIG_BYTES)
  except jsonfile.JsonFileError as e:
    raise errors.ConfigError(str(e)) from None
  return config_of(saved, config_path)


def config_of(saved: Any, where: str) -> config_lib.ExperimentConfig:
  """The config of `saved`, a config.json's content (read from `where`;
  fields this version does not know are left out).

  Raises:
    ConfigError: one that does not read as a config.
  """
  if not isinstance(saved, dict):
    raise errors.ConfigError(f'{where}: not a JSON object')
  known = {f.name for f in config_lib.base_fields()}
  # Its algorithm's own flags: a config.json of an earlier version holds
  # every algorithm's (at the defaults of its time).
  name = saved.get('algorithm')
  if name in registry.REGISTRY:
    known |= set(registry.flags_of(name))
  try:
    return config_lib.ExperimentConfig.from_flat(
      **{k: v for k, v in saved.items() if k in known}
    )
  except TypeError as e:
    raise errors.ConfigError(f'{where}: {e}') from None


def load_run(workdir: str, round_index: int | None = None) -> FinishedRun:
  """Reads a run back: config, state, model and history in one call.

  The model and the state's layout are rebuilt from config.json the way
  the run built them (`setup`, so the run's dataset must be readable) and
  the newest checkpoint that restores (or the one of `round_index`) is
  read into them (`restore_run`); nothing in the workdir is written or
  moved.

  Raises:
    UserError: no config.json or no intact checkpoint (of that round), or
      one that this version cannot read; the message names the file.
  """
  return restore_run(workdir, setup(read_config(workdir)), round_index)


def restore_run(
  workdir: str,
  experiment: build.Experiment,
  round_index: int | None = None,
) -> FinishedRun:
  """The run in `workdir` at its newest intact checkpoint (or the one of
  `round_index`), read into the state of `experiment` (`setup` of the
  run's config) and checked against its digest; nothing is written or
  moved.

  Raises:
    UserError: no checkpoint (of that round), or none that restores intact
      (the message names the folder and, for a damaged one, why).
  """
  folder = os.path.join(workdir, checkpoint.FOLDER)
  ckpt = checkpoint.Checkpointer(
    workdir, keep=experiment.config.run.keep_checkpoints
  )
  try:
    found = ckpt.find(
      experiment.state,
      at_most=round_index,
      check=resume.bound_to(records.rows_digests(workdir)),
    )
    damaged = dict(found.damaged)
    if round_index in damaged:
      raise errors.ConfigError(
        f'{folder}: the checkpoint of round {round_index} does not restore '
        f'({damaged[round_index]})'
      )
    ckpt.check_found(found)
  finally:
    ckpt.close()
  if found.round is None or round_index not in (None, found.round):
    which = '' if round_index is None else f' of round {round_index}'
    raise errors.ConfigError(f'{folder}: no checkpoint{which}')
  rows = metrics_io.read(os.path.join(workdir, records.METRICS_FILE))
  history = [r for r in rows if r['round'] <= found.round]
  return FinishedRun(
    experiment.config, found.state, experiment.model, history, found.round
  )
