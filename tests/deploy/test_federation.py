"""A real local federation: who may join it, and that nothing outlives it."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from fedjax_mr.deploy import credentials
from fedjax_mr.deploy import federation
from fedjax_mr.deploy import launch
from fedjax_mr.deploy import watchdog


def _log(folder, name):
  with open(os.path.join(folder, 'logs', f'{name}.log')) as f:
    return f.read()


def _wait_online(fed, count, timeout=60):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if fed.online_nodes() == count:
      return
    time.sleep(2)  # each look is a `flwr` process
  raise AssertionError(f'{count} nodes never came online')


def _group_members(pgid):
  found = []
  for entry in os.listdir('/proc'):
    if entry.isdigit():
      try:
        with open(f'/proc/{entry}/stat', 'rb') as f:
          fields = f.read().rsplit(b')', 1)[1].split()
      except OSError:
        continue
      if int(fields[2]) == pgid and fields[0] != b'Z':
        found.append(int(entry))
  return found


def test_only_registered_nodes_with_the_ca_join(tmp_path):
  folder = str(tmp_path / 'fed')
  fed = federation.Federation(folder, 1, lambda i: {'node-index': i})
  with fed:
    group = fed._group
    _wait_online(fed, 1)
    # An unregistered key, and a registered one that trusts another CA.
    credentials.write_node_key(f'{folder}/intruder', f'{folder}/intruder.pub')
    other = credentials.make(str(tmp_path / 'other'), 1)
    intruder = fed._start(
      'intruder', fed.node_command(0, key=f'{folder}/intruder')
    )
    no_ca = fed._start(
      'no_ca', fed.node_command(0, root_certificates=other.ca_cert)
    )
    assert intruder.wait(120) != 0
    assert no_ca.wait(120) != 0
    assert 'Failed to activate SuperNode' in _log(folder, 'intruder')
    assert 'CERTIFICATE_VERIFY_FAILED' in _log(folder, 'no_ca')
    assert fed.online_nodes() == 1
    assert len(_group_members(group)) > 2  # watchdog, link, node, execs
    # A warm SuperExec that ends under its living SuperNode (nothing would
    # start that node's App processes): the run stops, naming its log.
    ((name, superexec, node),) = [
      s for s in fed._superexecs if s[0] != 'superexec'
    ]
    superexec.kill()
    superexec.wait()
    app = launch.write_app(str(tmp_path / 'app'))
    with pytest.raises(federation.FederationError, match=f'{name}.log'):
      fed.run(app, {'spec': str(tmp_path)})
    assert node.poll() is None
  assert _group_members(group) == []
  # Flower's home and temporary files stayed in the folder.
  assert os.path.exists(f'{folder}/home/config.toml')
  with open(f'{folder}/credentials/node0.key', 'rb') as f:
    assert b'OPENSSH PRIVATE KEY' in f.read()
  assert os.stat(f'{folder}/credentials/node0.key').st_mode & 0o077 == 0


def test_the_watchdog_stops_the_group_when_its_parent_is_killed(tmp_path):
  # The parent starts the watchdog, a process in its group and one that
  # leaves it for a session of its own (as Flower's SuperLink starts its
  # SuperExec) with the federation's mark, then waits to be killed with
  # SIGKILL, which it cannot handle.
  parent = subprocess.Popen(
    [
      sys.executable,
      '-c',
      textwrap.dedent(
        """
        import os, subprocess, sys, time
        from fedjax_mr.deploy import watchdog
        dog = subprocess.Popen(
          [sys.executable, '-m', watchdog.__name__, str(os.getpid()), 'M1'],
          process_group=0)
        env = {**os.environ, watchdog.MARK_VARIABLE: 'M1'}
        child = subprocess.Popen(['sleep', '600'], process_group=dog.pid)
        away = subprocess.Popen(
          ['bash', '-c', "trap '' TERM; sleep 600"], env=env,
          start_new_session=True)
        print(dog.pid, child.pid, away.pid, flush=True)
        time.sleep(600)
        """
      ),
    ],
    stdout=subprocess.PIPE,
    text=True,
  )
  group, child, away = map(int, parent.stdout.readline().split())
  assert child in _group_members(group)
  assert away in watchdog._members(group, 'M1')
  parent.send_signal(signal.SIGKILL)
  parent.wait()
  deadline = time.monotonic() + 60
  while watchdog._members(group, 'M1') and time.monotonic() < deadline:
    time.sleep(0.2)
  assert watchdog._members(group, 'M1') == []
  assert (
    not os.path.exists(f'/proc/{away}')
    or open(f'/proc/{away}/stat').read().rsplit(')', 1)[1].split()[0] == 'Z'
  )


def test_bad_arguments_are_named(tmp_path):
  with pytest.raises(ValueError, match='num_nodes'):
    federation.Federation(str(tmp_path), 0)
  with pytest.raises(ValueError, match='num_nodes'):
    credentials.make(str(tmp_path), 0)
