"""FedStitch's hyper-parameters and their checks.

What the paper leaves open and we chose (all are `Config` fields):
* Rank: a client's choice b is ranked, for every other participant c',
  by the fraction of c''s other candidates that c' scores below b (ties
  count half): 1 = c' rates it best. A client's round rank is the mean over
  its choices and over the other participants (and over the candidate
  networks of the round). No other participant: no update.
* Weights: rank ≥ `threshold` (0.75) multiplies the weight by
  1 + `reward` (0.2), below it by 1 − `penalty` (0.2); then all N weights
  are renormalised to sum 1. Initial weights 1/N.
* Voting: each participant adds its (updated) weight to each block it
  chose; 'uniform' aggregation (the paper's FedAvg-style ablation) adds 1.
  Over a selection's rounds the votes add up; the `num_selections` blocks
  with most votes (ties: higher weighted mean CKA) extend each candidate
  network, and of all unfinished children the `num_selections` with the
  highest path score stay candidates (a beam). The path score is
  StitchNet's: the product of the chosen blocks' (weighted mean) CKA along
  the path; ties go to the larger product of vote shares.
* Start: every pool model's start block begins one candidate network.
* ε-greedy: with probability ε a client uploads k random candidates
  instead of its top k; ε is multiplied by `epsilon_decay` per depth.
* Search space: after a selection, for each pre-trained model, the
  candidate of that model with the highest weighted mean CKA over the
  selection's rounds is found and the model's shallower blocks leave the
  pool of the network's children.
* Stitch fit: the last round's participants upload XᵀX and XᵀY for each
  chosen block on their batch; the server adds them and solves once (see
  `projection`).
* Termination: a network is finished when it ends with an end block; from
  depth `max_depth` − 1 only end blocks are candidates; a network whose
  pool has no candidate left is dropped.

References:
  "Heterogeneity-Aware Coordination for Federated Learning via Stitching
  Pre-trained blocks" (FedStitch), 2024, §III–IV.
"""

from __future__ import annotations

import math
from typing import Mapping
from typing import NamedTuple

from fedjax_mr.core import errors
from fedjax_mr.stitch import cka
from fedjax_mr.stitch import projection

AGGREGATIONS = ('rl', 'uniform')

# Bounds checked before anything is built. Every client holds at least one
# training example, and no training set here has 2**20 (the largest,
# EMNIST byclass, has 697,932): more clients cannot be partitioned, and a
# run would first build their weights, devices and index lists (10**8 took
# 2.6 GB and 103 s to be refused).
MAX_CLIENTS = 2**20
# A client's batch goes through every pool block at once, and each CKA
# holds its activations as float64 rows (B·H·W of them in the default
# view): at B = 4,096 (64 times the paper's 64) one 32×32×64 map is 2 GiB.
MAX_BATCH_SIZE = 4096


class Config(NamedTuple):
  """FedStitch hyper-parameters (defaults: the paper's where it gives them).

  Attributes:
    clients_per_round: participants per round (paper: 10 of 100).
    batch_size: examples per client batch for scoring (paper: 64).
    top_k: blocks each client uploads (paper: 3).
    epsilon: exploration probability of a client's upload.
    epsilon_decay: ε is multiplied by this per depth.
    reward: weight factor 1 + reward for a well-ranked client.
    penalty: weight factor 1 − penalty for a badly ranked client.
    threshold: the rank at or above which a client is rewarded.
    aggregation: 'rl' (weighted) or 'uniform' (FedAvg-style ablation).
    num_selections: blocks chosen per candidate network and number of
      candidate networks kept (paper: 3).
    rounds_per_selection: rounds whose votes decide one selection
      (paper: 5).
    max_depth: most blocks in a network.
    prune: run the search-space optimiser.
    view: CKA view ('positions', 'flatten', 'gap').
    debiased: debiased CKA.
    spatial: stitch spatial policy ('match', 'fit_only').
    stitch_bias: affine stitches.
    solver: 'pinv' or 'ridge'.
    seed: seeds client sampling, batches and exploration.
  """

  clients_per_round: int = 10
  batch_size: int = 64
  top_k: int = 3
  epsilon: float = 0.1
  epsilon_decay: float = 1.0
  reward: float = 0.2
  penalty: float = 0.2
  threshold: float = 0.75
  aggregation: str = 'rl'
  num_selections: int = 3
  rounds_per_selection: int = 5
  max_depth: int = 8
  prune: bool = True
  view: str = 'positions'
  debiased: bool = False
  spatial: str = 'match'
  stitch_bias: bool = False
  solver: str = 'pinv'
  seed: int = 0


def _one_of(choices) -> str:
  return f'must be one of {", ".join(choices)}'


def _rules(config: Config, num_clients: int) -> list[tuple[str, bool, str]]:
  """(field, whether its value is good, what it must be), in check order."""
  rules = [
    (
      'num_clients',
      num_clients <= MAX_CLIENTS,
      f'must be at most {MAX_CLIENTS:,} (each client holds a training '
      f'example), got {num_clients:,}',
    ),
  ]
  for name in ('epsilon', 'epsilon_decay', 'reward', 'penalty', 'threshold'):
    value = getattr(config, name)
    rules.append((name, math.isfinite(value), f'must be finite, got {value}'))
  return rules + [
    ('batch_size', config.batch_size >= 2, 'must be ≥ 2'),
    (
      'batch_size',
      config.batch_size <= MAX_BATCH_SIZE,
      f'must be at most {MAX_BATCH_SIZE:,} (scored at once; the paper '
      f'takes 64), got {config.batch_size:,}',
    ),
    ('top_k', config.top_k >= 1, 'must be ≥ 1'),
    ('epsilon', 0 <= config.epsilon <= 1, 'must be in [0, 1]'),
    ('epsilon_decay', 0 < config.epsilon_decay <= 1, 'must be in (0, 1]'),
    ('reward', config.reward >= 0, 'must be ≥ 0'),
    ('penalty', 0 <= config.penalty < 1, 'must be in [0, 1)'),
    ('threshold', 0 <= config.threshold <= 1, 'must be in [0, 1]'),
    (
      'aggregation',
      config.aggregation in AGGREGATIONS,
      _one_of(AGGREGATIONS),
    ),
    ('num_selections', config.num_selections >= 1, 'must be ≥ 1'),
    ('rounds_per_selection', config.rounds_per_selection >= 1, 'must be ≥ 1'),
    ('max_depth', config.max_depth >= 2, 'must be ≥ 2'),
    ('view', config.view in cka.VIEWS, _one_of(cka.VIEWS)),
    (
      'spatial',
      config.spatial in projection.SPATIAL_POLICIES,
      _one_of(projection.SPATIAL_POLICIES),
    ),
    (
      'solver',
      config.solver in projection.SOLVERS,
      _one_of(projection.SOLVERS),
    ),
  ]


def check_config(
  config: Config, num_clients: int, names: Mapping[str, str] | None = None
) -> None:
  """Raises ConfigError naming the field of the first bad value.

  Args:
    config: the hyper-parameters.
    num_clients: N, the clients the run keeps weights for.
    names: what the caller calls a field, where it calls it otherwise
      (e.g. a program's `stitch_solver` for `solver`).
  """
  names = names or {}
  try:
    errors.check_count('clients_per_round', config.clients_per_round)
    errors.check_count('num_clients', num_clients)
  except errors.ArgumentError as e:
    raise errors.ConfigError(
      f'`{names.get(e.argument, e.argument)}` {e.message}'
    ) from None
  for name, ok, rule in _rules(config, num_clients):
    if not ok:
      raise errors.ConfigError(f'`{names.get(name, name)}` {rule}')
