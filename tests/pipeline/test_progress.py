"""What a run prints: the per-round line and the summary."""

import os

from fedjax_mr.pipeline import progress


def test_the_round_line_says_what_the_k_models_accuracy_is():
  timer = progress.Timer(0, 20)
  timer.tick(1, 2.0)
  row = {
    'round': 1,
    'train_loss': 0.25,
    'test_accuracy': 0.5,
    'local_accuracy_mean': 0.2211,
    'client_ids': [3, 1, 4],
  }
  assert timer.progress_line(row) == (
    'round 1/20 | train loss 0.2500 | test acc 0.5000 | '
    "next round's 3 models: mean test acc 0.2211 | elapsed 2.0s | "
    '0.50 rounds/s | ETA 38s'
  )


def test_the_summary_counts_rounds_and_lists_the_files_written(tmp_path):
  timer = progress.Timer(0, 1)
  timer.tick(1, 3.0)
  history = [{'round': 1, 'test_accuracy': 0.5, 'test_loss': 1.5}]
  for name in ('metrics.jsonl', 'clients.jsonl', 'config.json'):
    (tmp_path / name).write_text('')
  os.makedirs(tmp_path / 'checkpoints')
  lines = timer.summary(history, str(tmp_path)).splitlines()
  assert lines[0] == (
    'done: 1 round; this process ran 1 in 3.0s (first round incl. compile '
    '3.0s, then 3.00s/round)'
  )
  # No partition.json (generated clients), no tensorboard/ (--notensorboard).
  assert lines[-1] == (
    f'workdir {tmp_path}: metrics.jsonl, clients.jsonl, config.json, '
    'checkpoints/'
  )
  for name in ('partition.json', 'learning_curve.png'):
    (tmp_path / name).write_text('')
  os.makedirs(tmp_path / 'tensorboard')
  assert timer.summary(history, str(tmp_path)).splitlines()[-1] == (
    f'workdir {tmp_path}: metrics.jsonl, clients.jsonl, config.json, '
    'partition.json, learning_curve.png, tensorboard/, checkpoints/'
  )
