"""A deployed run on a real local federation (a SuperLink and 3
SuperNodes as processes, TLS, node authentication) ends with
`experiments.run`'s own rows, bit for bit, for FedMR (which needs every
client's model) and for SCAFFOLD (whose client state lives on the nodes;
FedAvg's, killed and resumed, in test_deploy_faults.py); a deployed
FedStitch run (each node holding the block pool and its clients'
examples) ends with `experiments.stitch`'s own records. One federation
serves the runs, as a real fleet serves many
(`launch.run(..., federation=)`), then a run one of whose nodes is
killed mid-round and started again, and last a secure run (SecAgg+) one
of whose nodes is killed between its masked input and unmasking; the
program's own start of a federation is tested in test_deploy_faults.py."""

import datetime
import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

import tests
from fedjax_mr.deploy import credentials
from fedjax_mr.deploy import federation
from fedjax_mr.deploy import launch
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.pipeline import experiment
from fedjax_mr.pipeline import stitch_config
from fedjax_mr.pipeline import stitch_experiment
from fedjax_mr.stitch import pool as pool_lib
from fedjax_mr.stitch import state as state_lib
from tests.deploy import test_federation
from tests.stitch import common

# A tiny run: 9 generated clients, 3 a round, 2 rounds, a 610-parameter
# model; one device and one client at a time, the order of the
# deployment's sums (see fedjax_mr/deploy/server.py).
SETTING = dict(
  dataset='synthetic',
  model='logistic',
  num_clients=9,
  clients_per_round=3,
  rounds=2,
  local_epochs=1,
  client_chunk=1,
  num_devices=1,
  eval_every=1,
  checkpoint_every=1,
  seed=3,
)
FLAGS = [f'--{k}={v}' for k, v in SETTING.items()]
NODES = 3
# The module federation's SuperNodes beat every 10 s (the least a
# SuperLink accepts; Flower's own is 30 s): a killed node's clients fail
# at most 20 s after its death.
HEARTBEAT_S = 10.0
TIMES = {'round_time_s', 'eval_time_s', 'elapsed_s'}


def _rows(workdir, name):
  with open(os.path.join(workdir, name)) as f:
    return [
      {k: v for k, v in json.loads(line).items() if k not in TIMES}
      for line in f
    ]


def wait_rows(workdir, n, alive, timeout=900):
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


def _attack_the_run(tmp_path, fed):
  """Once `fed` runs a run, `flwr log` and `flwr stop` of it from a Flower
  home with the public CA only: each refused (`fed.attacked`)."""
  fed.attacked = False
  deadline = time.monotonic() + 300
  while fed.running is None and time.monotonic() < deadline:
    time.sleep(0.2)
  run_id = str(fed.running)
  home = test_federation._attacker_home(str(tmp_path / 'attacker'), fed)
  for args in (('log', run_id, 'x', '--show'), ('stop', run_id, 'x')):
    said = test_federation._attacker_flwr(home, *args)
    assert test_federation._refused(said), (args, said)
    assert 'Authentication failed' in said[1], (args, said)
  fed.attacked = True


def kill_submitter_after_round_1(fed, workdir, remote):
  """Submits FedMR's run to `remote` from another process, kills that
  process with SIGKILL once round 1 is written, and checks that the run
  was stopped at the SuperLink (by the process's watchdog)."""
  code = (
    'from fedjax_mr.deploy import federation, launch\n'
    'from tests.deploy import test_deploy_program as t\n'
    f'remote = federation.Remote(*{tuple(remote)!r})\n'
    f"launch.run(t.config({str(workdir)!r}, algorithm='fedmr'), t.NODES,"
    ' superlink=remote, log=lambda line: None)\n'
  )
  submitter = subprocess.Popen(
    [sys.executable, '-c', code], cwd=os.path.dirname(tests.__path__[0])
  )
  wait_rows(str(workdir), 1, lambda: submitter.poll() is None)
  submitter.kill()
  submitter.wait()
  with open(os.path.join(workdir, 'flower', 'logs', 'run.log')) as f:
    (run_id,) = re.findall(r'Successfully started run (\d+)', f.read())
  deadline = time.monotonic() + 90
  while time.monotonic() < deadline:
    out = fed._flwr('ls', federation.FEDERATION, '--format', 'json')
    (run,) = [r for r in json.loads(out)['runs'] if r['run-id'] == run_id]
    if run['status'].startswith('finished'):
      break
    time.sleep(2)
  assert run['status'] == 'finished:stopped', run
  # Its server saves the round in flight and lets the workdir go.
  assert launch.wait_released(str(workdir))


def config(workdir, **values):
  return config_lib.ExperimentConfig.from_flat(
    **{**SETTING, **values}, workdir=str(workdir)
  )


@pytest.fixture(scope='module')
def fed(tmp_path_factory):
  folder = str(tmp_path_factory.mktemp('federation'))
  with federation.Federation(
    folder,
    NODES,
    launch.node_config(folder, NODES),
    heartbeat_s=HEARTBEAT_S,
    poll_s=federation.LOCAL_POLL_S,
  ) as f:
    yield f


def assert_same_run(simulated, deployed, rounds=2):
  for name in ('metrics.jsonl', 'clients.jsonl'):
    assert _rows(deployed, name) == _rows(simulated, name)
  assert len(_rows(deployed, 'metrics.jsonl')) == rounds
  a, b = experiment.load_run(simulated), experiment.load_run(deployed)
  assert a.round == b.round == rounds
  for x, y in zip(
    jax.tree.leaves(a.state.server), jax.tree.leaves(b.state.server)
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# FedAvg's: test_deploy_faults.py, its run killed after round 1 and resumed
# (the program's own federation).
@pytest.mark.parametrize('algorithm', ['fedmr', 'scaffold'])
def test_deployed_run_equals_the_simulation(tmp_path, fed, algorithm):
  simulated, deployed = tmp_path / 'sim', tmp_path / 'dep'
  experiment.train_and_evaluate(
    config(simulated, algorithm=algorithm), str(simulated), log=lambda s: None
  )
  lines = []
  to = dict(federation=fed)
  if algorithm == 'fedmr':
    # Submitted as to a real fleet's SuperLink: by its address, CA
    # certificate, node ids and operator token (`--superlink`,
    # `--root_certificates`, `--node_ids`, `--operator_token`) ...
    remote = federation.Remote(
      fed.address,
      fed.credentials.ca_cert,
      tuple(fed.node_ids),
      fed.secrets.operator_token,
    )
    to = dict(superlink=remote)
    # ... by a process killed with SIGKILL once round 1 is written: its
    # run is stopped at the SuperLink, and the same call resumes it.
    kill_submitter_after_round_1(fed, deployed, remote)
  else:
    # While the run goes on, someone with the public CA tries to read its
    # log and to stop it (attack 1 of issue 71): refused, and the run
    # ends with the simulation's bits.
    attacker = threading.Thread(target=_attack_the_run, args=(tmp_path, fed))
    attacker.start()
  launch.run(
    config(deployed, algorithm=algorithm), NODES, log=lines.append, **to
  )
  if algorithm != 'fedmr':
    attacker.join()
    assert fed.attacked
  assert any(f'SuperLink on {fed.address}' in line for line in lines)
  assert_same_run(str(simulated), str(deployed))
  with open(deployed / 'flower' / 'result.json') as f:
    assert json.load(f) == {'ok': True}


def test_a_superlink_elsewhere_is_checked_in_one_line_first(tmp_path, fed):
  """Attacks 7 and 8 of issue 71: node ids the SuperLink never
  registered, another CA, a CA file that is not one, a wrong token and no
  SuperLink at all are each one line, within 30 s, before any run."""
  other = credentials.make(str(tmp_path / 'other'), 1).ca_cert
  garbage = tmp_path / 'garbage.crt'
  garbage.write_bytes(b'\xff\xfe not a certificate')
  wrong_token = tmp_path / 'wrong.token'
  wrong_token.write_text('w' * 43)
  ca, token = fed.credentials.ca_cert, fed.secrets.operator_token
  ids = list(fed.node_ids)
  cases = [
    (fed.address, ca, ids[:2] + [12345], token, 'node ids 12345 are not'),
    (fed.address, other, ids, token, 'is not one the CA in'),
    (fed.address, str(garbage), ids, token, 'not a PEM CA certificate'),
    (fed.address, ca, ids, str(wrong_token), 'refused the operator token'),
    (f'127.0.0.1:{federation.free_port()}', ca, ids, token, 'no SuperLink'),
  ]
  for i, (address, root, node_ids, token_file, says) in enumerate(cases):
    remote = federation.Federation.attach(
      str(tmp_path / f'attach{i}'),
      address,
      NODES,
      root_certificates=root,
      node_ids=node_ids,
      operator_token=token_file,
    )
    started = time.monotonic()
    with pytest.raises(federation.FederationError, match=says) as e:
      remote.start()
    assert time.monotonic() - started < federation.CHECK_TIMEOUT_S
    assert '\n' not in str(e.value)
    remote.stop()


# A small FedStitch run: a pool of two zoo models (random weights), 6
# clients of a Fashion-MNIST subset, 3 a round; one selection of 2 rounds
# (the second under the deadline the first set), then the stitches of
# each start block to its end blocks: 3 messages to each node.
STITCH = dict(
  num_clients=6,
  clients_per_round=3,
  rounds_per_selection=2,
  max_depth=2,
  batch_size=16,
  local_clients=0,
  eval_examples=200,
)
# What results.json times or measures of the process that wrote it.
RESULT_TIMES = {
  'run_seconds',
  'selection_seconds_per_round',
  'selection_seconds_total',
  'peak_host_mib',
}


@pytest.fixture(scope='module')
def stitch_pool(tmp_path_factory):
  folder = str(tmp_path_factory.mktemp('pool'))
  for name in ('cnn_mnist', 'cnn_femnist'):
    pool_lib.save_model(
      folder,
      name,
      common.model(name, 10, common.IMAGE),
      common.variables(name, 10, common.IMAGE),
    )
  return folder


def _stitch_rows(workdir, name):
  with open(os.path.join(workdir, name)) as f:
    return [
      {
        k: v
        for k, v in json.loads(line).items()
        if k not in ('client_time_s', 'round_time_s')
      }
      for line in f
    ]


def test_deployed_fedstitch_equals_experiments_stitch(
  tmp_path, fed, stitch_pool, small_fmnist_dir
):
  def config(workdir):
    return stitch_config.StitchConfig.from_flat(
      **STITCH, pool=stitch_pool, data_dir=small_fmnist_dir, workdir=workdir
    )

  simulated, deployed = str(tmp_path / 'sim'), str(tmp_path / 'dep')
  stitch_experiment.stitch_and_evaluate(config(simulated), log=lambda s: None)
  lines = []
  launch.run(config(deployed), NODES, federation=fed, log=lines.append)
  with open(os.path.join(deployed, 'flower', 'result.json')) as f:
    assert json.load(f) == {'ok': True}
  # Every round's clients, weights, choices' votes, selected blocks and
  # every client's energy record.
  log = _stitch_rows(deployed, 'log.jsonl')
  assert log == _stitch_rows(simulated, 'log.jsonl') and len(log) == 2
  assert _stitch_rows(deployed, 'energy.jsonl') == _stitch_rows(
    simulated, 'energy.jsonl'
  )
  # The records of every run: the same rows, a checkpoint of each round.
  rows = _stitch_rows(deployed, 'metrics.jsonl')
  assert rows == _stitch_rows(simulated, 'metrics.jsonl')
  assert [r['round'] for r in rows] == [1, 2]
  assert sorted(os.listdir(os.path.join(deployed, 'checkpoints'))) == ['1', '2']
  results = []
  for workdir in (simulated, deployed):
    with open(os.path.join(workdir, 'results.json')) as f:
      got = json.load(f)
    results.append({k: v for k, v in got.items() if k not in RESULT_TIMES})
  assert results[0] == results[1] and results[0]['networks']
  # The stitched networks, bit for bit.
  (a, _), (b, _) = (
    state_lib.read_document(os.path.join(w, 'networks.npz'))
    for w in (simulated, deployed)
  )
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_killed_node_fails_its_clients_and_rejoins(tmp_path, fed):
  workdir = tmp_path / 'dep'
  nodes = NODES
  lines, failures = [], []

  def deploy(rounds):
    try:
      launch.run(
        config(workdir, algorithm='fedavg', rounds=rounds),
        nodes,
        round_timeout=120,
        federation=fed,
        log=lines.append,
      )
    except BaseException as e:  # noqa: BLE001 - reported below
      failures.append(e)

  run = threading.Thread(target=deploy, args=(2,))
  run.start()
  wait_rows(str(workdir), 1, run.is_alive)
  # Round 2 trains clients 4, 6 and 0 (seed 3): node 1 serves client 4.
  killed_at = time.time()
  fed.nodes[1].kill()
  fed.nodes[1].wait()
  run.join(900)
  assert not failures, failures
  # The SuperLink counted node 1 offline (and failed its messages) two of
  # its heartbeat intervals after its last beat at the latest: with
  # Flower's own interval, 38 s after the kill at the earliest.
  (listed,) = [
    n for n in fed.node_list() if int(n['node-id']) == fed.node_ids[1]
  ]
  assert listed['status'] == 'offline'
  offline_at = datetime.datetime.fromisoformat(listed['offline-at'])
  assert offline_at.timestamp() - killed_at <= 2 * HEARTBEAT_S + 1
  rows = _rows(workdir, 'metrics.jsonl')
  assert rows[1]['client_ids'] == [4, 6, 0]
  assert rows[1]['failed_clients'] == [4]
  clients = _rows(workdir, 'clients.jsonl')[1]['clients']
  assert [c.get('failed', False) for c in clients] == [True, False, False]
  assert any('client 4 failed' in line for line in lines)
  # Node 1 comes back (its registered key: the same node id) and
  # serves round 3 of the run, resumed with one more round; the module's
  # federation is whole again for the tests after this one.
  fed.nodes[1] = fed.start_node(1)
  deadline = time.monotonic() + 300
  # (Each look is one Control API request of this process.)
  while fed.online_nodes() < nodes and time.monotonic() < deadline:
    time.sleep(0.25)
  deploy(3)
  assert not failures, failures
  rows = _rows(workdir, 'metrics.jsonl')
  assert len(rows) == 3 and 'failed_clients' not in rows[2]
  assert any(c % nodes == 1 for c in rows[2]['client_ids'])


def _stage_kept(fed, node, client, round_index):
  """The stage at which `client`'s secrets on `node` (secure_node's file)
  are kept in round `round_index` (0-based); None: none kept for it."""
  pattern = os.path.join(
    fed.folder,
    'nodes',
    f'node{node}',
    'run-*',
    'secagg',
    f'client{client}.json',
  )
  for path in glob.glob(pattern):
    try:
      with open(path) as f:
        kept = json.load(f)
    except (OSError, ValueError):
      continue
    if kept['round'] == round_index:
      return kept['stage']
  return None


def _superexec_of(fed, node):
  """The SuperExec of `fed`'s SuperNode `node` (it starts a process for
  each of the node's messages)."""
  return [p for _, p, parent in fed._superexecs if parent is fed.nodes[node]][
    -1
  ]


def test_a_secure_run_with_a_node_killed_before_unmasking_equals_the_simulation(
  tmp_path, fed
):
  """Issue 75: FedAvg with --secure_aggregation; in round 2 (clients 4, 6
  and 0) node 1 is killed once client 4's masked input is made and
  before it reveals its shares: its input is in the sum (the two others'
  shares rebuild every mask, t = 2 of 3), so the run ends with the
  simulated secure run's bits, and no client failed."""
  simulated, deployed = tmp_path / 'sim', tmp_path / 'dep'
  secure = dict(algorithm='fedavg', secure_aggregation=True, secagg_range=100.0)
  experiment.train_and_evaluate(
    config(simulated, **secure), str(simulated), log=lambda s: None
  )
  lines, failures = [], []

  def deploy():
    try:
      launch.run(
        config(deployed, **secure),
        NODES,
        round_timeout=120,
        federation=fed,
        log=lines.append,
      )
    except BaseException as e:  # noqa: BLE001 - reported below
      failures.append(e)

  run = threading.Thread(target=deploy)
  run.start()
  deadline = time.monotonic() + 600

  def wait(until):
    while not until():
      assert run.is_alive() and time.monotonic() < deadline, (failures, lines)
      time.sleep(0.05)

  wait(lambda: _stage_kept(fed, 1, 4, 1) == 'mask')
  # Client 4's masked input is made, its reply on its way (the node writes
  # the file, then replies). Node 1's SuperExec, which starts a process
  # for each of the node's messages, is held (SIGSTOP: the process that
  # replies is its child and goes on), so node 1 cannot start unmasking.
  superexec = _superexec_of(fed, 1)
  os.kill(superexec.pid, signal.SIGSTOP)
  try:
    assert _stage_kept(fed, 1, 4, 1) == 'mask'  # nothing revealed yet
    # Node 0's clients of the round (6 and 0) revealed their shares: the
    # server held every masked input and asked for the shares.
    wait(lambda: {_stage_kept(fed, 0, c, 1) for c in (6, 0)} == {None})
    assert _stage_kept(fed, 1, 4, 1) == 'mask'
  finally:
    fed.nodes[1].kill()
    fed.nodes[1].wait()
    superexec.kill()  # held, it would not see its node end
    superexec.wait()
  run.join(900)
  assert not failures, failures
  assert any(
    'client 4 failed at secure stage unmask' in line for line in lines
  ), lines
  assert_same_run(str(simulated), str(deployed))
  assert 'failed_clients' not in _rows(deployed, 'metrics.jsonl')[1]
  # (The module's last test: node 1 stays down.)
