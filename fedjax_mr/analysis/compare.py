"""Several algorithms (variants) × seeds on one setting, and their table.

A *variant* is a name and the config fields it overrides, e.g. `fedmr_p2`
= `{'algorithm': 'fedmr_p', 'fedmr_segments': 2}`. `run_matrix` runs every
(variant, seed) in `<workdir>/<variant>/s<seed>` (each an ordinary, resumable
experiment workdir, so an interrupted matrix resumes where it stopped, and
finished runs train nothing), then `summarize` reads the metrics back:
final accuracy per run = mean test accuracy of its last `last` evaluations,
reported as mean ± std over seeds, and one PNG with every variant's
seed-averaged curve.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Callable

import numpy as np

from fedjax_mr.core import errors
from fedjax_mr.core import files
from fedjax_mr.core import workdir as workdir_lib
from fedjax_mr.pipeline import checks
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import records
from fedjax_mr.pipeline import registry
from fedjax_mr.runtime import metrics_io
from fedjax_mr.runtime import plots
from fedjax_mr.runtime import provenance

# The named variants of the papers' comparisons: every algorithm by its
# name and the registry entries' own variants.
VARIANTS: dict[str, dict[str, Any]] = registry.variants()

RESULTS_FILE = 'results.json'
TABLE_FILE = 'results.md'
CURVES_FILE = 'curves.png'


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
  """A variant from `name` (one of `VARIANTS`) or `name:field=value,...`.

  Values are converted to the field's type (bool: true/false/1/0).

  Raises:
    ConfigError: unknown name or field, or a value of the wrong type.
  """
  name, sep, rest = spec.partition(':')
  name = name.strip()
  if not sep:
    if name not in VARIANTS:
      raise errors.ConfigError(
        f'`variants`: unknown variant {name!r}; choose among '
        f'{", ".join(VARIANTS)} or define one as name:field=value,...'
      )
    return name, dict(VARIANTS[name])
  if not name or '/' in name or name.startswith('.'):
    # The name is a folder under `out`: it must stay inside it.
    raise errors.ConfigError(
      f'`variants`: bad variant name in {spec!r} (a folder name under '
      "`workdir`, without '/' and not starting with '.')"
    )
  if name in (RESULTS_FILE, TABLE_FILE, CURVES_FILE):
    # A folder of that name would stop the table's write, after training.
    raise errors.ConfigError(
      f'`variants`: variant name {name!r} in {spec!r} is a file the '
      f'comparison writes in `workdir` ({TABLE_FILE}, {RESULTS_FILE}, '
      f'{CURVES_FILE}); name it otherwise'
    )
  fields = {f.name: f for f in config_lib.base_fields()}
  fields.update({flag: f for flag, (f, _) in registry.all_flags().items()})
  overrides: dict[str, Any] = {}
  for item in filter(None, (s.strip() for s in rest.split(','))):
    key, eq, value = item.partition('=')
    if not eq or key not in fields:
      raise errors.ConfigError(
        f'`variants`: {item!r} in {spec!r} is not field=value with a field '
        'of the experiment config (a flag of experiments.run)'
      )
    if key in _SET_PER_RUN:
      raise errors.ConfigError(
        f'`variants`: {item!r} in {spec!r}: a variant cannot set {key}; '
        f'each run takes it from {_SET_PER_RUN[key]}'
      )
    overrides[key] = _convert(key, fields[key], value, spec)
  return name, overrides


# The fields every run of a comparison gets from the comparison itself.
_SET_PER_RUN = {
  'seed': '`seeds`',
  'workdir': '`workdir` (<workdir>/<variant>/s<seed>)',
}


def _convert(name: str, field: dataclasses.Field, value: str, spec: str) -> Any:
  kind = field.type if isinstance(field.type, str) else field.type.__name__
  try:
    if kind == 'bool':
      if value.lower() not in ('true', 'false', '1', '0'):
        raise ValueError(value)
      return value.lower() in ('true', '1')
    if kind == 'int':
      return int(value)
    if kind == 'float':
      return float(value)
  except ValueError:
    raise errors.ConfigError(
      f'`variants`: {name}={value!r} in {spec!r} is not a {kind}'
    ) from None
  return value


def run_dir(out: str, variant: str, seed: int) -> str:
  return os.path.join(out, variant, f's{seed}')


def base_config(base: Mapping[str, Any]) -> config_lib.ExperimentConfig:
  """The config of the flat flag values `base` without the algorithms'
  own flags (which apply to the variants of the algorithms that read
  them): the setting every variant shares."""
  fields = {f.name for f in config_lib.base_fields()}
  return config_lib.ExperimentConfig.from_flat(
    **{k: v for k, v in base.items() if k in fields}
  )


def configs(
  base: Mapping[str, Any],
  variants: Sequence[tuple[str, Mapping[str, Any]]],
  seeds: Sequence[int],
  out: str,
) -> list[tuple[str, int, config_lib.ExperimentConfig]]:
  """Every (variant, seed, config), validated before anything runs.

  `base` holds flat flag values (`ExperimentConfig.flat`, the flags of
  `experiments.run`). A hyper-parameter field of an algorithm set in
  `base` (e.g. `fedprox_mu`) applies to the variants of the algorithms
  that read it; the others keep its default. One that no variant's
  algorithm reads is refused.

  Raises:
    ConfigError: a variant named twice, a seed out of range or given
      twice, such a field, or a config that does not validate
      (`config.validate`), named by its field in backticks.
  """
  if len({name for name, _ in variants}) != len(variants):
    raise errors.ConfigError('`variants`: a name appears twice')
  for seed in seeds:
    checks.check_seed('seeds', seed)
  seen = set()
  for seed in seeds:  # one run folder per seed: a second would be the first
    if seed in seen:
      raise errors.ConfigError(
        f'`seeds`: seed {seed} appears twice; each seed is one run'
      )
    seen.add(seed)
  algorithm_flags = registry.all_flags()
  given = {
    flag: users
    for flag, (f, users) in algorithm_flags.items()
    if base.get(flag, f.default) != f.default
  }
  default = base.get('algorithm', config_lib.AlgorithmChoice().name)
  algorithms = {o.get('algorithm', default) for _, o in variants}
  for flag, users in given.items():
    if not algorithms & set(users):
      raise errors.ConfigError(
        f'`{flag}` applies to `algorithm={" or ".join(users)}` only, and no '
        f'variant runs one ({", ".join(sorted(algorithms))})'
      )
  result = []
  for name, overrides in variants:
    algorithm = overrides.get('algorithm', default)
    reset = {
      flag: algorithm_flags[flag][0].default
      for flag, users in given.items()
      if algorithm not in users and flag not in overrides
    }
    if 'partition_file' in overrides and 'partition_sha256' not in overrides:
      # The variant's own file: its hash is computed afresh.
      reset['partition_sha256'] = ''
    for seed in seeds:
      values = {**base, **reset, **overrides}
      values.update(seed=int(seed), workdir=run_dir(out, name, seed))
      try:
        config = checks.check(
          config_lib.ExperimentConfig.from_flat(**values)
        ).config
      except errors.ConfigError as e:
        raise errors.ConfigError(f'variant {name}: {e}') from None
      result.append((name, int(seed), config))
  return result


def final_accuracy(rows: Sequence[Mapping[str, Any]], last: int) -> float:
  """Mean test accuracy of the last `last` evaluated rounds (nan if none)."""
  accs = [r['test_accuracy'] for r in rows if 'test_accuracy' in r][-last:]
  return float(np.mean(accs)) if accs else math.nan


def runs_in(out: str) -> dict[str, list[int]]:
  """`{variant: [seeds]}` of every run folder under `out` that holds a
  metrics.jsonl (`<out>/<variant>/s<seed>`), variants and seeds sorted."""
  found: dict[str, list[int]] = {}
  if not os.path.isdir(out):
    return found
  for name in sorted(os.listdir(out)):
    folder = os.path.join(out, name)
    if name.startswith('.') or not os.path.isdir(folder):
      continue
    seeds = sorted(
      int(s[1:])
      for s in os.listdir(folder)
      if s[:1] == 's'
      and s[1:].isdigit()
      and os.path.exists(os.path.join(folder, s, 'metrics.jsonl'))
    )
    if seeds:
      found[name] = seeds
  return found


def summarize(
  out: str,
  variants: Sequence[str] | None = None,
  seeds: Sequence[int] | None = None,
  *,
  last: int = 10,
  title: str = '',
  first: Sequence[str] = (),
  started: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
  """Reads the runs under `out`; writes results.json, results.md, curves.png.

  Args:
    out: the comparison's folder.
    variants: the variants to tabulate; None: every variant with runs
      under `out` (`runs_in`), those in `first` first, so the table and
      figure of a folder never drop the runs of another command.
    seeds: the seeds to read; None: every seed of each variant found.
    last: final accuracy = mean of the last `last` evaluations.
    title: the table's and figure's title.
    first: see `variants`.
    started: results.json's provenance record, collected when the command
      that writes the table started (`provenance.collect`: its
      `start_time` is then the command's); None: collected now.

  Returns:
    `{'variants': {name: {'per_seed': {seed: acc}, 'mean', 'std', 'rounds',
    'n', 'evals': {seed: evaluations averaged}, 'diverged': {seed:
    round}}}, 'last': last}`; runs without metrics are left out. A run
    whose loss became non-finite counts in 'diverged', not in the mean
    ('mean' and 'std' are nan when every seed diverged).

  Raises:
    ConfigError: no run of these variants and seeds under `out` (nothing
      is written then, so an earlier table is never overwritten by an
      empty one).
  """
  found = runs_in(out)
  if variants is None:
    variants = [v for v in first if v in found]
    variants += [v for v in found if v not in variants]
  results: dict[str, Any] = {}
  curves = {}
  for name in variants:
    read = _read_variant(
      out, name, found.get(name, []) if seeds is None else seeds, last
    )
    if read is not None:
      results[name], curves[name] = read
  if not results:
    which = (f' of variants {", ".join(variants)}' if variants else '') + (
      f' with seeds {", ".join(map(str, seeds))}' if seeds else ''
    )
    raise errors.ConfigError(
      f'`workdir={out}`: no runs{which} there; nothing to summarize'
    )
  summary = {'variants': results, 'last': last}
  _write_summary(out, summary, curves, title, started)
  return summary


def _read_variant(
  out: str, name: str, seeds: Sequence[int], last: int
) -> tuple[dict[str, Any], dict[int, list]] | None:
  """One variant's entry of `summarize` and its rows by seed (diverged
  runs too: they are drawn up to the end), or None without metrics."""
  per_seed, diverged, histories, evals = {}, {}, [], {}
  plotted = {}
  for seed in seeds:
    path = os.path.join(run_dir(out, name, seed), 'metrics.jsonl')
    rows = metrics_io.read(path) if os.path.exists(path) else []
    if not rows:
      continue
    plotted[seed] = rows
    stop = metrics_io.diverged_at(rows)
    if stop is not None:
      diverged[str(seed)] = stop
      continue
    per_seed[str(seed)] = final_accuracy(rows, last)
    evals[str(seed)] = min(last, sum('test_accuracy' in r for r in rows))
    histories.append(rows)
  if not per_seed and not diverged:
    return None
  values = np.array(list(per_seed.values()) or [math.nan])
  entry = {
    'per_seed': per_seed,
    'mean': float(np.mean(values)),
    'std': float(np.std(values)),
    'n': len(per_seed),
    'rounds': min((h[-1]['round'] for h in histories), default=0),
    'evals': evals,
    'diverged': diverged,
  }
  return entry, plotted


def _write_summary(
  out: str,
  summary: dict[str, Any],
  curves: Mapping[str, Mapping[int, list]],
  title: str,
  started: Mapping[str, Any] | None,
) -> None:
  """results.json (with who wrote the table, from when: each run's own
  config.json records the devices and versions it ran with), results.md
  and curves.png."""
  written = {
    **summary,
    'provenance': started or provenance.collect(with_devices=False),
  }
  files.write_atomic(
    os.path.join(out, RESULTS_FILE), lambda f: json.dump(written, f, indent=2)
  )
  text = table(summary, title=title)
  files.write_atomic(os.path.join(out, TABLE_FILE), lambda f: f.write(text))
  labels = display_names(curves)
  groups = families(list(curves)) if len(curves) > plots.MAX_SIDE_LEGEND else {}
  plots.plot_curves(
    {labels[name]: rows for name, rows in curves.items()},
    os.path.join(out, CURVES_FILE),
    title=title,
    groups={g: [labels[v] for v in vs] for g, vs in groups.items()},
  )


def families(variants: Sequence[str], size: int = 5) -> dict[str, list[str]]:
  """The rows of the many-methods figure: after the first variant (the
  reference, drawn in every row), the variants of algorithms that keep K
  models (FedMR's family) apart from the others, each in rows of at most
  `size`, in their order."""
  named = registry.variants()
  kinds: dict[str, list[str]] = {'keep K models': [], 'aggregate': []}
  for name in variants[1:]:
    algorithm = named.get(name, {}).get('algorithm')
    multi = (
      algorithm in registry.REGISTRY and registry.get(algorithm).multi_model
    )
    kinds['keep K models' if multi else 'aggregate'].append(name)
  rows = {}
  for kind, members in sorted(kinds.items(), key=lambda k: k[0] != 'aggregate'):
    chunks = [members[i : i + size] for i in range(0, len(members), size)]
    for i, chunk in enumerate(chunks):
      part = f' ({i + 1} of {len(chunks)})' if len(chunks) > 1 else ''
      rows[f'methods that {kind}{part}'] = chunk
  return rows


def display_names(variants: Sequence[str]) -> dict[str, str]:
  """{variant: its name in the figure and table}: `registry.display_name`
  ('FedAvg', a custom variant's own name), followed by the variant's name
  where an earlier variant has that display name ('FedAvg (FedAvg)' for a
  custom variant named so after `fedavg`)."""
  names = {}
  for name in variants:
    label = registry.display_name(name)
    names[name] = f'{label} ({name})' if label in names.values() else label
  return names


def _evals(summary: Mapping[str, Any]) -> str:
  """The numbers of evaluations the final accuracies average: '10', or
  '4-10' when runs had fewer."""
  counts = [
    n for r in summary['variants'].values() for n in r.get('evals', {}).values()
  ]
  if not counts:
    return str(summary['last'])
  lo, hi = min(counts), max(counts)
  return str(lo) if lo == hi else f'{lo}-{hi}'


def table(summary: Mapping[str, Any], title: str = '') -> str:
  """A markdown table: method (the figure's name of each variant:
  `display_names`), final accuracy (mean ± std), seeds, rounds.

  The header says how many evaluations each final accuracy averages (the
  last `last`, fewer for a run that has fewer).
  """
  lines = [f'### {title}', ''] if title else []
  lines += [
    f'| method | final accuracy, % (mean of the last {_evals(summary)} '
    'evaluations; ± std over seeds) | seeds | rounds |',
    '|---|---|---|---|',
  ]
  labels = display_names(summary['variants'])
  for name, r in summary['variants'].items():
    diverged = r.get('diverged', {})
    if r['n']:
      acc = f'{100 * r["mean"]:.2f}'
      if r['n'] > 1:
        acc += f' ± {100 * r["std"]:.2f}'
    if diverged:
      stops = ', '.join(f'seed {s} at round {t}' for s, t in diverged.items())
      acc = f'{acc} (diverged: {stops})' if r['n'] else f'diverged: {stops}'
    lines.append(f'| {labels[name]} | {acc} | {r["n"]} | {r["rounds"]} |')
  return '\n'.join(lines) + '\n'


def run_matrix(
  runs: Sequence[tuple[str, int, config_lib.ExperimentConfig]],
  train: Callable[[config_lib.ExperimentConfig], Any],
  log: Callable[[str], None] = print,
) -> dict[tuple[str, int], int]:
  """Runs (or resumes) each run in order.

  A finished run resumes from its final checkpoint and trains nothing; its
  workdir's config is still checked against the requested one. A run whose
  loss becomes non-finite is logged and left (it would diverge again the
  same way: runs are deterministic); the others go on.

  Each run's workdir is locked while it runs (`experiment.run`); a run
  that another process is running is refused before anything starts.
  Each run's first line gives the rounds left in the whole matrix and,
  once this process has trained some, their ETA at its pace so far.

  Returns:
    `{(variant, seed): round}` of the runs that diverged.
  """
  for _, _, config in runs:  # refuse before running any of them
    workdir_lib.check_free(config.run.workdir)

  def done(config) -> int:
    rows = metrics_io.read(os.path.join(config.run.workdir, 'metrics.jsonl'))
    if not rows:
      return 0
    # A diverged run trains no more.
    if metrics_io.diverged_at(rows) is not None:
      return config.run.rounds
    return int(rows[-1]['round'])

  diverged = {}
  start, trained = time.monotonic(), 0
  for i, (name, seed, config) in enumerate(runs):
    left = sum(max(0, c.run.rounds - done(c)) for _, _, c in runs[i:])
    line = f'[{i + 1}/{len(runs)}] {name} seed {seed} in {config.run.workdir}'
    line += f'; {records.rounds(left)} left in the matrix'
    if trained and left:
      pace = (time.monotonic() - start) / trained
      line += f', ETA {_duration(left * pace)} ({pace:.1f} s/round so far)'
    log(line)
    path = os.path.join(config.run.workdir, 'metrics.jsonl')
    before = done(config)
    stop = metrics_io.diverged_at(metrics_io.read(path))
    if stop is None:
      try:
        train(config)
      except errors.NonFiniteError as e:
        log(f'{name} seed {seed}: {e}')
        rows = metrics_io.read(path)
        stop = metrics_io.diverged_at(rows) or 0  # 0: round unknown
    else:
      log(
        f'{name} seed {seed} diverged at round {stop} before; skipped '
        f'(remove {config.run.workdir} to run it again)'
      )
    if stop is not None:
      diverged[(name, seed)] = stop
    else:
      trained += max(0, done(config) - before)
  return diverged


def _duration(seconds: float) -> str:
  """`1h02m`, `12m05s` or `40s`."""
  s = int(round(seconds))
  if s >= 3600:
    return f'{s // 3600}h{s % 3600 // 60:02d}m'
  if s >= 60:
    return f'{s // 60}m{s % 60:02d}s'
  return f'{s}s'
