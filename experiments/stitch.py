r"""FedStitch on a dataset with a pool of pre-trained models.

  python -m experiments.pretrain_zoo --workdir=runs/pool
  python -m experiments.stitch --pool=runs/pool --partition=dirichlet \
      --alpha=1.0 --workdir=runs/stitch/dir1.0

The clients (`--num_clients`, default 100) hold the dataset's training
examples that are not in the pool's public split, partitioned IID or by
Dirichlet(α); `--clients_per_round` (10) take part in each round. Prints
per-round progress (depth, pool size, selected blocks, client weights, the
energy configurations chosen, the rounds run of at most (`--max_depth` − 1)
× `--rounds_per_selection`, the time elapsed and an ETA that bounds the
rounds left) and writes, under `--workdir`:

* `config.json`, `metrics.jsonl`, `clients.jsonl`, `checkpoints/`: the
  records of every run (`experiments.run` writes the same): the flags
  that define the run, one metrics row per round (numbered as the state
  after it: participants, their selection times, pool sizes, ranks,
  weight summary, selections), one row of the participants and their
  energy records, and a checkpoint of the run state after every round (the
  newest two kept), each bound to the rows before it. A re-run with the
  same flags resumes from the newest intact one (other flags are refused;
  a damaged row or checkpoint rolls the run back); a workdir of an earlier
  version, whose state is in `state.npz`, resumes from that state;
* `log.jsonl`: the metrics rows as the analysis programs read them (one
  line per round, rounds from 0, without the energy records);
* `energy.jsonl`: one line per round from the clients' local energy
  coordinators (FedStitch §IV-D), which run in the loop: the server's
  deadline and, per participant, the chosen DVFS configuration, predicted
  and measured time, energy, whether the deadline was met, and the same
  work at the highest frequency (`fedjax_mr.energy.fleet`). The devices are
  simulated (`--energy_backend=simulated`, a `--energy_mix` of profiles and
  speeds), or the Jetson the run is on, whose clocks are set through sysfs
  (`sysfs`; restored at the end, also after an error) or only planned
  (`dry_run`), with `--energy_profile`;
* `results.json`: every stitched network (path, accuracy by its head and/or
  a kNN probe), every pool model's own accuracy, the "Local" baseline when
  `--local_clients` > 0, timing, pool sizes, the energy totals (local
  coordinators vs the highest frequency) and the peak host memory;
* `partition.json`: each client's size and examples per class (as
  `experiments.run` writes it);
* `client_indices.json`: each client's training-example indices, for
  `experiments.run --partition=file --partition_file=...` (with the same
  `--classes`): the training baselines learn from exactly these clients;
* `networks.npz`: the stitched networks (block paths + stitch matrices;
  `fedjax_mr.stitch.state.read_document` reads it). Neither it nor a
  checkpoint is a pickle: nothing is ever unpickled.

Every flag is a field of `fedjax_mr.pipeline.stitch_config.StitchConfig`
(`--help` lists them by concern, a line each; `--helpfull` gives each
flag's whole help); the work is
`fedjax_mr.pipeline.stitch_experiment.stitch_and_evaluate`.

Pool models whose labels differ from the dataset's need `--label_map`, a
JSON list with, per dataset class, the pool classes that count as it.

A transfer setting: `--classes=5-9` gives the clients (and the test set)
those classes only; with a pool trained on others (`experiments.pretrain_zoo
--classes=0-4`) no head answers the task, and networks are evaluated by a
kNN probe (`--eval=knn`) fitted on the public examples of the clients'
classes, which the pool never saw.

`--imagenet_pool=<folder>` replaces `--pool` with FedStitch's own pool: the
five ImageNet-1K networks, read from torchvision state dicts saved as
`.safetensors` (`fedjax_mr.stitch.torchvision_import`); images are resized
to `--imagenet_resolution` and ImageNet-normalised at the start of every
model, and `--label_map` maps ImageNet classes to the dataset's (for
CIFAR-10 and CINIC-10 the bundled map `fedjax_mr.stitch.label_maps.CIFAR10`
is the default, so the paper's pool runs with that one flag).
"""

from __future__ import annotations

# First: Ctrl-C while the modules below import ends in one line (cli).
from . import cli  # isort: split

from absl import flags
from absl import logging

from fedjax_mr.pipeline import stitch_config as config_lib
from fedjax_mr.pipeline import stitch_experiment


def _define_flags() -> None:
  for name in cli.define_config_flags(config_lib.fields(), config_lib.choices):
    flags.declare_key_flag(name)  # listed by --helpshort
  # The flag's name before it was unified with experiments.run's.
  flags.DEFINE_alias('dirichlet_alpha', 'alpha')


_define_flags()
FLAGS = flags.FLAGS

# `--help`: the flags by the config's parts.
_HEADINGS = {
  'pool': 'Pool',
  'data': 'Data',
  'partition': 'Partition',
  'selection': 'Selection (a round)',
  'search': 'Search (selections, depth, pruning)',
  'cka': 'Block comparison (CKA)',
  'stitching': 'Stitching',
  'run': 'Run and records',
  'evaluation': 'Evaluation',
  'energy': "Energy (the clients' coordinators)",
}
HELP_GROUPS = cli.config_help_groups(config_lib.fields(), _HEADINGS)
cli.set_help_groups(__name__, HELP_GROUPS)


def config_from_flags() -> config_lib.StitchConfig:
  return config_lib.StitchConfig.from_flat(
    **{f.name: FLAGS[f.name].value for f in config_lib.fields()}
  )


def main(argv) -> None:
  cli.no_arguments(argv)
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore
  config = config_from_flags()
  with cli.training_errors(
    're-run with the same flags to resume', workdir=config.run.workdir
  ):
    stitch_experiment.stitch_and_evaluate(config, log=cli.log)


def entry() -> None:
  """The console script `fedjax-mr-stitch`."""
  cli.run(main)


if __name__ == '__main__':
  entry()
