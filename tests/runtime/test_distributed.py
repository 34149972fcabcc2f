"""Two cooperating processes (jax.distributed on 127.0.0.1) give the result
of one process."""

import os
import platform
import socket
import subprocess
import sys

import pytest

from fedjax_mr.runtime import distributed
from fedjax_mr.runtime import metrics_io
from tests import helpers
from tests import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _cmd(cfg, workdir, **extra):
  flags = {**cfg.to_dict(), 'workdir': workdir, **extra}
  return [sys.executable, '-m', 'experiments.run'] + [
    f'--{k}={v}' for k, v in flags.items()
  ]


def _env():
  # The binary sets its host devices; the suite's compile flags stay
  # (tests/xla_flags.py): both runs compile alike.
  return dict(os.environ, XLA_FLAGS=' '.join(xla_flags.COMPILE_FLAGS))


def test_two_processes_equal_one(small_fmnist_dir, tmp_path):
  cfg = helpers.small_config(small_fmnist_dir, eval_every=3, checkpoint_every=2)
  one = subprocess.run(
    _cmd(cfg, tmp_path / 'one', host_devices=2),
    cwd=REPO,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert one.returncode == 0, one.stderr
  assert '2 cpu device(s) in 1 process(es)' in one.stdout
  port = _free_port()
  procs = [
    subprocess.Popen(
      _cmd(
        cfg,
        tmp_path / 'two',
        host_devices=1,
        coordinator_address=f'127.0.0.1:{port}',
        num_processes=2,
        process_id=i,
      ),
      cwd=REPO,
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  try:
    outs = [p.communicate(timeout=300) for p in procs]
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    report = [p.communicate() for p in procs]
    pytest.fail(
      'the two processes did not finish in 300 s:\n'
      + '\n'.join(
        f'process {i}: rc {p.returncode}\nstdout: {o[-2000:]}\n'
        f'stderr: {e[-4000:]}'
        for i, (p, (o, e)) in enumerate(zip(procs, report))
      )
    )
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err
  assert '2 cpu device(s) in 2 process(es)' in outs[0][0]
  assert (
    'round 1/3' in outs[0][0] and 'round' not in outs[1][0]
  )  # process 0 logs
  a = metrics_io.read(str(tmp_path / 'one' / 'metrics.jsonl'))
  b = metrics_io.read(str(tmp_path / 'two' / 'metrics.jsonl'))
  assert [r['round'] for r in b] == [1, 2, 3]
  for ra, rb in zip(a, b):
    assert ra['num_steps'] == rb['num_steps']
    helpers.assert_close(ra['train_loss'], rb['train_loss'], rtol=1e-5)
  helpers.assert_close(
    a[-1]['test_accuracy'], b[-1]['test_accuracy'], atol=1e-3
  )


@pytest.mark.parametrize('process_id', [0, 1])
def test_a_process_alone_says_what_it_waits_for_and_gives_up(
  small_fmnist_dir, tmp_path, process_id
):
  # Process 0 runs the coordinator and waits for process 1; process 1
  # finds no coordinator. Each says so, then gives up in one line.
  cfg = helpers.small_config(small_fmnist_dir)
  port = _free_port()
  proc = subprocess.run(
    _cmd(
      cfg,
      tmp_path / 'run',
      host_devices=1,
      coordinator_address=f'127.0.0.1:{port}',
      num_processes=2,
      process_id=process_id,
      coordinator_timeout=2,
    ),
    cwd=REPO,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 2, proc.stderr
  waits = (
    'the 1 other process(es) to join its coordinator'
    if process_id == 0
    else 'the coordinator (process 0) and every other process'
  )
  assert proc.stdout == (
    f'process {process_id} of 2: waiting up to 2 s for {waits} at '
    f'127.0.0.1:{port}\n'
  )
  assert proc.stderr == (
    f'error: process {process_id} of 2: not every process joined '
    f'--coordinator_address=127.0.0.1:{port} within --coordinator_timeout=2 '
    's; start all --num_processes=2 (process 0 first, reachable at that '
    'address) or wait longer\n'
  )
  assert not (tmp_path / 'run').exists()


def test_auto_host_devices_one_per_core_at_most_k(monkeypatch):
  monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: {0, 1, 2, 3})
  assert [distributed.auto_host_devices(k) for k in (1, 2, 3, 10)] == [
    1,
    2,
    3,
    4,
  ]


def test_default_chunk_is_one_on_cpu_and_bounded_on_accelerators():
  assert distributed.default_chunk('cpu', 10_000) == 1
  assert distributed.default_chunk('cpu', 10_000, 7_850) == 1
  assert distributed.default_chunk('gpu', 300) == 300
  assert (
    distributed.default_chunk('gpu', 10_000) == distributed.ACCELERATOR_CHUNK
  )
  assert distributed.default_chunk('tpu', 1_000) == 1_000
  assert distributed.default_chunk('gpu', 0) == 1


def test_default_chunk_vmaps_a_tiny_model_on_cpu():
  # Synthetic's logistic regression (610 parameters), up to the clients a
  # device has; the bound is at the threshold; accelerators ignore it.
  # (BUILD.md and the --client_chunk help say 8 and 1,000.)
  assert distributed.default_chunk('cpu', 10_000, 610) == 8
  assert distributed.default_chunk('cpu', 10_000, 1_000) == 8
  assert distributed.default_chunk('cpu', 10_000, 1_001) == 1
  assert distributed.default_chunk('cpu', 3, 610) == 3
  assert distributed.default_chunk('gpu', 300, 610) == 300


# Eight threads malloc at once after `initialize`, then glibc lists its
# arenas (malloc_info).
_COUNT_ARENAS = """
import ctypes, sys, tempfile, threading
from fedjax_mr.runtime import distributed
distributed.initialize(host_devices=int(sys.argv[1]))
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
libc.fclose.argtypes = (ctypes.c_void_p,)
start = threading.Barrier(8)
def allocate():
  start.wait()
  for _ in range(200):
    libc.malloc(4096)
threads = [threading.Thread(target=allocate) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
with tempfile.NamedTemporaryFile() as f:
  fp = libc.fopen(f.name.encode(), b'w')
  libc.malloc_info(0, fp)
  libc.fclose(fp)
  print(open(f.name).read().count('<heap nr='))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != 'glibc', reason='glibc only')
def test_several_host_devices_keep_mallocs_arenas_to_two():
  # With two devices more threads allocate at once, and glibc's extra
  # arenas kept what they freed (the 2-device run's peak 7-29 % over one
  # device's); one device keeps glibc's default (the cap slowed its rounds),
  # and MALLOC_ARENA_MAX in the environment wins.
  def arenas(host_devices, **env):
    environ = {k: v for k, v in os.environ.items() if k != 'MALLOC_ARENA_MAX'}
    environ.pop('XLA_FLAGS', None)
    proc = subprocess.run(
      [sys.executable, '-c', _COUNT_ARENAS, str(host_devices)],
      cwd=REPO,
      env={**environ, **env},
      capture_output=True,
      text=True,
      check=True,
    )
    return int(proc.stdout)

  assert arenas(1) > distributed.MALLOC_ARENAS  # the probe can see arenas
  assert arenas(2) <= distributed.MALLOC_ARENAS
  assert arenas(2, MALLOC_ARENA_MAX='3') == 3
