"""Local training and the round engine: the layer below the algorithms.

Modules: `client` (exact-step local training with hooks for a loss term, a
loss on the representation, a gradient correction and a sharpness-aware
step), `optimizers` (client and server optimizers that keep their
hyper-parameters; `server_step`), `budgets` (client memory budgets),
`engine` (the jitted round: dispatch, the K client updates, aggregation),
`sampling` (the round's K client ids), `streaming` (the clients mapped on
one device, their contributions summed as they finish), `placement` (the
client axis over the devices of a mesh), `host_round` (per-client state and
training data in host memory) and `evaluation` (test accuracy and loss of
one, K stacked or K dispatched models). Nothing here imports an algorithm
or the run pipeline.
"""

from fedjax_mr.training import budgets as budgets
from fedjax_mr.training import client as client
from fedjax_mr.training import engine as engine
from fedjax_mr.training import evaluation as evaluation
from fedjax_mr.training import host_round as host_round
from fedjax_mr.training import optimizers as optimizers
from fedjax_mr.training import placement as placement
from fedjax_mr.training import sampling as sampling
from fedjax_mr.training import streaming as streaming
from fedjax_mr.training.client import LocalTraining as LocalTraining
from fedjax_mr.training.client import make_client_update as make_client_update
from fedjax_mr.training.client import make_local_update as make_local_update
from fedjax_mr.training.engine import RoundState as RoundState
from fedjax_mr.training.engine import init_state as init_state
from fedjax_mr.training.engine import make_round_fn as make_round_fn
from fedjax_mr.training.evaluation import make_evaluate as make_evaluate

__all__ = [
  'LocalTraining',
  'RoundState',
  'budgets',
  'client',
  'engine',
  'evaluation',
  'host_round',
  'init_state',
  'make_client_update',
  'make_evaluate',
  'make_local_update',
  'make_round_fn',
  'optimizers',
  'placement',
  'sampling',
  'streaming',
]
