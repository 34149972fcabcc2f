"""Faults of the deploy program on the federation it starts: the program
killed with SIGKILL and run again, and stopped with Ctrl-C. (A SuperNode
killed and started again: test_deploy_program.py, on that module's
federation.)"""

import json
import os
import signal
import subprocess
import sys
import time

from fedjax_mr.pipeline import experiment
from tests import test_cli
from tests.deploy import test_deploy_program as program

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
FLAGS = [*program.FLAGS, '--algorithm=fedavg']


def _start(workdir, *extra, nodes=3):
  # SIGINT at its default action (a suite started in the background of a
  # non-interactive shell hands its children an ignored SIGINT).
  return subprocess.Popen(
    test_cli._default_sigint([
      sys.executable, '-m', 'experiments.deploy', f'--nodes={nodes}', *FLAGS,
      f'--workdir={workdir}', *extra,
    ]),
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )  # fmt: skip


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


def test_a_killed_server_resumes_to_the_uninterrupted_run(tmp_path):
  simulated, workdir = str(tmp_path / 'sim'), str(tmp_path / 'dep')
  proc = _start(workdir)
  program.wait_rows(workdir, 1, lambda: proc.poll() is None)
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
  # Flower's own log lines stay in the workdir (issue 71), the rounds'
  # lines reach the terminal.
  assert ':flwr:' not in out + err and 'round 2/2' in out
  with open(os.path.join(workdir, 'flower', 'logs', 'run.log')) as f:
    assert 'DEBUG:flwr:' in f.read()
  # The uninterrupted run: `experiments.run`'s pipeline, in this process.
  # Its rows and final model, bit for bit (FedAvg's equality with the
  # simulation: test_deploy_program.py checks the other algorithms).
  experiment.train_and_evaluate(
    program.config(simulated, algorithm='fedavg'), simulated, log=print
  )
  program.assert_same_run(simulated, workdir)
  with open(os.path.join(workdir, 'flower', 'result.json')) as f:
    assert json.load(f) == {'ok': True}


def test_ctrl_c_stops_every_process_and_keeps_what_was_written(tmp_path):
  # Flower's own launcher here (a fresh process for every message), the
  # warm SuperExec everywhere else. One node: a process of each kind (the
  # group's stop does not depend on their number; the killed server's
  # test above stops three nodes).
  workdir = str(tmp_path / 'dep')
  proc = _start(workdir, '--insecure_federation', '--nowarm_superexec', nodes=1)
  program.wait_rows(workdir, 1, lambda: proc.poll() is None)
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


def test_sigterm_says_one_line_and_stops_every_process(tmp_path):
  # SIGTERM as Ctrl-C (issue 71: it ended the program with 143 and no
  # line): once the federation is up, the program stops it, says one line
  # and exits with Ctrl-C's code. One node, as for Ctrl-C.
  workdir = str(tmp_path / 'dep')
  proc = _start(workdir, nodes=1)
  for line in proc.stdout:
    if line.startswith('federation: a SuperLink on'):
      break
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 130, out[-2000:] + err[-2000:]
  assert [line for line in err.splitlines() if line.strip()] == [
    'interrupted; re-run with the same --workdir to resume'
  ]
  deadline = time.monotonic() + 60
  while _processes_with(workdir) and time.monotonic() < deadline:
    time.sleep(0.5)
  assert _processes_with(workdir) == []
