"""Local training and the round engine: the layer below the algorithms.

Modules: `client` (exact-step local training with hooks for a loss term, a
loss on the representation, a gradient correction and a sharpness-aware
step), `optimizers` (client and server optimizers that keep their
hyper-parameters; `server_step`), `budgets` (client memory budgets) and
`engine` (the jitted round: sampling, dispatch, the K client updates,
aggregation; evaluation). Nothing here imports an algorithm or the
run pipeline.
"""

from fedjax_mr.training import budgets as budgets
from fedjax_mr.training import client as client
from fedjax_mr.training import engine as engine
from fedjax_mr.training import optimizers as optimizers
from fedjax_mr.training.client import LocalTraining as LocalTraining
from fedjax_mr.training.client import make_client_update as make_client_update
from fedjax_mr.training.client import make_local_update as make_local_update
from fedjax_mr.training.engine import RoundState as RoundState
from fedjax_mr.training.engine import init_state as init_state
from fedjax_mr.training.engine import make_evaluate as make_evaluate
from fedjax_mr.training.engine import make_round_fn as make_round_fn

__all__ = [
  'LocalTraining',
  'RoundState',
  'budgets',
  'client',
  'engine',
  'init_state',
  'make_client_update',
  'make_evaluate',
  'make_local_update',
  'make_round_fn',
  'optimizers',
]
