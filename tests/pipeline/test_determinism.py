"""A run is a pure function of (config, seed) on 2 host devices too.

With XLA:CPU's convolution gradient two host devices running at once
change each other's results in the last digits (BUILD.md,
"Reproducibility"); the default im2col gradient does not. These tests fail
with `layers.conv_implementation('conv')`: `G=conv python
scripts/xla_cpu_concurrency_repro.py` measured 8 of 8 concurrent results
differing from the sequential one, 0 of 8 with G=im2col (jaxlib 0.10.2).
"""

import hashlib
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import fedjax_mr as fm
from fedjax_mr.models import layers
from tests import helpers
from tests import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
SCRIPT = 'xla_cpu_concurrency_repro.py'


def _bits(tree) -> np.ndarray:
  leaves = jax.tree.leaves(jax.device_get(tree))
  return np.concatenate([np.asarray(v).ravel() for v in leaves]).view(np.uint32)


@pytest.mark.slow
def test_concurrent_devices_give_the_sequential_bits():
  # The reproducer: one model trained on device 0 and on device 1, one
  # after the other (it asserts they agree), then both at once. Compiled
  # as a program compiles (1,600 steps: at the suite's -O0 they took twice
  # the time), where the conv gradient differs in 2 of 2 concurrent
  # results (G=conv S=400 N=1; S=150 2 of 4, S=100 0 of 4, AMD EPYC).
  assert layers.conv_gradient() == 'im2col'
  env = {**os.environ, 'G': 'im2col', 'N': '1', 'S': '400'}
  env['XLA_FLAGS'] = xla_flags.program_flags(env['XLA_FLAGS'])
  proc = subprocess.run(
    [sys.executable, os.path.join(REPO, 'scripts', SCRIPT)],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip().endswith(
    'im2col gradient, 400 steps: 0 of 2 concurrent results differ from '
    'the sequential one'
  )


def test_the_note_names_the_backends_that_cannot_promise_bits(monkeypatch):
  from fedjax_mr.runtime import distributed

  assert distributed.reproducibility_note('cpu', 2) is None
  assert distributed.reproducibility_note('cpu', 1) is None
  with layers.conv_implementation('conv'):
    assert distributed.reproducibility_note('cpu', 2) == (
      distributed.CPU_DEVICES_NOTE
    )
    assert distributed.reproducibility_note('cpu', 1) is None
  # GPUs: deterministic only when XLA is told to be.
  monkeypatch.setenv('XLA_FLAGS', '--xla_gpu_autotune_level=0')
  assert distributed.reproducibility_note('gpu', 1) == distributed.GPU_NOTE
  monkeypatch.setenv('XLA_FLAGS', '--xla_gpu_deterministic_ops=true')
  assert distributed.reproducibility_note('gpu', 1) is None
  assert distributed.reproducibility_note('tpu', 4) is None


def test_fresh_processes_on_two_devices_give_the_same_bits(
  small_fmnist_dir, tmp_path
):
  runs = []
  for i in range(3):
    work = tmp_path / f'run{i}'
    proc = helpers.run_module(
      'experiments.run',
      f'--data_dir={small_fmnist_dir}',
      '--num_clients=10',
      '--clients_per_round=4',
      '--alpha=0.5',
      '--local_epochs=3',
      '--rounds=2',
      '--eval_every=1',
      '--host_devices=2',
      '--num_devices=2',
      f'--workdir={work}',
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '2 cpu device(s)' in proc.stdout
    rows = [json.loads(line) for line in open(work / 'metrics.jsonl')]
    rows = [{k: v for k, v in r.items() if not k.endswith('_s')} for r in rows]
    digest = hashlib.sha256(_bits(fm.load_run(str(work)).state).tobytes())
    runs.append((rows, digest.hexdigest()))
  assert len(runs[0][0]) == 2 and 'test_loss' in runs[0][0][-1]
  assert runs[1] == runs[0] and runs[2] == runs[0]
