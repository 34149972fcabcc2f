"""The serialized payload of a deployed round against the algorithm's
`bytes_communicated`, at the default setting (experiments/configs/
default.flags: Fashion-MNIST, cnn_mnist, 100 clients, K = 10).

  python docs/results/deploy/payload.py > docs/results/deploy/payload.json

For round 1 of each algorithm: the requests' payload (each of the K
messages holds the shared part, the client's row of the per-client part
and its key: `node.request_content`) and the replies' (K `ClientOutput`s
as `codec.encode` writes them: their size depends only on their shapes,
so zeros of the reply's shape are encoded), in the bytes of Flower's
array records (`.npy` headers included, message envelopes and protobuf
framing not); and the round's `bytes_communicated` from the algorithm's
own `aggregate` on zero replies (it counts from shapes). Flower stores
arrays by content hash, so the shared part that K messages repeat is one
object in the SuperLink's store; the figures count it K times, as the
messages carry it.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mr.core import types
from fedjax_mr.deploy import adapter
from fedjax_mr.deploy import codec
from fedjax_mr.deploy import node
from fedjax_mr.pipeline import config as config_lib
from fedjax_mr.training import engine

DEFAULT = dict(
  dataset='fashion_mnist',
  model='cnn_mnist',
  num_clients=100,
  clients_per_round=10,
  partition='dirichlet',
  alpha=0.1,
  local_epochs=5,
  batch_size=50,
  lr=0.01,
  momentum=0.9,
  seed=0,
  num_devices=1,
)


def measure(algorithm: str) -> dict:
  config = config_lib.ExperimentConfig.from_flat(algorithm=algorithm, **DEFAULT)
  e = adapter.setup(config)
  k = config.server.clients_per_round
  sent = engine.next_dispatch(e.algorithm, e.state, e.data, e.key, k)
  ids = engine.make_sample_fn(e.algorithm, k)(e.state, e.data, e.key)
  request = sum(
    codec.payload_bytes(
      node.request_content(sent, p, int(c), jax.random.key(0), 0)[part]
    )
    for p, c in enumerate(np.asarray(ids))
    for part in ('shared', 'row', 'key')
  )
  template = node.output_shape(e, sent, e.state)
  zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), template)
  reply = k * codec.payload_bytes(codec.encode(zeros))
  stacked = jax.tree.map(lambda x: jnp.asarray(np.stack([x] * k)), zeros)
  _, metrics = types.aggregate_stacked(
    e.algorithm, e.state.server, stacked, ids, e.state.round, e.key
  )
  communicated = float(metrics['bytes_communicated'])
  return {
    'algorithm': algorithm,
    'clients_per_round': k,
    'request_bytes': int(request),
    'reply_bytes': int(reply),
    'payload_bytes': int(request + reply),
    'bytes_communicated': communicated,
    'payload_over_communicated': (request + reply) / communicated,
  }


if __name__ == '__main__':
  names = sys.argv[1:] or ['fedavg', 'fedmr', 'fedmut', 'scaffold']
  print(json.dumps([measure(n) for n in names], indent=1))
