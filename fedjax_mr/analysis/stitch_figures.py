"""The FedStitch paper's tables and figures, from finished workdirs.

References: "Heterogeneity-Aware Coordination for Federated Learning via
Stitching Pre-trained blocks", Shichen Zhan, Yebo Wu, Chunlin Tian, Yan
Zhao, Li Li (2024): Table III (accuracy of every method, IID and non-IID),
Fig. 4 (accuracy against time; and against round, for the training
budgets), Fig. 5 (client memory in one round), Fig. 7
(the search-space optimiser), Table IV (RL-weighted against plain voting)
and Fig. 2 (a client's number of classes against the quality of its block
choices).

Three kinds of folder are read, never written:

* a FedStitch workdir (`experiments.stitch`): `log.jsonl` (one row per
  round: participants `clients`, their cross-validated `ranks`, `depth`,
  `pool_sizes`, `client_time_s`, `round_time_s`), `results.json` (written
  once the run has finished: every stitched network with its accuracy and
  the round it was finished in, the "Local" baseline), its final state
  (the clients' learned weights and the run's flags: the newest
  checkpoint's, or state.npz of a workdir of an earlier version) and,
  where the run wrote
  one, `partition.json` (per-client label histograms, as experiments.run
  writes it);
* a training workdir (`experiments.run`): `metrics.jsonl`,
  `config.json` and, once experiments.probe has read it, `probe.json`;
* a pool model folder (`experiments.pretrain_zoo`): `meta.json`.

The folders are read by `stitch_tables` (which also holds Tables III and
IV); the memory measurement of Fig. 5 is `stitch_memory`. Every function
here is host-only Python and numpy; matplotlib is imported on first use
through `fedjax_mr.runtime.plots` (never pyplot).
"""

from __future__ import annotations

import math
import os
from typing import Any
from typing import Mapping
from typing import Sequence

import numpy as np

from fedjax_mr.analysis import stitch_tables
from fedjax_mr.core import files
from fedjax_mr.core import jsonfile
from fedjax_mr.runtime import metrics_io
from fedjax_mr.runtime import plots

# --- Accuracy against time (Fig. 4) ----------------------------------------


def run_curve(
  path: str, include_eval: bool = False
) -> tuple[np.ndarray, np.ndarray]:
  """`(seconds, accuracy)` of a training run: the cumulative sum of its
  rounds' `round_time_s` (evaluation excluded unless `include_eval`) at
  every evaluated round."""
  rows = sorted(
    metrics_io.read(os.path.join(path, 'metrics.jsonl')),
    key=lambda r: r['round'],
  )
  t, ts, accs = 0.0, [], []
  for r in rows:
    t += r.get('round_time_s', 0.0)
    if include_eval:
      t += r.get('eval_time_s', 0.0)
    if 'test_accuracy' in r:
      ts.append(t)
      accs.append(r['test_accuracy'])
  return np.array(ts), np.array(accs)


def round_seconds(row: Mapping[str, Any]) -> float:
  """A stitch round's wall time (selection, stitch fits, aggregation);
  rows of runs older than `round_time_s`: the clients' selection time."""
  if 'round_time_s' in row:
    return float(row['round_time_s'])
  return float(sum(row.get('client_time_s', ())))


def stitch_curve(path: str) -> tuple[np.ndarray, np.ndarray]:
  """`(seconds, accuracy)` of a finished stitch run: at the end of each
  round where networks were finished, the cumulative round time and the
  best accuracy of the networks finished so far (results.json). Empty
  until results.json exists."""
  res = stitch_tables.stitch_results(path)
  if res is None:
    return np.zeros(0), np.zeros(0)
  key = stitch_tables.eval_key(res)
  log = stitch_tables.read_log(path)
  ts, accs, best = [], [], -math.inf
  for done in sorted({int(n['round']) for n in res.get('networks') or []}):
    # A network finished with `round` = rounds done: after rows < round.
    best = max(
      [best] + [n[key] for n in res['networks'] if int(n['round']) == done]
    )
    ts.append(sum(round_seconds(r) for r in log if r['round'] < done))
    accs.append(best)
  return np.array(ts), np.array(accs)


def time_curves(
  runs: stitch_tables.RunSpec, include_eval: bool = False
) -> dict[str, dict[str, dict[str, Any]]]:
  """{column: {label: {'kind', 'seconds', 'accuracy', 'path'}}} of every
  workdir with points (others are left out)."""
  out: dict[str, dict[str, dict[str, Any]]] = {}
  for label, by_col in runs.items():
    for col, path in by_col.items():
      kind = stitch_tables.kind_of(path)
      if kind == 'run':
        t, a = run_curve(path, include_eval)
      elif kind == 'stitch':
        t, a = stitch_curve(path)
      else:
        continue
      if len(t):
        out.setdefault(col, {})[label] = {
          'kind': kind,
          'path': path,
          'seconds': t.tolist(),
          'accuracy': a.tolist(),
        }
  return out


def _panels(
  curves: Mapping[str, Mapping[str, Any]], legend_width: float, height: float
) -> tuple[Any, Sequence[Any], dict[str, Any]]:
  """A figure with one panel per column of `curves` (5.2 inches each,
  plus `legend_width` for the side legend), and a colour per label."""
  figure, canvas = plots._matplotlib()
  cols = list(curves)
  fig = figure(
    figsize=(5.2 * len(cols) + legend_width, height), layout='constrained'
  )
  canvas(fig)
  axes = fig.subplots(1, len(cols), squeeze=False)[0]
  labels = list(dict.fromkeys(lb for c in cols for lb in curves[c]))
  return fig, axes, dict(zip(labels, plots._colors(len(labels))))


def _side_legend(fig: Any, axes: Sequence[Any]) -> None:
  """One legend for all panels, each label once, right of the axes."""
  handles, names = [], []
  for ax in axes:
    for h, n in zip(*ax.get_legend_handles_labels()):
      if n not in names:
        handles.append(h)
        names.append(n)
  fig.legend(handles, names, loc='outside right upper', fontsize='small')


def time_figure(
  curves: Mapping[str, Mapping[str, Mapping[str, Any]]],
  unit: str = 'minutes',
  include_eval: bool = False,
) -> Any:
  """Fig. 4: one panel per column, test accuracy (%) against cumulative
  wall time; FedStitch's curve steps up where networks were finished."""
  fig, axes, colors = _panels(curves, 2.5, 4.0)
  cols = list(curves)
  for ax, col in zip(axes, cols):
    for label, c in curves[col].items():
      t = np.asarray(c['seconds']) / stitch_tables.TIME_UNITS[unit]
      a = 100 * np.asarray(c['accuracy'])
      stitch = c['kind'] == 'stitch'
      ax.plot(
        t,
        a,
        color=colors[label],
        lw=1.3,
        marker='o' if stitch or len(t) <= 30 else None,
        ms=4,
        drawstyle='steps-post' if stitch else 'default',
        label=label,
      )
    ax.set_title(col)
    ax.set_xlabel(f'wall time ({unit})')
    ax.set_ylabel('test accuracy (%)')
    ax.grid(alpha=0.3)
  _side_legend(fig, axes)
  fig.suptitle(
    'accuracy against time; round times summed, evaluation '
    + ('included' if include_eval else 'excluded')
  )
  return fig


# --- Accuracy against round (the training budgets) --------------------------


def round_curves(
  runs: stitch_tables.RunSpec, last: int = 10
) -> dict[str, dict[str, dict[str, Any]]]:
  """{column: {label: curve}} of every workdir with something to draw.

  A training run: {'kind': 'run', 'path', 'round', 'accuracy' (its own
  read-out per evaluated round), 'mean' (`trailing_means` of the last
  `last` evaluations at each of them), 'gain' (`trailing_gain` of that
  mean)} and, once experiments.probe read it, 'probe_round' and
  'probe_accuracy' (the 5-NN probe on the trunk). A finished stitch run,
  which trains no rounds: {'kind': 'stitch', 'path', 'level' (its best
  network's accuracy)}. Pool models and unfinished stitch runs are left out.
  """
  out: dict[str, dict[str, dict[str, Any]]] = {}
  for label, by_col in runs.items():
    for col, path in by_col.items():
      kind = stitch_tables.kind_of(path)
      curve: dict[str, Any] | None = None
      if kind == 'run':
        rows = metrics_io.read(os.path.join(path, 'metrics.jsonl'))
        evaluated = stitch_tables.evaluations(rows)
        if evaluated:
          accs = [a for _, a in evaluated]
          curve = {
            'kind': kind,
            'path': path,
            'round': [r for r, _ in evaluated],
            'accuracy': accs,
            'mean': stitch_tables.trailing_means(accs, last),
            'gain': stitch_tables.trailing_gain(evaluated, last),
          }
          probe = stitch_tables.read_probe(path)
          if probe.get('rounds') and probe.get('accuracy'):
            curve['probe_round'] = list(probe['rounds'])
            curve['probe_accuracy'] = list(probe['accuracy'])
      elif kind == 'stitch':
        res = stitch_tables.stitch_results(path)
        best = (res or {}).get('best') or {}
        if (
          res is not None and best.get(stitch_tables.eval_key(res)) is not None
        ):
          curve = {
            'kind': kind,
            'path': path,
            'level': best[stitch_tables.eval_key(res)],
          }
      if curve is not None:
        out.setdefault(col, {})[label] = curve
  return out


def round_axis_floor(curves: Mapping[str, Mapping[str, Any]]) -> float:
  """The y axis's floor (%) of one panel of `round_figure`: 1 point below
  the lowest trailing mean after each training run's first fifth of
  evaluations (the start from the pool's or a random head would squash the
  rest; single rounds, drawn faint, may dip below), the FedStitch levels
  and the probe points included."""
  low = []
  for c in curves.values():
    if c['kind'] == 'stitch':
      low.append(c['level'])
      continue
    means = c['mean']
    low.append(min(means[len(means) // 5 :]))
    low.extend(c.get('probe_accuracy') or [])
  return 100 * min(low) - 1.0


def round_figure(
  curves: Mapping[str, Mapping[str, Mapping[str, Any]]], last: int = 10
) -> Any:
  """Test accuracy (%) against round, one panel per column: per training
  run (its own read-out) a faint line of every evaluation and a solid one
  of their `round_curves` mean (of the last `last` evaluations: table3's
  figure at the run's last round), × at the rounds its trunk was probed,
  and a dashed level per FedStitch run (its best network; it trains no
  rounds)."""
  fig, axes, colors = _panels(curves, 3.0, 4.8)
  cols = list(curves)
  for ax, col in zip(axes, cols):
    for label, c in curves[col].items():
      if c['kind'] == 'stitch':
        ax.axhline(
          100 * c['level'], color=colors[label], ls='--', lw=1.3, label=label
        )
        continue
      ax.plot(
        c['round'],
        100 * np.asarray(c['accuracy']),
        color=colors[label],
        lw=0.6,
        alpha=0.3,
      )
      ax.plot(
        c['round'],
        100 * np.asarray(c['mean']),
        color=colors[label],
        lw=1.4,
        label=label,
      )
      if c.get('probe_round'):
        ax.plot(
          c['probe_round'],
          100 * np.asarray(c['probe_accuracy']),
          color=colors[label],
          ls='none',
          marker='x',
          ms=4,
        )
    ax.set_title(col)
    ax.set_xlabel('round')
    ax.set_ylabel('test accuracy (%)')
    ax.set_ylim(bottom=round_axis_floor(curves[col]))
    ax.grid(alpha=0.3)
  _side_legend(fig, axes)
  fig.suptitle(
    f'test accuracy against round\nsolid: mean of the last {last} evaluations '
    "(the table's figure); faint: each evaluation\ndashed: FedStitch's best "
    'network; ×: the 5-NN probe on the trunk'
  )
  return fig


# --- Search-space optimiser (Fig. 7) ----------------------------------------


def search_space(runs: stitch_tables.RunSpec) -> dict[str, dict[str, Any]]:
  """Per stitch run: candidate blocks scored per round (the live networks'
  pool sizes summed), round time, `prune`, final accuracy."""
  out = {}
  for label, by_col in runs.items():
    for col, path in by_col.items():
      if stitch_tables.kind_of(path) != 'stitch':
        continue
      log = stitch_tables.read_log(path)
      if not log:
        continue
      name = label if len(by_col) == 1 else f'{label} ({col})'
      c = stitch_tables.cell(path)
      seconds = [round_seconds(r) for r in log]
      out[name] = {
        'path': path,
        'prune': stitch_tables.stitch_setting(path, 'prune'),
        'rounds': [r['round'] for r in log],
        'depth': [r.get('depth') for r in log],
        'candidates': [int(sum(r.get('pool_sizes', ()))) for r in log],
        'seconds': seconds,
        'selection_seconds': [
          float(sum(r.get('client_time_s', ()))) for r in log
        ],
        'total_seconds': float(sum(seconds)),
        'accuracy': c['accuracy'],
        'status': c['status'],
      }
  return out


def search_space_table(data: Mapping[str, Mapping[str, Any]]) -> str:
  """The runs of `search_space` side by side; with one run without the
  optimiser, every other run's speed-up over it (its total time over
  theirs)."""
  without = [d for d in data.values() if d['prune'] is False]
  rows = []
  for name, d in data.items():
    speedup = ''
    if len(without) == 1 and d['prune'] is not False and d['total_seconds']:
      speedup = f'{without[0]["total_seconds"] / d["total_seconds"]:.2f}×'
    rows.append(
      [
        name,
        {True: 'on', False: 'off'}.get(d['prune'], '?'),
        len(d['rounds']),
        f'{np.mean(d["candidates"]):.1f}',
        f'{d["candidates"][0]} → {d["candidates"][-1]}',
        f'{d["total_seconds"]:.1f}',
        speedup,
        stitch_tables.cell_text(
          {**d, 'kind': 'stitch', 'round': len(d['rounds'])}
        ),
      ]
    )
  header = [
    'run',
    'optimiser',
    'rounds',
    'candidates / round',
    'first → last',
    'time (s)',
    'speed-up',
    'accuracy (%)',
  ]
  return stitch_tables.markdown(header, rows)


def search_space_figure(data: Mapping[str, Mapping[str, Any]]) -> Any:
  """Fig. 7: candidate blocks per round and round time, per run."""
  figure, canvas = plots._matplotlib()
  fig = figure(figsize=(11.5, 4.0), layout='constrained')
  canvas(fig)
  ax_n, ax_t = fig.subplots(1, 2)
  for (name, d), color in zip(data.items(), plots._colors(len(data))):
    acc = (
      '' if d['accuracy'] is None else f', {stitch_tables.pct(d["accuracy"])} %'
    )
    label = f'{name} ({d["total_seconds"]:.0f} s{acc})'
    ax_n.plot(
      d['rounds'], d['candidates'], color=color, marker='.', label=label
    )
    ax_t.plot(d['rounds'], d['seconds'], color=color, marker='.', label=label)
  ax_n.set_ylabel('candidate blocks scored per client')
  ax_t.set_ylabel('round time (s)')
  for ax in (ax_n, ax_t):
    ax.set_xlabel('round')
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
  ax_t.legend(fontsize='small')
  fig.suptitle('search-space optimiser: candidates and time per round')
  return fig


# --- A client's classes against its rank (Fig. 2) --------------------------


def classes_per_client(summary: Mapping[str, Any]) -> list[int]:
  """Per client, how many classes it holds (at least one example of
  each), from a partition summary (`fedjax_mr.data.partition.summary`:
  'label_histograms')."""
  return [int(np.count_nonzero(h)) for h in summary['label_histograms']]


# A partition summary holds a histogram per client: 10,000 clients of
# 100 classes are a few MiB.
MAX_SUMMARY_BYTES = 1 << 26


def read_classes_per_client(path: str) -> list[int]:
  """`classes_per_client` of the partition summary in the file `path`.

  Raises:
    JsonFileError: not a bounded JSON object whose 'label_histograms' is
      a list of lists of integers (one line naming the file and field).
  """
  summary = jsonfile.load(path, MAX_SUMMARY_BYTES)
  histograms = jsonfile.field(summary, 'label_histograms', list, path)
  for k, h in enumerate(histograms):
    name = f'"label_histograms"[{k}]'
    for c, n in enumerate(jsonfile.check(h, list, path, name)):
      jsonfile.check(n, int, path, f'{name}[{c}]')
  return classes_per_client(summary)


def rank_data(
  log: Sequence[Mapping[str, Any]],
  classes: Sequence[int],
  weights: Sequence[float] | None = None,
  local: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
  """What Fig. 2 plots, per number of classes.

  Args:
    log: a stitch run's log rows ('clients', 'ranks' aligned with them,
      'depth').
    classes: `[N]` classes per client.
    weights: `[N]` the clients' learned weights after the last round, or
      None.
    local: results.json's 'local' ('clients', 'best'), or None.

  Returns:
    'points': every (client, round, depth, classes, rank) with a rank;
    'by_classes': {k: {'clients', 'ranks' (points), 'mean_rank',
    'mean_rank_by_depth', 'mean_weight' (× N: 1 is the initial weight),
    'local_accuracy'}} for every k some client holds.
  """
  n = len(classes)
  points = []
  for row in log:
    for c, r in zip(row.get('clients', ()), row.get('ranks', ())):
      if r is not None and 0 <= c < n:
        points.append(
          {
            'client': int(c),
            'round': int(row['round']),
            'depth': row.get('depth'),
            'classes': int(classes[c]),
            'rank': float(r),
          }
        )
  local_acc = {}
  if local:
    for c, a in zip(local.get('clients', ()), local.get('best', ())):
      if 0 <= c < n and a is not None and math.isfinite(a):
        local_acc.setdefault(int(classes[c]), []).append(float(a))
  by = {}
  for k in sorted(set(int(x) for x in classes)):
    ps = [p for p in points if p['classes'] == k]
    depths = sorted({p['depth'] for p in ps if p['depth'] is not None})
    who = [c for c in range(n) if classes[c] == k]
    entry = {
      'clients': len(who),
      'ranks': len(ps),
      'mean_rank': float(np.mean([p['rank'] for p in ps])) if ps else None,
      'mean_rank_by_depth': {
        str(d): float(np.mean([p['rank'] for p in ps if p['depth'] == d]))
        for d in depths
      },
    }
    if weights is not None:
      entry['mean_weight'] = float(np.mean([weights[c] * n for c in who]))
    if k in local_acc:
      entry['local_accuracy'] = float(np.mean(local_acc[k]))
    by[str(k)] = entry
  return {'points': points, 'by_classes': by}


def rank_table(data: Mapping[str, Any]) -> str:
  rows = []
  for k, e in data['by_classes'].items():
    rows.append(
      [
        k,
        e['clients'],
        e['ranks'],
        stitch_tables.MISSING
        if e['mean_rank'] is None
        else f'{e["mean_rank"]:.3f}',
        f'{e["mean_weight"]:.3f}'
        if 'mean_weight' in e
        else stitch_tables.MISSING,
        stitch_tables.pct(e.get('local_accuracy')),
      ]
    )
  header = [
    'classes',
    'clients',
    'ranks',
    'mean rank',
    'mean weight × N',
    'Local accuracy (%)',
  ]
  return stitch_tables.markdown(header, rows)


def rank_figure(data: Mapping[str, Any], title: str = '') -> Any:
  """Fig. 2: (a) a lone client's stitched accuracy (the Local baseline),
  when there is one, (b) the cross-validated rank of its block choices by
  depth, (c) its learned weight, against its number of classes."""
  figure, canvas = plots._matplotlib()
  by = data['by_classes']
  ks = np.array([int(k) for k in by])
  has_local = any('local_accuracy' in e for e in by.values())
  has_weight = any('mean_weight' in e for e in by.values())
  n = 1 + has_local + has_weight
  fig = figure(figsize=(4.6 * n + 0.5, 3.9), layout='constrained')
  canvas(fig)
  axes = list(fig.subplots(1, n, squeeze=False)[0])
  if has_local:
    ax = axes.pop(0)
    sel = [k for k in by if 'local_accuracy' in by[k]]
    ax.plot(
      [int(k) for k in sel],
      [100 * by[k]['local_accuracy'] for k in sel],
      marker='o',
    )
    ax.set_ylabel('Local stitched accuracy (%)')
    ax.set_title('(a) one client alone')
  ax = axes.pop(0)
  pts = data['points']
  depths = sorted({p['depth'] for p in pts if p['depth'] is not None})
  jitter = np.random.default_rng(0)
  for d, color in zip(depths, plots._colors(len(depths))):
    ps = [p for p in pts if p['depth'] == d]
    x = np.array([p['classes'] for p in ps], float)
    ax.scatter(
      x + jitter.uniform(-0.15, 0.15, len(x)),
      [p['rank'] for p in ps],
      s=8,
      alpha=0.35,
      color=color,
    )
    mk = [k for k in by if str(d) in by[k]['mean_rank_by_depth']]
    ax.plot(
      [int(k) for k in mk],
      [by[k]['mean_rank_by_depth'][str(d)] for k in mk],
      color=color,
      marker='o',
      label=f'depth {d}',
    )
  ax.set_ylabel("rank of its blocks in the others' CKA (1: best)")
  ax.set_title('(b) cross-validated rank')
  if depths:
    ax.legend(fontsize='small')
  if has_weight:
    ax = axes.pop(0)
    sel = [k for k in by if 'mean_weight' in by[k]]
    ax.bar([int(k) for k in sel], [by[k]['mean_weight'] for k in sel])
    ax.axhline(1.0, color='k', lw=0.8, ls='--')
    ax.set_ylabel('learned weight × N (1: initial)')
    ax.set_title('(c) weight after the last round')
  for ax in fig.axes:
    ax.set_xlabel("classes in the client's data")
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
  if title:
    plots.suptitle(fig, title)
  return fig


# --- Writing ----------------------------------------------------------------


def write(out: str, name: str, data: Any, text: str | None = None, fig=None):
  """Writes `<out>/<name>.json` (data), `.md` (text) and `.png` (fig),
  each atomically; returns the paths written."""
  os.makedirs(out, exist_ok=True)
  paths = []
  path = os.path.join(out, f'{name}.json')
  metrics_io.write_json(path, data, indent=1)
  paths.append(path)
  if text is not None:
    path = os.path.join(out, f'{name}.md')
    files.write_atomic(path, lambda f: f.write(text))
    paths.append(path)
  if fig is not None:
    path = os.path.join(out, f'{name}.png')
    plots.save(fig, path)
    paths.append(path)
  return paths
