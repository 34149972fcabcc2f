"""Copies the records of finished runs into a folder that git keeps.

  .venv/bin/python scripts/archive_runs.py runs/table docs/results/fmnist_table

Every finished run below SOURCE is copied to the same relative path below
DEST, records only (no checkpoints, networks or weights):

* a training run (experiments.run / compare: config.json + metrics.jsonl)
  when its last recorded round is config.json's `rounds`, or when that
  round's train loss is non-finite (the run diverged and stopped for
  good): metrics.jsonl, config.json, and probe.json where experiments.probe
  wrote one;
* a FedStitch run (experiments.stitch; its config.json holds the run's
  `identity`, or, of an earlier version, it has a state.npz) once it wrote
  results.json: results.json, log.jsonl, energy.jsonl, partition.json, and
  the records config.json, metrics.jsonl, clients.jsonl where it has them;
* a pool model (experiments.pretrain_zoo): meta.json.

`experiments.compare --summarize_only --workdir=<DEST column>` and
`experiments.stitch_figures` read the copies as they read the runs.
Unfinished runs are listed and left out; files already in DEST are
replaced.
"""

import json
import math
import os
import shutil
import sys

TRAINING = ('metrics.jsonl', 'config.json', 'probe.json')
STITCH = (
  'results.json',
  'log.jsonl',
  'energy.jsonl',
  'partition.json',
  'config.json',
  'metrics.jsonl',
  'clients.jsonl',
)


def _last_row(path):
  last = {}
  with open(path) as f:
    for line in f:
      if line.strip():
        last = json.loads(line)
  return last


def kind(folder):
  """('training' | 'stitch' | 'pool_model', finished) or None."""
  has = set(os.listdir(folder))
  config = {}
  if 'config.json' in has:
    with open(os.path.join(folder, 'config.json')) as f:
      config = json.load(f)
  if 'identity' in config or (
    'log.jsonl' in has and ('state.npz' in has or 'results.json' in has)
  ):
    return 'stitch', 'results.json' in has
  if {'config.json', 'metrics.jsonl'} <= has:
    rounds = config.get('rounds')
    last = _last_row(os.path.join(folder, 'metrics.jsonl'))
    # A null train loss is a run whose clients upload none (distributed
    # DP), not a divergence.
    loss = last.get('train_loss', 0.0)
    diverged = loss is not None and not math.isfinite(loss)
    done = rounds is not None and last.get('round', 0) >= rounds
    return 'training', done or diverged
  if 'meta.json' in has:
    return 'pool_model', True
  return None


def main(source, dest):
  copied = skipped = 0
  for folder, dirs, _ in os.walk(source):
    dirs[:] = sorted(
      d for d in dirs if d not in ('checkpoints', 'tensorboard', 'variables')
    )
    found = kind(folder)
    if found is None:
      continue
    what, finished = found
    rel = os.path.relpath(folder, source)
    if not finished:
      print(f'unfinished, left out: {rel}')
      skipped += 1
      continue
    names = {'training': TRAINING, 'stitch': STITCH}.get(what, ('meta.json',))
    target = os.path.join(dest, rel)
    os.makedirs(target, exist_ok=True)
    for name in names:
      if os.path.exists(os.path.join(folder, name)):
        shutil.copyfile(os.path.join(folder, name), os.path.join(target, name))
    copied += 1
  print(f'{copied} finished runs copied to {dest}; {skipped} left out')


if __name__ == '__main__':
  if len(sys.argv) != 3:
    sys.exit('usage: archive_runs.py SOURCE DEST')
  main(*sys.argv[1:])
