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
  the round it was finished in, the "Local" baseline), `state.npz` (the
  clients' learned weights and the run's flags) and, where the run wrote
  one, `partition.json` (per-client label histograms, as experiments.run
  writes it);
* a training workdir (`experiments.run`): `metrics.jsonl`,
  `config.json` and, once experiments.probe has read it, `probe.json`;
* a pool model folder (`experiments.pretrain_zoo`): `meta.json`.

Every function here is host-only Python and numpy; matplotlib is imported
on first use through `fedjax_mr.runtime.plots` (never pyplot), and JAX
only by the memory measurements.
"""

from __future__ import annotations

import math
import os
from typing import Any
from typing import Mapping
from typing import Sequence

import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.core import files
from fedjax_mr.core import jsonfile
from fedjax_mr.runtime import metrics_io
from fedjax_mr.runtime import plots

# label -> {column (a setting, e.g. iid / noniid): workdir}
RunSpec = dict[str, dict[str, str]]
# The column of a `label:path` entry that names no setting.
SINGLE = 'run'
# A cell of a folder that is not there, and of a run not finished yet.
MISSING = '–'
# A training run's probe record (experiments.probe) and its column's name.
PROBE_FILE = 'probe.json'
PROBE_LABEL = '5-NN on trunk'
RUNNING = 'running'
# A training run has stopped rising when the mean of its last evaluations
# (table3's `last`) rose by less than PLATEAU_GAIN over its last
# PLATEAU_SPAN rounds.
PLATEAU_GAIN = 0.002
PLATEAU_SPAN = 20
TIME_UNITS = {'hours': 3600.0, 'minutes': 60.0, 'seconds': 1.0}


# --- Which runs -------------------------------------------------------------


# A runs file names a few dozen workdirs.
MAX_RUNS_BYTES = 1 << 20


def parse_runs(spec: str, name: str = 'runs') -> RunSpec:
  """The methods and their workdirs from `spec`.

  `spec` is either the path of a JSON file holding `{label: {column: path}}`
  (or `{label: path}`), or `label:column=path,column=path;label:path;...`:
  entries separated by ';', a label before the first ':', then
  `column=path` pairs separated by ',' or one bare path (column 'run').

  Raises:
    ConfigError: an empty spec, an entry without a label or path, a label
      given twice, or an unreadable JSON file (the message names `name`,
      the argument or field that gave `spec`).
  """
  spec = spec.strip()
  if not spec:
    raise errors.ConfigError(f'`{name}` is empty: give label:column=path,...')
  if spec.endswith('.json') or os.path.isfile(spec):
    where = f'`{name}={errors.clip(spec)}`'
    try:
      raw = jsonfile.load(spec, MAX_RUNS_BYTES)
    except jsonfile.JsonFileError as e:
      raise errors.ConfigError(
        f'{where}: {e.reason} (want a JSON object {{label: {{column: path}}}})'
      ) from None
    if not raw:
      raise errors.ConfigError(
        f'{where}: want a JSON object {{label: {{column: path}}}}'
      )
    out: RunSpec = {}
    for label, value in raw.items():
      if isinstance(value, str):
        value = {SINGLE: value}
      if not isinstance(value, dict) or not all(
        isinstance(v, str) for v in value.values()
      ):
        raise errors.ConfigError(
          f'{where}: {errors.clip(repr(label), 40)} must map to a path or '
          'to {column: path}'
        )
      out[str(label)] = dict(value)
    return out
  out = {}
  for entry in filter(None, (e.strip() for e in spec.split(';'))):
    label, sep, rest = entry.partition(':')
    label, rest = label.strip(), rest.strip()
    if not sep or not label or not rest:
      raise errors.ConfigError(
        f'`{name}`: {entry!r} is not label:column=path,... or label:path'
      )
    if label in out:
      raise errors.ConfigError(f'`{name}`: label {label!r} given twice')
    if '=' not in rest:
      out[label] = {SINGLE: rest}
      continue
    columns = {}
    for item in filter(None, (s.strip() for s in rest.split(','))):
      column, eq, path = item.partition('=')
      if not eq or not column.strip() or not path.strip():
        raise errors.ConfigError(
          f'`{name}`: {item!r} in {entry!r} is not column=path'
        )
      columns[column.strip()] = path.strip()
    out[label] = columns
  if not out:
    raise errors.ConfigError(f'`{name}` names no run')
  return out


def columns_of(runs: RunSpec) -> list[str]:
  """Every column of `runs`, in the order they first appear."""
  seen: dict[str, None] = {}
  for cols in runs.values():
    seen.update(dict.fromkeys(cols))
  return list(seen)


# --- Reading workdirs -------------------------------------------------------


def kind_of(path: str) -> str | None:
  """'pool_model', 'run', 'stitch', or None (no such folder, or none of
  their files in it)."""
  if not os.path.isdir(path):
    return None
  has = lambda name: os.path.exists(os.path.join(path, name))  # noqa: E731
  if has('meta.json'):
    return 'pool_model'
  if has('metrics.jsonl') or has('config.json'):
    return 'run'
  if has('state.npz') or has('log.jsonl') or has('results.json'):
    return 'stitch'
  return None


def _json(path: str) -> dict[str, Any] | None:
  """The JSON object in the file `path`, or None where there is none.

  Raises:
    DataError: a file that is not a bounded JSON object (`jsonfile`).
  """
  if not os.path.lexists(path):
    return None
  return jsonfile.load(path)


def _numbers(obj: Mapping[str, Any], key: str, path: str) -> list | None:
  """`obj[key]`, a list of numbers in the file `path`, or None."""
  values = jsonfile.field(obj, key, list, path, default=None)
  for i, v in enumerate(values or ()):
    jsonfile.check(v, (int, float), path, f'"{key}"[{i}]')
  return values


def read_probe(path: str) -> dict[str, Any]:
  """A training workdir's probe.json ('mean', 'rounds', 'accuracy'),
  checked; {} without one."""
  file = os.path.join(path, PROBE_FILE)
  probe = _json(file) or {}
  jsonfile.field(probe, 'mean', float, file, default=None)
  _numbers(probe, 'rounds', file)
  _numbers(probe, 'accuracy', file)
  return probe


def read_log(path: str) -> list[dict[str, Any]]:
  """A stitch workdir's log.jsonl rows, by round (empty without one)."""
  return sorted(
    metrics_io.read(os.path.join(path, 'log.jsonl')), key=lambda r: r['round']
  )


def stitch_results(path: str) -> dict[str, Any] | None:
  """A stitch workdir's results.json (None until the run has finished)."""
  return _json(os.path.join(path, 'results.json'))


def eval_key(results: Mapping[str, Any]) -> str:
  """The accuracy experiments.stitch ranks networks by: the head's where
  it evaluated heads (`eval=head` or both), else the kNN probe's."""
  nets = results.get('networks') or []
  return 'head' if nets and 'head' in nets[0] else 'knn'


def stitch_state(path: str) -> tuple[dict, dict] | None:
  """`(payload, identity)` of a stitch workdir's state.npz, or None."""
  from fedjax_mr.stitch import state as state_lib

  file = os.path.join(path, 'state.npz')
  if not os.path.exists(file):
    return None
  payload, identity = state_lib.read_document(file)
  return payload, identity or {}


def stitch_setting(path: str, name: str) -> Any:
  """The value of flag `name` a stitch run was made with (results.json's
  config, else state.npz's flags), or None."""
  res = stitch_results(path)
  if res and name in (res.get('config') or {}):
    return res['config'][name]
  state = stitch_state(path)
  return None if state is None else state[1].get(name)


def cell(path: str, last: int = 10) -> dict[str, Any]:
  """The accuracy of one workdir, whatever its kind.

  Returns:
    {'path', 'kind', 'status' ('done', 'running' or 'missing'),
    'accuracy' (a fraction or None), ...}: a stitch run's best network as
    experiments.stitch reports it (`results.json` 'best'), with its Local
    baseline ('local', the mean of the clients' best) when it made one; a
    training run's mean test accuracy over its last `last` evaluations,
    and its 'best'; a pool model's test accuracy from meta.json.
  """
  kind = kind_of(path)
  out: dict[str, Any] = {'path': path, 'kind': kind, 'accuracy': None}
  if kind is None:
    return {**out, 'status': 'missing'}
  if kind == 'pool_model':
    file = os.path.join(path, 'meta.json')
    meta = _json(file) or {}
    acc = jsonfile.field(meta, 'test_accuracy', float, file, default=None)
    return {
      **out,
      'status': 'done' if acc is not None else 'running',
      'accuracy': acc,
    }
  if kind == 'run':
    rows = metrics_io.read(os.path.join(path, 'metrics.jsonl'))
    file = os.path.join(path, 'config.json')
    config = _json(file) or {}
    evaluated = evaluations(rows)
    accs = [a for _, a in evaluated]
    rounds = max((r['round'] for r in rows), default=0)
    total = jsonfile.field(config, 'rounds', int, file, default=None)
    done = bool(accs) and (total is None or rounds >= total)
    probe = read_probe(path)
    return {
      **out,
      'status': 'done' if done else 'running',
      'accuracy': float(np.mean(accs[-last:])) if accs else None,
      'best': float(max(accs)) if accs else None,
      'evaluations': len(accs[-last:]),
      'gain': trailing_gain(evaluated, last),
      'round': rounds,
      'rounds': total,
      'probe': probe.get('mean'),
      'probe_rounds': probe.get('rounds'),
    }
  res = stitch_results(path)
  if res is None:
    return {**out, 'status': 'running', 'round': len(read_log(path))}
  key = eval_key(res)
  best = res.get('best') or {}
  local = res.get('local') or None
  pool = {
    model: accs.get(key)
    for model, accs in sorted((res.get('pool_models') or {}).items())
    if isinstance(accs, dict)
  }
  trunk = key == 'knn' and res.get('knn_at') == 'trunk'
  return {
    **out,
    'status': 'done',
    'accuracy': best.get(key),
    # Read by the probe experiments.probe gives the training runs.
    'trunk': trunk,
    'probe': best.get(key) if trunk else None,
    'eval': key,
    'network': best.get('path'),
    'networks': len(res.get('networks') or []),
    'local': None if local is None else local.get('mean_best'),
    'pool': pool,
    'round': res.get('rounds'),
  }


def evaluations(rows: Sequence[Mapping[str, Any]]) -> list[tuple[int, float]]:
  """`(round, test accuracy)` of a training run's metrics rows, by round
  (`plots.series`: a repeated round keeps its last row)."""
  rounds, accs = plots.series(rows, 'test_accuracy')
  return list(zip(rounds.tolist(), accs.tolist()))


def trailing_means(
  accuracies: Sequence[float], window: int = 10
) -> list[float]:
  """At each evaluation, the mean of the last `window` evaluations up to it
  (all of them while fewer were made): the figure table3 reads at a run's
  last round, drawn at every round."""
  if window < 1:
    raise ValueError(f'window must be ≥ 1, got {window}')
  sums = np.concatenate([[0.0], np.cumsum(np.asarray(accuracies, float))])
  ends = np.arange(1, len(accuracies) + 1)
  starts = np.maximum(ends - window, 0)
  return ((sums[ends] - sums[starts]) / (ends - starts)).tolist()


def trailing_gain(
  evaluated: Sequence[tuple[int, float]],
  window: int = 10,
  span: int = PLATEAU_SPAN,
) -> float | None:
  """How much a run's mean accuracy of its last `window` evaluations rose
  over its last `span` rounds: that mean at its last round R minus the
  same mean at round R − span (the last `window` evaluations made by then).

  Args:
    evaluated: `(round, accuracy)` pairs in increasing round.
    window: evaluations averaged.
    span: rounds between the two means.

  Returns:
    The gain as a fraction (0.002 is 0.2 points), or None when fewer than
    `window` evaluations were made by round R − span.
  """
  if window < 1 or span < 1:
    raise ValueError(f'window and span must be ≥ 1, got {window}, {span}')
  if not evaluated:
    return None
  last_round = evaluated[-1][0]
  earlier = [a for r, a in evaluated if r <= last_round - span]
  if len(earlier) < window:
    return None
  now = [a for _, a in evaluated][-window:]
  return float(np.mean(now) - np.mean(earlier[-window:]))


def _pct(value: float | None) -> str:
  return MISSING if value is None else f'{100 * value:.2f}'


def cell_text(c: Mapping[str, Any]) -> str:
  """A table cell: '84.52'; '81.20 (best 83.10)' for a training run, and
  '81.20 (best 83.10; 100 rounds, +0.05 in 20, flat)' once it has a
  trailing gain (`trailing_gain`, in points; flat below PLATEAU_GAIN,
  else rising) to show; 'running' or '–' without a result."""
  if c['status'] == 'missing':
    return MISSING
  if c['accuracy'] is None:  # a finished run without any network: 'none'
    return RUNNING if c['status'] == 'running' else 'none'
  text = _pct(c['accuracy'])
  if c['kind'] == 'run':
    gain, trail = c.get('gain'), ''
    if gain is not None:
      word = 'flat' if gain < PLATEAU_GAIN else 'rising'
      trail = f'; {c["round"]} rounds, {100 * gain:+.2f} in {PLATEAU_SPAN}'
      trail += f', {word}'
    text += f' (best {_pct(c["best"])}{trail})'
  if c['status'] == 'running':
    text += f' ({RUNNING}, round {c["round"]}/{c.get("rounds") or "?"})'
  return text


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  lines += ['| ' + ' | '.join(map(str, r)) + ' |' for r in rows]
  return '\n'.join(lines) + '\n'


def _derived_rows(cells, label):
  """The rows a stitch run's cells add: 'Local (label)' (its clients
  stitching alone) and '<model> alone (label)' per pool model."""
  derived = []
  if any(c.get('local') is not None for c in cells.values()):
    derived.append(
      (f'Local ({label})', {c: v.get('local') for c, v in cells.items()})
    )
  models = sorted({m for v in cells.values() for m in v.get('pool') or {}})
  for m in models:
    derived.append(
      (
        f'{m} alone ({label})',
        {c: (v.get('pool') or {}).get(m) for c, v in cells.items()},
      )
    )
  return [
    (
      name,
      {
        c: {
          'path': cells[c]['path'],
          'kind': 'stitch_derived',
          'status': cells[c]['status'],
          'accuracy': acc,
          'probe': acc if cells[c].get('trunk') else None,
        }
        for c, acc in accs.items()
      },
    )
    for name, accs in derived
  ]


def probe_text(c: Mapping[str, Any] | None) -> str:
  """A cell of a '5-NN' column: the stitch probe's accuracy on the trunk
  (a training run: the mean over the checkpoints experiments.probe read,
  with their rounds; '–' without its probe.json); '' for a row read
  otherwise."""
  if c is None:
    return ''
  if c['kind'] == 'run':
    if c.get('probe') is None:
      return MISSING
    rounds = c.get('probe_rounds') or []
    span = f'{rounds[0]}–{rounds[-1]}' if len(rounds) > 1 else rounds[0]
    return f'{_pct(c["probe"])} (rounds {span})'
  return '' if c.get('probe') is None else _pct(c['probe'])


def accuracy_table(runs: RunSpec, last: int = 10) -> tuple[dict[str, Any], str]:
  """Table III: one row per method, one column per setting.

  A stitch run adds a row 'Local (<label>)' when it made a Local baseline,
  and a row '<model> alone (<label>)' per pool model it evaluated. Once a
  training run holds a probe.json (experiments.probe), each setting gets a
  second column, '<setting>, 5-NN on trunk': every row read by the stitch
  runs' kNN probe on its trunk (`probe_text`), beside its own read-out.
  Returns (JSON-able data, markdown). Percentages with two decimals.
  """
  cols = columns_of(runs)
  rows = []
  for label, by_col in runs.items():
    cells = {c: cell(p, last) for c, p in by_col.items()}
    rows.append({'method': label, 'cells': cells})
    for name, derived in _derived_rows(cells, label):
      rows.append({'method': name, 'cells': derived})
  # A '5-NN' column beside each setting once a training run was probed.
  probed = any(
    c['kind'] == 'run' and c.get('probe') is not None
    for r in rows
    for c in r['cells'].values()
  )
  header, text_rows = ['method'], []
  for c in cols:
    header += [c, f'{c}, {PROBE_LABEL}'] if probed else [c]
  for r in rows:
    text = [r['method']]
    for c in cols:
      got = r['cells'].get(c)
      shown = got is not None and (
        got['kind'] != 'stitch_derived' or got['accuracy'] is not None
      )
      text.append(cell_text(got) if shown else '')
      if probed:
        text.append(probe_text(got))
    text_rows.append(text)
  data = {'columns': cols, 'last': last, 'probed': probed, 'rows': rows}
  note = (
    f'\nAccuracy in %. Training runs: mean test accuracy of the last {last} '
    'evaluations (best in brackets); FedStitch: its best stitched network; '
    f'{RUNNING}: not finished; {MISSING}: no such workdir.\n'
  )
  if any(c.get('gain') is not None for r in rows for c in r['cells'].values()):
    note += (
      f'"N rounds, +g in {PLATEAU_SPAN}": the rounds a training run trained, '
      f'and how much the mean of its last {last} evaluations rose over its '
      f'last {PLATEAU_SPAN} rounds, in points; flat: under '
      f'{100 * PLATEAU_GAIN:.1f} before rounding (it has stopped rising), '
      'else rising.\n'
    )
  if probed:
    note += (
      f"{PROBE_LABEL}: the stitch runs' 5-NN probe on the input of the end "
      "block, fitted on the same public examples; a training run's is the "
      'mean over the checkpoints experiments.probe read (its rounds in '
      f'brackets; {MISSING}: not probed).\n'
    )
  return data, markdown(header, text_rows) + note


def voting_table(runs: RunSpec) -> tuple[dict[str, Any], str]:
  """Table IV: FedStitch with RL-weighted against uniform voting.

  Rows are the labels of `runs` (each a stitch workdir per setting), with
  the `aggregation` each run was made with; with two rows, a last row
  holds their difference (first − second) in points.
  """
  cols = columns_of(runs)
  rows, text_rows = [], []
  for label, by_col in runs.items():
    cells = {c: cell(p) for c, p in by_col.items()}
    for c, p in by_col.items():
      if cells[c]['kind'] == 'stitch':
        cells[c]['aggregation'] = stitch_setting(p, 'aggregation')
    aggs = sorted(
      {str(v['aggregation']) for v in cells.values() if v.get('aggregation')}
    )
    rows.append({'method': label, 'aggregation': aggs, 'cells': cells})
    text_rows.append(
      [label, '/'.join(aggs) or MISSING]
      + [cell_text(cells[c]) if c in cells else '' for c in cols]
    )
  data = {'columns': cols, 'rows': rows}
  if len(rows) == 2:
    diff = {}
    for c in cols:
      a, b = (r['cells'].get(c, {}).get('accuracy') for r in rows)
      diff[c] = None if a is None or b is None else 100 * (a - b)
    data['difference_points'] = diff
    text_rows.append(
      [f'{rows[0]["method"]} − {rows[1]["method"]}', '']
      + [MISSING if diff[c] is None else f'{diff[c]:+.2f}' for c in cols]
    )
  note = '\nAccuracy of the best stitched network in %.\n'
  return data, markdown(['voting', 'aggregation', *cols], text_rows) + note


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
  res = stitch_results(path)
  if res is None:
    return np.zeros(0), np.zeros(0)
  key = eval_key(res)
  log = read_log(path)
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
  runs: RunSpec, include_eval: bool = False
) -> dict[str, dict[str, dict[str, Any]]]:
  """{column: {label: {'kind', 'seconds', 'accuracy', 'path'}}} of every
  workdir with points (others are left out)."""
  out: dict[str, dict[str, dict[str, Any]]] = {}
  for label, by_col in runs.items():
    for col, path in by_col.items():
      kind = kind_of(path)
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
      t = np.asarray(c['seconds']) / TIME_UNITS[unit]
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
  runs: RunSpec, last: int = 10
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
      kind = kind_of(path)
      curve: dict[str, Any] | None = None
      if kind == 'run':
        rows = metrics_io.read(os.path.join(path, 'metrics.jsonl'))
        evaluated = evaluations(rows)
        if evaluated:
          accs = [a for _, a in evaluated]
          curve = {
            'kind': kind,
            'path': path,
            'round': [r for r, _ in evaluated],
            'accuracy': accs,
            'mean': trailing_means(accs, last),
            'gain': trailing_gain(evaluated, last),
          }
          probe = read_probe(path)
          if probe.get('rounds') and probe.get('accuracy'):
            curve['probe_round'] = list(probe['rounds'])
            curve['probe_accuracy'] = list(probe['accuracy'])
      elif kind == 'stitch':
        res = stitch_results(path)
        best = (res or {}).get('best') or {}
        if res is not None and best.get(eval_key(res)) is not None:
          curve = {'kind': kind, 'path': path, 'level': best[eval_key(res)]}
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


def search_space(runs: RunSpec) -> dict[str, dict[str, Any]]:
  """Per stitch run: candidate blocks scored per round (the live networks'
  pool sizes summed), round time, `prune`, final accuracy."""
  out = {}
  for label, by_col in runs.items():
    for col, path in by_col.items():
      if kind_of(path) != 'stitch':
        continue
      log = read_log(path)
      if not log:
        continue
      name = label if len(by_col) == 1 else f'{label} ({col})'
      c = cell(path)
      seconds = [round_seconds(r) for r in log]
      out[name] = {
        'path': path,
        'prune': stitch_setting(path, 'prune'),
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
        cell_text({**d, 'kind': 'stitch', 'round': len(d['rounds'])}),
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
  return markdown(header, rows)


def search_space_figure(data: Mapping[str, Mapping[str, Any]]) -> Any:
  """Fig. 7: candidate blocks per round and round time, per run."""
  figure, canvas = plots._matplotlib()
  fig = figure(figsize=(11.5, 4.0), layout='constrained')
  canvas(fig)
  ax_n, ax_t = fig.subplots(1, 2)
  for (name, d), color in zip(data.items(), plots._colors(len(data))):
    acc = '' if d['accuracy'] is None else f', {_pct(d["accuracy"])} %'
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
        MISSING if e['mean_rank'] is None else f'{e["mean_rank"]:.3f}',
        f'{e["mean_weight"]:.3f}' if 'mean_weight' in e else MISSING,
        _pct(e.get('local_accuracy')),
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
  return markdown(header, rows)


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


# --- Client memory in one round (Fig. 5) -----------------------------------


def _nbytes(tree: Any) -> int:
  import jax

  return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)))


def block_memory(block: Any, batch_size: int) -> dict[str, Any]:
  """Measured memory of one block's inference forward pass at
  `batch_size` (`budgets.step_memory_bytes`): its variables, the input
  batch, its output and temporaries."""
  import jax
  import jax.numpy as jnp

  from fedjax_mr.stitch import blocks as blocks_lib
  from fedjax_mr.training import budgets

  x = jax.ShapeDtypeStruct((batch_size, *block.in_spec), jnp.float32)
  variables = jax.tree.map(
    lambda v: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype),
    block.variables,
  )
  forward = budgets.step_memory_bytes(
    lambda v, x: blocks_lib.run_steps(block.steps, v, x), variables, x
  )
  params = _nbytes(block.variables)
  return {
    'block': block.describe(),
    'model': block.model,
    'forward_bytes': forward,
    'parameter_bytes': params,
    'working_bytes': max(forward - params, 0),
  }


def memory_data(
  chains: Sequence[Sequence[Any]],
  pool_models: Sequence[Any],
  baselines: Sequence[tuple[str, Any]],
  batch_size: int,
  train_batch_size: int,
  ft_layers: int = 2,
) -> dict[str, Any]:
  """Fig. 5's bars, in bytes.

  FedStitch: a client holds the pool's blocks and scores candidates one
  forward pass at a time, so its memory in a round is every block's
  parameters plus the largest working memory (input, output and
  temporaries) of one block's forward pass at `batch_size`; 'FedStitch
  (one block)': the largest forward pass alone (parameters, input, output
  and temporaries of one block), as if blocks were loaded one at a time.
  FT-Full and FT-Part of each pool model, and every baseline trained from
  scratch:
  one SGD step at `train_batch_size` (`budgets.training_memory_bytes`),
  at the model's own input shape.

  Args:
    chains: the pool models cut into blocks (`pool.chains`).
    pool_models: the `PoolModel`s of `chains` (for FT-Full / FT-Part).
    baselines: (label, zoo `Model`) trained from scratch.
    batch_size: FedStitch's scoring batch.
    train_batch_size: the baselines' local batch.
    ft_layers: FT-Part trains the last this many parameterised modules
      (`fedjax_mr.algorithms.finetune.final_modules`, as experiments.run
      does with `algorithm=ft_part` and `ft_layers`).
  """
  from fedjax_mr.algorithms import finetune

  blocks = [block_memory(b, batch_size) for chain in chains for b in chain]
  bars = {}
  if blocks:
    held = sum(b['parameter_bytes'] for b in blocks)
    bars['FedStitch'] = held + max(b['working_bytes'] for b in blocks)
    # Without the pool held: the largest single forward pass.
    bars['FedStitch (one block)'] = max(b['forward_bytes'] for b in blocks)
  for m in pool_models:
    bars[f'FT-Full {m.id}'] = finetune.training_memory(
      m.model, None, train_batch_size, None
    )
    bars[f'FT-Part {m.id}'] = finetune.training_memory(
      m.model,
      finetune.final_modules(m.model, ft_layers),
      train_batch_size,
      None,
    )
  for label, model in baselines:
    bars[label] = finetune.training_memory(model, None, train_batch_size, None)
  return {
    'batch_size': batch_size,
    'train_batch_size': train_batch_size,
    'bars_bytes': bars,
    'blocks': blocks,
  }


def memory_table(data: Mapping[str, Any]) -> str:
  bars = data['bars_bytes']
  ref = bars.get('FedStitch')
  rows = [
    [
      name,
      f'{b / 2**20:.2f}',
      ''
      if ref is None or name.startswith('FedStitch')
      else f'{100 * (1 - ref / b):.1f}',
    ]
    for name, b in bars.items()
  ]
  return markdown(
    ['method', 'client memory (MiB)', 'FedStitch saves (%)'], rows
  )


def memory_figure(data: Mapping[str, Any]) -> Any:
  """Fig. 5: one bar per method, client memory in one round (MiB)."""
  figure, canvas = plots._matplotlib()
  bars = data['bars_bytes']
  fig = figure(
    figsize=(min(0.8 * len(bars) + 3, 14), 4.4), layout='constrained'
  )
  canvas(fig)
  ax = fig.subplots()
  names = list(bars)
  colors = plots._colors(len(names))
  drawn = ax.bar(
    range(len(names)), [bars[n] / 2**20 for n in names], color=colors
  )
  ax.bar_label(drawn, fmt='%.1f', fontsize='x-small')
  ax.set_xticks(range(len(names)), names, rotation=30, ha='right')
  ax.set_ylabel('client memory in one round (MiB)')
  ax.grid(alpha=0.3, axis='y')
  fig.suptitle(
    f'FedStitch: forward passes at batch {data["batch_size"]}; baselines: '
    f'one SGD step at batch {data["train_batch_size"]}',
    fontsize='medium',
  )
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
