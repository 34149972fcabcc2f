"""Faults on a real local federation: a SuperNode killed and started
again, the program itself killed with SIGKILL and run again, and the
program stopped with Ctrl-C."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

from fedjax_mr.deploy import federation
from fedjax_mr.deploy import launch
from fedjax_mr.pipeline import experiment
from tests import test_cli
from tests.deploy import test_deploy_program as program

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
FLAGS = [*program.FLAGS, '--algorithm=fedavg']


def _start(workdir, *extra):
  # SIGINT at its default action (a suite started in the background of a
  # non-interactive shell hands its children an ignored SIGINT).
  return subprocess.Popen(
    test_cli._default_sigint([
      sys.executable, '-m', 'experiments.deploy', '--nodes=3', *FLAGS,
      f'--workdir={workdir}', *extra,
    ]),
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )  # fmt: skip


def _wait_rows(workdir, n, alive, timeout=900):
  """Waits for `n` metrics rows in `workdir` while `alive()` holds."""
  path = os.path.join(workdir, 'metrics.jsonl')
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if os.path.exists(path):
      with open(path) as f:
        if len(f.readlines()) >= n:
          return
    assert alive(), 'the run ended early'
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


def test_a_killed_node_fails_its_clients_and_rejoins(tmp_path):
  folder, workdir = str(tmp_path / 'fed'), tmp_path / 'dep'
  nodes = program.NODES
  lines, failures = [], []

  def deploy(rounds):
    try:
      launch.run(
        program.config(workdir, algorithm='fedavg', rounds=rounds),
        nodes,
        round_timeout=120,
        federation=fed,
        log=lines.append,
      )
    except BaseException as e:  # noqa: BLE001 - reported below
      failures.append(e)

  with federation.Federation(
    folder, nodes, launch.node_config(folder, nodes)
  ) as fed:
    run = threading.Thread(target=deploy, args=(2,))
    run.start()
    _wait_rows(str(workdir), 1, run.is_alive)
    # Round 2 trains clients 4, 6 and 0 (seed 3): node 1 serves client 4.
    fed.nodes[1].kill()
    fed.nodes[1].wait()
    run.join(900)
    assert not failures, failures
    rows = program._rows(workdir, 'metrics.jsonl')
    assert rows[1]['client_ids'] == [4, 6, 0]
    assert rows[1]['failed_clients'] == [4]
    clients = program._rows(workdir, 'clients.jsonl')[1]['clients']
    assert [c.get('failed', False) for c in clients] == [True, False, False]
    assert any('client 4 failed' in line for line in lines)
    # Node 1 comes back (its registered key: the same node id) and
    # serves round 3 of the run, resumed with one more round.
    fed.nodes[1] = fed.start_node(1)
    deadline = time.monotonic() + 300
    while fed.online_nodes() < nodes and time.monotonic() < deadline:
      time.sleep(1)
    deploy(3)
    assert not failures, failures
  rows = program._rows(workdir, 'metrics.jsonl')
  assert len(rows) == 3 and 'failed_clients' not in rows[2]
  assert any(c % nodes == 1 for c in rows[2]['client_ids'])


def test_a_killed_server_resumes_to_the_uninterrupted_run(tmp_path):
  simulated, workdir = str(tmp_path / 'sim'), str(tmp_path / 'dep')
  proc = _start(workdir)
  _wait_rows(workdir, 1, lambda: proc.poll() is None)
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
  # The uninterrupted run: `experiments.run`'s pipeline, in this process.
  experiment.train_and_evaluate(
    program.config(simulated, algorithm='fedavg'), simulated, log=print
  )
  for name in ('metrics.jsonl', 'clients.jsonl'):
    assert program._rows(workdir, name) == program._rows(simulated, name)
  with open(os.path.join(workdir, 'flower', 'result.json')) as f:
    assert json.load(f) == {'ok': True}


def test_ctrl_c_stops_every_process_and_keeps_what_was_written(tmp_path):
  # Flower's own launcher here (a fresh process for every message), the
  # warm SuperExec everywhere else.
  workdir = str(tmp_path / 'dep')
  proc = _start(workdir, '--insecure_federation', '--nowarm_superexec')
  _wait_rows(workdir, 1, lambda: proc.poll() is None)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 130, out[-2000:] + err[-2000:]
  assert 'warning: an insecure federation' in out + err
  interrupted = 'interrupted; re-run with the same --workdir to resume'
  assert [line for line in err.splitlines() if 'interrupted' in line] == [
    interrupted
  ]
  deadline = time.monotonic() + 60
  while _processes_with(workdir) and time.monotonic() < deadline:
    time.sleep(0.5)
  assert _processes_with(workdir) == []
  assert len(program._rows(workdir, 'metrics.jsonl')) >= 1
  assert experiment.load_run(workdir).round >= 1
