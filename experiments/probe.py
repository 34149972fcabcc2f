r"""The transfer setting's 5-NN probe on a finished training run's models.

  python -m experiments.probe \
      --workdir=runs/transfer/iid/ft_full_cnn_mnist
  python -m experiments.probe --workdir=runs/transfer/iid/heterofl \
      --pool=runs/pool_0-4

experiments.stitch reads FedStitch's networks, the Local baseline and the
pool models in the transfer setting (`--eval=knn --knn_at=trunk`) by a
5-NN probe fitted on the first `--knn_reference` public examples of the
clients' classes. This program gives a training baseline of
`experiments.run` (its finished `--workdir`) the same read-out: for every
checkpoint the run kept (`--keep_checkpoints`), it restores the global
model (checked against its digest), applies the probe to the input of its
end block (its classifier) on the same reference examples (from the
`--pool`'s public split; default: the pool of the run's `--init_from`
model) and the same test images, prints each round's accuracy beside the
head's (for DepthFL's multi-exit model also each exit's alone) and their
means, and writes `<workdir>/probe.json` (`fedjax_mr.analysis.probe`).
`experiments.stitch_figures --figure=table3` shows the probe's mean
beside the head's. Nothing is written before every input is checked and
every round probed.
"""

from __future__ import annotations

# First: Ctrl-C while the modules below import ends in one line (cli).
from . import cli  # isort: split

import os

from absl import flags
from absl import logging

from fedjax_mr.pipeline import stitch_config

_WORKDIR = flags.DEFINE_string(
  'workdir', None, 'The finished run (its folder, as given to experiments.run).'
)
_POOL = flags.DEFINE_string(
  'pool',
  '',
  'The pool folder whose public split the probe is fitted on (default: the '
  "pool of the run's --init_from model).",
)
_KNN_REFERENCE = flags.DEFINE_integer(
  'knn_reference',
  stitch_config.Evaluation().knn_reference,
  'Public examples the probe is fitted on, the first ones (as '
  'experiments.stitch --knn_reference).',
)
for _flag in ('workdir', 'pool', 'knn_reference'):
  flags.declare_key_flag(_flag)


def main(argv) -> None:
  cli.no_arguments(argv)
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore
  from fedjax_mr.analysis import probe

  record = probe.probe(
    _WORKDIR.value or '',
    pool=_POOL.value,
    knn_reference=_KNN_REFERENCE.value,
    log=cli.log,
  )
  rounds = record['rounds']
  cli.log(
    f'{probe.K}-NN on the trunk, mean of rounds {rounds[0]}–{rounds[-1]} '
    f'({len(rounds)} checkpoints): {100 * record["mean"]:.2f} %'
    + (
      ''
      if record['head_mean'] is None
      else f' (own head {100 * record["head_mean"]:.2f} %)'
    )
    + probe.exits_text(record['exit_mean'])
  )
  cli.log(f'wrote {os.path.join(_WORKDIR.value, probe.PROBE_FILE)}')


def entry() -> None:
  """The console script `fedjax-mr-probe`."""
  cli.run(main)


if __name__ == '__main__':
  entry()
