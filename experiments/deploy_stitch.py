r"""Runs one FedStitch experiment on a local Flower federation.

  python -m experiments.deploy_stitch --nodes=3 --pool=runs/pool \
      --workdir=runs/stitch_deployed

Starts a Flower SuperLink and `--nodes` SuperNodes as processes on this
machine (127.0.0.1, free ports; node i serves clients i, i + N, ...), with
TLS from a certificate authority it makes and Flower's node
authentication, and runs the FedStitch experiment of `experiments.stitch`'s
flags over them: each node holds the block pool and its clients' examples
itself and, each round, scores the candidate blocks on its clients'
batches under each client's own energy coordinator (and, at the end of a
selection, sends the statistics the stitches are fitted on); the server
aggregates, stitches and prunes, and writes the workdir
`experiments.stitch` writes (the same log, energy records, networks and
results). Re-running with the same `--workdir` resumes. Every process it
starts is stopped when it ends, fails, is interrupted or killed. The
federation's files (certificates, Flower's home, logs) are in
`<workdir>/flower`. Installed, the program is the console script
`fedjax-mr-deploy-stitch` (the `deploy` extra).
"""

from __future__ import annotations

# First: Ctrl-C while the modules below import ends in one line (cli).
from . import cli  # isort: split

from absl import flags
from absl import logging

from . import deploy_flags
from . import stitch as stitch_program

_DEPLOY_FLAGS = deploy_flags.define_deploy_flags()
for _name in _DEPLOY_FLAGS:
  flags.declare_key_flag(_name)
FLAGS = flags.FLAGS
# `--help`: experiments.stitch's flags by concern, then the federation's.
cli.set_help_groups(
  __name__,
  [*stitch_program.HELP_GROUPS, ('Federation', list(_DEPLOY_FLAGS))],
)


def main(argv) -> None:
  cli.no_arguments(argv)
  logging.set_verbosity(logging.WARNING)
  # The federation's processes run in <workdir>/flower: a relative path
  # would name another file there.
  deploy_flags.absolute_paths()
  config = stitch_program.config_from_flags()
  with cli.training_errors(
    're-run with the same flags to resume', workdir=config.run.workdir
  ):
    from fedjax_mr.deploy import launch

    launch.run(config, FLAGS.nodes, **deploy_flags.deploy_arguments())


def entry() -> None:
  """The console script `fedjax-mr-deploy-stitch`."""
  cli.run(main)


if __name__ == '__main__':
  entry()
