"""One of the FedStitch paper's tables or figures, made from finished
workdirs: a frozen `Setting` (which figure, where, from which runs) goes to
`make`, which checks it, reads the runs, writes `<figure>.json` and
`<figure>.md` and/or `<figure>.png` into `output` and returns what it
wrote (`Made`).

References: "Heterogeneity-Aware Coordination for Federated Learning via
Stitching Pre-trained blocks", Shichen Zhan, Yebo Wu, Chunlin Tian, Yan
Zhao, Li Li (2024).

Nothing is trained or run: the runs are read by `stitch_tables` (Tables III
and IV), the figures drawn by `stitch_figures`, and only `memory` compiles
(never runs) models, in `stitch_memory`. Errors are `ConfigError`s naming
the setting's field in backticks (`runs`, `figure`=memory), which a program
renders as its flags.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any
from typing import Callable
from typing import NamedTuple

from fedjax_mr.analysis import stitch_figures as figures
from fedjax_mr.analysis import stitch_memory
from fedjax_mr.analysis import stitch_tables
from fedjax_mr.core import errors
from fedjax_mr.core import jsonfile
from fedjax_mr.models import model as model_lib
from fedjax_mr.stitch import pool as pool_lib

FIGURES = (
  'table3',
  'acc_vs_time',
  'acc_vs_round',
  'memory',
  'search_space',
  'voting',
  'rank_vs_classes',
)
_NO_POINTS = (
  '`runs`: no workdir has points yet (training runs need evaluated rounds '
  'in metrics.jsonl, FedStitch runs their results.json)'
)


def _field(default: Any, help_text: str, choices=None):
  return dataclasses.field(
    default=default, metadata={'help': help_text, 'choices': choices}
  )


@dataclasses.dataclass(frozen=True)
class Setting:
  """Which table or figure to make, from which runs (see each field's
  help; a name in backticks is another field)."""

  figure: str | None = _field(
    None, 'Which table or figure of the paper to make.', FIGURES
  )
  output: str | None = _field(
    None, 'Output folder (<figure>.json, .md and/or .png).'
  )
  runs: str = _field(
    '',
    "Methods and workdirs: 'label:column=path,column=path;label:path;...' "
    '(columns are settings, e.g. iid and noniid; a bare path is column '
    "'run'), or a JSON file {label: {column: path}}. All figures but memory.",
  )
  last: int = _field(
    10,
    'table3 and acc_vs_round: training runs average their last this many '
    'evaluations.',
  )
  time_unit: str = _field(
    'minutes', 'acc_vs_time: x axis.', tuple(stitch_tables.TIME_UNITS)
  )
  include_eval: bool = _field(
    False,
    "acc_vs_time: add training runs' evaluation time to their wall time.",
  )
  partition_summary: str | None = _field(
    None,
    'rank_vs_classes: the partition summary (JSON with per-client '
    "'label_histograms') of the run. Default: <workdir>/partition.json.",
  )
  pool: str | None = _field(None, 'memory: the pool folder.')
  pool_models: tuple[str, ...] = _field(
    (), 'memory: pool model ids (default: all in `pool`).'
  )
  cuts: str = _field(
    'default',
    'memory: how pool models are cut into blocks (as experiments.stitch).',
    ('default', 'per_linear', 'every_unit'),
  )
  batch_size: int = _field(64, "memory: FedStitch's scoring batch.")
  train_batch_size: int = _field(128, "memory: the baselines' local batch.")
  ft_layers: int = _field(
    2,
    'memory: FT-Part trains the last this many parameterised modules (as '
    'experiments.run `algorithm=ft_part` `ft_layers`).',
  )
  models: tuple[str, ...] = _field(
    (), 'memory: zoo models trained from scratch (baselines).'
  )
  # Numbers, or their digits as a command line gives them.
  input_shape: tuple[int | str, ...] = _field(
    (),
    "memory: the `models`' input shape, e.g. 32,32,3 (default: the pool's).",
  )
  num_classes: int = _field(10, "memory: the `models`' classes.")


class Made(NamedTuple):
  """What `make` made: the numbers shown (`data`, as `<figure>.json`
  holds them), the table (`text`, None for a figure alone) and the paths
  written."""

  data: Any
  text: str | None
  written: list[str]


def check(setting: Setting) -> None:
  """Raises `errors.ConfigError` naming the first bad field of `setting`:
  `figure`, `output`, then what the figure reads (a memory figure's sizes
  and models; the others' `last` and `runs`)."""
  if setting.figure is None:
    raise errors.ConfigError(f'`figure` is needed: one of {", ".join(FIGURES)}')
  for f in dataclasses.fields(Setting):
    value, choices = getattr(setting, f.name), f.metadata['choices']
    if choices and value not in choices:
      raise errors.ConfigError(
        f'`{f.name}` is {value!r}, not one of {", ".join(choices)}'
      )
  if not setting.output:
    raise errors.ConfigError(
      '`output` is needed: the folder to write the figure into'
    )
  if setting.figure == 'memory':
    for name in ('batch_size', 'train_batch_size', 'num_classes', 'ft_layers'):
      if getattr(setting, name) < 1:
        raise errors.ConfigError(
          f'`{name}` must be ≥ 1, got {getattr(setting, name)}'
        )
    if not setting.pool and not setting.models:
      raise errors.ConfigError('`figure`=memory needs `pool` and/or `models`')
    return
  if setting.figure in ('table3', 'acc_vs_round') and setting.last < 1:
    raise errors.ConfigError(f'`last` must be ≥ 1, got {setting.last}')
  if not setting.runs:
    raise errors.ConfigError(f'`runs` is needed for `figure`={setting.figure}')


def _quiet(line: str) -> None:
  del line


def make(setting: Setting, log: Callable[[str], None] = _quiet) -> Made:
  """Makes `setting.figure` into `setting.output`.

  Args:
    setting: the figure, its output folder and what it reads (`check`).
    log: called with what a program prints, in order: the table (one
      string, without its last newline), the runs left out of a figure
      for want of points, then `wrote <path>` for each file written.

  Returns:
    The numbers, the table and the paths written (`Made`).

  Raises:
    errors.UserError: a bad setting (`check`) or an unreadable run, pool
      or partition summary, naming the field in backticks.
  """
  check(setting)
  if setting.figure == 'memory':
    data, text, fig = _memory(setting)
  else:
    runs = stitch_tables.parse_runs(setting.runs)
    data, text, fig = _MAKERS[setting.figure](setting, runs, log)
  if text is not None:
    log(text.removesuffix('\n'))
  written = figures.write(setting.output, setting.figure, data, text, fig)
  for path in written:
    log(f'wrote {path}')
  return Made(data, text, written)


def _table3(setting, runs, log):
  del log
  data, text = stitch_tables.accuracy_table(runs, setting.last)
  return data, text, None


def _voting(setting, runs, log):
  del setting, log
  data, text = stitch_tables.voting_table(runs)
  return data, text, None


def _acc_vs_time(setting, runs, log):
  curves = figures.time_curves(runs, setting.include_eval)
  if not curves:
    raise errors.ConfigError(_NO_POINTS)
  for label, cols in runs.items():
    for col, path in cols.items():
      if label not in curves.get(col, {}):
        log(f'no points yet, left out: {label} ({col}): {path}')
  fig = figures.time_figure(curves, setting.time_unit, setting.include_eval)
  data = {
    'time_unit': 'seconds',
    'evaluation_included': setting.include_eval,
    'curves': curves,
  }
  return data, None, fig


def _acc_vs_round(setting, runs, log):
  del log
  curves = figures.round_curves(runs, setting.last)
  if not curves:
    raise errors.ConfigError(_NO_POINTS)
  fig = figures.round_figure(curves, setting.last)
  return {'last': setting.last, 'curves': curves}, None, fig


def _search_space(setting, runs, log):
  del setting, log
  data = figures.search_space(runs)
  if not data:
    raise errors.ConfigError(
      '`runs`: no FedStitch workdir with a log.jsonl among them'
    )
  text = figures.search_space_table(data)
  return data, text, figures.search_space_figure(data)


def _rank_vs_classes(setting, runs, log):
  del log
  paths = [p for cols in runs.values() for p in cols.values()]
  if len(paths) != 1:
    raise errors.ConfigError(
      f'`runs`: rank_vs_classes takes one workdir, got {len(paths)}'
    )
  (path,) = paths
  if stitch_tables.kind_of(path) != 'stitch':
    raise errors.ConfigError(
      f'`runs`: {path} is not a FedStitch workdir (no log.jsonl)'
    )
  rounds = stitch_tables.read_log(path)
  if not rounds:
    raise errors.ConfigError(f'`runs`: {path}/log.jsonl holds no round')
  summary = setting.partition_summary or os.path.join(path, 'partition.json')
  classes = _classes(summary, setting.partition_summary, path)
  state = stitch_tables.stitch_state(path)
  weights = None
  if state is not None and state[0].get('weights') is not None:
    weights = [float(w) for w in state[0]['weights']]
    if len(weights) != len(classes):
      raise errors.ConfigError(
        f'`partition_summary`: {summary} has '
        f'{len(classes)} clients, the run {path} has {len(weights)}'
      )
  res = stitch_tables.stitch_results(path)
  data = figures.rank_data(
    rounds, classes, weights, (res or {}).get('local') or None
  )
  data['path'] = path
  fig = figures.rank_figure(data, f'{next(iter(runs))}: {path}')
  return data, figures.rank_table(data), fig


def _classes(summary: str, given: str | None, path: str) -> list[int]:
  """The number of classes of each client of the run `path`, from the
  partition summary `summary` (`given`, or the run's partition.json)."""
  if given:
    where = f'`partition_summary`={given}'
  else:
    where = (
      f'`runs`: {path} has no readable partition.json (and no '
      '`partition_summary` was given)'
    )
  try:
    return figures.read_classes_per_client(summary)
  except jsonfile.JsonFileError as e:
    raise errors.ConfigError(
      f"{where}: cannot read the clients' classes ({e.reason}); want a "
      "JSON partition summary with per-client 'label_histograms'"
    ) from None


def _memory(setting):
  models, chains = [], []
  if setting.pool:
    models = pool_lib.load(setting.pool, list(setting.pool_models) or None)
    chains = pool_lib.chains(models, setting.cuts)
  baselines = _baselines(setting, models)
  try:
    data = stitch_memory.memory_data(
      chains,
      models,
      baselines,
      setting.batch_size,
      setting.train_batch_size,
      setting.ft_layers,
    )
  except errors.ArgumentError as e:  # FT-Part's layers, the one argument
    raise errors.ConfigError(f'`ft_layers`: {e.message}') from None
  text = stitch_memory.memory_table(data)
  return data, text, stitch_memory.memory_figure(data)


def _baselines(setting, models) -> list[tuple[str, Any]]:
  """(label, zoo model) of each of `setting.models`, at `input_shape`
  (default: the first pool model's of `models`)."""
  shape = None
  if setting.input_shape:
    try:
      shape = tuple(int(s) for s in setting.input_shape)
    except ValueError:
      given = ','.join(str(s) for s in setting.input_shape)
      raise errors.ConfigError(
        f'`input_shape`: not integers: {given}'
      ) from None
  elif models:
    shape = tuple(models[0].model.input_shape)
  if setting.models and shape is None:
    raise errors.ConfigError(
      '`models` needs `input_shape` (or a `pool` to take it from)'
    )
  baselines = []
  for m in setting.models:
    try:
      baselines.append(
        (f'{m} (scratch)', model_lib.get(m, setting.num_classes, shape))
      )
    except (KeyError, ValueError) as e:
      raise errors.ConfigError(f'`models`: {m}: {e}') from None
  return baselines


_MAKERS = {
  'table3': _table3,
  'voting': _voting,
  'acc_vs_time': _acc_vs_time,
  'acc_vs_round': _acc_vs_round,
  'search_space': _search_space,
  'rank_vs_classes': _rank_vs_classes,
}
