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
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Callable

import numpy as np

from fedjax_mr.algorithms import registry
from fedjax_mr.core import errors
from fedjax_mr.core import files
from fedjax_mr.core import workdir as workdir_lib
from fedjax_mr.training import config as config_lib
from fedjax_mr.training import metrics_io
from fedjax_mr.training import provenance

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
        f'--variants: unknown variant {name!r}; choose among '
        f'{", ".join(VARIANTS)} or define one as name:field=value,...'
      )
    return name, dict(VARIANTS[name])
  if not name or '/' in name or name.startswith('.'):
    # The name is a folder under --workdir: it must stay inside it.
    raise errors.ConfigError(
      f'--variants: bad variant name in {spec!r} (a folder name under '
      "--workdir, without '/' and not starting with '.')"
    )
  fields = {f.name: f for f in config_lib.base_fields()}
  fields.update({flag: f for flag, (f, _) in registry.all_flags().items()})
  overrides: dict[str, Any] = {}
  for item in filter(None, (s.strip() for s in rest.split(','))):
    key, eq, value = item.partition('=')
    if not eq or key not in fields:
      raise errors.ConfigError(
        f'--variants: {item!r} in {spec!r} is not field=value with a flag '
        'of experiments.run'
      )
    overrides[key] = _convert(key, fields[key], value, spec)
  return name, overrides


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
      f'--variants: {name}={value!r} in {spec!r} is not a {kind}'
    ) from None
  return value


def run_dir(out: str, variant: str, seed: int) -> str:
  return os.path.join(out, variant, f's{seed}')


def configs(
  base: config_lib.ExperimentConfig,
  variants: Sequence[tuple[str, Mapping[str, Any]]],
  seeds: Sequence[int],
  out: str,
) -> list[tuple[str, int, config_lib.ExperimentConfig]]:
  """Every (variant, seed, config), validated before anything runs."""
  if len({name for name, _ in variants}) != len(variants):
    raise errors.ConfigError('--variants: a name appears twice')
  result = []
  for name, overrides in variants:
    for seed in seeds:
      config = dataclasses.replace(
        base, **overrides, seed=int(seed), workdir=run_dir(out, name, seed)
      )
      try:
        config_lib.validate(config)
      except errors.ConfigError as e:
        raise errors.ConfigError(f'variant {name}: {e}') from None
      result.append((name, int(seed), config))
  return result


def diverged_at(rows: Sequence[Mapping[str, Any]]) -> int | None:
  """The round whose train loss was non-finite (the run stopped there)."""
  if rows and not math.isfinite(rows[-1]['train_loss']):
    return int(rows[-1]['round'])
  return None


def final_accuracy(rows: Sequence[Mapping[str, Any]], last: int) -> float:
  """Mean test accuracy of the last `last` evaluated rounds (nan if none)."""
  accs = [r['test_accuracy'] for r in rows if 'test_accuracy' in r][-last:]
  return float(np.mean(accs)) if accs else math.nan


def summarize(
  out: str,
  variants: Sequence[str],
  seeds: Sequence[int],
  *,
  last: int = 10,
  title: str = '',
) -> dict[str, Any]:
  """Reads the runs under `out`; writes results.json, results.md, curves.png.

  Returns:
    `{'variants': {name: {'per_seed': {seed: acc}, 'mean', 'std', 'rounds',
    'n', 'diverged': {seed: round}}}, 'last': last}`; runs without metrics
    are left out. A run whose loss became non-finite counts in 'diverged',
    not in the mean ('mean' and 'std' are nan when every seed diverged).

  Raises:
    ConfigError: no run of these variants and seeds under `out` (nothing
      is written then, so an earlier table is never overwritten by an
      empty one).
  """
  results: dict[str, Any] = {}
  curves = {}
  for name in variants:
    per_seed, diverged, histories = {}, {}, []
    for seed in seeds:
      path = os.path.join(run_dir(out, name, seed), 'metrics.jsonl')
      rows = metrics_io.read(path) if os.path.exists(path) else []
      if not rows:
        continue
      stop = diverged_at(rows)
      if stop is not None:
        diverged[str(seed)] = stop
        continue
      per_seed[str(seed)] = final_accuracy(rows, last)
      histories.append(rows)
    if not per_seed and not diverged:
      continue
    values = np.array(list(per_seed.values()) or [math.nan])
    results[name] = {
      'per_seed': per_seed,
      'mean': float(np.mean(values)),
      'std': float(np.std(values)),
      'n': len(per_seed),
      'rounds': min((h[-1]['round'] for h in histories), default=0),
      'diverged': diverged,
    }
    if histories:
      curves[name] = _mean_curve(histories)
  if not results:
    raise errors.ConfigError(
      f'--workdir={out}: no runs of variants {", ".join(variants)} with seeds '
      f'{", ".join(map(str, seeds))} there; nothing to summarize'
    )
  summary = {'variants': results, 'last': last}
  # Who wrote the table (each run's own config.json records the devices
  # and versions it ran with).
  written = {**summary, 'provenance': provenance.collect(with_devices=False)}
  files.write_atomic(
    os.path.join(out, RESULTS_FILE), lambda f: json.dump(written, f, indent=2)
  )
  text = table(summary, title=title)
  files.write_atomic(os.path.join(out, TABLE_FILE), lambda f: f.write(text))
  if curves:
    metrics_io.plot_curves(curves, os.path.join(out, CURVES_FILE), title=title)
  return summary


def _mean_curve(histories: Sequence[Sequence[Mapping[str, Any]]]) -> list:
  """Per-round mean over seeds (rounds all of them reached)."""
  n = min(len(h) for h in histories)
  rows = []
  for i in range(n):
    row = {'round': histories[0][i]['round']}
    for key in ('train_loss', 'test_accuracy'):
      vals = [h[i][key] for h in histories if key in h[i]]
      if len(vals) == len(histories):
        row[key] = float(np.mean(vals))
    rows.append(row)
  return rows


def table(summary: Mapping[str, Any], title: str = '') -> str:
  """A markdown table: variant, final accuracy (mean ± std), seeds, rounds."""
  lines = [f'### {title}', ''] if title else []
  lines += [
    f'| variant | final accuracy (mean of last {summary["last"]} evals) '
    '| seeds | rounds |',
    '|---|---|---|---|',
  ]
  for name, r in summary['variants'].items():
    diverged = r.get('diverged', {})
    if r['n']:
      acc = f'{100 * r["mean"]:.2f}'
      if r['n'] > 1:
        acc += f' ± {100 * r["std"]:.2f}'
    if diverged:
      stops = ', '.join(f'seed {s} at round {t}' for s, t in diverged.items())
      acc = f'{acc} (diverged: {stops})' if r['n'] else f'diverged: {stops}'
    lines.append(f'| {name} | {acc} | {r["n"]} | {r["rounds"]} |')
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

  Returns:
    `{(variant, seed): round}` of the runs that diverged.
  """
  for _, _, config in runs:  # refuse before running any of them
    workdir_lib.check_free(config.workdir, '--workdir')
  diverged = {}
  for i, (name, seed, config) in enumerate(runs):
    log(f'[{i + 1}/{len(runs)}] {name} seed {seed} in {config.workdir}')
    path = os.path.join(config.workdir, 'metrics.jsonl')
    stop = diverged_at(metrics_io.read(path))
    if stop is None:
      try:
        train(config)
      except errors.NonFiniteError as e:
        log(f'{name} seed {seed}: {e}')
        stop = diverged_at(metrics_io.read(path)) or 0  # 0: round unknown
    else:
      log(
        f'{name} seed {seed} diverged at round {stop} before; skipped '
        f'(remove {config.workdir} to run it again)'
      )
    if stop is not None:
      diverged[(name, seed)] = stop
  return diverged
