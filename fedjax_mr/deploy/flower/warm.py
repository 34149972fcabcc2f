"""A warm SuperExec: Flower's own `flower-superexec`, whose App processes
start as forks of an interpreter that has already imported them.

Flower 1.42 runs every message a node gets (and every run's ServerApp) in
a fresh process: its SuperExec starts `flwr-clientapp` (`flwr-serverapp`),
which imports Flower, JAX and this package before it reads the message:
about 6 s of a core here for each message, most of a round's time in a
small run (docs/howto/deploy.md, "Warm App processes"). This module is
`flower-superexec` with one change: the process of a ClientApp or
ServerApp task is a fork of this one, made after the imports, that runs
Flower's own `flwr-clientapp` (`flwr-serverapp`) entry point with the
arguments Flower would give it. Everything from there on is Flower's: the
Runtime API, the task's token, the message, the App and its reply.
Nothing has touched JAX's backends before the fork (imports only), so
each task starts its own, as a fresh process does.

Run it where Flower would run its SuperExec, with the arguments Flower
gives `flower-superexec`, next to a SuperNode (or a SuperLink) whose
isolation option is `process`, in which Flower starts no SuperExec itself
(`python -m fedjax_mr.deploy.flower.warm`; docs/howto/deploy.md has a real
fleet's command lines; `federation.Federation` starts one per process).

It leans on names inside Flower (the subprocess executor's `launch` and
`reconcile`, the exit handlers' registry, the entry points), pinned with
Flower's version
(pyproject.toml); Flower's own isolation, `subprocess`, is the way back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import traceback

# What a task process imports, imported once here (JAX's import starts no
# backend and no thread).
import jax  # noqa: F401
from flwr.supercore import constant as flwr_constant
from flwr.supercore.cli.flower_superexec import flower_superexec
from flwr.supercore.exit import exit_handler
from flwr.supercore.superexec.executor import subprocess_executor
from flwr.supercore.superexec.executor import types as executor_types
from flwr.superlink.cli.flwr_serverapp import flwr_serverapp
from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

from fedjax_mr.deploy import clientapp  # noqa: F401
from fedjax_mr.deploy import serverapp  # noqa: F401

TaskType = flwr_constant.TaskType

# The task types started warm, and the entry point each runs.
ENTRY_POINTS = {
  TaskType.CLIENT_APP: flwr_clientapp,
  TaskType.SERVER_APP: flwr_serverapp,
}


def _arguments(executor, spec) -> tuple[list[str], bool]:
  """The command line Flower's subprocess executor gives the task, and
  whether it sends the task's output to /dev/null (Flower's launcher does
  for a ServerApp, whose lines the run's log stream carries)."""
  seen = []

  def popen(args, **kwargs):
    seen.append((list(args), kwargs.get('stdout') == subprocess.DEVNULL))

  saved = subprocess_executor.subprocess.Popen
  subprocess_executor.subprocess.Popen = popen
  try:
    _STOCK_LAUNCH(executor, spec)
  finally:
    subprocess_executor.subprocess.Popen = saved
  (found,) = seen
  return found


def _run_task(entry, args: list[str], quiet: bool) -> None:
  """In the forked process: Flower's entry point with `args` (its output
  to /dev/null if `quiet`), then exit without running this process's
  parent's exit or `atexit` handlers (they would close the SuperExec's
  connections, which the fork shares)."""
  code = 1
  try:
    if quiet:
      null = os.open(os.devnull, os.O_WRONLY)
      os.dup2(null, 1)
      os.dup2(null, 2)
      os.close(null)
    for sig in (signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, signal.SIG_DFL)
    exit_handler.registered_exit_handlers.clear()
    sys.argv = args
    entry()
    code = 0
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException:  # noqa: BLE001 - a task's failure, reported
    traceback.print_exc()
  finally:
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # noqa: BLE001
        pass
    os._exit(code)


_children: set[int] = set()


def _reap() -> None:
  for pid in list(_children):
    try:
      done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
      done = pid
    if done:
      _children.discard(pid)


def _launch(self, spec):
  """`SubprocessExecutor.launch`, forking warm for the App tasks."""
  _reap()
  entry = ENTRY_POINTS.get(spec.task_type)
  if entry is None:
    return _STOCK_LAUNCH(self, spec)
  args, quiet = _arguments(self, spec)
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid == 0:
    _run_task(entry, args, quiet)
  _children.add(pid)
  return executor_types.LaunchResult.accepted()


def _reconcile(self) -> None:
  _reap()
  _STOCK_RECONCILE(self)


_STOCK_LAUNCH = subprocess_executor.SubprocessExecutor.launch
_STOCK_RECONCILE = subprocess_executor.SubprocessExecutor.reconcile


def install() -> None:
  """Makes Flower's subprocess executor fork warm App processes."""
  subprocess_executor.SubprocessExecutor.launch = _launch
  subprocess_executor.SubprocessExecutor.reconcile = _reconcile


def main() -> None:
  install()
  sys.argv[0] = 'flower-superexec'
  flower_superexec()


if __name__ == '__main__':
  main()
