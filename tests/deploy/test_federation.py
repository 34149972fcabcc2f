"""A real local federation: who may join it, and that nothing outlives it."""

import os
import subprocess
import sys
import time

import pytest

from fedjax_mr.deploy import credentials
from fedjax_mr.deploy import federation
from fedjax_mr.deploy import launch
from tests.core import test_watchdog


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
    # The watchdog, the SuperLink, the node, the SuperExecs.
    assert len(test_watchdog.group_members(group)) > 2
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
  assert test_watchdog.group_members(group) == []
  # Flower's home and temporary files stayed in the folder.
  assert os.path.exists(f'{folder}/home/config.toml')
  with open(f'{folder}/credentials/node0.key', 'rb') as f:
    assert b'OPENSSH PRIVATE KEY' in f.read()
  assert os.stat(f'{folder}/credentials/node0.key').st_mode & 0o077 == 0


def test_bad_arguments_are_named(tmp_path):
  with pytest.raises(ValueError, match='num_nodes'):
    federation.Federation(str(tmp_path), 0)
  with pytest.raises(ValueError, match='num_nodes'):
    credentials.make(str(tmp_path), 0)
  for heartbeat_s in (9.5, 1801, float('nan')):
    with pytest.raises(ValueError, match='heartbeat_s'):
      federation.Federation(str(tmp_path), 1, heartbeat_s=heartbeat_s)


def test_a_heartbeat_interval_starts_the_nodes_beating_at_it(tmp_path):
  from flwr.supercore import heartbeat
  from flwr.supernode import fleet_http_connection

  from fedjax_mr.deploy import supernode

  # The bounds the Federation checks without importing Flower are Flower's.
  assert federation.HEARTBEAT_S == (supernode.MIN_S, supernode.MAX_S)
  default = federation.Federation(str(tmp_path), 2, insecure=True)
  fed = federation.Federation(str(tmp_path), 2, insecure=True, heartbeat_s=12)
  default.port = fed.port = 1
  plain = default.node_command(1, port=7)
  assert os.path.basename(plain[0]) == 'flower-supernode'
  command = fed.node_command(1, port=7)
  assert command == [
    sys.executable, '-m', federation.SUPERNODE, '--heartbeat-interval', '12',
    *plain[1:],
  ]  # fmt: skip
  # What that module changes in the node's process: the interval it
  # asks the SuperLink for and the one its heartbeat thread waits by.
  saved = fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL
  try:
    supernode.set_interval(12)
    assert fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL == 12
    assert heartbeat.HEARTBEAT_DEFAULT_INTERVAL == 12
  finally:
    supernode.set_interval(saved)
  assert heartbeat.HEARTBEAT_DEFAULT_INTERVAL == saved
  with pytest.raises(ValueError, match='10'):
    supernode.set_interval(5)
  # The module as a program: an interval the SuperLink would refuse, or
  # none, ends it with one line before Flower starts.
  for args in (['--heartbeat-interval', '5'], ['--superlink', 'x:1']):
    done = subprocess.run(
      [sys.executable, '-m', federation.SUPERNODE, *args],
      capture_output=True,
      text=True,
    )
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert 'heartbeat-interval' in done.stderr
