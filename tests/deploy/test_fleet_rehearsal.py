"""The deploy how-to's real-fleet steps, run literally on one machine as a
rehearsal: each step's shell block, with the server's address 10.0.0.1 as
127.0.0.1 and free ports for 9092 and the devices' 9094; each device in a
folder of its own holding what the how-to copies to it (`ca.crt`, its
key); step 4 as written for device 0 and, as the how-to says, alike for
devices 1 and 2. The run step 5 submits ends with `experiments.run`'s
rows and final model of the same flags, bit for bit."""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np

from fedjax_mr.deploy import federation
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import experiment
from tests import docs_text
from tests.deploy import test_deploy_program

PAGE = 'docs/howto/deploy.md'
SECTION = ('**A real fleet**', '**Who can do what')
DEVICES = 3


def fleet_steps():
  """The shell blocks of the how-to's real-fleet steps, in order."""
  text = docs_text.read(PAGE)
  start, end = (text.index(marker) for marker in SECTION)
  return [
    '\n'.join(line.strip() for line in block.strip().splitlines())
    for block in re.findall(r'```sh\n(.*?)```', text[start:end], re.S)
  ]


def _wait_port(port, processes, timeout=120):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    for p in processes:
      assert p.poll() is None, f'a fleet process ended ({p.args})'
    try:
      socket.create_connection(('127.0.0.1', port), timeout=1).close()
      return
    except OSError:
      time.sleep(0.25)
  raise AssertionError(f'nothing listens on {port}')


def _flags(command):
  """`--name=value` of the step-5 command as `{name: value}`."""
  words = shlex.split(command)
  return dict(w[2:].split('=', 1) for w in words if w.startswith('--'))


def test_the_fleet_steps_run_as_written(tmp_path):
  steps = fleet_steps()
  assert len(steps) == 5, steps
  link, node_port = federation.free_port(), federation.free_port()

  def literal(step, device=None, port=None):
    step = step.replace('10.0.0.1', '127.0.0.1').replace('9092', str(link))
    if device is not None:
      step = step.replace('node0', f'node{device}')
      step = step.replace('node-index=0', f'node-index={device}')
      step = step.replace('/abs/state0', str(tmp_path / f'state{device}'))
      step = step.replace('9094', str(port))
    return step

  server = tmp_path / 'server'
  server.mkdir()
  env = dict(os.environ)
  env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env['PATH']
  env['HOME'] = str(tmp_path / 'home')  # Flower's default home is there
  processes = []

  def background(step, cwd):
    # One shell for the block (its `$!`), waiting for its jobs; the group
    # is stopped at the end.
    process = subprocess.Popen(
      ['bash', '-c', step + '\nwait'],
      cwd=cwd,
      env=env,
      stdin=subprocess.DEVNULL,
      stdout=open(os.path.join(cwd, 'out.log'), 'ab'),
      stderr=subprocess.STDOUT,
      start_new_session=True,
    )
    processes.append(process)
    return process

  def foreground(step, cwd):
    done = subprocess.run(
      ['bash', '-c', step],
      cwd=cwd,
      env=env,
      capture_output=True,
      text=True,
      timeout=900,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout

  try:
    # 1. The credentials; 2. the SuperLink and its SuperExec.
    foreground(literal(steps[0]), server)
    background(literal(steps[1]), server)
    _wait_port(link, processes)
    # 3. The operator's home, the keys registered: their ids.
    said = foreground(literal(steps[2]), server)
    ids = [int(n) for n in re.findall(r'"node-id": (\d+)', said)]
    assert len(ids) == DEVICES, said
    # 4. Each device, its own folder with what was copied to it.
    for i in range(DEVICES):
      device = tmp_path / f'device{i}'
      device.mkdir()
      shutil.copy(server / 'fleet' / 'ca.crt', device)
      shutil.copy(server / 'fleet' / 'roster.json', device)
      shutil.copy(server / 'fleet' / f'node{i}.key', device)
      port = node_port if i == 0 else federation.free_port()
      background(literal(steps[3], i, port), device)
    # 5. The operator's run, with the registered ids.
    run = literal(steps[4]).replace('ID0,ID1,ID2', ','.join(map(str, ids)))
    workdir = str(tmp_path / 'run')
    run = run.replace('/abs/run', workdir)
    out = foreground(run, server)
  finally:
    for process in processes:
      try:
        os.killpg(process.pid, signal.SIGTERM)
      except ProcessLookupError:
        pass
    for process in processes:
      try:
        process.wait(30)
      except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
  assert f'SuperLink on 127.0.0.1:{link}, {DEVICES} SuperNodes' in out
  # The same flags, simulated.
  flags = _flags(steps[4])
  run_flags = {
    k: v
    for k, v in flags.items()
    if k
    not in {
      'nodes',
      'superlink',
      'root_certificates',
      'operator_token',
      'node_ids',
      'workdir',
    }
  }
  simulated = str(tmp_path / 'sim')
  config = config_lib.ExperimentConfig.from_flat(
    **{k: _value(v) for k, v in run_flags.items()}, workdir=simulated
  )
  experiment.train_and_evaluate(config, simulated, log=lambda line: None)
  rounds = int(flags['rounds'])
  for name in ('metrics.jsonl', 'clients.jsonl'):
    assert test_deploy_program._rows(workdir, name) == (
      test_deploy_program._rows(simulated, name)
    )
  a, b = experiment.load_run(simulated), experiment.load_run(workdir)
  assert a.round == b.round == rounds
  for x, y in zip(
    jax.tree.leaves(a.state.server), jax.tree.leaves(b.state.server)
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  with open(os.path.join(workdir, 'flower', 'result.json')) as f:
    assert json.load(f) == {'ok': True}


def _value(text):
  """A flag's text as the config's value (an int where it is one)."""
  try:
    return int(text)
  except ValueError:
    return text
