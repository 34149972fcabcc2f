"""The Flower App's `ClientApp`: a node serving its clients.

Flower 1.42's SuperNode runs every message in a process of its own (a
fresh `flwr-clientapp`, or a fork of the warm SuperExec, `flower/warm.py`),
which imports this module: it imports what a node needs (Flower's
message types, `node` and the config's `setup`), never the server's side
(`serverapp.py`).

A node's node config names its index (`node-index`), the number of nodes
(`num-nodes`), where it keeps its clients' state (`state`) and, in a
federation with node authentication, its key and the nodes' public keys
(`signing-key`, `roster`: secure aggregation's keys are signed,
`secure_node.identity`); each
`train` message carries the run's config (its text) and kind (a training
or a FedStitch run), so one federation serves any number of runs and a
node needs no file of the server's, and holds the requests of all the
node's clients of a round (`node.pack`).
"""

from __future__ import annotations

from flwr.app import ConfigRecord
from flwr.app import Context
from flwr.app import Message
from flwr.app import RecordDict
from flwr.clientapp import ClientApp

from fedjax_mr.deploy import adapter
from fedjax_mr.deploy import node as node_lib
from fedjax_mr.deploy import secure_node
from fedjax_mr.deploy import stitch_node

client_app = ClientApp()


def _node_of(context: Context) -> tuple[int, int]:
  config = context.node_config
  return int(config['node-index']), int(config['num-nodes'])


@client_app.query()
def answer_index(message: Message, context: Context) -> Message:
  """Replies this node's index (asked in an insecure federation, whose
  node ids are not known in advance)."""
  index, num_nodes = _node_of(context)
  content = RecordDict(
    {'node': ConfigRecord({'index': index, 'num-nodes': num_nodes})}
  )
  return Message(content, reply_to=message)


@client_app.train()
def train(message: Message, context: Context) -> Message:
  """Serves this node's clients of a round: their updates (`node.serve`)
  or, in a FedStitch run, their scores and statistics
  (`stitch_node.serve`)."""
  index, num_nodes = _node_of(context)
  text, kind = node_lib.run_of(message.content)
  config = adapter.config_from_text(kind, text)
  if kind == node_lib.STITCH:
    held = adapter.stitch_node(config)
    reply = stitch_node.serve(held, message.content, index, num_nodes)
    return Message(reply, reply_to=message)
  if not config.privacy.secure.enabled:
    experiment = adapter.setup(config)
    state = node_lib.run_folder(context.node_config.get('state'), text)
    reply = node_lib.serve(experiment, message.content, index, num_nodes, state)
    return Message(reply, reply_to=message)
  # A secure run: only the stage that trains sets the run up
  # (`secure_node.Run`); every stage checks its config first.
  checked = adapter.validated(config)
  state = node_lib.run_folder(context.node_config.get('state'), text)
  who = secure_node.identity(context.node_config)
  run = secure_node.Run(checked.config, lambda: adapter.setup(checked))
  reply = secure_node.serve(run, message.content, index, num_nodes, state, who)
  return Message(reply, reply_to=message)
