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
FedStitch (experiments.stitch: log.jsonl, results.json, state.npz), a
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
  its learned weight after the last round (state.npz) and, with
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

from absl import flags
from absl import logging

FIGURES = [
  'table3',
  'acc_vs_time',
  'acc_vs_round',
  'memory',
  'search_space',
  'voting',
  'rank_vs_classes',
]
_FIGURE = flags.DEFINE_enum(
  'figure', None, FIGURES, 'Which table or figure of the paper to make.'
)
_OUTPUT = flags.DEFINE_string(
  'output', None, 'Output folder (<figure>.json, .md and/or .png).'
)
_RUNS = flags.DEFINE_string(
  'runs',
  '',
  "Methods and workdirs: 'label:column=path,column=path;label:path;...' "
  '(columns are settings, e.g. iid and noniid; a bare path is column '
  "'run'), or a JSON file {label: {column: path}}. All figures but memory.",
)
_LAST = flags.DEFINE_integer(
  'last',
  10,
  'table3 and acc_vs_round: training runs average their last this many '
  'evaluations.',
)
_TIME_UNIT = flags.DEFINE_enum(
  'time_unit',
  'minutes',
  ['hours', 'minutes', 'seconds'],
  'acc_vs_time: x axis.',
)
_INCLUDE_EVAL = flags.DEFINE_bool(
  'include_eval',
  False,
  "acc_vs_time: add training runs' evaluation time to their wall time.",
)
_PARTITION_SUMMARY = flags.DEFINE_string(
  'partition_summary',
  None,
  'rank_vs_classes: the partition summary (JSON with per-client '
  "'label_histograms') of the run. Default: <workdir>/partition.json.",
)
_POOL = flags.DEFINE_string('pool', None, 'memory: the pool folder.')
_POOL_MODELS = flags.DEFINE_list(
  'pool_models', [], 'memory: pool model ids (default: all in --pool).'
)
_CUTS = flags.DEFINE_enum(
  'cuts',
  'default',
  ['default', 'per_linear', 'every_unit'],
  'memory: how pool models are cut into blocks (as experiments.stitch).',
)
_BATCH_SIZE = flags.DEFINE_integer(
  'batch_size', 64, "memory: FedStitch's scoring batch."
)
_TRAIN_BATCH_SIZE = flags.DEFINE_integer(
  'train_batch_size', 128, "memory: the baselines' local batch."
)
_FT_LAYERS = flags.DEFINE_integer(
  'ft_layers',
  2,
  'memory: FT-Part trains the last this many parameterised modules (as '
  'experiments.run --algorithm=ft_part --ft_layers).',
)
_MODELS = flags.DEFINE_list(
  'models', [], 'memory: zoo models trained from scratch (baselines).'
)
_INPUT_SHAPE = flags.DEFINE_list(
  'input_shape',
  [],
  "memory: the --models' input shape, e.g. 32,32,3 (default: the pool's).",
)
_NUM_CLASSES = flags.DEFINE_integer(
  'num_classes', 10, "memory: the --models' classes."
)


def _runs(figures):
  from fedjax_mr.analysis import stitch_tables

  if not _RUNS.value:
    cli.fail(f'--runs is needed for --figure={_FIGURE.value}')
  return stitch_tables.parse_runs(_RUNS.value)


def _print_written(paths) -> None:
  for p in paths:
    print(f'wrote {p}')


def main(argv) -> None:
  cli.no_arguments(argv)
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore
  if _FIGURE.value is None:
    cli.fail(f'--figure is needed: one of {", ".join(FIGURES)}')
  if not _OUTPUT.value:
    cli.fail('--output is needed: the folder to write the figure into')
  from fedjax_mr.analysis import stitch_figures as figures
  from fedjax_mr.core import errors

  try:
    _main(figures, errors)
  except errors.UserError as e:
    cli.fail(str(e))


def _main(figures, errors) -> None:
  from fedjax_mr.analysis import stitch_tables

  name, out = _FIGURE.value, _OUTPUT.value
  if name == 'memory':
    _memory(figures, errors, out)
    return
  if name in ('table3', 'acc_vs_round') and _LAST.value < 1:
    cli.fail(f'--last must be ≥ 1, got {_LAST.value}')
  runs = _runs(figures)
  if name == 'table3':
    data, text = stitch_tables.accuracy_table(runs, _LAST.value)
    print(text, end='')
    _print_written(figures.write(out, name, data, text))
  elif name == 'voting':
    data, text = stitch_tables.voting_table(runs)
    print(text, end='')
    _print_written(figures.write(out, name, data, text))
  elif name == 'acc_vs_time':
    curves = figures.time_curves(runs, _INCLUDE_EVAL.value)
    if not curves:
      cli.fail(
        '--runs: no workdir has points yet (training runs need evaluated '
        'rounds in metrics.jsonl, FedStitch runs their results.json)'
      )
    for label, cols in runs.items():
      for col, path in cols.items():
        if label not in curves.get(col, {}):
          print(f'no points yet, left out: {label} ({col}): {path}')
    fig = figures.time_figure(curves, _TIME_UNIT.value, _INCLUDE_EVAL.value)
    data = {
      'time_unit': 'seconds',
      'evaluation_included': _INCLUDE_EVAL.value,
      'curves': curves,
    }
    _print_written(figures.write(out, name, data, None, fig))
  elif name == 'acc_vs_round':
    curves = figures.round_curves(runs, _LAST.value)
    if not curves:
      cli.fail(
        '--runs: no workdir has points yet (training runs need evaluated '
        'rounds in metrics.jsonl, FedStitch runs their results.json)'
      )
    fig = figures.round_figure(curves, _LAST.value)
    data = {'last': _LAST.value, 'curves': curves}
    _print_written(figures.write(out, name, data, None, fig))
  elif name == 'search_space':
    data = figures.search_space(runs)
    if not data:
      cli.fail('--runs: no FedStitch workdir with a log.jsonl among them')
    text = figures.search_space_table(data)
    print(text, end='')
    fig = figures.search_space_figure(data)
    _print_written(figures.write(out, name, data, text, fig))
  elif name == 'rank_vs_classes':
    _rank(figures, runs, out)


def _rank(figures, runs, out) -> None:
  import os

  from fedjax_mr.analysis import stitch_tables
  from fedjax_mr.core import jsonfile

  paths = [p for cols in runs.values() for p in cols.values()]
  if len(paths) != 1:
    cli.fail(f'--runs: rank_vs_classes takes one workdir, got {len(paths)}')
  (path,) = paths
  if stitch_tables.kind_of(path) != 'stitch':
    cli.fail(f'--runs: {path} is not a FedStitch workdir (no log.jsonl)')
  log = stitch_tables.read_log(path)
  if not log:
    cli.fail(f'--runs: {path}/log.jsonl holds no round')
  summary_path = _PARTITION_SUMMARY.value or os.path.join(
    path, 'partition.json'
  )
  if _PARTITION_SUMMARY.value:
    where = f'--partition_summary={summary_path}'
  else:
    where = (
      f'--runs: {path} has no readable partition.json (and no '
      '--partition_summary was given)'
    )
  try:
    classes = figures.read_classes_per_client(summary_path)
  except jsonfile.JsonFileError as e:
    cli.fail(
      f"{where}: cannot read the clients' classes ({e.reason}); want a "
      "JSON partition summary with per-client 'label_histograms'"
    )
  state = stitch_tables.stitch_state(path)
  weights = None
  if state is not None and state[0].get('weights') is not None:
    weights = [float(w) for w in state[0]['weights']]
    if len(weights) != len(classes):
      cli.fail(
        f'--partition_summary: {summary_path} has {len(classes)} clients, '
        f'the run {path} has {len(weights)}'
      )
  res = stitch_tables.stitch_results(path)
  data = figures.rank_data(
    log, classes, weights, (res or {}).get('local') or None
  )
  data['path'] = path
  text = figures.rank_table(data)
  print(text, end='')
  fig = figures.rank_figure(data, f'{next(iter(runs))}: {path}')
  _print_written(figures.write(out, 'rank_vs_classes', data, text, fig))


def _memory(figures, errors, out) -> None:
  from fedjax_mr.analysis import stitch_memory
  from fedjax_mr.models import model as model_lib

  for flag in (_BATCH_SIZE, _TRAIN_BATCH_SIZE, _NUM_CLASSES, _FT_LAYERS):
    if flag.value < 1:
      cli.fail(f'--{flag.name} must be ≥ 1, got {flag.value}')
  if not _POOL.value and not _MODELS.value:
    cli.fail('--figure=memory needs --pool and/or --models')
  models, chains = [], []
  if _POOL.value:
    from fedjax_mr.stitch import pool as pool_lib

    models = pool_lib.load(_POOL.value, _POOL_MODELS.value or None)
    chains = pool_lib.chains(models, _CUTS.value)
  shape = None
  if _INPUT_SHAPE.value:
    try:
      shape = tuple(int(s) for s in _INPUT_SHAPE.value)
    except ValueError:
      cli.fail(f'--input_shape: not integers: {",".join(_INPUT_SHAPE.value)}')
  elif models:
    shape = tuple(models[0].model.input_shape)
  if _MODELS.value and shape is None:
    cli.fail('--models needs --input_shape (or a --pool to take it from)')
  baselines = []
  for m in _MODELS.value:
    try:
      baselines.append(
        (f'{m} (scratch)', model_lib.get(m, _NUM_CLASSES.value, shape))
      )
    except (KeyError, ValueError) as e:
      cli.fail(f'--models: {m}: {e}')
  try:
    data = stitch_memory.memory_data(
      chains,
      models,
      baselines,
      _BATCH_SIZE.value,
      _TRAIN_BATCH_SIZE.value,
      _FT_LAYERS.value,
    )
  except errors.ArgumentError as e:  # FT-Part's layers, the one argument
    cli.fail(f'--ft_layers: {e.message}')
  text = stitch_memory.memory_table(data)
  print(text, end='')
  fig = stitch_memory.memory_figure(data)
  _print_written(figures.write(out, 'memory', data, text, fig))


def entry() -> None:
  """The console script `fedjax-mr-stitch-figures`."""
  cli.run(main)


if __name__ == '__main__':
  entry()
