r"""Runs one federated training experiment.

  python -m experiments.run --flagfile=experiments/configs/default.flags
  python -m experiments.run --partition=iid --rounds=20 --workdir=/tmp/iid

Every flag is a field of `fedjax_mr.harness.config.ExperimentConfig`:
`--helpshort` lists the common ones, `--helpfull` also each algorithm's
hyper-parameters (`--fedprox_mu`, `--fedmr_first_stage`, ...; each names
the algorithms that read it). Re-running with the same `--workdir`
resumes. Installed, the program is the console script `fedjax-mr-run`.
"""

from __future__ import annotations

# First: Ctrl-C while the modules below import ends in one line (cli).
from . import cli  # isort: split

from absl import flags
from absl import logging

from fedjax_mr.harness import config as config_lib
from fedjax_mr.harness import registry


def _define_flags() -> None:
  for f in config_lib.base_fields():
    help_text = f.metadata['help']
    allowed = config_lib.choices(f)
    if allowed:
      # Validated by config_lib.validate, for one clear error message.
      help_text += f' One of: {", ".join(allowed)}.'
    cli.define_flag(f.name, f, help_text)
    flags.declare_key_flag(f.name)  # listed by --helpshort
  # The algorithms' hyper-parameters, from the registry (--helpfull).
  cli.define_algorithm_flags()


_define_flags()
FLAGS = flags.FLAGS


def config_from_flags() -> config_lib.ExperimentConfig:
  names = [f.name for f in config_lib.base_fields()]
  names += list(registry.all_flags())
  return config_lib.ExperimentConfig(
    **{name: getattr(FLAGS, name) for name in names}
  )


def main(argv) -> None:
  cli.no_arguments(argv)
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  config = config_from_flags()
  with cli.training_errors(
    're-run with the same --workdir to resume',
    workdir=config.workdir or config.default_workdir(),
  ):
    from fedjax_mr.harness import experiment

    # Checks every flag (before the distributed runtime starts: a bad
    # --coordinator_address would otherwise wait for a coordinator), sets
    # up the devices, then runs or resumes.
    experiment.train_and_evaluate(config, log=cli.log)


def entry() -> None:
  """The console script `fedjax-mr-run`."""
  cli.run(main)


if __name__ == '__main__':
  entry()
