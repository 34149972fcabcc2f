"""A node's side of a secure round (`deploy.secure_node`): each stage once
and in turn, its secrets its user's alone, and the messages it refuses:
replayed, reordered, duplicated or forged ones, plain requests in a
secure run and secure stages in a plain one."""

import json
import os
import stat

import jax
import numpy as np
import pytest
from flwr.app import ConfigRecord
from flwr.app import Context
from flwr.app import Message
from flwr.app import RecordDict

from fedjax_mr.core import errors
from fedjax_mr.deploy import adapter
from fedjax_mr.deploy import clientapp
from fedjax_mr.deploy import node
from fedjax_mr.deploy import secure_node
from fedjax_mr.deploy import server
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.privacy import secagg
from fedjax_mr.training import engine

NODES = 2
ME = 2  # a client of node 0
ATTEMPT = bytes(range(16))


def _experiment(**flags):
  return adapter.setup(
    config_lib.ExperimentConfig.from_flat(
      dataset='synthetic',
      model='logistic',
      num_clients=7,
      clients_per_round=5,
      local_epochs=1,
      seed=5,
      **flags,
    )
  )


@pytest.fixture(scope='module')
def experiment():
  return _experiment(secure_aggregation=True, secagg_range=100.0)


def _part(stage, attempt=ATTEMPT, client=ME, r=0, **records):
  meta = ConfigRecord(
    {'stage': stage, 'client': client, 'round': r, 'attempt': attempt}
  )
  for name in ('survivors', 'dropped'):
    if name in records:
      meta[name] = records.pop(name)
  return RecordDict({secure_node.SECAGG: meta, **records})


def _serve(experiment, part, folder):
  run = secure_node.Run.of(experiment)
  return secure_node.serve_part(run, part, ME % NODES, NODES, folder)


class Peers:
  """Three other clients of the round, their secrets held by the test."""

  def __init__(self, ids=(0, 4, 6)):
    self.seeds = {v: secagg.new_seed() for v in ids}
    self.keys = {v: secagg.public_keys(s) for v, s in self.seeds.items()}

  def record(self):
    return ConfigRecord({str(v): c + s for v, (c, s) in self.keys.items()})

  def shares_to(self, me_keys, ctx, t):
    """What each peer encrypts for ME."""
    out = {}
    for v, seed in self.seeds.items():
      cts = secagg.share_keys(seed, v, {ME: me_keys}, min(t, 2), ctx)
      out[str(v)] = cts[ME]
    return ConfigRecord(out)


def _training(experiment):
  """ME's training request of round 1 (`node.request_content`)."""
  state = experiment.state
  ids = np.array([0, ME, 4, 6, 1], np.int32)
  sent = experiment.algorithm.dispatch(
    state.server, ids, state.round, jax.random.key(1)
  )
  keys = engine.client_keys(jax.random.key(2), clients_per_round=5)
  return node.request_content(sent, 1, ME, keys[1], 0)


def _through_mask(experiment, folder, peers, serve=_serve):
  """ME through keys, share and mask (each stage `serve`d): `(its keys,
  the mask reply, the mask request)`."""
  ctx = secure_node.context(0, ATTEMPT)
  keys = serve(experiment, _part('keys'), folder)['keys']
  mine = (bytes(keys['c']), bytes(keys['s']))
  serve(experiment, _part('share', peers=peers.record()), folder)
  shares = peers.shares_to(mine, ctx, 3)
  part = _part('mask', shares=shares)
  for name, record in _training(experiment).items():
    part[name] = record
  return mine, serve(experiment, part, folder), part


def test_the_stages_in_turn_and_the_secrets_kept_private(experiment, tmp_path):
  folder = str(tmp_path / 'node0')
  peers = Peers()
  _, reply, _ = _through_mask(experiment, folder, peers)
  assert reply['masked']["['y']"].numpy().dtype == np.uint32
  assert int(reply['counts']['num_examples']) == experiment.client_sizes[ME]
  kept = os.path.join(folder, 'secagg', f'client{ME}.json')
  assert stat.S_IMODE(os.stat(kept).st_mode) == 0o600
  assert stat.S_IMODE(os.stat(os.path.dirname(kept)).st_mode) == 0o700
  revealed = _serve(
    experiment, _part('unmask', survivors=[0, 4], dropped=[6]), folder
  )['revealed']
  assert sorted(revealed) == ['0', '2', '4', '6']  # its own share too
  assert not os.path.exists(kept)  # gone once revealed
  # A second unmasking (the server asking for the other kind) is refused.
  with pytest.raises(node.RequestError, match='no attempt'):
    _serve(experiment, _part('unmask', survivors=[6], dropped=[0]), folder)


def _by_the_app(experiment, part, folder, config=None):
  """`part`'s reply from the ClientApp (`clientapp.train`) as node 0 of
  NODES keeping its state in `folder`, `part` at position 1 of a message
  of the run of `config` (`experiment`'s by default)."""
  text = json.dumps((config or experiment.config).to_dict(), sort_keys=True)
  message = Message(
    node.pack({1: part}, text), dst_node_id=1, message_type='train'
  )
  where = {'node-index': 0, 'num-nodes': NODES, 'state': folder}
  context = Context(1, 1, where, RecordDict(), {})
  (reply,) = node.unpack(clientapp.train(message, context).content).values()
  assert secure_node.ERROR not in reply, reply[secure_node.ERROR]
  return reply


@pytest.mark.usefixtures('a_run')
def test_only_the_stage_that_trains_sets_the_run_up(
  experiment, tmp_path, monkeypatch
):
  # Flower runs each message in a process of its own: the keys, share
  # and unmask stages do not read the data nor build the model.
  made = []
  setup = adapter.setup
  monkeypatch.setattr(adapter, 'setup', lambda c: made.append(c) or setup(c))
  folder = str(tmp_path / 'node0')
  stages = []

  def serve(experiment, part, folder):
    stages.append((str(part[secure_node.SECAGG]['stage']), len(made)))
    return _by_the_app(experiment, part, folder)

  _, reply, _ = _through_mask(experiment, folder, Peers(), serve)
  assert reply['masked']["['y']"].numpy().dtype == np.uint32
  serve(experiment, _part('unmask', survivors=[0, 4], dropped=[6]), folder)
  assert stages == [('keys', 0), ('share', 0), ('mask', 0), ('unmask', 1)]
  # Once, from the config the stage checked (not checked again).
  assert [m.config for m in made] == [experiment.config]


@pytest.mark.usefixtures('a_run')
def test_a_stage_of_a_config_the_run_would_refuse_is_refused_first(
  experiment, tmp_path
):
  # What the server sends is checked by every stage, as the run's set-up
  # checks it: a threshold of 1/10 would let 1 of 5 shares rebuild a
  # client's secrets.
  config = config_lib.ExperimentConfig.from_flat(
    **{**experiment.config.flat(), 'secagg_threshold': 0.1}
  )
  folder = str(tmp_path / 'node0')
  with pytest.raises(errors.ConfigError, match='secagg_threshold'):
    _by_the_app(experiment, _part('keys'), folder, config)
  assert not os.path.exists(folder)


def test_stages_out_of_turn_or_of_another_attempt_are_refused(
  experiment, tmp_path
):
  folder = str(tmp_path / 'node0')
  peers = Peers()
  with pytest.raises(node.RequestError, match='no attempt'):
    _serve(experiment, _part('share', peers=peers.record()), folder)
  _serve(experiment, _part('keys'), folder)
  with pytest.raises(node.RequestError, match='out of turn'):
    _serve(experiment, _part('mask', shares=ConfigRecord({})), folder)
  _serve(experiment, _part('share', peers=peers.record()), folder)
  with pytest.raises(node.RequestError, match='out of turn'):  # replayed
    _serve(experiment, _part('share', peers=peers.record()), folder)
  other = bytes(16)
  with pytest.raises(node.RequestError, match='out of turn'):
    _serve(experiment, _part('mask', attempt=other), folder)
  with pytest.raises(node.RequestError, match='out of turn'):
    _serve(experiment, _part('mask', r=1), folder)


@pytest.mark.parametrize(
  'peers, match',
  [
    ({'0': b'x' * 64, '4': b'y' * 64}, 'fewer than the 3'),
    ({'2': b'x' * 64, '4': b'y' * 64, '6': b'z' * 64}, 'malformed peers'),
    ({'0': b'x' * 63, '4': b'y' * 64, '6': b'z' * 64}, 'malformed peers'),
    ({'0': b'x' * 64, '4': b'y' * 64, '99': b'z' * 64}, 'names no client'),
  ],
)
def test_malformed_or_too_few_peers_are_refused(
  experiment, tmp_path, peers, match
):
  folder = str(tmp_path)
  _serve(experiment, _part('keys'), folder)
  with pytest.raises(node.RequestError, match=match):
    _serve(experiment, _part('share', peers=ConfigRecord(peers)), folder)


def test_forged_or_stray_shares_are_refused_before_any_mask(
  experiment, tmp_path
):
  peers = Peers()
  ctx = secure_node.context(0, ATTEMPT)
  for case in ('forged', 'stranger'):
    folder = str(tmp_path / case)
    keys = _serve(experiment, _part('keys'), folder)['keys']
    mine = (bytes(keys['c']), bytes(keys['s']))
    _serve(experiment, _part('share', peers=peers.record()), folder)
    shares = dict(peers.shares_to(mine, ctx, 3))
    if case == 'forged':
      shares['4'] = bytes(len(shares['4']))
      match = 'do not open'
    else:
      shares['5'] = shares.pop('4')
      match = 'not its neighbours'
    part = _part('mask', shares=ConfigRecord(shares))
    for name, record in _training(experiment).items():
      part[name] = record
    with pytest.raises(node.RequestError, match=match):
      _serve(experiment, part, folder)


def test_a_training_request_of_another_client_is_refused(experiment, tmp_path):
  folder = str(tmp_path)
  peers = Peers()
  ctx = secure_node.context(0, ATTEMPT)
  keys = _serve(experiment, _part('keys'), folder)['keys']
  mine = (bytes(keys['c']), bytes(keys['s']))
  _serve(experiment, _part('share', peers=peers.record()), folder)
  part = _part('mask', shares=peers.shares_to(mine, ctx, 3))
  training = _training(experiment)
  training['meta'] = ConfigRecord({**training['meta'], 'client': 4})
  for name, record in training.items():
    part[name] = record
  with pytest.raises(node.RequestError, match='another client'):
    _serve(experiment, part, folder)


def test_plain_and_secure_requests_stay_in_their_own_runs(experiment, tmp_path):
  plain = _experiment()
  run = secure_node.Run.of(experiment)
  request = node.pack({1: _training(experiment)})
  with pytest.raises(node.RequestError, match='masked inputs only'):
    secure_node.serve(run, request, 0, NODES, str(tmp_path))
  staged = node.pack({1: _part('keys')})
  with pytest.raises(node.RequestError, match='without secure aggregation'):
    node.serve(plain, staged, 0, NODES, str(tmp_path))
  # A refused stage is replied as an error record, its reason in it.
  reply = node.unpack(
    secure_node.serve(
      run, node.pack({1: _part('mask')}), 0, NODES, str(tmp_path)
    )
  )
  assert 'no attempt' in str(reply[1][secure_node.ERROR]['reason'])


def test_a_secure_run_is_never_summed_in_the_clear(experiment):
  with pytest.raises(ValueError, match='collect'):
    server.make_round(experiment, 1, transport=None, num_nodes=NODES)
