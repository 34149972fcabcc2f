"""Faults on a real local federation: a SuperNode killed, and the program
itself killed with SIGKILL and run again."""

import json
import os
import signal
import subprocess
import sys
import time

from tests import helpers
from tests.deploy import test_deploy_program as program

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
FLAGS = [*program.FLAGS, '--algorithm=fedavg']


def _start(workdir, *extra):
  return subprocess.Popen(
    [
      sys.executable, '-m', 'experiments.deploy', '--nodes=3', *FLAGS,
      f'--workdir={workdir}', *extra,
    ],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )  # fmt: skip


def _wait_rows(workdir, n, proc, timeout=900):
  path = os.path.join(workdir, 'metrics.jsonl')
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if os.path.exists(path):
      with open(path) as f:
        if len(f.readlines()) >= n:
          return
    assert proc.poll() is None, proc.communicate()
    time.sleep(0.5)
  raise AssertionError(f'{n} rows never came')


def _processes_with(text):
  found = []
  for entry in os.listdir('/proc'):
    if entry.isdigit():
      try:
        with open(f'/proc/{entry}/cmdline', 'rb') as f:
          if text.encode() in f.read():
            found.append(int(entry))
      except OSError:
        pass
  return found


def test_a_killed_node_fails_its_clients_and_the_run_completes(tmp_path):
  workdir = str(tmp_path / 'dep')
  proc = _start(workdir, '--round_timeout=120')
  _wait_rows(workdir, 1, proc)
  # Round 2 trains clients 4, 6 and 0 (seed 3): node 1 serves client 4.
  node = [
    p
    for p in _processes_with('node-index=1 ')
    if workdir.encode() in open(f'/proc/{p}/cmdline', 'rb').read()
  ]
  assert node, 'SuperNode 1 not found'
  for pid in node:
    os.kill(pid, signal.SIGKILL)
  out, err = proc.communicate(timeout=900)
  assert proc.returncode == 0, out[-2000:] + err[-2000:]
  rows = program._rows(workdir, 'metrics.jsonl')
  assert rows[1]['client_ids'] == [4, 6, 0]
  assert rows[1]['failed_clients'] == [4]
  clients = program._rows(workdir, 'clients.jsonl')[1]['clients']
  assert [c.get('failed', False) for c in clients] == [True, False, False]
  assert 'client 4 failed' in out


def test_a_killed_server_resumes_to_the_uninterrupted_run(tmp_path):
  simulated, workdir = str(tmp_path / 'sim'), str(tmp_path / 'dep')
  proc = _start(workdir)
  _wait_rows(workdir, 1, proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  # The watchdog stops the federation: nothing of it outlives the program.
  deadline = time.monotonic() + 60
  while _processes_with(workdir) and time.monotonic() < deadline:
    time.sleep(0.5)
  assert _processes_with(workdir) == []
  again = _start(workdir)
  out, err = again.communicate(timeout=900)
  assert again.returncode == 0, out[-2000:] + err[-2000:]
  assert 'resum' in out.lower()
  run = helpers.run_module('experiments.run', *FLAGS, f'--workdir={simulated}')
  assert run.returncode == 0, run.stderr[-2000:]
  for name in ('metrics.jsonl', 'clients.jsonl'):
    assert program._rows(workdir, name) == program._rows(simulated, name)
  with open(os.path.join(workdir, 'flower', 'result.json')) as f:
    assert json.load(f) == {'ok': True}
