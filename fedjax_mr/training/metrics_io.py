"""Per-round metrics as JSON lines, and learning-curve plots."""

from __future__ import annotations

import json
import os
from typing import Any
from typing import Mapping
from typing import Sequence

from fedjax_mr.core import files


def read(path: str) -> list[dict[str, Any]]:
  """The rows of a metrics.jsonl file (empty if it does not exist); lines
  that are not a JSON object with an integer 'round' (a partial last line
  left by a crash, garbled or binary data) are skipped, see `read_checked`.
  """
  return read_checked(path)[0]


def read_checked(path: str) -> tuple[list[dict[str, Any]], int]:
  """`(rows, number of unreadable lines)` of a metrics.jsonl file."""
  if not os.path.exists(path):
    return [], 0
  rows, bad = [], 0
  with open(path, 'rb') as f:
    for raw in f:
      if not raw.strip():
        continue
      try:
        row = json.loads(raw.decode('utf-8'))
      except (UnicodeDecodeError, ValueError):
        bad += 1
        continue
      ok = isinstance(row, dict) and type(row.get('round')) is int
      if ok:
        rows.append(row)
      else:
        bad += 1
  return rows, bad


def write_json(path: str, obj: Any, **dump_kwargs: Any) -> None:
  """Writes `obj` as JSON atomically (`files.write_atomic`): a reader
  (another process of the same run, a resumed run) sees the old file or the
  whole new one, never part."""
  files.write_atomic(path, lambda f: json.dump(obj, f, **dump_kwargs))


def append(path: str, row: Mapping[str, Any]) -> None:
  """Appends one row and flushes it to disk."""
  files.append_line(path, json.dumps(row))


def truncate(path: str, max_round: int) -> tuple[list[dict[str, Any]], str]:
  """Keeps only the readable rows with `round <= max_round`, each round
  once (atomically).

  Returns:
    `(rows kept, what was dropped)`: the second is '' when nothing but rows
    past `max_round` went (those belong to rounds the checkpoint does not
    hold), else one line naming the unreadable lines and repeated rounds
    dropped.
  """
  rows, bad = read_checked(path)
  kept, seen, repeated = [], set(), 0
  for r in rows:
    if r['round'] > max_round:
      continue
    if r['round'] in seen:
      repeated += 1
      continue
    seen.add(r['round'])
    kept.append(r)
  notes = []
  if bad:
    notes.append(
      f'dropped {bad} unreadable line{"s" * (bad != 1)} (not a JSON row '
      "with a 'round')"
    )
  if repeated:
    notes.append(
      f'dropped {repeated} repeated row{"s" * (repeated != 1)} of a round'
    )
  if os.path.exists(path) or kept:
    files.write_atomic(
      path, lambda f: f.writelines(json.dumps(r) + '\n' for r in kept)
    )
  return kept, '; '.join(notes)


def plot_curves(
  runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str, title: str = ''
) -> None:
  """Writes a PNG: test accuracy (left) and train loss (right) per round.

  Args:
    runs: label → metrics rows (as in metrics.jsonl).
    path: output PNG path.
    title: figure title.
  """
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(10, 4))
  for label, rows in runs.items():
    evals = [r for r in rows if 'test_accuracy' in r]
    ax_acc.plot(
      [r['round'] for r in evals],
      [r['test_accuracy'] for r in evals],
      marker='.' if len(evals) < 30 else None,
      label=label,
    )
    ax_loss.plot(
      [r['round'] for r in rows], [r['train_loss'] for r in rows], label=label
    )
  ax_acc.set_xlabel('round')
  ax_acc.set_ylabel('test accuracy')
  ax_acc.grid(alpha=0.3)
  ax_loss.set_xlabel('round')
  ax_loss.set_ylabel('train loss')
  ax_loss.set_yscale('log')
  ax_loss.grid(alpha=0.3)
  ax_acc.legend()
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  try:
    files.write_atomic(
      path, lambda f: fig.savefig(f, dpi=100, format='png'), binary=True
    )
  finally:
    plt.close(fig)
