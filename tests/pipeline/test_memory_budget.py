"""The host memory of a run that keeps per-client state: at most FedAvg's
peak at the same scale plus twice the client-state bytes (BUILD.md,
"Scale: what a round holds"), checkpoints included. Each run is a program
in its own process, with glibc's malloc arenas fixed so that allocator
noise does not decide."""

import os
import subprocess
import sys

import pytest

# N clients of the logistic model (610 float32 parameters): SCAFFOLD's
# controls take N x 2,440 bytes (244 MB), each copy of them a third of
# FedAvg's whole peak (about 630 MiB), so one extra copy breaks the budget.
_N = 100_000
_CLIENT_STATE_BYTES = _N * 610 * 4
# Runs `experiments.run` with the given flags and prints this process's
# peak resident memory (KiB) last.
_CHILD = """
import resource, sys
from absl import app
from experiments import run
try:
  app.run(run.main, argv=['run', *sys.argv[1:]])
finally:
  print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _start(algorithm: str, workdir: str) -> subprocess.Popen:
  repo = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  flags = [
    '--dataset=synthetic',
    '--model=logistic',
    f'--algorithm={algorithm}',
    f'--num_clients={_N}',
    '--clients_per_round=100',
    '--rounds=2',
    '--checkpoint_every=1',
    '--client_chunk=1',  # compiles in half the time of the default 8
    '--notensorboard',
    f'--workdir={workdir}',
  ]
  env = {**os.environ, 'MALLOC_ARENA_MAX': '2', 'TF_CPP_MIN_LOG_LEVEL': '2'}
  return subprocess.Popen(
    [sys.executable, '-c', _CHILD, *flags],
    cwd=repo,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def _peak_bytes(proc: subprocess.Popen) -> int:
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-2000:]
  return int(out.splitlines()[-1]) * 1024


@pytest.mark.slow
def test_scaffold_holds_its_controls_at_most_twice(tmp_path):
  # Side by side: each process's peak is its own.
  fedavg = _start('fedavg', str(tmp_path / 'fedavg'))
  scaffold = _start('scaffold', str(tmp_path / 'scaffold'))
  base, peak = _peak_bytes(fedavg), _peak_bytes(scaffold)
  budget = base + 2 * _CLIENT_STATE_BYTES
  mib = 2**20
  assert peak <= budget, (
    f"SCAFFOLD peaked at {peak / mib:.0f} MiB, over FedAvg's "
    f'{base / mib:.0f} MiB plus twice its controls '
    f'({_CLIENT_STATE_BYTES / mib:.0f} MiB each): {budget / mib:.0f} MiB'
  )
