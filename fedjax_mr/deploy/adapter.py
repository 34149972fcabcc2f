"""Everything the deployment layer takes from the run pipeline.

One place, so that the pipeline can change shape without the rest of
`fedjax_mr.deploy` noticing: the config (read, written, validated), the
experiment built from it (data, model, algorithm, initial state: the
same `setup` as `experiments.run`), the host loop with its records,
checkpoints, resume and provenance (`train_and_evaluate`, given the
deployed round), and the workdir's checks; and the same for FedStitch
runs (`experiments.stitch`'s `StitchConfig`, `stitch_and_evaluate` given
the deployed clients, and what a node loads: `stitch_node`).
"""

from __future__ import annotations

import json
import os
from typing import Any
from typing import Callable
from typing import NamedTuple

from fedjax_mr.core import errors
from fedjax_mr.core import files
from fedjax_mr.core import jsonfile
from fedjax_mr.core import workdir as workdir_lib
from fedjax_mr.pipeline import build
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import energy_report
from fedjax_mr.pipeline import experiment
from fedjax_mr.pipeline import protection
from fedjax_mr.pipeline import records
from fedjax_mr.pipeline import resume
from fedjax_mr.pipeline import stitch_config
from fedjax_mr.pipeline import stitch_experiment

Config = config_lib.ExperimentConfig
Experiment = build.Experiment
StitchConfig = stitch_config.StitchConfig
UserError = errors.UserError
STITCH_CONFIG = 'stitch.json'


def write_config(config: Config, folder: str) -> str:
  """Writes `config` where `read_spec(folder)` reads it; its path."""
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, records.CONFIG_FILE)
  text = json.dumps(config.to_dict(), indent=1, sort_keys=True)
  files.write_atomic(path, lambda f: f.write(text))
  return path


def check(config: Config) -> str:
  """Validates `config` for a deployed run and returns its workdir;
  refuses a workdir in use or of another run before anything is written.

  Raises:
    UserError: a bad field (named), secure recombination (FedMR's
      client-to-client swaps, which a Flower federation could relay only
      through the server), an algorithm that DP or secure aggregation
      refuses (the experiment is set up here to find out, as the server
      will), or the workdir.
  """
  checked = checks.check(config)  # the partition file read once
  config = checked.config
  if config.algorithm.options().get('fedmr_secure_repeats', 0):
    raise errors.ConfigError(
      '`fedmr_secure_repeats` is not deployed: secure recombination swaps '
      'layers between clients, which a Flower federation relays only '
      'through the server, which is what it hides them from'
    )
  if config.privacy.clip > 0 or config.privacy.secure.enabled:
    experiment.setup(checked)
  workdir = config.run.workdir or config.default_workdir()
  resume.check_workdir(config, workdir)
  workdir_lib.check_free(workdir)
  return workdir


def validated(config: Config) -> checks.Checked:
  """`config` checked once (`checks.check`, which `setup` takes as it is)
  and its privacy part's rules too: every rule `setup` applies to its
  fields, building nothing (no data read, no model; a partition file is
  read, once).

  Raises:
    ConfigError: naming the first bad field.
  """
  checked = checks.check(config)
  protection.check_privacy(checked.config)
  return checked


def setup(config: Config | checks.Checked) -> Experiment:
  """The experiment `experiments.run` builds from `config` (or from what
  `validated` returned for it): the same data, partition, model,
  algorithm and initial state."""
  return experiment.setup(config)


def train_and_evaluate(
  config: Config,
  workdir: str,
  make_round: Callable[[Experiment, int], Callable],
  log: Callable[[str], None],
  on_round: Callable[[int, dict[str, Any]], None] | None = None,
) -> Any:
  """`experiments.run`'s whole run (records, checkpoints, resume) with
  `make_round(experiment, client_chunk)` as its round."""
  return experiment.train_and_evaluate(
    config, workdir, log=log, on_round=on_round, make_round=make_round
  )


# FedStitch runs.


def write_stitch_config(config: StitchConfig, folder: str) -> str:
  """Writes `config` where `read_spec(folder)` reads it; its path."""
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, STITCH_CONFIG)
  text = json.dumps(config.flat(), indent=1, sort_keys=True)
  files.write_atomic(path, lambda f: f.write(text))
  return path


TRAINING, STITCH = 'training', 'stitch'  # the kinds of run


def read_spec(folder: str) -> tuple[str, str]:
  """`(kind, text)`: the kind of run and the config text that
  `write_config` or `write_stitch_config` wrote in `folder` (what travels
  to the nodes in each message: they need no file of the server's).

  Raises:
    ConfigError: no config there, or one too large.
  """
  for kind, name in ((STITCH, STITCH_CONFIG), (TRAINING, records.CONFIG_FILE)):
    path = os.path.join(folder, name)
    if os.path.exists(path):
      try:
        data = jsonfile.read_bytes(path, checks.MAX_CONFIG_BYTES)
        return kind, data.decode('utf-8')
      except (jsonfile.JsonFileError, UnicodeDecodeError) as e:
        raise errors.ConfigError(str(e)) from None
  raise errors.ConfigError(f'{folder} holds no run config')


def config_from_text(kind: str, text: str) -> Config | StitchConfig:
  """The config of a run of `kind` whose config text is `text`
  (`read_spec`).

  Raises:
    ConfigError: a text that does not read as such a config.
  """
  where = f'the {kind} run config'
  try:
    values = jsonfile.loads(text.encode('utf-8'), where)
  except jsonfile.JsonFileError as e:
    raise errors.ConfigError(str(e)) from None
  if kind == TRAINING:
    return experiment.config_of(values, where)
  if kind != STITCH:
    raise errors.ConfigError(f'a run of unknown kind {kind!r}')
  try:
    return StitchConfig.from_flat(
      **{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    )
  except (TypeError, ValueError) as e:
    raise errors.ConfigError(f'{where}: {e}') from None


def check_stitch(config: StitchConfig, *, local_nodes: bool = True) -> str:
  """Validates `config` for a deployed FedStitch run and returns its
  workdir; refuses a workdir in use or of another run, an energy backend
  this machine's nodes cannot use (`local_nodes`: they run here), and a
  dataset or pool the run cannot use (they are loaded here, as the server
  will load them), before anything is written.

  Raises:
    UserError: a bad field (named), a file it names, or the workdir.
  """
  coordinators = stitch_experiment.check(config, deployed=not local_nodes)
  stitch_experiment.load(config, coordinators, log=lambda line: None)
  return config.run.workdir


def stitch_and_evaluate(
  config: StitchConfig,
  deployed: Callable[[stitch_experiment.Setup], Any],
  log: Callable[[str], None],
) -> dict[str, Any]:
  """`experiments.stitch`'s whole run (records, resume, evaluation) with
  `deployed(setup)` as the clients (`stitch_server.DeployedClients`)."""
  return stitch_experiment.stitch_and_evaluate(
    config, log=log, deployed=deployed
  )


class StitchNode(NamedTuple):
  """What a node of a FedStitch run holds (`stitch_node`).

  Attributes:
    pool: the block pool.
    library_config: the FedStitch hyper-parameters.
    coordinators: the clients' energy coordinators (this device's).
    num_clients: the clients of the run.
    batch_fn: `(client, round) → [B, ...]` a client's batch of a round.
  """

  pool: Any
  library_config: Any
  coordinators: Any
  num_clients: int
  batch_fn: Callable[[int, int], Any]


def stitch_node(config: StitchConfig) -> StitchNode:
  """The pool and the clients' examples of `config`, loaded as
  `experiments.stitch` loads them (the same partition), and the clients'
  coordinators on this device (the sysfs backend on a Jetson).

  Raises:
    UserError: a bad field or a file it names.
  """
  stitch_config.validate(config)
  p = config.partition
  coordinators = energy_report.make_fleet(
    config.energy, p.num_clients, config.run.seed
  )
  s = stitch_experiment.load(config, coordinators, log=lambda line: None)
  return StitchNode(
    s.pool,
    stitch_config.library_config(config),
    coordinators,
    p.num_clients,
    stitch_experiment.make_batch_fn(s),
  )
