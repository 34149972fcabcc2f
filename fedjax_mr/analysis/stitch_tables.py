"""The FedStitch paper's tables, from finished workdirs: which runs
(`parse_runs`), reading their folders (`cell`: a run's accuracy, rounds
and time), Table III (`accuracy_table`: every method, IID and non-IID) and
Table IV (`voting_table`: RL-weighted against plain voting).

References: "Heterogeneity-Aware Coordination for Federated Learning via
Stitching Pre-trained blocks", Shichen Zhan, Yebo Wu, Chunlin Tian, Yan
Zhao, Li Li (2024).

Three kinds of folder are read, never written: a FedStitch workdir
(`experiments.stitch`: config.json with its identity, log.jsonl,
results.json, partition.json and its state in checkpoints/, or in
state.npz for a workdir of an earlier version), a training workdir
(`experiments.run`: metrics.jsonl, config.json and, once experiments.probe
has read it, probe.json) and a pool model folder
(`experiments.pretrain_zoo`: meta.json). Host-only Python and numpy (a
FedStitch state's checkpoint is read with orbax, imported then). The
figures are in `stitch_figures`, the client memory measurement in
`stitch_memory`.
"""

from __future__ import annotations

import os
from typing import Any
from typing import Mapping
from typing import Sequence

import numpy as np

from fedjax_mr.core import errors
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
  # A FedStitch run's config.json holds its identity (a training run's
  # does not); one of an earlier version has no config.json.
  config = (
    _json(os.path.join(path, 'config.json')) if has('config.json') else {}
  )
  if 'identity' in config:
    return 'stitch'
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
  """`(payload, identity)` of a stitch workdir's final state: its newest
  intact checkpoint's document (nothing is written or moved), else, of a
  workdir of an earlier version, its state.npz; None without either."""
  from fedjax_mr.runtime import checkpoint
  from fedjax_mr.stitch import state as state_lib

  file = os.path.join(path, 'state.npz')
  folder = os.path.join(path, checkpoint.FOLDER)
  if os.path.isdir(folder):
    ckpt = checkpoint.Checkpointer(path)
    try:
      found = ckpt.find(None)
    finally:
      ckpt.close()
    if found.round is not None:
      data = found.state[state_lib.CHECKPOINT_ENTRY].tobytes()
      where = os.path.join(folder, str(found.round))
      payload, identity = state_lib.parse_document(data, where)
      return payload, identity or {}
  if not os.path.exists(file):
    return None
  payload, identity = state_lib.read_document(file)
  return payload, identity or {}


def stitch_setting(path: str, name: str) -> Any:
  """The value of flag `name` a stitch run was made with (results.json's
  config, else its state's flags), or None."""
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


def pct(value: float | None) -> str:
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
  text = pct(c['accuracy'])
  if c['kind'] == 'run':
    gain, trail = c.get('gain'), ''
    if gain is not None:
      word = 'flat' if gain < PLATEAU_GAIN else 'rising'
      trail = f'; {c["round"]} rounds, {100 * gain:+.2f} in {PLATEAU_SPAN}'
      trail += f', {word}'
    text += f' (best {pct(c["best"])}{trail})'
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
    return f'{pct(c["probe"])} (rounds {span})'
  return '' if c.get('probe') is None else pct(c['probe'])


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
