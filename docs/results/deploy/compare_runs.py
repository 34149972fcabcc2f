"""Two training workdirs compared, for the record scripts of this folder
(equality.sh, placement.sh, resume_across.sh): their metrics and clients
rows (times left out) and the leaves of their final states, bit for bit.

  .venv/bin/python docs/results/deploy/compare_runs.py STYLE A B

STYLE is the script's report: `equality` (rows equal, final model, the
last row), `placement` (each rows file, the fields that differ, final
model, the last row) or `resume` (rows equal by round, final state and
its largest difference, the test accuracy by round).
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', '..'))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fedjax_mr.pipeline import experiment  # noqa: E402

TIMES = {'round_time_s', 'eval_time_s', 'elapsed_s'}
FILES = ('metrics.jsonl', 'clients.jsonl')


def rows(folder, name):
  """A rows file's rows, without their times."""
  with open(f'{folder}/{name}') as f:
    return [
      {k: v for k, v in json.loads(line).items() if k not in TIMES}
      for line in f
    ]


def leaves(a, b, whole):
  """The two runs, and the leaves of their final server states (`whole`:
  of their whole round states)."""
  ra, rb = experiment.load_run(a), experiment.load_run(b)
  pick = (lambda r: r.state) if whole else (lambda r: r.state.server)
  return ra, rb, jax.tree.leaves(pick(ra)), jax.tree.leaves(pick(rb))


def differing(la, lb):
  return sum(
    not np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
  )


def _model_and_last(a, b, prefix, last_keys):
  """The final model's line (after `prefix`) and the last metrics row of
  `b` by `last_keys`."""
  ra, rb, la, lb = leaves(a, b, whole=False)
  print(
    f'{prefix}final model: {differing(la, lb)} of {len(la)} leaves differ; '
    f'rounds {ra.round} and {rb.round}'
  )
  last = rows(b, 'metrics.jsonl')[-1]
  print('  last row: ' + ', '.join(f'{k} {last[k]!r}' for k in last_keys))


def equality(a, b):
  same = {n: rows(a, n) == rows(b, n) for n in FILES}
  _model_and_last(
    a,
    b,
    f'  rows equal: {same}; ',
    ('train_loss', 'test_accuracy', 'test_loss'),
  )


def placement(a, b):
  for n in FILES:
    x, y = rows(a, n), rows(b, n)
    bad = sorted({k for r, s in zip(x, y) for k in r if r[k] != s.get(k)})
    print(
      f'  {n}: {len(x)} and {len(y)} rows, equal {x == y}'
      + ('' if x == y else f'; fields that differ: {bad}')
    )
  _model_and_last(a, b, '  ', ('train_loss', 'test_accuracy'))


def resume(a, b):
  for n in FILES:
    x, y = rows(a, n), rows(b, n)
    same = [r == s for r, s in zip(x, y)]
    bad = sorted({k for r, s in zip(x, y) for k in r if r[k] != s.get(k)})
    print(
      f'    {n}: {len(x)} and {len(y)} rows, equal by round {same}'
      + ('' if all(same) else f'; fields that differ: {bad}')
    )
  ra, rb, la, lb = leaves(a, b, whole=True)
  worst = max(
    (
      float(
        np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
      )
      for x, y in zip(la, lb)
      if np.issubdtype(np.asarray(x).dtype, np.floating) and np.asarray(x).size
    ),
    default=0.0,
  )
  print(
    f'    final state: {differing(la, lb)} of {len(la)} leaves differ, the '
    f'largest |difference| {worst:.3g}; rounds {ra.round} and {rb.round}'
  )
  print(
    '    test_accuracy by round:',
    [r['test_accuracy'] for r in rows(a, 'metrics.jsonl')],
    'and',
    [r['test_accuracy'] for r in rows(b, 'metrics.jsonl')],
  )


if __name__ == '__main__':
  style, first, second = sys.argv[1:]
  {'equality': equality, 'placement': placement, 'resume': resume}[style](
    first, second
  )
