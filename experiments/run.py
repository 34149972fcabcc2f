r"""Runs one federated training experiment.

  python -m experiments.run --flagfile=experiments/configs/default.flags
  python -m experiments.run --partition=iid --rounds=20 --workdir=/tmp/iid

Every flag is a field of `fedjax_mr.pipeline.config.ExperimentConfig`:
`--help` lists them by concern, a line each; `--helpfull` gives each
flag's whole help and each algorithm's hyper-parameters (`--fedprox_mu`,
`--fedmr_first_stage`, ...; each names the algorithms that read it).
Re-running with the same `--workdir` resumes. Installed, the program is
the console script `fedjax-mr-run`.
"""

from __future__ import annotations

import os

# First: Ctrl-C while the modules below import ends in one line (cli).
from . import cli  # isort: split

from absl import flags
from absl import logging

from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import registry


def _define_flags() -> None:
  for name in cli.define_config_flags(
    config_lib.base_fields(), config_lib.choices
  ):
    flags.declare_key_flag(name)  # listed by --helpshort
  # The algorithms' hyper-parameters, from the registry (--helpfull).
  cli.define_algorithm_flags()


_define_flags()
FLAGS = flags.FLAGS

# `--help`: the flags by the config's parts.
_HEADINGS = {
  'data': 'Data',
  'partition': 'Partition',
  'model': 'Model',
  'local': 'Local training',
  'server': 'Server',
  'algorithm': 'Algorithm (its own flags: --helpfull)',
  'privacy': 'Privacy (user-level DP of the sum)',
  'privacy.secure': 'Secure aggregation (the server reads only the sum)',
  'run': 'Run and records',
  'evaluation': 'Evaluation',
  'energy': 'Energy (simulated devices)',
  'devices': 'Devices',
  'devices.processes': 'Processes (multi-host)',
}
HELP_GROUPS = cli.config_help_groups(config_lib.base_fields(), _HEADINGS)
cli.set_help_groups(__name__, HELP_GROUPS)


def flag_values() -> dict[str, object]:
  """Every experiment flag's value, by name (the algorithms' too)."""
  names = [f.name for f in config_lib.base_fields()]
  names += list(registry.all_flags())
  return {name: getattr(FLAGS, name) for name in names}


def config_from_flags() -> config_lib.ExperimentConfig:
  """The config of the flags (`partition_sha256` read from the partition
  file where it is empty).

  Raises:
    ConfigError: an unknown --algorithm, or another algorithm's flag set.
  """
  config = config_lib.ExperimentConfig.from_flat(**flag_values())
  return config_lib.with_file_digest(config)


def checked_flags() -> checks.Checked:
  """The config of the flags, checked once (`checks.check`: the partition
  file read once, `partition_sha256` that of its bytes where it is empty).

  Raises:
    ConfigError: naming the first bad flag.
  """
  config = config_lib.ExperimentConfig.from_flat(**flag_values())
  return checks.check(config)


def main(argv) -> None:
  cli.no_arguments(argv)
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  with cli.training_errors('nothing was written'):
    checked = checked_flags()
  config = checked.config
  with cli.training_errors(
    're-run with the same --workdir to resume',
    workdir=config.run.workdir or config.default_workdir(),
  ):
    import jax

    from fedjax_mr.pipeline import experiment

    try:
      # The flags were checked before the distributed runtime starts (a
      # bad --coordinator_address would otherwise wait for a coordinator);
      # sets up the devices, then runs or resumes.
      experiment.train_and_evaluate(checked, log=cli.log)
    except jax.errors.JaxRuntimeError as e:
      if 'RESOURCE_EXHAUSTED' not in str(e):
        raise
      cli.fail(out_of_memory(str(e), config.server.clients_per_round))


def out_of_memory(error: str, clients_per_round: int) -> str:
  """The one line for XLA's RESOURCE_EXHAUSTED `error`: what it could not
  allocate, against this machine's memory, and the flag to lower (the
  algorithms that keep every client's model, FedMR's family, hold about
  5 models a client: 1.35 MB a client with cnn_mnist, measured)."""
  first = error.strip().splitlines()[0] if error.strip() else error
  total = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  return (
    f'out of memory ({first}; this machine has {total / 2**30:.1f} GiB): '
    f'a round of --clients_per_round={clients_per_round} does not fit; '
    'lower it, or --client_chunk (clients trained at once on a device)'
  )


def entry() -> None:
  """The console script `fedjax-mr-run`."""
  cli.run(main)


if __name__ == '__main__':
  entry()
