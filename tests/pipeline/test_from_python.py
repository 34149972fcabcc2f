"""A run started from Python gets the devices the command line gives it."""

import os
import subprocess
import sys

import pytest

from fedjax_mr.runtime import distributed

# Two runs in other processes (~15 s each).
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))

# A script as a user writes it: a config, train_and_evaluate, load_run.
SCRIPT = """
import warnings
warnings.simplefilter('always')
import fedjax_mr as fm
import jax
if {touch_jax_first}:
  jax.devices()  # sets JAX's devices up before the run can
config = fm.pipeline.config.ExperimentConfig.from_flat(
  dataset='synthetic', model='logistic', num_clients=20,
  clients_per_round=2, local_epochs=1, rounds=1, eval_every=1)
fm.train_and_evaluate(config, {workdir!r}, log=lambda line: None)
run = fm.load_run({workdir!r})
print(run.round, jax.device_count())
"""


@pytest.mark.parametrize('touch_jax_first', [False, True])
def test_train_and_evaluate_then_load_run_set_up_the_devices(
  tmp_path, touch_jax_first
):
  code = SCRIPT.format(touch_jax_first=touch_jax_first, workdir=str(tmp_path))
  # A user's environment: not the tests' forced 2 host devices (conftest).
  # Their compile flags (tests/xla_flags.py) stay: they change how fast
  # XLA compiles, not the devices, and let the interpreter read back what
  # this session compiled (the session's compilation cache).
  env = dict(os.environ)
  env['XLA_FLAGS'] = ' '.join(
    f
    for f in env.get('XLA_FLAGS', '').split()
    if not f.startswith('--xla_force_host_platform_device_count')
  )
  proc = subprocess.run(
    [sys.executable, '-c', code],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    env={**env, 'TF_CPP_MIN_LOG_LEVEL': '2'},
  )
  assert proc.returncode == 0, proc.stderr
  rounds, devices = map(int, proc.stdout.split())
  # The command line's devices: one per core, at most K = 2.
  want = distributed.auto_host_devices(2)
  warned = proc.stderr.count('before this run was set up')
  if touch_jax_first and want > 1:
    # Too late: one device, and it says so (train_and_evaluate, and
    # load_run again).
    assert (rounds, devices) == (1, 1) and warned >= 1, proc.stderr
  else:
    assert (rounds, devices, warned) == (1, want, 0), proc.stderr
