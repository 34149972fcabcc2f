"""Bit-identity of the algorithms with their recorded runs
(`regression/*.json`): any change of numerics shows here.

Each recording is a 3-round run on the 1,500-example Fashion-MNIST subset,
seed 0, one device: its metrics rows (times left out) and the SHA-256 of
every leaf of the final round state. Re-record (only after a deliberate
change of numerics, and say so in the commit) with
`FEDJAX_MR_RECORD=1 pytest tests/training/test_regression.py`.
"""

from __future__ import annotations

import hashlib
import json
import os

import jax
import numpy as np
import pytest

from fedjax_mr.training import experiment
from tests import helpers

HERE = os.path.join(os.path.dirname(__file__), 'regression')

CASES = {
  'fedavg': {'algorithm': 'fedavg'},
  'fedmr': {'algorithm': 'fedmr'},
  'fedmr_2stage1': {'algorithm': 'fedmr', 'fedmr_first_stage': 1},
  'fedmr_p2': {'algorithm': 'fedmr_p', 'fedmr_segments': 2},
  'indep': {'algorithm': 'indep'},
  'fedmr_secure': {'algorithm': 'fedmr', 'fedmr_secure_repeats': 1},
  'fedmut': {'algorithm': 'fedmut', 'fedmut_alpha': 2.0},
}


def fingerprint(state) -> dict[str, str]:
  """SHA-256 of every leaf (bytes, shape and dtype), by tree path."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(state)):
    a = np.ascontiguousarray(np.asarray(leaf))
    h = hashlib.sha256(f'{a.shape}{a.dtype}'.encode() + a.tobytes())
    out[jax.tree_util.keystr(path)] = h.hexdigest()
  return out


def _rows(history):
  return [{k: v for k, v in r.items() if not k.endswith('_s')} for r in history]


@pytest.mark.parametrize('name', sorted(CASES))
def test_bit_identical_to_recording(name, small_fmnist_dir, tmp_path):
  cfg = helpers.small_config(
    small_fmnist_dir, num_devices=1, local_eval_every=1, **CASES[name]
  )
  res = experiment.train_and_evaluate(cfg, str(tmp_path), log=lambda s: None)
  got = {'rows': _rows(res.history), 'state': fingerprint(res.state)}
  path = os.path.join(HERE, f'{name}.json')
  if os.environ.get('FEDJAX_MR_RECORD'):
    with open(path, 'w') as f:
      json.dump(got, f, indent=1)
  with open(path) as f:
    want = json.load(f)
  assert got['rows'] == want['rows']
  assert got['state'] == want['state']
