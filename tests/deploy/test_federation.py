"""A real local federation: who may join it, command it or take its
tasks, and that nothing outlives it."""

import os
import subprocess
import sys
import time
from concurrent import futures

import pytest

from fedjax_mr.deploy import credentials
from fedjax_mr.deploy import federation
from fedjax_mr.deploy import launch
from fedjax_mr.deploy.flower import superlink
from tests.core import test_watchdog


def _log(folder, name):
  with open(os.path.join(folder, 'logs', f'{name}.log')) as f:
    return f.read()


def _wait_online(fed, count, timeout=60):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if fed.online_nodes() == count:
      return
    time.sleep(0.25)  # a look is one Control API request of this process
  raise AssertionError(f'{count} nodes never came online')


def _attacker_home(folder, fed, token=None):
  """A Flower home whose `flwr` reaches the federation's SuperLink with
  its public CA certificate, and `token` (if any) as a bearer token."""
  os.makedirs(folder)
  with open(os.path.join(folder, 'config.toml'), 'w') as f:
    f.write(
      f'[superlink]\ndefault = "x"\n[superlink.x]\n'
      f'address = "{fed.address}"\n'
      f'root-certificates = "{fed.credentials.ca_cert}"\n'
    )
  if token is not None:
    superlink.store_operator_token(folder, fed.address, token)
  return folder


def _attacker_flwr(home, *args):
  """`flwr args` from `home`: (exit code, its output)."""
  env = dict(os.environ, FLWR_HOME=home)
  done = subprocess.run(
    [os.path.join(os.path.dirname(sys.executable), 'flwr'), *args],
    capture_output=True,
    text=True,
    env=env,
    timeout=120,
  )
  return done.returncode, done.stdout + done.stderr


def _own_app(folder, marker):
  """A Flower App whose ServerApp and ClientApp write `marker` (so any
  process that runs either leaves it)."""
  os.makedirs(os.path.join(folder, 'evil'))
  with open(os.path.join(folder, 'pyproject.toml'), 'w') as f:
    f.write(
      '[build-system]\nrequires = ["hatchling"]\n'
      'build-backend = "hatchling.build"\n[project]\nname = "evil"\n'
      'version = "1.0.0"\ndependencies = []\n[tool.flwr.app]\n'
      'publisher = "x"\n[tool.flwr.app.components]\n'
      'serverapp = "evil.apps:server"\nclientapp = "evil.apps:client"\n'
    )
  with open(os.path.join(folder, 'evil', '__init__.py'), 'w') as f:
    f.write('')
  with open(os.path.join(folder, 'evil', 'apps.py'), 'w') as f:
    f.write(
      f'open({marker!r}, "w").write("ran")\n'
      'from flwr.serverapp import ServerApp\n'
      'from flwr.clientapp import ClientApp\n'
      'server = ServerApp()\nclient = ClientApp()\n'
    )
  return folder


def _refused(code_and_output):
  code, output = code_and_output
  return code != 0 or '"success": false' in output


@pytest.fixture(scope='module')
def one_node(tmp_path_factory):
  """The module's secure 1-node federation, online: `one_node()`. A test
  that breaks it stops it, and the next call starts a fresh one (each
  costs about 11 s of CPU to start and stop)."""
  started = []

  def running():
    if not started or started[-1]._group is None:  # stopped
      folder = str(tmp_path_factory.mktemp('fed'))
      fed = federation.Federation(folder, 1, lambda i: {'node-index': i})
      started.append(fed.start())
      _wait_online(fed, 1)
    return started[-1]

  yield running
  for fed in started:
    fed.stop()


def test_only_the_operator_commands_the_federation(tmp_path, one_node):
  """Attacks 1, 2 and 4 of issue 71, replayed: with the public CA (and
  a wrong token), running an App, listing, reading logs, stopping runs
  and registering a key are refused, and SuperExecs without the secret
  (or with a wrong one) get no task and end; the operator's `flwr` is
  obeyed."""
  fed = one_node()
  folder = fed.folder
  marker = str(tmp_path / 'ran')
  app = _own_app(str(tmp_path / 'evil_app'), marker)
  key = f'{folder}/intruder'
  credentials.write_node_key(key, key + '.pub')
  homes = [
    _attacker_home(str(tmp_path / 'ca_only'), fed),
    _attacker_home(str(tmp_path / 'guess'), fed, 'x' * 43),
  ]
  attempts = [
    (home, args)
    for home in homes
    for args in (
      ('run', app, 'x', '--format', 'json'),
      ('ls', 'x', '--format', 'json'),
      ('log', '1', 'x', '--show'),
      ('stop', '1', 'x', '--format', 'json'),
      ('supernode', 'list', 'x', '--format', 'json'),
      ('supernode', 'register', key + '.pub', 'x', '--format', 'json'),
      ('supernode', 'unregister', str(fed.node_ids[0]), 'x'),
    )
  ]
  # A few `flwr` processes at once (each mostly imports Flower).
  with futures.ThreadPoolExecutor(4) as pool:
    replies = list(pool.map(lambda a: _attacker_flwr(a[0], *a[1]), attempts))
  for (home, args), said in zip(attempts, replies):
    assert _refused(said), (home, args, said)
    assert 'Authentication failed' in said[1], (args, said)
  # The operator's own `flwr` (its token in the federation's home).
  nodes = fed.node_list()
  assert [int(n['node-id']) for n in nodes] == fed.node_ids
  # SuperExecs without the secret, or with another, at the node's
  # Runtime API and at the SuperLink's: refused, they end.
  node_runtime = fed._superexecs[1][1].args
  node_runtime = node_runtime[node_runtime.index('--runtime-api-address') + 1]
  with open(f'{folder}/wrong.secret', 'w') as f:
    f.write('0' * 64)
  tool = os.path.join(os.path.dirname(sys.executable), 'flower-superexec')
  ca = fed.credentials.ca_cert
  foreign = [
    fed._start('x1', [tool, '--insecure', '--runtime-api-address',
                      node_runtime]),
    fed._start('x2', [tool, '--root-certificates', ca,
                      '--runtime-api-address', fed.address]),
    fed._start('x3', [tool, '--insecure', '--runtime-api-address',
                      node_runtime, '--superexec-auth-secret-file',
                      f'{folder}/wrong.secret']),
  ]  # fmt: skip
  for process in foreign:
    process.wait(60)
  for name in ('x1', 'x2', 'x3'):
    assert 'Launch' not in _log(folder, name)
  # Ours still serve.
  assert all(p.poll() is None for _, p, _ in fed._superexecs)
  assert fed.online_nodes() == 1
  assert not os.path.exists(marker)
  # The secrets and Flower's home are the operator's alone.
  for path in ('', '/credentials', '/home', '/logs'):
    assert os.stat(folder + path).st_mode & 0o077 == 0, path
  for name in ('operator.token', 'superexec.secret', 'node0.key'):
    assert os.stat(f'{folder}/credentials/{name}').st_mode & 0o077 == 0
  assert os.stat(f'{folder}/home/credentials.yaml').st_mode & 0o077 == 0


def test_only_registered_nodes_with_the_ca_join(tmp_path, one_node):
  # The module's federation (attacked by the test above, if it ran), which
  # this test breaks and stops.
  fed = one_node()
  folder = fed.folder
  try:
    group = fed._group
    # An unregistered key, and a registered one that trusts another CA.
    key = str(tmp_path / 'intruder')
    credentials.write_node_key(key, key + '.pub')
    other = credentials.make(str(tmp_path / 'other'), 1)
    intruder = fed._start('intruder', fed.node_command(0, key=key))
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
  finally:
    fed.stop()
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
  for poll_s in (0.01, 3.5, float('nan')):
    with pytest.raises(ValueError, match='poll_s'):
      federation.Federation(str(tmp_path), 1, poll_s=poll_s)


def test_a_heartbeat_interval_starts_the_nodes_beating_at_it(tmp_path):
  from flwr.supercore import heartbeat
  from flwr.supernode import fleet_http_connection
  from flwr.supernode import start_client_internal

  from fedjax_mr.deploy.flower import supernode

  # The bounds the Federation checks without importing Flower are Flower's.
  assert federation.HEARTBEAT_S == (supernode.MIN_S, supernode.MAX_S)
  assert federation.POLL_S == (supernode.POLL_MIN_S, 3.0)
  default = federation.Federation(str(tmp_path), 2, insecure=True)
  fed = federation.Federation(str(tmp_path), 2, insecure=True, heartbeat_s=12)
  default.port = fed.port = 1
  default.secrets = fed.secrets = credentials.Secrets('token', 'secret')
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
  # A poll interval: the node's message loop waits at most that long
  # (Flower's 3 s when no message came), its other clocks untouched.
  polled = federation.Federation(str(tmp_path), 2, insecure=True, poll_s=0.25)
  polled.port, polled.secrets = 1, default.secrets
  assert polled.node_command(1, port=7) == [
    sys.executable, '-m', federation.SUPERNODE, '--poll-interval', '0.25',
    *plain[1:],
  ]  # fmt: skip
  both = federation.Federation(
    str(tmp_path), 2, insecure=True, heartbeat_s=12, poll_s=0.25
  )
  both.port, both.secrets = 1, default.secrets
  assert both.node_command(1, port=7)[3:7] == [
    '--heartbeat-interval', '12', '--poll-interval', '0.25'
  ]  # fmt: skip
  assert polled.env()['FLWR_SUPEREXEC_TASK_POLL_INTERVAL'] == '0.25'
  assert 'FLWR_SUPEREXEC_TASK_POLL_INTERVAL' not in default.env()
  saved = start_client_internal.time
  try:
    supernode.set_poll(0.1)
    clock = start_client_internal.time
    started = time.monotonic()
    clock.sleep(3)
    assert time.monotonic() - started < 1
    assert clock.monotonic is time.monotonic
  finally:
    start_client_internal.time = saved
  for seconds in (0.01, 4, float('nan')):
    with pytest.raises(ValueError, match='poll interval'):
      supernode.set_poll(seconds)
  # The module as a program: an interval the SuperLink would refuse, a
  # poll interval out of range, an option twice, or none, ends it with one
  # line before Flower starts.
  for args, says in (
    (['--heartbeat-interval', '5'], 'heartbeat-interval'),
    (['--poll-interval', '0'], 'poll-interval'),
    (['--poll-interval', '1', '--poll-interval', '1'], 'usage'),
    (['--superlink', 'x:1'], 'usage'),
  ):
    done = subprocess.run(
      [sys.executable, '-m', federation.SUPERNODE, *args],
      capture_output=True,
      text=True,
    )
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert says in done.stderr
