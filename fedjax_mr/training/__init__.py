"""Local training, the round engine, evaluation and the experiment loop."""

from fedjax_mr.training import checkpoint as checkpoint
from fedjax_mr.training import client as client
from fedjax_mr.training import config as config
from fedjax_mr.training import engine as engine
from fedjax_mr.training import experiment as experiment
from fedjax_mr.training import metrics_io as metrics_io
from fedjax_mr.training.client import make_client_update as make_client_update
from fedjax_mr.training.config import ExperimentConfig as ExperimentConfig
from fedjax_mr.training.engine import RoundState as RoundState
from fedjax_mr.training.engine import init_state as init_state
from fedjax_mr.training.engine import make_evaluate as make_evaluate
from fedjax_mr.training.engine import make_round_fn as make_round_fn
from fedjax_mr.training.experiment import (
  train_and_evaluate as train_and_evaluate,
)
