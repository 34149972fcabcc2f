"""The ServerApp's transport over a grid: replies as they come, failures,
slots bound to the named nodes (an impostor claiming a dead node's index
gets nothing), a node that comes back under a new id in an insecure
federation (a fake grid: no processes)."""

import itertools
from types import SimpleNamespace

import pytest
from flwr.app import ConfigRecord
from flwr.app import RecordDict

from fedjax_mr.core import errors
from fedjax_mr.deploy import federation
from fedjax_mr.deploy import launch
from fedjax_mr.deploy import node
from fedjax_mr.deploy import server
from fedjax_mr.deploy import serverapp as apps
from fedjax_mr.deploy.flower import commands

# Flower 1.42 builds a message only inside a run (tests/deploy/conftest.py).
pytestmark = pytest.mark.usefixtures('a_run')


class FakeGrid:
  """Nodes `{id: index}` of a federation of `num_nodes`; `train` replies
  echo the request, in the order `pull_order` gives; `dead` ids answer
  with an error."""

  def __init__(self, nodes, num_nodes, dead=()):
    self.nodes = dict(nodes)
    self.num_nodes = num_nodes
    self.dead = set(dead)
    self.sent = {}
    self.ids = (f'm{i}' for i in itertools.count())
    self.pulls = 0

  def get_node_ids(self):
    return list(self.nodes)

  def push_messages(self, messages):
    out = []
    for m in messages:
      mid = next(self.ids)
      self.sent[mid] = m
      out.append(mid)
    return out

  def pull_messages(self, ids):
    self.pulls += 1
    ids = list(ids)
    # One reply per pull, the last asked first: out of order.
    if not ids:
      return []
    mid = ids[-1]
    m = self.sent[mid]
    dst = m.metadata.dst_node_id
    error = dst in self.dead or dst not in self.nodes
    if m.metadata.message_type == apps.QUERY:
      content = RecordDict(
        {
          'node': ConfigRecord(
            {'index': self.nodes.get(dst, -1), 'num-nodes': self.num_nodes}
          )
        }
      )
    else:
      content = m.content
    return [
      SimpleNamespace(
        metadata=SimpleNamespace(reply_to_message_id=mid, src_node_id=dst),
        has_error=lambda error=error: error,
        content=content,
      )
    ]


def _requests(n):
  return [
    server.Request(p, p, p % 2, RecordDict({'c': ConfigRecord({'p': p})}))
    for p in range(n)
  ]


def test_replies_come_as_they_arrive_with_their_positions():
  grid = FakeGrid({11: 0, 22: 1}, 2)
  transport = apps.GridTransport(grid, apps.discover(grid, 2, 10))
  assert transport.node_ids == {0: 11, 1: 22}
  got = list(transport.exchange(_requests(4), None))
  # One message per node (node 0: positions 0 and 2; node 1: 1 and 3);
  # node 1's reply comes first.
  trains = [
    m for m in grid.sent.values() if m.metadata.message_type == apps.TRAIN
  ]
  assert len(trains) == 2
  assert [p for p, _ in got] == [1, 3, 0, 2]
  assert all(reply['c']['p'] == p for p, reply in got)


def test_a_dead_node_fails_its_requests():
  grid = FakeGrid({11: 0, 22: 1}, 2, dead={22})
  transport = apps.GridTransport(grid, {0: 11, 1: 22})
  got = dict(transport.exchange(_requests(4), None))
  assert [p for p in sorted(got) if got[p] is None] == [1, 3]


def _sent_to(grid, node_id):
  return [m for m in grid.sent.values() if m.metadata.dst_node_id == node_id]


def _failed(got):
  return sorted(p for p, reply in got.items() if reply is None)


def test_a_named_slot_is_not_taken_by_an_impostor_while_its_node_is_down(
  capsys,
):
  grid = FakeGrid({10: 0, 11: 1}, 2)
  transport = apps.GridTransport(grid, {0: 10, 1: 11})
  assert _failed(dict(transport.exchange(_requests(4), None))) == []
  # Node 1 (id 11) dies; an unregistered node claiming index 1 joins.
  del grid.nodes[11]
  grid.nodes[99] = 1
  for _ in range(2):
    got = dict(transport.exchange(_requests(4), None))
    assert _failed(got) == [1, 3]
    assert all(got[p]['c']['p'] == p for p in (0, 2))
  assert transport.node_ids == {0: 10, 1: 11}
  # Once per outage, however many rounds it lasts.
  assert capsys.readouterr().out == (
    'node 1 (id 11) is offline: its clients fail until it is back\n'
  )
  # Node 1 back under its own key serves the next round.
  grid.nodes[11] = 1
  got = dict(transport.exchange(_requests(4), None))
  assert _failed(got) == []
  assert capsys.readouterr().out == 'node 1 (id 11) is back online\n'
  assert _sent_to(grid, 99) == []
  assert len(_sent_to(grid, 11)) == 4


def test_a_reply_from_another_node_is_not_read():
  grid = FakeGrid({10: 0, 11: 1}, 2)
  pull = grid.pull_messages

  def forged(ids):
    # Replies to node 1's messages say they come from node 99.
    return [
      SimpleNamespace(
        metadata=SimpleNamespace(
          reply_to_message_id=r.metadata.reply_to_message_id,
          src_node_id={11: 99}.get(src, src),
        ),
        has_error=r.has_error,
        content=r.content,
      )
      for r in pull(ids)
      for src in [r.metadata.src_node_id]
    ]

  grid.pull_messages = forged
  transport = apps.GridTransport(grid, {0: 10, 1: 11})
  assert _failed(dict(transport.exchange(_requests(4), None))) == [1, 3]


def test_named_node_ids_bind_the_slots_and_nothing_is_asked():
  grid = FakeGrid({10: 0, 11: 1, 99: 1}, 2)
  transport = apps.connect(grid, {'num-nodes': 2, 'node-ids': '10,11'})
  assert transport.node_ids == {0: 10, 1: 11}
  del grid.nodes[11]
  assert _failed(dict(transport.exchange(_requests(2), None))) == [1]
  assert transport.node_ids == {0: 10, 1: 11}
  assert _sent_to(grid, 99) == []
  assert not any(
    m.metadata.message_type == apps.QUERY for m in grid.sent.values()
  )
  with pytest.raises(ValueError, match='names 2 nodes, not 3'):
    apps.connect(grid, {'num-nodes': 3, 'node-ids': '10,11'})


def test_an_insecure_federation_asks_and_a_node_back_under_a_new_id_too():
  grid = FakeGrid({11: 0, 22: 1}, 2)
  transport = apps.connect(grid, {'num-nodes': 2, 'node-ids': ''})
  assert transport.node_ids == {0: 11, 1: 22}
  del grid.nodes[22]
  grid.nodes[33] = 1  # node 1 was 22, now 33
  got = dict(transport.exchange(_requests(2), None))
  assert transport.node_ids == {0: 11, 1: 33}
  assert _failed(got) == []
  queried = [
    m.metadata.dst_node_id
    for m in grid.sent.values()
    if m.metadata.message_type == apps.QUERY
  ]
  assert sorted(queried) == [11, 22, 33]


def test_a_deadline_fails_the_requests_without_a_reply():
  grid = FakeGrid({11: 0, 22: 1}, 2)
  grid.pull_messages = lambda ids: []
  transport = apps.GridTransport(grid, {0: 11, 1: 22})
  got = list(transport.exchange(_requests(2), 0.2))
  assert sorted(got, key=lambda x: x[0]) == [(0, None), (1, None)]


def test_a_packed_message_holds_each_position_and_the_run():
  parts = {2: RecordDict({'meta': ConfigRecord({'p': 2})}), 0: RecordDict()}
  parts[0]['meta'] = ConfigRecord({'p': 0})
  content = node.pack(parts, '{"seed": 1}')
  assert node.run_of(content) == ('{"seed": 1}', node.TRAINING)
  stitch = node.pack(parts, '{"seed": 1}', node.STITCH)
  assert node.run_of(stitch) == ('{"seed": 1}', node.STITCH)
  with pytest.raises(node.RequestError, match="kind 'x'"):
    node.run_of(node.pack(parts, '{"seed": 1}', 'x'))
  back = node.unpack(content)
  assert sorted(back) == [0, 2]
  assert all(back[p]['meta']['p'] == p for p in back)
  with pytest.raises(node.RequestError, match='names no run'):
    node.run_of(node.pack(parts))
  with pytest.raises(node.RequestError, match='x/meta'):
    node.unpack(RecordDict({'x/meta': ConfigRecord({'p': 0})}))
  assert node.run_folder(None, '/a') is None
  assert node.run_folder('/s', '/a') != node.run_folder('/s', '/b')


def test_a_result_that_cannot_be_written_is_said_in_the_stream(
  tmp_path, capsys
):
  # A full disk at the ServerApp (issue 71): its result goes through the
  # run's stream, and the launcher says it in one line.
  result = {'error': 'cannot write /w/clients.jsonl: No space left on device'}
  apps._write_result(str(tmp_path / 'gone' / 'result.json'), result)
  (line,) = capsys.readouterr().out.splitlines()
  fed = federation.Federation(str(tmp_path / 'fed'), 1)
  fed.streamed_result = commands.read_result(line)
  with pytest.raises(errors.UserError, match='^cannot write /w/clients'):
    launch._check_result(str(tmp_path / 'gone' / 'result.json'), fed)
  fed.streamed_result = None
  with pytest.raises(errors.UserError, match='without a result'):
    launch._check_result(str(tmp_path / 'gone' / 'result.json'), fed)
  apps._write_result(str(tmp_path / 'result.json'), {'ok': True})
  assert capsys.readouterr().out == ''
  launch._check_result(str(tmp_path / 'result.json'), fed)
