"""experiments/profile_device.py against fake trees, and the no-jax rule."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from fedjax_mr.energy import profiles
from fedjax_mr.energy import sysfs
from tests.energy import fake_sysfs

REPO = pathlib.Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(REPO))
  return subprocess.run(
    [sys.executable, '-m', 'experiments.profile_device', *args],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=60,
  )


def tree_contents(root: pathlib.Path) -> dict[str, str]:
  return {
    str(p.relative_to(root)): p.read_text()
    for p in root.rglob('*')
    if p.is_file() and not p.is_symlink()
  }


def test_energy_never_imports_jax():
  code = (
    'import sys, fedjax_mr.energy, experiments.profile_device;'
    ' bad = [m for m in ("jax", "flax", "jaxlib") if m in sys.modules];'
    ' assert not bad, bad'
  )
  done = subprocess.run(
    [sys.executable, '-c', code],
    cwd=REPO,
    env=dict(os.environ, PYTHONPATH=str(REPO)),
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert done.returncode == 0, done.stderr


def test_dry_run_lists_and_changes_nothing(tmp_path):
  fake_sysfs.build_tx2_tree(tmp_path)
  before = tree_contents(tmp_path)
  done = run('--dry_run', f'--sysfs_root={tmp_path}', '--configs=tx2_table2')
  assert done.returncode == 0, done.stderr
  out = done.stdout
  assert 'board: NVIDIA Jetson TX2' in out
  assert 'cpu policy1: cores 1,2;' in out
  assert 'gpu 17000000.gp10b (gp10b)' in out
  assert 'power rail VDD_IN: iio 0-0041' in out
  assert 'table2_1_MAXQ: policy0=1113600 kHz, gpu=854250000 Hz' in out
  policy0 = tmp_path / 'sys/devices/system/cpu/cpufreq/policy0'
  assert f'echo 1113600 > {policy0}/scaling_min_freq' in out
  assert tree_contents(tmp_path) == before


def test_dry_run_orin_sweep(tmp_path):
  fake_sysfs.build_orin_tree(tmp_path)
  done = run('--dry_run', f'--sysfs_root={tmp_path}', '--levels=2')
  assert done.returncode == 0, done.stderr
  assert 'power rail VDD_CPU_CV: hwmon 1-0040' in done.stdout
  assert 'level0: policy0=115200 kHz, policy4=115200 kHz' in done.stdout
  assert 'level1: policy0=2201600 kHz' in done.stdout


def test_dry_run_nvpmodel_runs_no_command(tmp_path):
  fake_sysfs.build_tx2_tree(tmp_path)
  done = run(
    '--dry_run',
    f'--sysfs_root={tmp_path}',
    '--backend=nvpmodel',
    '--configs=tx2_nvpmodel',
  )
  assert done.returncode == 0, done.stderr
  assert 'nvpmodel -m 4' in done.stdout


def test_measures_and_saves_a_profile(tmp_path):
  root = tmp_path / 'tree'
  fake_sysfs.build_tx2_tree(root)
  before = fake_sysfs.control_files(sysfs.SysfsRoot(root))
  output = tmp_path / 'profile.json'
  done = run(
    f'--sysfs_root={root}',
    f'--output={output}',
    '--levels=2',
    '--idle_s=0.02',
    '--repeats=1',
    '--workload_size=8',
    '--workload_steps=1',
    '--settle_s=0',
    '--period_s=0.005',
  )
  assert done.returncode == 0, done.stderr
  profile = profiles.load_profile(output)
  assert [c.name for c in profile.configs] == ['level0', 'level1']
  assert profile.speedup[0] == 1.0
  # Plain files: the power stays at the tree's VDD_IN of 1876 mW.
  assert profile.p_idle_w == pytest.approx(1.876)
  assert profile.p_active_w == pytest.approx((1.876, 1.876))
  # A plain tree does not update scaling_cur_freq: a mismatch warning.
  assert 'Clocks differ from the request' in done.stderr
  assert fake_sysfs.control_files(sysfs.SysfsRoot(root)) == before
  assert json.loads(output.read_text())['name'] == 'nvidia_jetson_tx2'


@pytest.mark.parametrize(
  'args, message',
  [
    (['--configs=bogus'], 'configs'),
    (['--levels=0'], 'levels'),
    (['--dry_run', '--sysfs_root=/no/such/dir'], 'is no directory'),
    (['--dry_run', 'extra'], 'unexpected arguments'),
    ([], '--output is required'),
    (['--dry_run', '--backend=nvpmodel'], 'needs --configs=tx2_table2'),
  ],
)
def test_bad_flags_give_a_clear_error(tmp_path, args, message):
  fake_sysfs.build_tx2_tree(tmp_path)
  if not any(a.startswith('--sysfs_root') for a in args):
    args = [*args, f'--sysfs_root={tmp_path}']
  done = run(*args)
  assert done.returncode != 0
  assert 'Traceback' not in done.stderr
  assert message in done.stderr
  assert len(done.stderr.strip().splitlines()) <= 2


def test_no_device_is_an_error_not_a_traceback(tmp_path):
  done = run(f'--sysfs_root={tmp_path}', f'--output={tmp_path / "p.json"}')
  assert done.returncode == 1
  assert 'Traceback' not in done.stderr
  assert 'error: no CPU or GPU frequency table found' in (done.stderr)
