"""`python -m <program> <flags>` for the program tests, without paying the
imports each time: no tests here, a helper of the tests that start
programs (tests/test_programs.py and the others that import it).

Each program still runs in a process of its own, with its own exit code,
stdout and stderr, as `python -m` runs it (`runpy`, as `__main__`, in the
given folder and environment). That process is forked from a server
process that imported the libraries every program imports (jax, flax,
optax, orbax, fedjax_mr: about 3 s of CPU each time) and did nothing else:
no JAX backend, no thread, so a fork gets a clean interpreter. One server
per test process, started on first use; a program's own flags, modules
and XLA settings are all made in its fork, as in a fresh process.

Signals sent to a running program (the SIGTERM tests) need a process the
test holds: those keep `subprocess.Popen`.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Imported once by the server: what the programs share.
_SHARED = (
  'numpy',
  'jax',
  'jax.numpy',
  'flax.linen',
  'optax',
  'orbax.checkpoint',
  'absl.app',
  'absl.flags',
  'absl.logging',
  'fedjax_mr.pipeline.experiment',
  'fedjax_mr.bench',
  'fedjax_mr.stitch',
)

_server = None
_lock = threading.Lock()


def _start():
  global _server
  if _server is None or _server.poll() is not None:
    _server = subprocess.Popen(
      [sys.executable, '-m', 'tests.fork_server'],
      cwd=REPO,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
      env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'},
    )
    atexit.register(_stop, _server)
  return _server


def _stop(server):
  """Ends the server and waits for it: its CPU time (and its forks')
  then counts in this process's, as the subprocesses' did."""
  server.stdin.close()
  server.wait(timeout=60)


def run_module(*args, timeout=600, cwd=REPO, env=None):
  """Runs `python -m <args>` (`python -c <code>` for args `'-c', code`)
  in `cwd` (the repository root) with `env`
  (this process's, with TF_CPP_MIN_LOG_LEVEL=2, as
  `tests.helpers.run_module`); returns the `CompletedProcess`. Raises
  `subprocess.TimeoutExpired` past `timeout` seconds (the program is
  killed)."""
  if env is None:
    env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'}
  request = {
    'args': [str(a) for a in args],
    'cwd': str(cwd),
    'env': dict(env),
    'timeout': timeout,
  }
  with _lock:  # one request at a time per server
    server = _start()
    server.stdin.write(json.dumps(request) + '\n')
    server.stdin.flush()
    reply = server.stdout.readline()
  if not reply:
    raise RuntimeError(f'the fork server ended: exit {server.poll()}')
  reply = json.loads(reply)
  cmd = [sys.executable, *(['-m'] if args[0] != '-c' else []), *args]
  if reply['code'] is None:
    raise subprocess.TimeoutExpired(cmd, timeout)
  return subprocess.CompletedProcess(
    cmd, reply['code'], reply['stdout'], reply['stderr']
  )


def _child(request, out_path, err_path):
  """In the fork: the program as `python -m` runs it; never returns."""
  import runpy

  os.chdir(request['cwd'])
  os.environ.clear()
  os.environ.update(request['env'])
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  for fd, path in ((1, out_path), (2, err_path)):
    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(f, fd)
    os.close(f)
  module, *argv = request['args']
  # Exceptions and SystemExit end the fork as they end `python -m`: the
  # interpreter prints the traceback, runs the exit handlers, exits.
  if module == '-c':  # `python -c code`: the folder is '' on the path
    # The code (a test's own: a README or docs block) runs from a file
    # beside the output files, as `__main__` (sys.argv[0] names that file
    # while it runs, where `python -c` has '-c').
    path = os.path.join(os.path.dirname(out_path), 'main.py')
    with open(path, 'w', encoding='utf-8') as f:
      f.write(argv[0])
    sys.argv, sys.path[0] = ['-c', *argv[1:]], ''
    runpy.run_path(path, run_name='__main__')
  else:  # `python -m module`: the folder is first on the path
    sys.argv, sys.path[0] = ['-m', *argv], os.getcwd()
    runpy.run_module(module, run_name='__main__', alter_sys=True)
  sys.exit(0)


def _serve_one(request, scratch):
  """Forks, runs `request`, waits; the reply's code is None on timeout."""
  import signal
  import time

  out_path = os.path.join(scratch, 'stdout')
  err_path = os.path.join(scratch, 'stderr')
  if threading.active_count() != 1:  # a fork would lose their locks
    raise RuntimeError('the fork server started a thread')
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid == 0:
    _child(request, out_path, err_path)
  deadline = time.monotonic() + request['timeout']
  while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      code = os.waitstatus_to_exitcode(status)
      break
    if time.monotonic() > deadline:
      os.kill(pid, signal.SIGKILL)
      os.waitpid(pid, 0)
      code = None
      break
    time.sleep(0.05)

  def read(path):
    with open(path, 'rb') as f:
      return f.read().decode('utf-8', 'replace')

  return {'code': code, 'stdout': read(out_path), 'stderr': read(err_path)}


def _serve():
  import importlib
  import shutil
  import tempfile

  for name in _SHARED:
    importlib.import_module(name)
  scratch = tempfile.mkdtemp(prefix='fedjax_mr_fork_server_')
  for line in sys.stdin:
    reply = _serve_one(json.loads(line), scratch)
    sys.stdout.write(json.dumps(reply) + '\n')
    sys.stdout.flush()
  # (Not in a `finally`: a fork's SystemExit passes through here.)
  shutil.rmtree(scratch, ignore_errors=True)


if __name__ == '__main__':
  _serve()
