"""The warm SuperExec (fedjax_mr/deploy/flower/warm.py): its task processes get
the command line Flower's own launcher gives, and its imports leave the
process safe to fork (no JAX backend, no thread). Its runs are those of
the real federations in test_deploy_program.py and test_deploy_faults.py
(the Ctrl-C test runs Flower's own launcher)."""

import subprocess
import sys

from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor import subprocess_executor
from flwr.supercore.superexec.executor import types as executor_types

from fedjax_mr.deploy.flower import warm


def _spec(task_type, **values):
  fields = dict(
    task_type=task_type,
    runtime_api_address='127.0.0.1:9094',
    token='a-token',
    insecure=False,
    root_certificates_path='/ca.crt',
    parent_pid=42,
    runtime_dependency_install=False,
    suppress_output=False,
    task_id=7,
  )
  return executor_types.ExecutionSpec(**{**fields, **values})


def test_a_task_gets_the_command_line_of_flowers_launcher():
  executor = subprocess_executor.SubprocessExecutor()
  for task_type, command in (
    (TaskType.CLIENT_APP, 'flwr-clientapp'),
    (TaskType.SERVER_APP, 'flwr-serverapp'),
  ):
    for insecure in (False, True):
      for quiet in (False, True):
        spec = _spec(task_type, insecure=insecure, suppress_output=quiet)
        args, got_quiet = warm._arguments(executor, spec)
        tls = ['--insecure'] if insecure else ['--root-certificates', '/ca.crt']
        assert args == [
          command, '--runtime-api-address', '127.0.0.1:9094',
          '--token', 'a-token', *tls, '--parent-pid', '42',
        ]  # fmt: skip
        assert got_quiet == quiet
  # The stock launcher is left as it was.
  assert subprocess_executor.subprocess.Popen is subprocess.Popen


def test_the_imports_start_no_backend_and_no_thread():
  code = (
    'import threading\n'
    'import fedjax_mr.deploy.flower.warm\n'
    'from jax._src import xla_bridge\n'
    'assert not xla_bridge._backends, xla_bridge._backends\n'
    'assert threading.active_count() == 1, threading.enumerate()\n'
  )
  done = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 0, done.stderr[-2000:]
