"""Everything the deployment layer takes from the run pipeline.

One place, so that the pipeline can change shape without the rest of
`fedjax_mr.deploy` noticing: the config (read, written, validated), the
experiment built from it (data, model, algorithm, initial state: the
same `setup` as `experiments.run`), the host loop with its records,
checkpoints, resume and provenance (`train_and_evaluate`, given the
deployed round), and the workdir's checks.
"""

from __future__ import annotations

import json
import os
from typing import Any
from typing import Callable

from fedjax_mr.core import errors
from fedjax_mr.core import files
from fedjax_mr.core import workdir as workdir_lib
from fedjax_mr.pipeline import build
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import experiment
from fedjax_mr.pipeline import records
from fedjax_mr.pipeline import resume

Config = config_lib.ExperimentConfig
Experiment = build.Experiment
UserError = errors.UserError


def write_config(config: Config, folder: str) -> str:
  """Writes `config` where `read_config(folder)` reads it; its path."""
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, records.CONFIG_FILE)
  text = json.dumps(config.to_dict(), indent=1, sort_keys=True)
  files.write_atomic(path, lambda f: f.write(text))
  return path


def read_config(folder: str) -> Config:
  """The config `write_config` wrote in `folder`.

  Raises:
    ConfigError: none there, or one that does not read as a config.
  """
  return experiment.read_config(folder)


def check(config: Config) -> str:
  """Validates `config` for a deployed run and returns its workdir;
  refuses a workdir in use or of another run before anything is written.

  Raises:
    UserError: a bad field (named), secure recombination (FedMR's
      client-to-client swaps, which a Flower federation could relay only
      through the server), or the workdir.
  """
  config = config_lib.with_file_digest(config)
  checks.validate(config)
  if config.algorithm.options().get('fedmr_secure_repeats', 0):
    raise errors.ConfigError(
      '`fedmr_secure_repeats` is not deployed: secure recombination swaps '
      'layers between clients, which a Flower federation relays only '
      'through the server, which is what it hides them from'
    )
  workdir = config.run.workdir or config.default_workdir()
  resume.check_workdir(config, workdir)
  workdir_lib.check_free(workdir)
  return workdir


def setup(config: Config) -> Experiment:
  """The experiment `experiments.run` builds from `config`: the same data,
  partition, model, algorithm and initial state."""
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
