"""scripts/archive_runs.py: which runs it copies, and what of them."""

import importlib.util
import json
import os

import pytest

_PATH = os.path.join(
  os.path.dirname(__file__), os.pardir, 'scripts', 'archive_runs.py'
)


@pytest.fixture(name='archive')
def _archive():
  spec = importlib.util.spec_from_file_location('archive_runs', _PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _run(folder, rounds, losses):
  os.makedirs(os.path.join(folder, 'checkpoints'))
  with open(os.path.join(folder, 'config.json'), 'w') as f:
    json.dump({'rounds': rounds}, f)
  with open(os.path.join(folder, 'metrics.jsonl'), 'w') as f:
    for i, loss in enumerate(losses, 1):
      f.write(json.dumps({'round': i, 'train_loss': loss}) + '\n')


def test_finished_and_diverged_runs_are_copied_unfinished_ones_not(
  archive, tmp_path, capsys
):
  src, dest = tmp_path / 'runs', tmp_path / 'kept'
  _run(src / 'fedavg' / 's0', 3, [1.0, 0.5, 0.4])
  _run(src / 'fedmut' / 's0', 3, [1.0, float('nan')])  # diverged: final
  _run(src / 'fedmr' / 's0', 3, [1.0, 0.5])  # still to resume
  # Only the last row's loss counts as divergence.
  _run(src / 'moon' / 's0', 3, [1.0, float('inf'), 0.3])
  # A null loss (distributed DP uploads none): finished by its rounds.
  _run(src / 'ddp' / 'done', 2, [None, None])
  _run(src / 'ddp' / 'half', 2, [None])
  (src / 'fedavg' / 's0' / 'probe.json').write_text('{}')  # experiments.probe
  archive.main(str(src), str(dest))
  out = capsys.readouterr().out
  assert 'unfinished, left out: fedmr/s0' in out
  assert 'ddp/half' in out
  kept = sorted(
    os.path.relpath(os.path.join(d, f), dest)
    for d, _, files in os.walk(dest)
    for f in files
  )
  assert kept == [
    'ddp/done/config.json',
    'ddp/done/metrics.jsonl',
    'fedavg/s0/config.json',
    'fedavg/s0/metrics.jsonl',
    'fedavg/s0/probe.json',
    'fedmut/s0/config.json',
    'fedmut/s0/metrics.jsonl',
    'moon/s0/config.json',
    'moon/s0/metrics.jsonl',
  ]
  rows = (dest / 'fedmut' / 's0' / 'metrics.jsonl').read_text().splitlines()
  assert len(rows) == 2


def test_fedstitch_runs_of_both_formats_are_copied_when_finished(
  archive, tmp_path, capsys
):
  src, dest = tmp_path / 'runs', tmp_path / 'kept'
  records = ('config.json', 'metrics.jsonl', 'clients.jsonl')
  reports = ('log.jsonl', 'energy.jsonl', 'partition.json')
  for name, files in (
    ('now', records + reports + ('results.json',)),
    ('running', records),  # no reports before its end
    ('earlier', ('state.npz', 'results.json') + reports),
  ):
    folder = src / name
    os.makedirs(folder / 'checkpoints')
    for f in files:
      text = '{"identity": {"seed": 0}}' if f == 'config.json' else '{}'
      (folder / f).write_text(text)
  archive.main(str(src), str(dest))
  assert 'unfinished, left out: running' in capsys.readouterr().out
  kept = sorted(
    os.path.relpath(os.path.join(d, f), dest)
    for d, _, files in os.walk(dest)
    for f in files
  )
  assert kept == sorted(
    [f'now/{f}' for f in records + reports + ('results.json',)]
    + [f'earlier/{f}' for f in reports + ('results.json',)]
  )
