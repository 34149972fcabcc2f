"""The algorithms against their recorded runs (`regression/*.json`): any
change of numerics shows here.

Each recording is a 3-round run on the 1,500-example Fashion-MNIST subset,
seed 0, one device: its metrics rows (times left out), and for every leaf
of the final round state its SHA-256 and its float64 L2 norm and mean.

Bits are promised on the machine that made them, not across CPUs: XLA's
CPU kernels sum in an order that depends on the machine (vector width,
blocking), and one ULP apart after round 1 is a few 1e-6 apart after
round 3. So a recording keeps one exact entry per kind of machine, keyed by
`machine_numerics()` (the bits of a fixed computation that does not use
this library); on a machine with an entry every bit must match, and on any
other the integer fields must match exactly and every float, row value or
leaf norm, within `CROSS_MACHINE_RTOL` of the first entry.

The entry 'legacy' holds the rows and hashes recorded before entries were
kept per machine, on the machines of the first sessions (whose digest is
not known); it is never matched exactly, and
`test_recorded_machines_agree` checks that every two entries of a recording
are within the cross-machine tolerance.

The cases run in the test process, under the suite's compile flags
(tests/xla_flags.py), which round some kernels differently from a
program's: `machine_numerics()`, computed under the same flags, keys them
as a kind of machine of their own. (Until 2026-11 the cases ran in a fresh
process with a program's flags, at 2.5 times the compile time; those
entries stay, compared within the tolerance, except SCAFFOLD's, whose
controls differ between the two flag sets by more than it.)

Re-record after a deliberate change of numerics, and say so in the commit:
`FEDJAX_MR_RECORD=1 pytest tests/pipeline/test_regression.py` (keeps only
this machine's entry: the others no longer hold). On a new kind of machine
with unchanged numerics, `FEDJAX_MR_RECORD=add` adds its entry (once it
is within the cross-machine tolerance of the recorded ones). A recording
run skips, saying so: it has nothing to compare against.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from fedjax_mr.pipeline import experiment
from tests import helpers

HERE = os.path.join(os.path.dirname(__file__), 'regression')

# Measured between two machines (AMD EPYC without AVX-512 against the
# machines the first recordings came from): at most 3.8e-6 relative, in
# FedMut's delta_norm (a norm of a difference); 1e-4 leaves a margin of 25.
CROSS_MACHINE_RTOL = 1e-4

CASES = {
  'fedavg': {'algorithm': 'fedavg'},
  'fedmr': {'algorithm': 'fedmr'},
  'fedmr_2stage1': {'algorithm': 'fedmr', 'fedmr_first_stage': 1},
  'fedmr_p2': {'algorithm': 'fedmr_p', 'fedmr_segments': 2},
  'indep': {'algorithm': 'indep'},
  'fedmr_secure': {'algorithm': 'fedmr', 'fedmr_secure_repeats': 1},
  'fedmut': {'algorithm': 'fedmut', 'fedmut_alpha': 2.0},
  'scaffold': {'algorithm': 'scaffold'},
}


def machine_numerics() -> str:
  """A digest of how this machine's XLA:CPU rounds float32: the bits of a
  convolution, a long matmul and reductions, and their gradients, on fixed
  inputs (no fedjax_mr code, so a change of the library never changes it).
  """
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (32, 28, 28, 1))
  w = 0.2 * jax.random.normal(keys[1], (5, 5, 1, 16))
  v = 0.01 * jax.random.normal(keys[2], (28 * 28 * 16, 10))

  def loss(w, v):
    h = lax.conv_general_dilated(
      x, w, (1, 1), 'SAME', dimension_numbers=('NHWC', 'HWIO', 'NHWC')
    )
    logits = jnp.tanh(h).reshape(32, -1) @ v
    return jnp.sum(jax.nn.logsumexp(logits, -1)) + jnp.sum(jnp.square(h))

  value, grads = jax.jit(jax.value_and_grad(loss, (0, 1)))(w, v)
  leaves = [value, *grads]
  data = b''.join(np.asarray(t, np.float32).tobytes() for t in leaves)
  return hashlib.sha256(data).hexdigest()[:16]


def fingerprint(state) -> tuple[dict[str, str], dict[str, list[float]]]:
  """Per leaf, by tree path: the SHA-256 (bytes, shape and dtype) and
  [L2 norm, mean] in float64."""
  hashes, norms = {}, {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(state)):
    a = np.ascontiguousarray(np.asarray(leaf))
    h = hashlib.sha256(f'{a.shape}{a.dtype}'.encode() + a.tobytes())
    name = jax.tree_util.keystr(path)
    hashes[name] = h.hexdigest()
    f = a.astype(np.float64)
    norms[name] = [float(np.sqrt(np.sum(f * f))), float(np.mean(f))]
  return hashes, norms


def _rows(history):
  return [{k: v for k, v in r.items() if not k.endswith('_s')} for r in history]


def _assert_rows_close(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.keys() == w.keys()
    for key, value in w.items():
      if isinstance(value, float):
        helpers.assert_close(
          g[key], value, rtol=CROSS_MACHINE_RTOL, err_msg=f'{g["round"]} {key}'
        )
      else:
        assert g[key] == value, (g['round'], key)


def _record(path, got, mode):
  machines = {}
  if mode == 'add':
    with open(path) as f:
      machines = json.load(f)['machines']
  machines[got['numerics']] = {k: v for k, v in got.items() if k != 'numerics'}
  with open(path, 'w') as f:
    json.dump({'machines': machines}, f, indent=1)


def measure(name: str, data_dir: str, workdir: str) -> dict:
  """The recording of case `name` made in this process."""
  cfg = helpers.small_config(
    data_dir, num_devices=1, local_eval_every=1, **CASES[name]
  )
  res = experiment.train_and_evaluate(cfg, workdir, log=lambda s: None)
  hashes, norms = fingerprint(res.state)
  return {
    'numerics': machine_numerics(),
    'rows': _rows(res.history),
    'state': hashes,
    'norms': norms,
  }


@pytest.fixture(scope='module')
def measured(request, small_fmnist_dir, tmp_path_factory):
  """The recording of every case this session runs, made now, by name."""
  names = sorted(
    {
      item.callspec.params['name']
      for item in request.session.items
      if item.originalname == 'test_against_recording'
    }
  )
  work = tmp_path_factory.mktemp('reg')
  return {n: measure(n, str(small_fmnist_dir), str(work / n)) for n in names}


@pytest.mark.parametrize('name', sorted(CASES))
def test_against_recording(name, measured):
  got = measured[name]
  path = os.path.join(HERE, f'{name}.json')
  mode = os.environ.get('FEDJAX_MR_RECORD')
  if mode and not os.path.exists(path):  # a new case: its first recording
    _record(path, got, '1')
    pytest.skip(f'FEDJAX_MR_RECORD={mode}: recorded, not compared')
  with open(path) as f:
    machines = json.load(f)['machines']
  if mode:
    if mode == 'add':  # numerics unchanged: within tolerance of the others
      _assert_close_to(got, next(m for m in machines.values() if 'norms' in m))
    _record(path, got, mode)
    pytest.skip(f'FEDJAX_MR_RECORD={mode}: recorded, not compared')
  if got['numerics'] in machines:
    want = machines[got['numerics']]
    assert got['rows'] == want['rows']
    assert got['state'] == want['state']
    return
  _assert_close_to(got, next(m for m in machines.values() if 'norms' in m))


def _assert_close_to(got: dict, want: dict) -> None:
  """A measurement against another machine's recording: within the
  cross-machine tolerance."""
  _assert_rows_close(got['rows'], want['rows'])
  assert got['norms'].keys() == want['norms'].keys()
  for leaf, values in want['norms'].items():
    helpers.assert_close(
      got['norms'][leaf], values, rtol=CROSS_MACHINE_RTOL, atol=1e-6
    )


def _machines(name: str) -> list[dict]:
  path = os.path.join(HERE, f'{name}.json')
  if not os.path.exists(path):  # a new case before its first recording
    return []
  with open(path) as f:
    return list(json.load(f)['machines'].values())


@pytest.mark.parametrize(
  'name', [n for n in sorted(CASES) if len(_machines(n)) >= 2]
)
def test_recorded_machines_agree(name):
  machines = _machines(name)
  for a, b in itertools.combinations(machines, 2):
    _assert_rows_close(a['rows'], b['rows'])
    if 'norms' in a and 'norms' in b:
      helpers.assert_close(
        a['norms'], b['norms'], rtol=CROSS_MACHINE_RTOL, atol=1e-6
      )


def test_machine_numerics_is_stable_in_a_process():
  assert machine_numerics() == machine_numerics()
