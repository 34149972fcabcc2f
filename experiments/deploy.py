r"""Runs one federated training experiment on a local Flower federation.

  python -m experiments.deploy --nodes=3 --flagfile=default
  python -m experiments.deploy --nodes=2 --partition=iid --rounds=20 \
      --workdir=/tmp/iid

Starts a Flower SuperLink and `--nodes` SuperNodes as processes on this
machine (127.0.0.1, free ports; node i serves clients i, i + N, ...), with
TLS from a certificate authority it makes and Flower's node
authentication, and runs the experiment of `experiments.run`'s flags over
them: the server samples, dispatches and aggregates, each node trains its
clients, and the workdir holds what `experiments.run` writes (the same
metrics rows and final model, bit for bit, at any --num_devices and
--client_chunk). Re-running with the
same `--workdir` resumes. Every process it starts is stopped when it ends,
fails, is interrupted or killed. The federation's files (certificates,
Flower's home, logs) are in `<workdir>/flower`. Installed, the program is
the console script `fedjax-mr-deploy` (the `deploy` extra).
"""

from __future__ import annotations

# First: Ctrl-C while the modules below import ends in one line (cli).
from . import cli  # isort: split

from absl import flags
from absl import logging

from . import deploy_flags
from . import run as run_program

_DEPLOY_FLAGS = deploy_flags.define_deploy_flags()
for _name in _DEPLOY_FLAGS:
  flags.declare_key_flag(_name)
FLAGS = flags.FLAGS
# `--help`: experiments.run's flags by concern, then the federation's.
cli.set_help_groups(
  __name__,
  [*run_program.HELP_GROUPS, ('Federation', list(_DEPLOY_FLAGS))],
)


def main(argv) -> None:
  cli.no_arguments(argv)
  logging.set_verbosity(logging.WARNING)
  # The federation's processes run in <workdir>/flower: a relative path
  # would name another file there.
  deploy_flags.absolute_paths()
  with cli.training_errors('nothing was written'):
    config = run_program.config_from_flags()
  with cli.training_errors(
    're-run with the same --workdir to resume',
    workdir=config.run.workdir or config.default_workdir(),
  ):
    from fedjax_mr.deploy import launch

    launch.run(config, FLAGS.nodes, **deploy_flags.deploy_arguments())


def entry() -> None:
  """The console script `fedjax-mr-deploy`."""
  cli.run(main)


if __name__ == '__main__':
  entry()
