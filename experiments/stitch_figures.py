r"""The FedStitch paper's tables and figures from finished workdirs.

  python -m experiments.stitch_figures --figure=table3 --output=runs/figs \
      --runs='FedStitch:iid=runs/stitch/iid,noniid=runs/stitch/dir0.1;
              HeteroFL:iid=runs/heterofl_iid,noniid=runs/heterofl_dir0.1'

(one argument; the line break is for reading: whitespace around ';', ','
and '=' is ignored.)

The paper: "Heterogeneity-Aware Coordination for Federated Learning via
Stitching Pre-trained blocks", Shichen Zhan, Yebo Wu, Chunlin Tian, Yan
Zhao, Li Li (2024). One `--figure` per run; each writes into `--output`
`<figure>.json` (the numbers shown) and `<figure>.md` (a table) and/or
`<figure>.png`. Nothing is trained or run here: the inputs are workdirs of
the other programs, and only `memory` compiles (never runs) models.

`--runs` names the methods and their workdirs: `label:column=path,...`
entries separated by ';' (a column is a setting, e.g. iid and noniid), or
`label:path` (one column, 'run'), or the path of a JSON file
`{"label": {"column": "path"}}`. A workdir is recognised by its files:
FedStitch (experiments.stitch: config.json with its identity, log.jsonl,
results.json; state.npz in a workdir of an earlier version), a
training run (experiments.run: metrics.jsonl, config.json) or a pool model
(experiments.pretrain_zoo: <pool>/<model>/meta.json).

Figures, what they read, and the commands that make their inputs (the
paper's settings, on Fashion-MNIST with our pool; --classes/--eval=knn for
the transfer setting):

* `table3` (Table III): accuracy of every method, a column per setting.
  FedStitch: its best stitched network as results.json reports it (head
  accuracy, or kNN with --eval=knn), a row 'Local (label)' when the
  run made the Local baseline (--local_clients) and a row '<model> alone
  (label)' per pool model, evaluated as the run evaluated its networks
  (in a transfer setting, the pool's meta.json accuracy is on the pool's
  own classes); a training run: mean
  test accuracy of its last `--last` evaluations (best in brackets); a
  pool model: meta.json's test accuracy (FT-Part/FT-Full from the pool
  are training runs). A workdir without results shows 'running', a
  missing one '–'. Once a training run holds a probe.json
  (experiments.probe), each setting gets a second column, '5-NN on
  trunk': every row read by the stitch runs' 5-NN probe on the input of
  its end block (a training run: the mean over the checkpoints probed,
  '–' where none was).

    python -m experiments.pretrain_zoo --workdir=runs/pool
    python -m experiments.stitch --pool=runs/pool --partition=iid \
        --local_clients=5 --workdir=runs/stitch/iid
    python -m experiments.stitch --pool=runs/pool --partition=dirichlet \
        --alpha=0.1 --local_clients=5 --workdir=runs/stitch/dir0.1
    python -m experiments.run --algorithm=heterofl --model=cnn_cifar \
        --partition=dirichlet --alpha=0.1 --workdir=runs/heterofl_dir0.1
    (and --partition=iid; likewise depthfl, fedavg, ...)

* `acc_vs_time` (Fig. 4): test accuracy against cumulative wall time
  (`--time_unit`), a panel per column. Training runs: metrics.jsonl's
  `round_time_s` summed (evaluation time `eval_time_s` added only with
  `--include_eval`), a point per evaluation. FedStitch: log.jsonl's
  `round_time_s` summed (selection, stitch fits and aggregation; the final
  evaluation of the networks excluded) up to each round where networks
  were finished, and the best accuracy of the networks finished so far
  (results.json). Same commands as table3.

* `acc_vs_round`: the training budgets behind table3: each training
  run's test accuracy (its own head) against round, faint at every
  evaluation and solid as the mean of its last `--last` evaluations
  (table3's figure at its last round), × where experiments.probe read its
  trunk, and each FedStitch run's best network as a dashed level. table3
  gives every training run's rounds and the trailing gain of that mean
  over 20 rounds (under 0.2 points: it has stopped rising). Same commands
  as table3.

* `memory` (Fig. 5): client memory in one round, measured from XLA's
  buffer assignment (`budgets.step_memory_bytes`, nothing runs).
  FedStitch: every block of `--pool` held, plus the largest working
  memory of one block's forward pass at `--batch_size` (its scoring
  batch); FT-Full / FT-Part of each pool model and every `--models` zoo
  model trained from scratch: one SGD step at `--train_batch_size`
  (`budgets.training_memory_bytes`). Needs only the pool:

    python -m experiments.pretrain_zoo --workdir=runs/pool

* `search_space` (Fig. 7): two (or more) FedStitch runs, with and
  without the search-space optimiser: candidate blocks scored per round
  (the live networks' pool sizes), round time and final accuracy; the
  speed-up of the optimiser.

    python -m experiments.stitch --pool=runs/pool --prune \
        --workdir=runs/stitch/prune
    python -m experiments.stitch --pool=runs/pool --noprune \
        --workdir=runs/stitch/noprune
    --runs='with optimiser:runs/stitch/prune;without:runs/stitch/noprune'

* `voting` (Table IV): RL-weighted against plain voting, IID and
  non-IID: the best network's accuracy per run, the aggregation each was
  made with, and the difference.

    python -m experiments.stitch --pool=runs/pool --aggregation=rl \
        --partition=dirichlet --alpha=0.1 --workdir=runs/stitch/rl_dir0.1
    python -m experiments.stitch --pool=runs/pool --aggregation=uniform \
        --partition=dirichlet --alpha=0.1 --workdir=runs/stitch/uni_dir0.1
    (and --partition=iid)
    --runs='RL-weighted:iid=...,noniid=runs/stitch/rl_dir0.1;Uniform:...'

* `rank_vs_classes` (Fig. 2): one FedStitch run; per number of classes a
  client holds: the cross-validated rank of its uploaded blocks in the
  other participants' CKA scores (log.jsonl 'ranks', 1 best; by depth),
  its learned weight after the last round (its final state) and, with
  --local_clients, the accuracy of the network it stitches alone. The
  clients' classes come from the run's partition.json (per-client label
  histograms, as experiments.run writes it), or `--partition_summary`.
  The paper's setting gives clients fixed numbers of classes; with a
  class-count partition in experiments.stitch (e.g. --partition=shards
  --shards_per_client=2, writing partition.json):

    python -m experiments.stitch --pool=runs/pool --partition=shards \
        --shards_per_client=2 --local_clients=10 --workdir=runs/stitch/shards2
"""

from __future__ import annotations

# First: Ctrl-C while the modules below import ends in one line (cli).
from . import cli  # isort: split

import dataclasses
import re

from absl import flags
from absl import logging

from fedjax_mr.analysis import stitch_paper
from fedjax_mr.core import errors

FIELDS = dataclasses.fields(stitch_paper.Setting)
_DEFINE = {'bool': flags.DEFINE_bool, 'int': flags.DEFINE_integer}


def _help(f: dataclasses.Field) -> str:
  """The help of the setting's field `f`, naming its fields as flags."""
  return re.sub(r'`([a-z][a-z0-9_]*(=[^`]*)?)`', r'--\1', f.metadata['help'])


for _f in FIELDS:
  if _f.metadata['choices']:
    flags.DEFINE_enum(_f.name, _f.default, _f.metadata['choices'], _help(_f))
  elif isinstance(_f.default, tuple):
    flags.DEFINE_list(_f.name, list(_f.default), _help(_f))
  else:
    _DEFINE.get(_f.type, flags.DEFINE_string)(_f.name, _f.default, _help(_f))
FLAGS = flags.FLAGS


def main(argv) -> None:
  cli.no_arguments(argv)
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore
  values = {f.name: FLAGS[f.name].value for f in FIELDS}
  setting = stitch_paper.Setting(
    **{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
  )
  try:
    stitch_paper.make(setting, log=print)
  except errors.UserError as e:
    cli.fail(str(e))


def entry() -> None:
  """The console script `fedjax-mr-stitch-figures`."""
  cli.run(main)


if __name__ == '__main__':
  entry()
