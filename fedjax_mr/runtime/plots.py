"""Figures of runs: learning curves over seeds, and loss landscapes.

Every figure is a `matplotlib.figure.Figure` drawn on the Agg canvas and
written atomically as a PNG. pyplot is never imported: neither importing
this module nor drawing with it changes the process's matplotlib backend
(a notebook keeps its own), and matplotlib itself is imported on first use.

Learning curves (`curves_figure`): test accuracy in percent, test loss and
train loss per round, and FedMR's mean pairwise cosine of the K models when
a run logged it; per method the mean over its seeds with a band of ±1
standard deviation. A run whose loss became non-finite is drawn up to its
last finite round, dashed, and marked there with ×; the legend says where
it diverged.
"""

from __future__ import annotations

import functools
import math
import re
import textwrap
from typing import Any
from typing import Mapping
from typing import NamedTuple
from typing import Sequence

import numpy as np

from fedjax_mr.core import files
from fedjax_mr.runtime import metrics_io

# label -> {seed: metrics rows}: what the curve figures take.
Runs = Mapping[str, Mapping[Any, Sequence[Mapping[str, Any]]]]


class Panel(NamedTuple):
  """One panel of the learning-curve figure.

  Attributes:
    key: the metrics row's key.
    label: the y axis label.
    scale: values are multiplied by it (accuracy in percent).
    log: log-scaled y axis (where every value is positive).
  """

  key: str
  label: str
  scale: float = 1.0
  log: bool = False


PANELS = (
  Panel('test_accuracy', 'test accuracy (%)', 100.0),
  Panel('test_loss', 'test loss', log=True),
  Panel('train_loss', 'train loss', log=True),
)
# Drawn when some run logged them.
OPTIONAL_PANELS = (
  Panel('pairwise_cosine', 'mean pairwise cosine of the K models'),
)
# Legends with more entries go below the panels, in columns.
MAX_SIDE_LEGEND = 8


def series(
  rows: Sequence[Mapping[str, Any]], key: str, scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
  """`(rounds, values * scale)` of the rows holding a finite `key`, by
  round (a repeated round keeps its last row)."""
  points = {}
  for row in rows:
    value = row.get(key)
    if isinstance(value, (int, float)) and math.isfinite(value):
      points[int(row['round'])] = float(value) * scale
  rounds = np.array(sorted(points), np.int64)
  return rounds, np.array([points[r] for r in rounds.tolist()], np.float64)


class Stopped(NamedTuple):
  """A seed whose loss became non-finite.

  Attributes:
    seed: the seed, as given.
    round: the round whose train loss was non-finite.
    rounds: `[R]` its rounds with a finite value (up to the last one).
    values: `[R]` the values there.
  """

  seed: Any
  round: int
  rounds: np.ndarray
  values: np.ndarray


class Curve(NamedTuple):
  """One method's curve of one metric over its seeds.

  Attributes:
    rounds: `[R]` the rounds where every finished seed has a finite value.
    mean: `[R]` mean over the finished seeds.
    std: `[R]` their standard deviation (over seeds, ddof 0 as in
      results.md).
    seeds: how many finished seeds have the metric.
    stopped: the seeds that diverged, each drawn on its own.
  """

  rounds: np.ndarray
  mean: np.ndarray
  std: np.ndarray
  seeds: int
  stopped: tuple[Stopped, ...]


def curve(
  runs: Mapping[Any, Sequence[Mapping[str, Any]]],
  key: str,
  scale: float = 1.0,
) -> Curve:
  """Mean and standard deviation of metric `key` over seeds.

  Args:
    runs: seed -> metrics rows of one method.
    key: the metric.
    scale: values are multiplied by it.

  Returns:
    A `Curve`: finished seeds (train loss finite in their last row) are
    averaged over the rounds they all have; diverged ones are kept apart.
  """
  finished, stopped = [], []
  for seed, rows in runs.items():
    rounds, values = series(rows, key, scale)
    stop = metrics_io.diverged_at(rows)
    if stop is not None:
      stopped.append(Stopped(seed, stop, rounds, values))
    elif len(rounds):
      finished.append((rounds, values))
  if not finished:
    empty = np.zeros(0)
    return Curve(empty.astype(np.int64), empty, empty, 0, tuple(stopped))
  common = functools.reduce(np.intersect1d, [r for r, _ in finished])
  stack = np.stack([v[np.isin(r, common)] for r, v in finished])
  return Curve(
    common,
    stack.mean(axis=0),
    stack.std(axis=0),
    len(finished),
    tuple(stopped),
  )


def legend_label(name: str, runs: Mapping[Any, Sequence[Mapping]]) -> str:
  """`name`, its number of seeds, and where runs diverged.

  'FedProx (3 seeds)', 'MOON (diverged at round 12)', 'SCAFFOLD (3 seeds;
  seed 0 diverged at round 10, seed 2 at round 8)'.
  """
  stops = [
    (seed, stop)
    for seed, rows in runs.items()
    if (stop := metrics_io.diverged_at(rows)) is not None
  ]
  notes = [f'{len(runs)} seeds'] if len(runs) > 1 else []
  if stops and len(runs) == 1:
    notes.append(f'diverged at round {stops[0][1]}')
  elif stops:
    (seed, stop), *more = stops
    notes.append(
      ', '.join(
        [f'seed {seed} diverged at round {stop}']
        + [f'seed {s} at round {r}' for s, r in more]
      )
    )
  text = f'{name} ({"; ".join(notes)})' if notes else name
  return textwrap.fill(text, 44, subsequent_indent='  ')


def _matplotlib():
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  return Figure, FigureCanvasAgg


def _colors(n: int) -> list:
  """n colours: tab20's ten dark shades (tab10's colours) first, then their
  light partners (tab20 in its own order puts each dark shade next to its
  light one, so neighbouring methods looked alike)."""
  import matplotlib

  cmap = matplotlib.colormaps['tab20']
  order = [*range(0, 20, 2), *range(1, 20, 2)]
  return [cmap(order[i % 20]) for i in range(n)]


def curves_figure(runs: Runs, title: str = '') -> Any:
  """The learning curves of several methods, each over its seeds.

  Loss panels have a log scale cut off a decade above the finished runs'
  typical values (`loss_ceiling`), so that one exploding run does not
  flatten the others; a diverged run's × beyond it sits on the top edge.

  Args:
    runs: method label -> {seed: metrics rows (as in metrics.jsonl)}.
    title: the setting, first line of the figure's title.

  Returns:
    A `matplotlib.figure.Figure` on the Agg canvas.
  """
  panels = _panels(runs)
  curves = {
    name: [curve(seeds, p.key, p.scale) for p in panels]
    for name, seeds in runs.items()
  }
  fig, axes = _grid(len(panels), 0.5)
  colors = dict(zip(runs, _colors(len(runs))))
  cut = False
  for i, (ax, panel) in enumerate(zip(axes, panels)):
    column = {name: c[i] for name, c in curves.items()}
    cut |= _draw_panel(ax, panel, column, colors)
    _say_who(ax, panel, column)
  _legend(fig, axes, runs, curves, colors)
  lines = [line for line in (title, '; '.join(_notes(curves, cut))) if line]
  if lines:
    suptitle(fig, '\n'.join(lines))
  return fig


def _drawn(c: Curve) -> bool:
  """Whether curve `c` has any value to draw."""
  return bool(len(c.rounds) or any(len(s.rounds) for s in c.stopped))


def _say_who(ax: Any, panel: Panel, column: Mapping[str, Curve]) -> None:
  """Titles an optional panel (the K models' cosine) with the methods
  that logged it, when others did not (FedMR's family, not FedAvg)."""
  if panel not in OPTIONAL_PANELS:
    return
  logged = [n for n, c in column.items() if _drawn(c)]
  if len(logged) < len(column):
    ax.set_title(
      textwrap.fill(f'{", ".join(logged)} only', 50), fontsize='small'
    )


def families_figure(
  runs: Runs, groups: Mapping[str, Sequence[str]], title: str = ''
) -> Any:
  """Small multiples of many methods: one row per group of methods
  (`groups`: row title -> method labels of `runs`), each row's test
  accuracy and train loss (and the K models' cosine where its methods
  logged it), with the first method of `runs` drawn in grey in every row
  as the reference.

  Returns:
    A `matplotlib.figure.Figure` on the Agg canvas.
  """
  figure, canvas = _matplotlib()
  reference = next(iter(runs))
  keys = {p.key for p in _panels(runs)}
  panels = [p for p in PANELS + OPTIONAL_PANELS if p.key in keys]
  panels = [p for p in panels if p.key != 'test_loss']
  fig = figure(
    figsize=(4.4 * len(panels), 3.0 * len(groups) + 0.8),
    layout='constrained',
  )
  canvas(fig)
  axes = fig.subplots(len(groups), len(panels), squeeze=False)
  cut = False
  for row, (name, members) in zip(axes, groups.items()):
    shown = [reference] + [m for m in members if m != reference]
    colors = dict(zip(shown, ['0.6'] + _colors(len(shown) - 1)))
    for ax, panel in zip(row, panels):
      column = {m: curve(runs[m], panel.key, panel.scale) for m in shown}
      logged = {m: c for m, c in column.items() if _drawn(c)}
      if not logged:  # a cosine panel of a row without FedMR's family
        ax.set_visible(False)
        continue
      cut |= _draw_panel(ax, panel, logged, colors)
      _say_who(ax, panel, column)
    row[0].set_title(name, loc='left', fontsize='medium')
    _legend(fig, row[:1], {m: runs[m] for m in shown}, {}, colors, inside=True)
  curves = {m: [curve(runs[m], 'train_loss')] for m in runs}
  lines = [line for line in (title, '; '.join(_notes(curves, cut))) if line]
  if lines:
    suptitle(fig, '\n'.join(lines))
  return fig


def suptitle(fig: Any, text: str, **kwargs: Any) -> None:
  """Sets `fig`'s title, each line broken after a comma or semicolon
  where it would be wider than the figure (a long setting's title was cut
  off at both edges)."""
  title = fig.suptitle(text, **kwargs)
  renderer = fig.canvas.get_renderer()
  room = 0.98 * fig.bbox.width

  def width(line: str) -> float:
    title.set_text(line)
    return title.get_window_extent(renderer).width

  out = []
  for line in text.split('\n'):
    words = re.split(r'(?<=[,;]) ', line)
    current = words[0]
    for word in words[1:]:
      if width(f'{current} {word}') <= room:
        current = f'{current} {word}'
      else:
        out.append(current)
        current = word
    out.append(current)
  title.set_text('\n'.join(out))


def _panels(runs: Runs) -> tuple[Panel, ...]:
  """`PANELS`, and the `OPTIONAL_PANELS` that some run logged."""
  logged = {
    key
    for seeds in runs.values()
    for rows in seeds.values()
    for row in rows
    for key in row
  }
  return PANELS + tuple(p for p in OPTIONAL_PANELS if p.key in logged)


def _grid(n: int, margin: float = 3.0) -> tuple[Any, np.ndarray]:
  """A figure (Agg canvas) and its first `n` axes, in rows of 2 (for 4)
  or up to 3, `margin` inches wider; the axes beyond `n` are hidden."""
  figure, canvas = _matplotlib()
  ncols = 2 if n == 4 else min(n, 3)
  nrows = -(-n // ncols)
  fig = figure(
    figsize=(4.4 * ncols + margin, 3.4 * nrows + 0.8), layout='constrained'
  )
  canvas(fig)
  axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
  for ax in axes[n:]:
    ax.set_visible(False)
  return fig, axes


def _draw_panel(
  ax: Any, panel: Panel, column: Mapping[str, Curve], colors: Mapping
) -> bool:
  """Draws each method's `Curve` of `panel` (`column`: method -> curve)
  on `ax`; returns whether a loss was cut off at the panel's ceiling."""
  ceiling = loss_ceiling(list(column.values())) if panel.log else math.inf
  drawn = [c.mean for c in column.values()] + [
    s.values for c in column.values() for s in c.stopped
  ]
  drawn = np.concatenate([np.zeros(0), *drawn])
  for name, c in column.items():
    _draw_curve(ax, c, colors[name], ceiling)
  cut = bool(panel.log and drawn.size and drawn.max() > ceiling)
  _axis(ax, panel, drawn, ceiling if cut else None)
  return cut


def _draw_curve(ax: Any, c: Curve, color: Any, ceiling: float) -> None:
  """One method's mean (dotted where there are few rounds), its ±1 std
  band over several seeds, and each diverged seed dashed up to a × at
  its last finite value (at most `ceiling`)."""
  if len(c.rounds):
    ax.plot(
      c.rounds,
      c.mean,
      color=color,
      lw=1.3,
      marker='.' if len(c.rounds) <= 30 else None,
    )
    if c.seeds > 1:
      ax.fill_between(
        c.rounds,
        c.mean - c.std,
        c.mean + c.std,
        color=color,
        alpha=0.2,
        lw=0,
      )
  for s in c.stopped:
    if not len(s.rounds):
      continue
    ax.plot(s.rounds, s.values, color=color, lw=1.0, ls='--')
    ax.plot(
      s.rounds[-1:],
      np.minimum(s.values[-1:], ceiling),
      color=color,
      ls='none',
      marker='x',
      ms=9,
      mew=2,
      clip_on=False,
      zorder=5,
    )


def _legend(
  fig: Any,
  axes: np.ndarray,
  runs: Runs,
  curves: Mapping[str, list[Curve]],
  colors: Mapping,
  inside: bool = False,
) -> None:
  """One entry per method (dashed when no seed finished, × when one
  diverged): a single method's inside its first panel (`axes[0]`),
  several below the panels, in rows of four, or of three when there are
  more than `MAX_SIDE_LEGEND` (beside the panels, centred, a legend
  floated between two rows of them, and at the top right it ran into a
  long title); `inside`: all inside `axes[0]`."""
  from matplotlib.lines import Line2D

  handles, labels = [], []
  for name, seeds in runs.items():
    drawn = curves.get(name) or [curve(seeds, 'train_loss')]
    finished = any(c.seeds for c in drawn)
    stopped = any(c.stopped for c in drawn)
    handles.append(
      Line2D(
        [],
        [],
        color=colors[name],
        lw=1.5,
        ls='-' if finished else '--',
        marker='x' if stopped else None,
        ms=8,
        mew=2,
      )
    )
    labels.append(legend_label(name, seeds))
  if len(handles) == 1 or inside:  # inside the accuracy panel
    axes[0].legend(handles, labels, loc='best', fontsize='small')
  else:  # below the panels, in columns
    fig.legend(
      handles,
      labels,
      loc='outside lower center',
      ncols=min(4 if len(handles) <= MAX_SIDE_LEGEND else 3, len(handles)),
      fontsize='small',
    )


def _notes(curves: Mapping[str, list[Curve]], cut: bool) -> list[str]:
  """What the figure's marks mean, for those it has."""
  notes = []
  if any(c.seeds > 1 for column in curves.values() for c in column):
    notes.append('mean ± 1 std over seeds')
  if any(c.stopped for column in curves.values() for c in column):
    notes.append("× : a diverged run's last finite round")
  if cut:
    notes.append('losses cut off above the panels')
  return notes


def loss_ceiling(column: Sequence[Curve], decades: float = 1.0) -> float:
  """The top of a loss panel: `decades` decades above the largest of the
  finished curves' first values and medians (inf without any)."""
  refs = [
    max(float(c.mean[0]), float(np.median(c.mean + c.std)))
    for c in column
    if len(c.rounds)
  ]
  return max(refs) * 10**decades if refs else math.inf


def _axis(
  ax: Any, panel: Panel, values: np.ndarray, top: float | None = None
) -> None:
  """Labels, integer rounds and a grid; for a loss panel whose `values`
  (the curves drawn, bands left out) are positive, a log scale (said in
  the axis label) from just below the lowest curve to `top` (default: just
  above the highest), labelled in plain numbers (`log_ticks`)."""
  from matplotlib import ticker

  ax.set_xlabel('round')
  ax.set_ylabel(panel.label)
  ax.xaxis.set_major_locator(
    ticker.MaxNLocator(integer=True, steps=[1, 2, 2.5, 5, 10])
  )
  ax.grid(alpha=0.3)
  if not (panel.log and values.size and values.min() > 0):
    return
  low = values.min() / 1.3
  high = values.max() * 1.1 if top is None else top
  ax.set_yscale('log')
  ax.set_ylim(low, high)
  ax.set_ylabel(f'{panel.label} (log scale)')
  ax.yaxis.set_major_locator(ticker.FixedLocator(log_ticks(low, high)))
  ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f'{v:g}'))
  ax.yaxis.set_minor_locator(ticker.LogLocator(subs='all'))
  ax.yaxis.set_minor_formatter(ticker.NullFormatter())
  ax.grid(alpha=0.1, which='minor')


# Labelled ticks per decade of a log axis, coarsest first.
_LOG_STEPS = (
  (1.0,),
  (1.0, 3.0),
  (1.0, 2.0, 5.0),
  (1.0, 1.5, 2.0, 3.0, 5.0, 7.0),
  (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0),
)


def log_ticks(low: float, high: float, at_least: int = 4) -> list[float]:
  """The labelled ticks of a log axis from `low` to `high` (> low > 0):
  the coarsest steps of `_LOG_STEPS` (powers of ten; and 3 times them;
  1, 2, 5 times them; ...) that put `at_least` ticks in the range, else
  evenly spaced round numbers."""
  decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)))
  for subs in _LOG_STEPS:
    ticks = [float(f'{m * 10.0**e:.6g}') for e in decades for m in subs]
    ticks = [t for t in ticks if low <= t <= high]
    if len(ticks) >= at_least:
      return ticks
  # Less than a factor 1.5 or so: evenly spaced round numbers.
  from matplotlib import ticker

  even = ticker.MaxNLocator(at_least + 1).tick_values(low, high)
  return [float(f'{t:.6g}') for t in even if low <= t <= high]


def plot_curves(
  runs: Runs,
  path: str,
  title: str = '',
  groups: Mapping[str, Sequence[str]] | None = None,
) -> None:
  """Writes `curves_figure(runs, title)` as a PNG at `path` (atomically),
  or `families_figure(runs, groups, title)` when `groups` are given."""
  fig = families_figure(runs, groups, title) if groups else None
  save(fig or curves_figure(runs, title), path)


def save(fig: Any, path: str, dpi: int = 120) -> None:
  """Writes a figure as a PNG, atomically (`files.write_atomic`)."""
  files.write_atomic(
    path, lambda f: fig.savefig(f, format='png', dpi=dpi), binary=True
  )


def landscape_figure(grid: Mapping[str, Any], title: str = '') -> Any:
  """Contours of a loss landscape (`fedjax_mr.analysis.landscape`).

  Args:
    grid: 'x' `[S]` and 'y' `[S]`, the coordinates along the two
      directions; 'loss' and 'accuracy' `[S][S]` (row i: y[i], column j:
      x[j]; None where non-finite); 'split', the data they were computed on.
    title: the figure's title.

  Returns:
    A `Figure` (Agg canvas): the loss (filled contours on log-spaced
    levels) beside the accuracy in percent; the model, at (0, 0), marked
    with a star.
  """
  from matplotlib import ticker
  from matplotlib.colors import LogNorm

  figure, canvas = _matplotlib()
  plain = ticker.FuncFormatter(lambda v, _: f'{v:g}')
  xs = np.asarray(grid['x'], np.float64)
  ys = np.asarray(grid['y'], np.float64)
  loss = _masked(grid['loss'])
  acc = 100 * _masked(grid['accuracy'])
  split = grid.get('split', 'test')
  fig = figure(figsize=(11, 4.6), layout='constrained')
  canvas(fig)
  ax_loss, ax_acc = fig.subplots(1, 2)
  finite = loss.compressed()
  lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (1, 1)
  if lo > 0 and hi > lo * (1 + 1e-6):
    levels = np.geomspace(lo, hi, 25)
    filled = ax_loss.contourf(
      xs, ys, loss, levels=levels, norm=LogNorm(lo, hi), cmap='viridis'
    )
    ax_loss.contour(
      xs, ys, loss, levels=levels[::3], colors='k', linewidths=0.4
    )
    bar = fig.colorbar(
      filled,
      ax=ax_loss,
      label=f'{split} loss (log scale)',
      ticks=ticker.LogLocator(subs=(1.0, 2.0, 5.0)),
      format=plain,
    )
    bar.ax.yaxis.set_minor_formatter(ticker.NullFormatter())
  else:  # flat, or nothing finite: the values as they are
    shown = ax_loss.pcolormesh(xs, ys, loss, shading='nearest')
    fig.colorbar(shown, ax=ax_loss, label=f'{split} loss')
  low, high = (acc.min(), acc.max()) if acc.count() else (0.0, 0.0)
  levels = ticker.MaxNLocator(20).tick_values(float(low), float(high))
  if high > low:
    filled = ax_acc.contourf(xs, ys, acc, levels=levels, cmap='magma')
  else:
    filled = ax_acc.pcolormesh(xs, ys, acc, shading='nearest')
  fig.colorbar(filled, ax=ax_acc, label=f'{split} accuracy (%)')
  for ax in (ax_loss, ax_acc):
    ax.plot(
      [0],
      [0],
      marker='*',
      ms=14,
      color='white',
      markeredgecolor='black',
      ls='none',
    )
    ax.set_xlabel('direction 1 (filter-normalised)')
    ax.set_ylabel('direction 2 (filter-normalised)')
    ax.set_aspect('equal')
    ax.xaxis.set_major_locator(ticker.MaxNLocator(5))
    ax.yaxis.set_major_locator(ticker.MaxNLocator(5))
    ax.set_facecolor('0.8')  # cells without a finite value
  if title:
    suptitle(fig, title)
  return fig


def _masked(values: Any) -> np.ma.MaskedArray:
  a = np.array(
    [[np.nan if v is None else v for v in row] for row in values], np.float64
  )
  return np.ma.masked_invalid(a)


def plot_landscape(grid: Mapping[str, Any], path: str, title: str = '') -> None:
  """Writes `landscape_figure(grid, title)` as a PNG at `path`."""
  save(landscape_figure(grid, title), path)
