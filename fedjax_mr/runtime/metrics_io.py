"""Per-round metrics as JSON lines (figures of them: `plots`)."""

from __future__ import annotations

import json
import math
import os
from typing import Any
from typing import BinaryIO
from typing import Iterator
from typing import Mapping
from typing import Sequence

from fedjax_mr.core import files

# The longest line a records file is read with (a clients row of 10^5
# clients is about 6 MB): a longer one counts as garbled, and no more of it
# than this is held in memory.
MAX_LINE_BYTES = 64 * 2**20


def lines(f: BinaryIO, limit: int = MAX_LINE_BYTES) -> Iterator[bytes | None]:
  """The lines of `f` (opened 'rb'), each read with at most `limit` bytes
  in memory: a longer line is skipped to its end and given as None."""
  while True:
    raw = f.readline(limit + 1)
    if not raw:
      return
    if len(raw) <= limit or raw.endswith(b'\n'):
      yield raw
      continue
    while raw and not raw.endswith(b'\n'):  # the rest of the long line
      raw = f.readline(limit)
    yield None


def parse(raw: bytes | None) -> dict[str, Any] | None:
  """A record line as a row: a JSON object with an integer 'round', or
  None (a cut, garbled, binary or over-long line)."""
  if raw is None:
    return None
  try:
    row = json.loads(raw.decode('utf-8'))
  except (UnicodeDecodeError, ValueError, RecursionError):
    return None
  ok = isinstance(row, dict) and type(row.get('round')) is int
  return row if ok else None


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
    for raw in lines(f):
      if raw is not None and not raw.strip():
        continue
      row = parse(raw)
      if row is None:
        bad += 1
      else:
        rows.append(row)
  return rows, bad


def intact_prefix(path: str) -> tuple[int, str]:
  """How far a records file reads row after row: `(last round, what
  stops it)`, the second '' when every line reads (or there is no file;
  an empty one is cut at its start).

  Rows must be JSON objects with an integer 'round', each the round after
  the one before (the first may be any round: a file can start late); a
  repeated round is skipped (`truncate` drops it). The first line that
  does not read, or a round that skips ahead, stops the prefix.
  """
  if not os.path.exists(path):
    return 0, ''
  last = None
  with open(path, 'rb') as f:
    for number, raw in enumerate(lines(f), 1):
      if raw is not None and not raw.strip():
        continue
      row = parse(raw)
      r = None if row is None else row['round']
      if r is None:
        after = f'after round {last}' if last else 'first'
        return last or 0, f'line {number} ({after}) is cut or garbled'
      if last is not None and r > last + 1:
        return last, f'line {number} skips from round {last} to {r}'
      last = r if last is None else max(last, r)
  if last is None:
    return 0, 'it holds no rows'
  return last, ''


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


def diverged_at(rows: Sequence[Mapping[str, Any]]) -> int | None:
  """The round whose train loss was non-finite (a run stops there and
  writes that round's row last), or None. A null train loss (a run
  whose clients upload none) is not a divergence."""
  loss = rows[-1]['train_loss'] if rows else None
  if loss is not None and not math.isfinite(loss):
    return int(rows[-1]['round'])
  return None
