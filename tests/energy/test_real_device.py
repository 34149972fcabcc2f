"""Smoke tests on a real Jetson; skipped elsewhere.

They only read, unless FEDJAX_MR_ALLOW_DVFS=1 (and root), when they also
apply the lowest sweep level and check that everything is restored.
"""

import os
import pathlib
import subprocess
import sys

import pytest

from fedjax_mr.energy import discovery
from fedjax_mr.energy import power
from fedjax_mr.energy import profiling
from fedjax_mr.energy import sysfs
from fedjax_mr.energy import sysfs_dvfs
from tests.energy import fake_sysfs

ROOT = sysfs.SysfsRoot('/')
REPO = pathlib.Path(__file__).resolve().parents[2]
ON_JETSON = 'jetson' in (discovery.find_model(ROOT) or '').lower()

pytestmark = pytest.mark.skipif(not ON_JETSON, reason='not on a Jetson')


def test_discovers_the_device():
  info = discovery.discover(ROOT)
  assert info.cpu_policies
  assert info.gpu is not None
  assert info.power_channels


def test_reads_power_twice():
  meter = power.SysfsPowerMeter(ROOT)
  first, second = meter.read_mw(), meter.read_mw()
  assert set(first) == set(second)
  assert meter.total_mw() > 0


def test_dry_run_program():
  done = subprocess.run(
    [sys.executable, '-m', 'experiments.profile_device', '--dry_run'],
    cwd=REPO,
    env=dict(os.environ, PYTHONPATH=str(REPO)),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode == 0, done.stderr
  assert 'planned changes' in done.stdout


@pytest.mark.skipif(
  os.environ.get('FEDJAX_MR_ALLOW_DVFS') != '1',
  reason='changes clocks only with FEDJAX_MR_ALLOW_DVFS=1',
)
def test_apply_and_restore():
  before = fake_sysfs.control_files(ROOT)
  info = discovery.discover(ROOT)
  with sysfs_dvfs.SysfsDvfs(ROOT, info) as backend:
    backend.apply(profiling.sweep_configs(info, 2)[0])
  assert fake_sysfs.control_files(ROOT) == before
