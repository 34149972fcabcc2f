"""Shared fixtures: small real Fashion-MNIST IDX folders and tiny models."""

from __future__ import annotations

import atexit
import gzip
import os
import shutil
import tempfile

from tests import xla_flags

# Two XLA host devices, as the experiment binary uses on a 2-core machine:
# the in-process runs exercise the sharded client axis; and the flags that
# make XLA:CPU compile faster (tests/xla_flags.py). Must precede the first
# JAX computation.
os.environ['XLA_FLAGS'] = ' '.join(
  [
    *os.environ.get('XLA_FLAGS', '').split(),
    '--xla_force_host_platform_device_count=2',
    *xla_flags.COMPILE_FLAGS,
  ]
)

# One persistent compilation cache for the whole session, shared with the
# programs the tests start as subprocesses and, under pytest-xdist (`-n 2`,
# as .ci/run runs), with the other workers, which inherit the controller's
# environment: the same round function is compiled by many tests (a
# reference run, a killed run, its resume), and reading it back is
# bit-identical to compiling it again. A fresh folder per session, so
# nothing carries over between sessions; the process that made it removes
# it.
os.environ['FEDJAX_MR_TEST_JAX_CACHE'] = (
  os.environ.get('PYTEST_XDIST_WORKER')
  and os.environ.get('FEDJAX_MR_TEST_JAX_CACHE')
) or tempfile.mkdtemp(prefix='fedjax_mr_test_jax_cache_')
os.environ['JAX_COMPILATION_CACHE_DIR'] = os.environ['FEDJAX_MR_TEST_JAX_CACHE']
os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'
# Each operation's location in the programs JAX lowers: the user's frame
# (file and line), not the whole call stack (up to 100 frames, pytest's
# included): the files that mostly compile take 2-8 % less CPU, those that
# mostly execute the same (docs/results/suite/locations_amd_epyc.txt). The
# code and its bits are the same (locations are metadata, and the
# persistent cache's keys leave them out).
os.environ['JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS'] = '0'

import numpy as np
import pytest

from fedjax_mr.data import datasets

if not os.environ.get('PYTEST_XDIST_WORKER'):  # the controller, or alone
  atexit.register(
    shutil.rmtree, os.environ['JAX_COMPILATION_CACHE_DIR'], ignore_errors=True
  )

FMNIST_DIR = datasets.DEFAULT_FASHION_MNIST_DIR


def write_idx(path: str, array: np.ndarray) -> None:
  """Writes a uint8 array as a gzipped IDX file."""
  array = np.asarray(array, np.uint8)
  header = bytes([0, 0, 0x08, array.ndim])
  header += b''.join(int(d).to_bytes(4, 'big') for d in array.shape)
  with gzip.open(path, 'wb') as f:
    f.write(header + array.tobytes())


def write_idx_dataset(folder, x_train, y_train, x_test, y_test) -> str:
  os.makedirs(folder, exist_ok=True)
  write_idx(os.path.join(folder, 'train-images-idx3-ubyte.gz'), x_train)
  write_idx(os.path.join(folder, 'train-labels-idx1-ubyte.gz'), y_train)
  write_idx(os.path.join(folder, 't10k-images-idx3-ubyte.gz'), x_test)
  write_idx(os.path.join(folder, 't10k-labels-idx1-ubyte.gz'), y_test)
  return str(folder)


@pytest.fixture(scope='session')
def fashion_mnist():
  """The real Fashion-MNIST (installed by scripts/setup.sh)."""
  if not os.path.exists(os.path.join(FMNIST_DIR, 't10k-labels-idx1-ubyte.gz')):
    pytest.fail(
      f"{FMNIST_DIR} is missing: run scripts/setup.sh (installs Debian's "
      'dataset-fashion-mnist)'
    )
  return datasets.load('fashion_mnist')


@pytest.fixture(scope='session')
def small_fmnist_dir(tmp_path_factory, fashion_mnist):
  """A real 1,500/500 subset of Fashion-MNIST as IDX files (fast runs)."""
  ds = fashion_mnist
  folder = tmp_path_factory.mktemp('fmnist_small')
  return write_idx_dataset(
    folder,
    ds.x_train[:1500, ..., 0],
    ds.y_train[:1500],
    ds.x_test[:500, ..., 0],
    ds.y_test[:500],
  )


# `pytest -m "not slow"`: the everyday subset. Slow are the tests that run
# the programs or whole experiments (end to end, on real data, in other
# processes, kill-and-resume, fault injection) and the contract and zoo
# sweeps (by module, below), and the tests marked `@pytest.mark.slow` in
# their files (each over 1.5 s: reductions through the engine, contract
# runs, larger sweeps); what stays checks each piece's arithmetic on tiny
# cases.
SLOW_MODULES = {
  'test_bad_invocations',
  'test_packaging',
  'test_programs',
  'test_readme',
  'test_docs_build',
  'test_docs_blocks',
  'test_stitch_programs',
  'test_stitch_figures',
  'test_torch_reference',
  'test_algorithms',
  'test_distributed',
  'test_experiment',
  'test_faults',
  'test_regression',
  'test_zoo_runs',
  'test_registry',
  'test_zoo',
  'test_workdir',
  # A local Flower federation's processes (tests/deploy), and its
  # watchdog's (tests/core).
  'test_federation',
  'test_watchdog',
  'test_deploy_program',
  'test_deploy_faults',
}
SLOW_FIXTURES = {'small_fmnist_dir', 'fashion_mnist'}


# The files that take a worker longest, longest first (each file is one
# unit of work for a worker, `--dist loadfile`): the README's test command
# keeps this order (`--no-loadscope-reorder`) so they start first and the
# suite ends on short files, not on one worker alone with a long one. The
# rest follow by their number of tests, most first (xdist's own order).
# From a `--durations=0` profile (2026-11-28, AMD EPYC, 2 workers): s of a
# worker per file, 164 down to 20.
LONGEST_FIRST = (
  'tests/deploy/test_deploy_program.py',
  'tests/pipeline/test_experiment.py',
  'tests/deploy/test_deploy_faults.py',
  'tests/pipeline/test_algorithms.py',
  'tests/pipeline/test_registry.py',
  'tests/test_programs.py',
  'tests/pipeline/test_zoo_runs.py',
  'tests/pipeline/test_determinism.py',
  'tests/pipeline/test_integrity.py',
  'tests/pipeline/test_faults.py',
  'tests/deploy/test_federation.py',
  'tests/test_stitch_programs.py',
  'tests/pipeline/test_synthetic_runs.py',
  'tests/deploy/test_fleet_rehearsal.py',
  'tests/pipeline/test_regression.py',
  'tests/models/test_zoo.py',
  'tests/stitch/test_torchvision_import.py',
  'tests/runtime/test_distributed.py',
  'tests/training/test_streaming.py',
  'tests/test_bad_invocations.py',
  'tests/deploy/test_server.py',
  'tests/test_readme.py',
)


def _file_order(items):
  """`items` in LONGEST_FIRST's order of files, then the other files by
  number of tests, most first; a file's tests keep their order."""
  files = {}
  for item in items:
    files.setdefault(item.nodeid.split('::', 1)[0], []).append(item)
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  order = sorted(files, key=lambda f: (rank.get(f, len(rank)), -len(files[f])))
  return [item for name in order for item in files[name]]


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    module = item.module.__name__.rsplit('.', 1)[-1]
    if module in SLOW_MODULES or SLOW_FIXTURES & set(item.fixturenames):
      item.add_marker(pytest.mark.slow)
  items[:] = _file_order(items)
